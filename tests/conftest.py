import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, max_examples=60)
# CI: derandomized, so a red run is reproducible and a green one is not luck
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path plugin has set up basetemp
def pytest_configure(config):
    # What the tests, and the processes they start, write to the temporary directory (tempfile's folders,
    # torch.compile's cache, which importing torch._inductor places at once) goes under pytest's basetemp,
    # which goes after a run that passed (tmp_path_retention_policy): a machine that runs the suite again
    # and again keeps nothing of it.
    folder = str(config._tmp_path_factory.mktemp("tmp", numbered=False))
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # set in each worker of `pytest -n N`
    if workers:
        # N workers share the cores: torch's default, a thread per core in each worker, oversubscribes them
        # (idle threads spin: `-n 2` ran test_nn.py in 45 s, serially 25 s). Each worker takes its share (or
        # fewer threads, if OMP_NUM_THREADS says so), and through the environment so do the daemons, demos
        # and ranks it starts.
        share = max(1, (os.cpu_count() or 1) // int(workers))
        share = min(share, int(os.environ.get("OMP_NUM_THREADS", share)))
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for item in items:
            _group_by_module_fixture(item)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _group_by_module_fixture(item):
    """Every worker that runs a test builds that test's module-scoped fixtures (a daemon, two ranks, a
    synthesized trace: seconds each): under `--dist loadgroup` the tests of a module that share such a
    fixture go to one worker, which builds it once."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs} if info else set()
    if "module" in scopes:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def no_matplotlib(monkeypatch):
    """Imports of matplotlib fail, as where the [plot] extra is not installed."""
    import builtins

    real_import = builtins.__import__

    def importer(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("injected: no matplotlib")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", importer)
