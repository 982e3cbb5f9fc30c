"""The rank pool (tests/rank_pool.py) reports a failing rank at once, releasing the
ranks left waiting for it, and works again afterwards; it destroys the process groups a
finished task dropped and keeps those something still holds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for
from rank_pool import FAILURE_GRACE_SECONDS, MAX_GROUPS, RankFailure


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


_cached = {}


def make_groups(dropped: int):
    """Makes `dropped` groups and lets them go, and a mesh and a group this module keeps
    (made once per rank); returns the rank's groups and threads."""
    import os

    from torch.distributed import distributed_c10d
    from torch.distributed.device_mesh import init_device_mesh

    made = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(dropped)]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    if not _cached:
        _cached["mesh"] = mesh
        _cached["group"] = dist.new_group([0, 1, 2, 3])
    del made, mesh
    return len(distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))


def group_count():
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def use_the_kept_groups():
    """All-reduces over the kept mesh's dims and the kept group: they still work. Returns
    the sums, the rank's groups and its threads."""
    import os

    from torch.distributed import distributed_c10d

    mesh = _cached["mesh"]
    totals = [torch.ones(1) for _ in range(3)]
    dist.all_reduce(totals[0], group=mesh.get_group("outer"))
    dist.all_reduce(totals[1], group=mesh["outer", "inner"]._flatten().get_group())
    dist.all_reduce(totals[2], group=_cached["group"])
    threads = len(os.listdir("/proc/self/task"))
    return [total.item() for total in totals], len(distributed_c10d._world.pg_map), threads


def test_the_groups_a_task_dropped_are_destroyed_and_the_kept_ones_work():
    pool = pool_for(4)
    before = max(pool.run(group_count))  # the earlier tests' kept groups
    if before + 4 > MAX_GROUPS:  # this test's would restart the pool
        pool.close()
        before = 1
    groups, threads = zip(*pool.run(make_groups, MAX_GROUPS + 8))
    # Counted before the release: the task's groups were all there.
    assert min(groups) > MAX_GROUPS, groups
    sums, kept, threads_after = zip(*pool.run(use_the_kept_groups))
    assert sums == ([2.0, 4.0, 4.0],) * 4, sums
    # The world, the kept mesh's two dims (its flattened dim may reuse the world's group),
    # the kept group: nothing the task dropped (the pool did not restart: they still work).
    assert max(kept) <= before + 4, (before, kept)
    # The destroyed groups' threads are gone (three a group).
    assert all(after < made - 2 * MAX_GROUPS for after, made in zip(threads_after, threads)), (threads, threads_after)
