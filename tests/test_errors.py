"""One base for tierstore's errors (issue #33, item 4): every error class the package
defines is a tierstore.TierstoreError and keeps its builtin base, and the CLI tells
a user's error from a bug by that type. The classes are found by importing every
module of the package, so a new error that forgets the base fails here."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

import tierstore
import tierstore.tools.stats
from tierstore import TierstoreError
from tierstore.tools.cli import main

PACKAGES = ("tierstore", "tierstore.capacity", "tierstore.daemon", "tierstore.engine", "tierstore.serving", "tierstore.training",
            "tierstore.io", "tierstore.eviction", "tierstore.metrics", "tierstore.tools")

# the builtin bases each error had before TierstoreError: `except` clauses written for them still catch it
BUILTIN_BASES = {
    "StoreLockedError": (RuntimeError,),
    "StoreCorruptError": (RuntimeError,),
    "SegmentFormatError": (ValueError,),
    "DeltaCorruptError": (RuntimeError,),
    "PlanMismatchError": (ValueError,),
    "SettingsMismatchError": (ValueError,),
    "TableTooLargeError": (RuntimeError,),
    "OptimizerMismatchError": (ValueError,),
    "DaemonBusyError": (ConnectionError,),
    "ProtocolError": (ValueError,),
    "RankFailedError": (RuntimeError,),
    "BagIndexError": (IndexError, RuntimeError),
    "BagOffsetsError": (ValueError, RuntimeError),
    "BagTypeError": (TypeError, RuntimeError),
}


PEER_ADAPTERS = {"tierstore.torchrec": "torchrec"}


def error_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by qualified name."""
    found = {}
    for package in PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            if name in PEER_ADAPTERS and importlib.util.find_spec(PEER_ADAPTERS[name]) is None:
                continue  # the adapter refuses to import without its optional peer
            module = importlib.import_module(name)
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                    found[f"{module.__name__}.{value.__qualname__}"] = value
    return found


def test_every_error_class_of_the_package_is_a_tierstore_error():
    import re
    from pathlib import Path

    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()  # (tomllib is Python >= 3.11)
    declared = re.findall(r'"([\w.]+)"', pyproject.split("packages = [", 1)[1].split("]", 1)[0])
    assert set(PACKAGES) == set(declared)  # every package is walked
    classes = error_classes()
    assert len(classes) >= len(BUILTIN_BASES)  # the walk finds them
    assert [name for name, cls in classes.items() if not issubclass(cls, TierstoreError)] == []


def test_each_error_keeps_its_builtin_base():
    by_name = {cls.__name__: cls for cls in error_classes().values()}
    for name, bases in BUILTIN_BASES.items():
        assert all(issubclass(by_name[name], b) for b in bases), (name, by_name[name].__mro__)


def test_the_base_is_exported_from_one_public_name():
    assert tierstore.TierstoreError is tierstore.errors.TierstoreError is TierstoreError
    assert "TierstoreError" in tierstore.__all__
    assert issubclass(TierstoreError, Exception) and not issubclass(TierstoreError, (ValueError, RuntimeError, OSError))


def test_the_cli_prints_one_line_for_a_damaged_store(tmp_path):
    """A StoreCorruptError (a RuntimeError, which is not a user error by itself) from a
    real store whose meta pages were overwritten: one error line naming the file."""
    path = tmp_path / "s"
    tierstore.TieredStore(path, [tierstore.TableSpec("t", 100, 4)], device="cpu", registry=CollectorRegistry()).close()
    with open(path / "data.mdb", "r+b") as f:
        f.write(b"\xff" * 8192)  # both meta pages
    r = subprocess.run([sys.executable, "-m", "tierstore.tools.cli", "stats", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"tierstore: error: {path / 'data.mdb'} is damaged: meta page"), lines


class PluginError(RuntimeError, TierstoreError):
    """A TierstoreError defined outside tierstore's modules."""


def test_the_cli_recognises_errors_by_type_not_by_module(tmp_path, monkeypatch, capsys):
    """The verb fails with a TierstoreError subclass defined in this test's module (a fault
    injected in place of the store's): a user error by its type, so one line, no traceback."""
    path = tmp_path / "s"
    tierstore.TieredStore(path, [tierstore.TableSpec("t", 100, 4)], device="cpu", registry=CollectorRegistry()).close()

    def fail(path):
        raise PluginError("the plugin's store is busy; try again")

    monkeypatch.setattr(tierstore.tools.stats, "read_facts", fail)
    assert main(["stats", str(path)]) == 2
    assert capsys.readouterr().err == "tierstore: error: the plugin's store is busy; try again\n"


def test_a_runtime_error_that_is_not_tierstores_keeps_its_traceback(tmp_path, monkeypatch):
    path = tmp_path / "s"
    tierstore.TieredStore(path, [tierstore.TableSpec("t", 100, 4)], device="cpu", registry=CollectorRegistry()).close()

    def fail(path):
        raise RuntimeError("a bug")

    monkeypatch.setattr(tierstore.tools.stats, "read_facts", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["stats", str(path)])
