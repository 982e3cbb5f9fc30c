"""The rank pool (tests/rank_pool.py) reports a failing rank at once, releasing the
ranks left waiting for it, and works again afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for
from rank_pool import FAILURE_GRACE_SECONDS, RankFailure


def fail_on_rank_zero():
    """Rank 0 raises; the others wait for it in a collective it never joins (on the
    default group, whose timeout is the process group's 30 minutes)."""
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 fails on purpose")
    dist.all_reduce(torch.ones(1))
    return "unreachable"


def world_size_and_rank():
    return dist.get_world_size(), dist.get_rank()


def test_a_failing_rank_releases_the_waiting_ones():
    # One world size, where two ranks wait for the failed one: each run kills its pool
    # and starts it again.
    world_size = 3
    pool = pool_for(world_size)
    with pytest.raises(RankFailure) as failure:
        pool.run(fail_on_rank_zero)
    message = str(failure.value)
    assert "rank 0: RuntimeError: rank 0 fails on purpose" in message
    # Released after the grace a failure gives, not after the pool's whole timeout.
    assert f"ranks {list(range(1, world_size))}: no answer in {FAILURE_GRACE_SECONDS} s after a failure" in message
    # A fresh pool replaces the killed one.
    assert pool.run(world_size_and_rank) == [(world_size, rank) for rank in range(world_size)]
