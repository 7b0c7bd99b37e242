"""Regenerate the example models in models/ and the sample inputs in examples/.

    .venv/bin/python scripts/make_examples.py [--out DIR]

Byte for byte the same files on every run (so pinned SHA256s and signatures stay valid):
a fixed PYTHONHASHSEED (the script re-runs itself with one: TorchScript and skl2onnx walk
sets whose order follows it), one BLAS thread (a parallel sum's order changes the last bits
of the weights) and one BLAS kernel whatever the CPU (OPENBLAS_CORETYPE), fixed seeds, the
ONNX opset imports sorted, and the TorchScript archive's random serialization id replaced
by a hash of its contents.

digits:  an MLP classifier trained on scikit-learn's bundled 8x8 digits data, as ONNX.
encoder: a small TorchScript encoder (8 features -> 4-d unit vector).
Needs the dev extra (scikit-learn, skl2onnx, torch).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy loads its BLAS
# OpenBLAS picks its kernels by CPU (Haswell, SkylakeX, Zen...), and they round differently:
# trained on an AMD EPYC, the digits model's weights differed in their last bits from those
# trained on an Intel Xeon. Its oldest x86-64 kernels run on every such CPU, the same way.
os.environ["OPENBLAS_CORETYPE"] = "Prescott"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import zipfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_digits(models: Path, examples: Path) -> float:
    from skl2onnx import to_onnx
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.neural_network import MLPClassifier

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0)
    clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=400, random_state=0)
    clf.fit(x_train, y_train)
    accuracy = float(clf.score(x_test, y_test))
    onx = to_onnx(
        clf, x_train[:1], options={id(clf): {"zipmap": False}}, initial_types=None, target_opset=17
    )
    # Name the tensors for people: input, label, probabilities.
    onx.graph.input[0].name = "input"
    for node in onx.graph.node:
        node.input[:] = ["input" if i == "X" else i for i in node.input]
    # Opset imports come from a set: sort them, or their order varies with the hash seed.
    from onnx.helper import make_opsetid

    imports = [make_opsetid(o.domain, o.version) for o in onx.opset_import]
    del onx.opset_import[:]
    onx.opset_import.extend(sorted(imports, key=lambda o: o.domain))
    folder = models / "digits" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(onx.SerializeToString())
    examples.mkdir(exist_ok=True)
    index = int(np.flatnonzero(y_test == 7)[0])
    np.save(examples / "digit-7.npy", x_test[index])
    return accuracy


def make_encoder(models: Path, examples: Path) -> None:
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.normalize(self.body(x), dim=-1)

    torch.manual_seed(0)
    module = torch.jit.script(Encoder().eval())
    folder = models / "encoder" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    module.save(str(folder / "model.pt"))
    _fix_serialization_id(folder / "model.pt")
    (models / "encoder" / "model.toml").write_text(
        "# A TorchScript file carries no tensor names: declare them here.\n"
        'runtime = "torchscript"\n\n'
        '[[inputs]]\nname = "features"\ndatatype = "FP32"\nshape = [-1, 8]\n\n'
        '[[outputs]]\nname = "embedding"\ndatatype = "FP32"\nshape = [-1, 4]\n'
    )
    np.save(examples / "features.npy", np.linspace(-1, 1, 8, dtype=np.float32))


def _fix_serialization_id(path: Path) -> None:
    """torch writes a random `.data/serialization_id` into each archive, and the absolute path
    of this script into its debug records: rewrite the archive without the debug records
    (torch loads it as well without them) and with a hash of the other records as its id,
    keeping torch's layout (entries stored, dated 1980, data aligned to 64 bytes with padding
    in the extra field)."""
    with zipfile.ZipFile(path) as src:
        kept = [i for i in src.infolist() if not i.filename.endswith(".debug_pkl")]
        records = [(i, src.read(i.filename)) for i in kept]
    digest = hashlib.sha256(b"".join(d for i, d in records if "serialization_id" not in i.filename))
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as dst:
        for info, data in records:
            if info.filename.endswith(".data/serialization_id"):
                data = str(int(digest.hexdigest()[:32], 16)).zfill(40).encode()
            entry = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            start = f.tell() + 30 + len(info.filename.encode()) + 4
            entry.extra = b"FB" + ((-start) % 64).to_bytes(2, "little") + b"Z" * ((-start) % 64)
            dst.writestr(entry, data)
    tmp.replace(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="write DIR/models, DIR/examples")
    out = parser.parse_args().out
    accuracy = make_digits(out / "models", out / "examples")
    print(f"digits: test accuracy {accuracy:.4f}")
    make_encoder(out / "models", out / "examples")
    print("encoder: written")
