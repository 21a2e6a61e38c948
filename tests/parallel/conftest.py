"""The `dist_pool` fixture: 4 gloo ranks spawned once per test session (see harness.py)."""

import pytest

from tests.parallel.harness import DistributedPool

WORLD_SIZE = 4


@pytest.fixture(scope="session")
def dist_pool():
    pool = DistributedPool(WORLD_SIZE)
    yield pool
    pool.close()
