"""Regenerate the example models in models/ and the sample inputs in examples/.

    .venv/bin/python scripts/make_examples.py

digits:  an MLP classifier trained on scikit-learn's bundled 8x8 digits data, as ONNX.
encoder: a small TorchScript encoder (8 features -> 4-d unit vector).
Needs the dev extra (scikit-learn, skl2onnx, torch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
    (models / "encoder" / "model.toml").write_text(
        "# A TorchScript file carries no tensor names: declare them here.\n"
        'runtime = "torchscript"\n\n'
        '[[inputs]]\nname = "features"\ndatatype = "FP32"\nshape = [-1, 8]\n\n'
        '[[outputs]]\nname = "embedding"\ndatatype = "FP32"\nshape = [-1, 4]\n'
    )
    np.save(examples / "features.npy", np.linspace(-1, 1, 8, dtype=np.float32))


if __name__ == "__main__":
    accuracy = make_digits(ROOT / "models", ROOT / "examples")
    print(f"digits: test accuracy {accuracy:.4f}")
    make_encoder(ROOT / "models", ROOT / "examples")
    print("encoder: written")
