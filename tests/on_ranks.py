"""Helpers that run inside the gloo ranks of the rank pool (tests/rank_pool.py).

rank_and_world()             this rank and the world size
timeout_group()              the world as a gloo group whose collectives time out
on_every_rank                decorator for rank functions that use timeout_group
all_ranks_agree(flag)        True iff flag is true on every rank
backward_on_every_rank(out, dout)   out.backward(dout), raising on every rank alike
                             when some rank's out is cut from the graph
raises(call, match)          None when call() raises the expected ValueError,
                             else what went wrong (a rank function's report)
"""

from __future__ import annotations

import functools
import re
from datetime import timedelta

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


# A collective that one rank never joins (a bug, or an assertion that failed on one
# rank only) should fail the test in seconds, not hang until the pool's 300 s timeout:
# the rank functions pass this gloo group, whose collectives time out, to the functions under test.
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
_group = None
_failed_last_call = False


def timeout_group():
    """The world as a group with a short collective timeout (made by on_every_rank at
    the start of a rank function, on every rank at the same point: new_group is
    collective)."""
    global _group
    if _group is None:
        world = list(range(dist.get_world_size()))
        _group = dist.new_group(world, timeout=COLLECTIVE_TIMEOUT, backend="gloo")
    return _group


def on_every_rank(fn):
    """Marks a rank function. A gloo group whose collective timed out is unusable, so
    if the previous call raised on any rank, every rank replaces the group first (they
    agree through one small all-reduce on the default group)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _group, _failed_last_call
        if dist.get_world_size() > 1:
            any_failed = torch.tensor([int(_failed_last_call)])
            dist.all_reduce(any_failed, op=dist.ReduceOp.MAX)
            if any_failed.item():
                _group = None
        _failed_last_call = False
        timeout_group()
        try:
            return fn(*args, **kwargs)
        except BaseException:
            _failed_last_call = True
            raise

    return wrapper


def all_ranks_agree(flag: bool) -> bool:
    """True iff `flag` is true on every rank (one small all-reduce)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bool(flag)
    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=timeout_group())
    return bool(value.item())


def backward_on_every_rank(out, dout):
    """out.backward(dout), but first make sure that every rank can run it: the
    backward is collective, so one rank whose output is cut from the graph would
    leave the others waiting until the pool's timeout. Raises on every rank alike."""
    connected = out.grad_fn is not None
    if not all_ranks_agree(connected):
        raise AssertionError(
            f"output of shape {tuple(out.shape)} has no grad_fn on some rank "
            f"(this rank: grad_fn={out.grad_fn}); its backward would hang the others"
        )
    out.backward(dout)


def raises(call, match: str) -> str | None:
    """None when call() raises ValueError matching `match` (a regex), else what went
    wrong: a rank function collects these instead of asserting, so that every rank
    reaches the same collectives whatever one rank's check finds."""
    try:
        call()
    except ValueError as error:
        return None if re.search(match, str(error)) else f"ValueError without {match!r}: {error}"
    return f"no ValueError (expected {match!r})"
