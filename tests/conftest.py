import os

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
