"""The default test run is `pytest -n 2` (pytest-xdist): what each worker sets up for itself
(tests/conftest.py) or inherits. Run serially, the first test has nothing to check."""
from __future__ import annotations

import os

import torch
from hypothesis import settings


def test_a_worker_takes_only_its_share_of_the_cores_and_passes_it_on():
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"]) <= max(1, (os.cpu_count() or 1) // workers)


def test_the_hypothesis_profile_named_in_the_environment_applies():
    # CI sets HYPOTHESIS_PROFILE=ci for the pytest process; each worker loads the profile from its copy
    if os.environ.get("HYPOTHESIS_PROFILE") == "ci":
        assert settings.default.derandomize and settings.default.print_blob
    else:
        assert not settings.default.derandomize
