"""Modules of a package loaded on first use, as attributes of the package (PEP 562): what lets
``import tierstore`` stay light and still reach ``tierstore.trace`` or ``tierstore.daemon.client``."""
from __future__ import annotations

import importlib


def submodule(package: str, name: str):
    """``package.name`` imported; AttributeError if the package has no such module."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":  # the module exists; something it imports does not
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
