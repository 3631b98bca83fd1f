"""One base for tierstore's errors: every error class the package
defines is a tierstore.TierstoreError and keeps its builtin base, and the CLI tells
a user's error from a bug by that type. The classes are found by importing every
module of the package, so a new error that forgets the base fails here."""
from __future__ import annotations

import builtins
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

PACKAGES = ("tierstore", "tierstore.capacity", "tierstore.daemon", "tierstore.engine", "tierstore.nn", "tierstore.serving", "tierstore.training",
            "tierstore.torchrec", "tierstore.distributed", "tierstore.io", "tierstore.eviction", "tierstore.metrics", "tierstore.tools")

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
    # the builtins the library raised before each kind of mistake had a class
    "SettingError": (ValueError,),
    "BadIdsError": (ValueError,),
    "BadValuesError": (ValueError,),
    "IdRangeError": (IndexError,),
    "ArgumentTypeError": (TypeError,),
    "UnknownTableError": (KeyError,),
    "WriteRefusedError": (PermissionError,),
    "StateError": (RuntimeError,),
    "StoreClosedError": (RuntimeError,),
    "UnsupportedError": (RuntimeError,),
    "FormatError": (ValueError,),
    "PathExistsError": (FileExistsError,),
    "PathNotFoundError": (FileNotFoundError,),
    "MissingDependencyError": (ImportError,),
    "WaitTimeoutError": (TimeoutError,),
    "DaemonConnectionError": (ConnectionError,),
}


PEER_ADAPTERS = {"tierstore.torchrec": "torchrec"}


def error_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package, by qualified name."""
    found = {}
    def peer_missing(name: str) -> bool:  # the adapter (and its modules) refuse to import without its optional peer
        return any((name == a or name.startswith(a + ".")) and importlib.util.find_spec(peer) is None
                   for a, peer in PEER_ADAPTERS.items())

    for package in PACKAGES:
        if peer_missing(package):
            continue
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            name = f"{package}.{info.name}"
            if peer_missing(name):
                continue
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


# -- every error raised on purpose is a TierstoreError ---------------------------------------------

LIBRARY = ("tierstore", "eviction", "metrics", "tools")  # io/ converts its own raises separately
BUILTIN_ERRORS = {name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)}
# (file, enclosing function, builtin) the library may still raise or build
ALLOWED = {
    # the package's lazy attributes: Python's protocol for a missing module attribute
    ("tierstore/lazy.py", "submodule", "AttributeError"),
    ("tierstore/lazy.py", "exports.__getattr__", "AttributeError"),
    # importing the TorchRec adapter without TorchRec: a failed import is Python's ImportError
    ("tierstore/torchrec/__init__.py", "", "ImportError"),
    # internal invariants: each means a bug in tierstore, not a caller's mistake
    ("tierstore/engine/hashindex.py", "HashIndex.remove", "KeyError"),
    ("tierstore/engine/hashindex.py", "HashIndex._rebuild", "RuntimeError"),
    ("tierstore/engine/tiers.py", "CacheTier.add", "RuntimeError"),
    ("tierstore/daemon/client.py", "DaemonStore._daemon_read_frame", "RuntimeError"),  # a reply of the wrong size
    ("tierstore/daemon/client.py", "ClientTableTrainer.admitted", "RuntimeError"),
    # the environment's errors, re-raised with their errno and a hint
    ("tierstore/store.py", "TieredStore._reap", "OSError"),
    ("metrics/server.py", "MetricsServer.__init__", "OSError"),
    # no memfd_create on this OS: the daemon catches it and sends frames through the socket
    ("tierstore/daemon/wire.py", "Segment.create", "OSError"),
    ("tools/capacity_plots.py", "check_plot_dir", "IsADirectoryError"),  # --plot's folder cannot take the plots
    ("tools/capacity_plots.py", "check_plot_dir", "NotADirectoryError"),
    ("tools/capacity_plots.py", "check_plot_dir", "PermissionError"),
}


def builtin_errors_made(path) -> list[tuple[str, str, int]]:
    """(enclosing function, builtin, line) of each `raise Builtin` or `Builtin(...)` in a file."""
    import ast

    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            name = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{where}.{child.name}" if where else child.name
            exc = child.exc if isinstance(child, ast.Raise) else child if isinstance(child, ast.Call) else None
            target = exc.func if isinstance(exc, ast.Call) else exc
            # NotImplementedError: abstract methods, unsupported modes; SystemExit: a command ends with its message
            if isinstance(target, ast.Name) and target.id in BUILTIN_ERRORS - {"NotImplementedError", "SystemExit"}:
                found.append((name, target.id, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "")
    return sorted(set(found))


def test_the_library_raises_no_bare_builtin_errors():
    """A source scan: `except TierstoreError` catches every error the library raises on
    purpose, so none is a bare ValueError, KeyError, RuntimeError, PermissionError, ..."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    made = {(str(p.relative_to(root)), where, name): line for folder in LIBRARY for p in sorted((root / folder).rglob("*.py"))
            for where, name, line in builtin_errors_made(p)}
    assert sorted(f"{f}:{line} {where}: {name}" for (f, where, name), line in made.items() if (f, where, name) not in ALLOWED) == []
    assert sorted(ALLOWED - set(made)) == []  # an allowance that no longer applies goes


def test_the_public_classes_are_exported_and_documented():
    from pathlib import Path

    import tierstore.errors

    doc = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
    public = [name for name in tierstore.errors.__all__ if isinstance(getattr(tierstore.errors, name), type)]
    assert len(public) >= 15
    assert [name for name in public if f"`{name}`" not in doc] == []


def test_a_message_quoting_an_error_names_the_builtin_it_was():
    """Messages that quote another error (a damaged file's, a failed rank's) read as before
    the classes: a SettingError is quoted as the ValueError it was."""
    from tierstore.errors import SettingError, kind
    from tierstore.io.errors import StoreCorruptError

    assert kind(SettingError("x")) == "ValueError"
    assert kind(StoreCorruptError("x")) == "StoreCorruptError"
    assert kind(KeyError("x")) == "KeyError"


# raises in io/ that stay builtin: invariants of the code itself (a bug, not an error a user meets),
# errors caught where they are raised, and the module protocol; LMDB's own classes are not builtins
IO_ALLOWED = {
    ("io/rowlog.py", "RowLog.id_span", "RuntimeError"),
    ("io/rowlog.py", "SeqMap.__getitem__", "KeyError"),  # a mapping's protocol
    ("io/rowlog.py", "SeqMap.many", "KeyError"),
    ("io/rowlog.py", "SeqMap.add", "ValueError"),  # seqs out of order: a bug of its caller
    ("io/lmdb_map.py", "map_base", "RuntimeError"),
    ("io/deltas.py", "decode_delta", "TypeError"),
    ("io/deltas.py", "decode_delta", "ValueError"),
}


def test_io_raises_its_own_errors():
    """io/ raises TierstoreError subclasses that keep their builtin base, not bare builtins."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    made = {(str(p.relative_to(root)), where, name): line for p in sorted((root / "io").rglob("*.py"))
            for where, name, line in builtin_errors_made(p)}
    assert sorted(f"{f}:{line} {where}: {name}" for (f, where, name), line in made.items() if (f, where, name) not in IO_ALLOWED) == []
    assert sorted(IO_ALLOWED - set(made)) == []
