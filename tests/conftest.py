import os
import sys

import pytest
import torch

# The references and the accuracy rule (tools/reference.py) and the developer tools live
# in the checkout's tools/, importable from its root also when pytest runs from elsewhere.
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPOSITORY not in sys.path:
    sys.path.insert(0, _REPOSITORY)

# Triton kernels run on CPU tensors through the interpreter when there is no GPU; with
# one, the kernel tests run the compiled kernels. (The gloo rank pool's workers always
# interpret: their tensors are on the CPU.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rank_pool import RankPool  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)
_pools: dict[int, RankPool] = {}


def pool_for(world_size: int) -> RankPool:
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size)
    return _pools[world_size]


@pytest.fixture(params=WORLD_SIZES, ids=lambda size: f"P{size}")
def ranks(request) -> RankPool:
    """A pool of local gloo ranks; tests run once per world size 1, 2, 3 and 4
    (3 catches power-of-two assumptions)."""
    return pool_for(request.param)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
