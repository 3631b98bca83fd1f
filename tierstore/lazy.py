"""Names and modules of a package loaded on first use, as attributes of the package (PEP 562): what
lets ``import tierstore`` stay light and still reach ``tierstore.trace`` or ``tierstore.daemon.client``."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def submodule(package: str, name: str):
    """``package.name`` imported; AttributeError if the package has no such module."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":  # the module exists; something it imports does not
            raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None


def exports(namespace: dict, names: dict[str, str | None], modules: bool = False
            ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``names`` (public name -> the submodule
    defining it, relative to the package; None: the name is a submodule). Each name is imported on
    first use and kept in the package's ``namespace`` (its ``globals()``), so later lookups skip
    ``__getattr__``. With ``modules``, other names are tried as submodules (``tierstore.trace``)."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name not in names:
            if modules:
                return submodule(package, name)
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{names[name] or name}")
        value = module if names[name] is None else getattr(module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
