"""`infergate infer`: one inference from .npy files, JSON, or a V2 request on stdin."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.text import Text

from infergate.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    Format,
    JsonOption,
    TokenOption,
    UrlOption,
    answer_of,
    check_model_name,
    check_name,
    client,
    emit_table,
    fail,
    fail_client,
    print_json,
    say,
)
from infergate.client_codec import MAX_ANSWER_MB
from infergate.client_errors import escape_controls

if TYPE_CHECKING:  # numpy and the client load when an inference runs
    import numpy as np

    from infergate.client import Client, InferResponse
    from infergate.tensors import Array


def _parse_value(text: str, dtype: np.dtype[Any] | None) -> Array:
    """A .npy file, a .json file, or a JSON literal."""
    import numpy as np

    from infergate.cli.npy import load_npy, sendable

    path = Path(text)
    if text.endswith(".npy"):
        array: Array = load_npy(path)
    else:
        raw, from_file = text.encode(), False
        if text.endswith(".json") and path.exists():
            if not path.is_file():
                raise typer.BadParameter(f"{text}: not a regular file (a directory?)")
            try:
                raw, from_file = path.read_bytes(), True
            except OSError as exc:
                raise typer.BadParameter(
                    f"{text}: cannot read it ({exc.strerror or exc})"
                ) from None
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if from_file:
                raise typer.BadParameter(f"{text}: not JSON ({exc})") from None
            if text.endswith(".json"):
                raise typer.BadParameter(f"{text}: no such file") from None
            raise typer.BadParameter(
                f"{text!r} is neither a .npy file, a .json file nor a JSON value ({exc})"
            ) from None
        try:
            array = np.array(value)
        except ValueError:
            raise typer.BadParameter(
                f"{text!r}: the lists in it are ragged (rows of different lengths); a tensor's "
                "rows are all alike"
            ) from None
        if array.dtype.kind == "O" and not all(isinstance(x, str) for x in array.reshape(-1)):
            raise typer.BadParameter(
                f"{text!r}: holds null, objects or a mix of strings and numbers; a tensor is "
                "all numbers, all booleans or all strings"
            )
    if dtype is not None and array.dtype != dtype and np.can_cast(array.dtype, dtype, "same_kind"):
        array = array.astype(dtype)
    return sendable(text, array)


def _build_inputs(items: list[str], metadata: dict[str, Any]) -> dict[str, Array]:
    import numpy as np

    from infergate.tensors import numpy_dtype

    specs = {t["name"]: t for t in metadata.get("inputs") or []}
    inputs: dict[str, Array] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            if len(specs) != 1:
                raise typer.BadParameter(
                    f"{item!r}: name the input as NAME=VALUE; the model's inputs are "
                    f"{', '.join(specs) or 'unknown'}"
                )
            name, value = next(iter(specs)), item
        if name in inputs:
            raise typer.BadParameter(f"input {name!r} is given twice; give each input once")
        spec = specs.get(name)
        dtype = numpy_dtype(spec["datatype"]) if spec and spec["datatype"] != "BYTES" else None
        array = _parse_value(value, dtype)
        if spec and array.ndim == len(spec["shape"]) - 1:
            array = array[np.newaxis]  # a single sample for a model with a batch dimension
        inputs[name] = array
    return inputs


def _preview(array: Array, limit: int = 10) -> str:
    flat = array.reshape(-1)
    items = [
        x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in flat[:limit].tolist()
    ]
    text = ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in items)
    return f"[{text}{', …' if flat.size > limit else ''}]"


MAX_FILE_NAME_BYTES = 255  # a file name's, on Linux and macOS filesystems


def unsafe_file_name(name: str) -> str | None:
    """Why an output's name, which the server's answer gives, cannot name NAME.npy in
    --save DIR (None when it can): it must be one plain file there, nothing outside DIR
    (`../x`, `/etc/x`), hidden (`.x`), or holding control characters."""
    if not name:
        return "it is empty"
    if name.startswith("."):
        return "it starts with '.', as a hidden file or a step up the path does"
    if "/" in name or "\\" in name:
        return "it holds a path separator"
    if escape_controls(name) != name:
        return "it holds control characters"
    if len(f"{name}.npy".encode()) > MAX_FILE_NAME_BYTES:
        return f"NAME.npy would be longer than the {MAX_FILE_NAME_BYTES} bytes of a file name"
    return None


def _check_names(response: InferResponse, server: str, folder: Path, json: bool) -> None:
    """Every output's name, before any file is written: a server's answer names them."""
    for name in response.outputs:
        why = unsafe_file_name(name)
        if why is not None:
            fail(
                f"{server} answered with an output named {name!r}, which --save cannot write "
                f"as a file: {why}. Nothing was saved to {folder}. Hint: a model's own output "
                "names may hold a '/' (dense/Softmax:0): take its outputs with --json, or ask "
                "for the others with -o; else check that --url is an infergate server",
                EXIT_FAILURE,
                json,
            )


def _save(response: InferResponse, folder: Path, server: str, json: bool) -> list[Path]:
    """Each output to FOLDER/NAME.npy, every NAME checked first; the paths written."""
    import numpy as np

    from infergate.file_swap import swapped_in

    _check_names(response, server, folder, json)
    paths = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, array in response.outputs.items():
            path = folder / f"{name}.npy"
            # Whole or absent, and a link or FIFO already at that name replaced, never
            # written through (outside DIR) or opened (blocking for ever).
            with swapped_in(path) as (file, _):
                np.save(file, array, allow_pickle=array.dtype.kind == "O")
            paths.append(path)
    except OSError as exc:
        fail(f"cannot save the outputs to {folder}: {exc.strerror or exc}", EXIT_FAILURE, json)
    return paths


def _show(response: InferResponse, json: bool, save: Path | None, server: str) -> None:
    saved = [] if save is None else _save(response, save, server, json)
    if json:
        doc = dict(response.raw)
        doc["outputs"] = [
            {
                "name": n,
                "datatype": o["datatype"],
                "shape": o["shape"],
                "data": [
                    x.decode("utf-8", "replace") if isinstance(x, bytes) else x
                    for x in response.outputs[n].reshape(-1).tolist()
                ],
            }
            for n, o in ((o["name"], o) for o in (response.raw.get("outputs") or []))
        ]
        if save is not None:
            doc["saved"] = [str(p) for p in saved]
        print_json(doc)
        return
    model, version = escape_controls(response.model), escape_controls(response.version)
    say(Text.assemble((model, "bold"), f" version {version}"))
    emit_table(
        ["output", "datatype", "shape", "values"],
        [
            [
                out["name"],
                out["datatype"],
                str(out["shape"]),
                _preview(response.outputs[out["name"]]),
            ]
            for out in (response.raw.get("outputs") or [])
        ],
        Format.table,
    )
    if save is not None:
        say(f"saved {', '.join(p.name for p in saved) or 'nothing'} to {save}")


def infer(
    model: Annotated[str, typer.Argument(help="Model name")],
    inputs: Annotated[
        list[str] | None,
        typer.Argument(
            help="NAME=FILE.npy, NAME=FILE.json or NAME='[json]' per input (NAME= may be left out "
            "for a one-input model), or - to read a whole V2 request from stdin"
        ),
    ] = None,
    version: Annotated[
        str | None, typer.Option("--model-version", help="Model version [default: the latest]")
    ] = None,
    output: Annotated[
        list[str] | None,
        typer.Option(
            "--output",
            "-o",
            help="Only this output (repeatable; not with -, whose request names its outputs)",
        ),
    ] = None,
    save: Annotated[Path | None, typer.Option(help="Write each output to DIR/NAME.npy")] = None,
    binary: Annotated[
        bool | None,
        typer.Option(
            help="Send tensors as binary data [default: binary] (not with -, sent as it is)",
            show_default=False,
        ),
    ] = None,
    max_answer_mb: Annotated[
        int,
        typer.Option(
            "--max-answer-mb",
            min=1,
            help="The largest answer read, in MB; a larger one is refused unread",
        ),
    ] = MAX_ANSWER_MB,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            min=0.001,
            show_default=False,
            help="Seconds for each request, its answer read to the end [default: 30] (a "
            "model that runs longer, or a large answer on a slow link, needs more)",
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
    json: JsonOption = False,
) -> None:
    """Run one inference and print the outputs."""
    from infergate.client import ClientError

    items = inputs or []
    if not items:
        check_model_name(model, json)  # (first: the hint below names it)
        fail(
            "give the inputs: NAME=FILE.npy or NAME='[[1, 2]]' each (FILE.npy alone for a "
            f"one-input model; infergate model status {model} names them), or - to read a "
            "V2 request on stdin",
            EXIT_USAGE,
            json,
        )
    check_model_name(model, json)
    if version is not None:
        check_name("model version", version, json)
    if items == ["-"] and output:
        fail(
            "-o/--output does not apply to a request on stdin, which names its own outputs: "
            'drop -o, or put "outputs" in the request',
            EXIT_USAGE,
            json,
        )
    if items == ["-"] and binary is not None:
        fail(
            "--binary/--no-binary does not apply to a request on stdin, which is sent as it "
            "is: drop the flag, or give the inputs as NAME=FILE",
            EXIT_USAGE,
            json,
        )
    try:
        with client(url, token, json, max_answer_mb, timeout) as c:
            response = _run(c, model, items, version, output, binary is not False)
    except ClientError as exc:
        fail_client(exc, json)
    with answer_of(url, json):
        _show(response, json, save, c.url)


def _run(
    c: Client,
    model: str,
    items: list[str],
    version: str | None,
    output: list[str] | None,
    binary: bool,
) -> InferResponse:
    if items == ["-"]:
        body = sys.stdin.buffer.read()
        return c.infer_raw(model, body, {"Content-Type": "application/json"}, version)
    metadata = c.metadata(model, version)
    return c.infer(model, _build_inputs(items, metadata), version, output, binary)
