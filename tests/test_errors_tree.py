"""infergate/errors.py holds every exception infergate raises on purpose, and its docstring
draws the tree: each class by name, each HTTP error with its status code."""

from __future__ import annotations

import ast
import builtins
import gc
import inspect
import re
from pathlib import Path

import infergate
from infergate import errors

# Client-side or private to one module, and named as such in errors.py's docstring.
OUTSIDE = {"ClientError", "UrlError", "InputsTooLarge", "SourceError", "_Refused"}


def _parse(text: str) -> ast.Module:
    """ast.parse, with no other thread's Python run in the middle of it. CPython 3.11.2
    (Debian's, which install.sh chooses) keeps the AST builder's recursion depth per
    interpreter, not per thread: a collection during the build ran another thread (one
    this xdist worker's earlier tests left) that built an AST too, and the parse failed
    with "SystemError: AST constructor recursion depth mismatch" (fixed in later 3.11s)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(text)
    finally:
        if enabled:
            gc.enable()


def _exceptions_defined_in_infergate() -> dict[str, str]:
    """Every class deriving from an exception, by name -> module, read from the sources (no
    imports: the torch runtime alone takes seconds to import)."""
    root = Path(infergate.__file__).parent
    classes: list[tuple[str, str, list[str]]] = []
    for source in sorted(root.rglob("*.py")):
        module = ".".join(("infergate", *source.relative_to(root).with_suffix("").parts))
        for node in ast.walk(_parse(source.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute))
                ]
                classes.append((node.name, module, names))
    exceptions = {
        n for n, v in vars(builtins).items() if inspect.isclass(v) and issubclass(v, BaseException)
    }
    while True:  # a class is an exception when one of its bases is: to a fixed point
        grown = {name for name, _, names in classes if exceptions & set(names)} - exceptions
        if not grown:
            break
        exceptions |= grown
    return {
        name: module
        for name, module, _ in classes
        if name in exceptions and name not in vars(builtins)
    }


def test_every_exception_lives_in_errors_py() -> None:
    elsewhere = {
        name: module
        for name, module in _exceptions_defined_in_infergate().items()
        if module != "infergate.errors" and name not in OUTSIDE
    }
    assert elsewhere == {}


def test_the_docstring_lists_every_class_with_its_status() -> None:
    doc = errors.__doc__ or ""
    for name, value in vars(errors).items():
        if not (inspect.isclass(value) and issubclass(value, Exception)):
            continue
        if value.__module__ != "infergate.errors":
            continue
        if issubclass(value, errors.InfergateError) and value is not errors.ConfigError:
            assert re.search(rf"\b{name}\s+{value.status}\b", doc), f"{name} {value.status}"
        else:
            assert re.search(rf"\b{name}\b", doc), name
    for name in OUTSIDE:
        assert name in doc


def test_an_unknown_tenant_is_not_an_unknown_model() -> None:
    assert not issubclass(errors.TenantNotFound, errors.ModelNotFound)
    assert errors.TenantNotFound.status == 404
