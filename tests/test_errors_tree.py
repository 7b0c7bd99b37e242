"""infergate/errors.py holds every exception infergate raises on purpose, and its docstring
draws the tree: each class by name, each HTTP error with its status code."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import infergate
from infergate import errors

# Client-side or private to one module, and named as such in errors.py's docstring.
OUTSIDE = {"ClientError", "SourceError", "_Refused"}


def _exceptions_defined_in_infergate() -> dict[str, str]:
    found: dict[str, str] = {}
    for info in pkgutil.walk_packages(infergate.__path__, "infergate."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                found[name] = module.__name__
    return found


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
