"""A bad input on one rank makes every rank raise a ValueError, for every public function.

For each function and each kind of bad input, one rank at a time gets the bad input and
the others good ones, at world sizes 2 and 4. The bad rank raises its own error; the
others raise one naming the bad rank and its reason (they learn it in the metadata
collective, which the bad rank still joins). The calls run on a group whose collectives
time out after 10 s, so a rank left waiting fails the test in seconds, not minutes.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for

import seqpar_kernels as sp

_group = None


def _short_timeout_group():
    global _group
    if _group is None:
        _group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=10), backend="gloo")
    return _group


def _qkv(heads=4, kv_heads=2, length=4, head_dim=8, dtype=torch.float32):
    shape = (1, length, heads, head_dim)
    return torch.randn(shape, dtype=dtype), *(torch.randn(1, length, kv_heads, head_dim, dtype=dtype) for _ in "kv")


def _attention_calls(function):
    """function(q, k, v, **options) -> {bad input: (good call, bad call)}."""
    good = lambda: function(*_qkv(), group=_group)  # noqa: E731
    q, k, v = _qkv()
    return {
        "wrong dtype": (good, lambda: function(*_qkv(dtype=torch.float64), group=_group)),
        "wrong number of dims": (good, lambda: function(q[0], k, v, group=_group)),
        "mismatched heads": (good, lambda: function(*_qkv(heads=5), group=_group)),
        "mismatched lengths": (good, lambda: function(q, k[:, :3], v[:, :3], group=_group)),
        "non-finite scale": (good, lambda: function(q, k, v, softmax_scale=float("inf"), group=_group)),
    }


def _tensor(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def bad_input_calls(world_size: int) -> dict:
    """{function: {bad input: (good call, bad call)}}; calls take no arguments."""
    even = 2 * world_size  # a length zigzag_split accepts
    return {
        "ulysses_attention": _attention_calls(sp.ulysses_attention),
        "ring_attention": _attention_calls(sp.ring_attention),
        "all_to_all_reshard": {
            "wrong dims": (
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2), 2, 1, _group),
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2), 4, 1, _group),
            ),
            "same dims": (
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2), 2, 1, _group),
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2), 1, 1, _group),
            ),
            "wrong number of dims": (
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2), 2, 1, _group),
                lambda: sp.all_to_all_reshard(_tensor(3, 5), 2, 1, _group),
            ),
            "wrong dtype": (
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2), 2, 1, _group),
                lambda: sp.all_to_all_reshard(_tensor(1, 3, 5, 2, dtype=torch.float16), 2, 1, _group),
            ),
        },
        "split_sequence": {
            "wrong dims": (
                lambda: sp.split_sequence(_tensor(2, 6), 1, _group),
                lambda: sp.split_sequence(_tensor(2, 6), 2, _group),
            ),
            "wrong number of dims": (
                lambda: sp.split_sequence(_tensor(2, 6), 1, _group),
                lambda: sp.split_sequence(torch.tensor(1.0), 1, _group),
            ),
            "mismatched lengths": (
                lambda: sp.split_sequence(_tensor(2, 6), 1, _group),
                lambda: sp.split_sequence(_tensor(2, 7), 1, _group),
            ),
        },
        "gather_sequence": {
            "wrong dims": (
                lambda: sp.gather_sequence(_tensor(2, 3), 1, _group),
                lambda: sp.gather_sequence(_tensor(2, 3), -3, _group),
            ),
            "wrong dtype": (
                lambda: sp.gather_sequence(_tensor(2, 3), 1, _group),
                lambda: sp.gather_sequence(_tensor(2, 3, dtype=torch.bfloat16), 1, _group),
            ),
        },
        "zigzag_split": {
            "mismatched lengths": (
                lambda: sp.zigzag_split(_tensor(2, even), 1, _group),
                lambda: sp.zigzag_split(_tensor(2, even + 1), 1, _group),
            ),
            "wrong dims": (
                lambda: sp.zigzag_split(_tensor(2, even), 1, _group),
                lambda: sp.zigzag_split(_tensor(2, even), 3, _group),
            ),
        },
        "zigzag_gather": {
            "mismatched lengths": (
                # 1 row among pieces of 4 is never a zigzag piece of their sum.
                lambda: sp.zigzag_gather(_tensor(2, 4), 1, _group),
                lambda: sp.zigzag_gather(_tensor(2, 1), 1, _group),
            ),
            "wrong dims": (
                lambda: sp.zigzag_gather(_tensor(2, 4), 1, _group),
                lambda: sp.zigzag_gather(_tensor(2, 4), 2, _group),
            ),
        },
    }


def run_bad_inputs() -> dict:
    """Every (function, bad input, bad rank): what this rank raised, or None if nothing.
    Afterwards a good call of each function must still work (the ranks stayed in step)."""
    _short_timeout_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    raised = {}
    for function, cases in bad_input_calls(world_size).items():
        for bad_input, (good_call, bad_call) in cases.items():
            for bad_rank in range(world_size):
                try:
                    (bad_call if rank == bad_rank else good_call)()
                except ValueError as error:
                    raised[function, bad_input, bad_rank] = str(error)
                else:
                    raised[function, bad_input, bad_rank] = None
    for cases in bad_input_calls(world_size).values():
        next(iter(cases.values()))[0]()  # still in step
    return raised


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_bad_input_on_one_rank_raises_on_every_rank(world_size):
    per_rank = pool_for(world_size).run(run_bad_inputs)
    failures = []
    for rank, raised in enumerate(per_rank):
        for (function, bad_input, bad_rank), message in raised.items():
            case = f"{function}, {bad_input} on rank {bad_rank}: rank {rank}"
            if message is None:
                failures.append(f"{case} raised nothing")
            elif rank != bad_rank and f"rank {bad_rank}" not in message:
                failures.append(f"{case} does not name rank {bad_rank}: {message}")
    assert not failures, "\n".join(failures)
