"""An eviction policy as a user adds one, and a fixture that registers it for a test: with the
registered policies, what the policy contract tests (test_policies.py, test_capacity.py) run over."""
import numpy as np
import pytest

from tierstore.eviction import POLICIES, EvictionPolicy, register
from tierstore.eviction.policies import smallest


class ProtectedLRU(EvictionPolicy):
    """A policy as a user would add one: rows used in 2 or more steps are protected, and
    go only after every row used once (a segmented LRU), least recently used first."""

    name = "test-protected-lru"

    def victims(self, last, freq, k):
        protected = freq >= 2
        once, twice = np.flatnonzero(~protected), np.flatnonzero(protected)
        if k <= len(once):
            return once[smallest(last[once], k)] if k < len(once) else once
        return np.concatenate([once, twice[smallest(last[twice], k - len(once))]])

    def order(self, last, freq):
        return (min(freq, 2), last)


CONTRACT_POLICIES = [*sorted(POLICIES), ProtectedLRU.name]


@pytest.fixture
def policy_named(request):
    """The policy of the test's parameter, registered for the test when it is ProtectedLRU."""
    name = request.param
    if name == ProtectedLRU.name:
        register(ProtectedLRU)
        request.addfinalizer(lambda: POLICIES.pop(name))
    return name
