"""The packages import one way (docs/design.md): no module imports a layer above its own, at
import time or inside a function, so there is no import circle between subsystems."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"tierstore": "tierstore", "eviction": "tierstore.eviction", "io": "tierstore.io",
           "metrics": "tierstore.metrics", "tools": "tierstore.tools"}
# a subsystem's layer: each may import its own and the layers below it
LAYERS = {
    "errors": 0, "lazy": 0,  # import nothing: every package may use them
    "io": 1, "eviction": 1, "metrics": 1, "precision": 1, "validate": 1,
    "spec": 2, "trace": 2, "optim": 2,
    "engine": 3,
    "training": 4,
    "capacity": 5,
    "config": 5, "inspection": 5,
    "store": 6,
    "serving": 7, "daemon": 7,
    "nn": 8, "torchrec": 9, "distributed": 9, "wire": 9, "__init__": 10,
    "tools": 11,
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def subsystem(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The tierstore modules a file imports, anywhere but under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known:
                out.add(name)
    return out


def test_no_module_imports_a_layer_above_its_own():
    known = modules()
    assert {subsystem(m) for m in known} <= set(LAYERS), sorted({subsystem(m) for m in known} - set(LAYERS))
    upward = [f"{m} imports {t}" for m, path in sorted(known.items()) for t in sorted(imports(path, known))
              if subsystem(t) != subsystem(m) and LAYERS[subsystem(t)] >= LAYERS[subsystem(m)]]
    assert upward == []


def test_the_library_has_no_relative_imports_across_packages():
    """Absolute imports inside tierstore/: a module that moves keeps its imports."""
    relative = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in (ROOT / "tierstore").rglob("*.py")
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level > 1]
    assert relative == []


def test_import_tierstore_reaches_every_module_as_an_attribute():
    """The package loads its names on first use; its modules stay reachable from `import tierstore`
    as they were when it imported them eagerly (tierstore.daemon.client, tierstore.trace, ...)."""
    import subprocess
    import sys

    code = ("import sys, tierstore\n"
            "assert 'torch' not in sys.modules\n"
            "print(tierstore.daemon.client.DaemonStore.__name__, tierstore.trace.Trace.__name__,"
            " tierstore.engine.table.TableStore.__name__, tierstore.TieredStore.__name__)\n"
            "try:\n    tierstore.no_such_module\nexcept AttributeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["DaemonStore Trace TableStore TieredStore",
                                        "module 'tierstore' has no attribute 'no_such_module'"], done.stderr
