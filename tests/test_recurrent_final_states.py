"""The mixers' final states (return_final_states=True): every sequence's state after its
last token, on every rank, what a cache keeps for generation, against the one-process
recurrence over each whole sequence (per document for packed ones), in every layout
(tests/recurrent_cases.py), world sizes 1-4 and a USP grid."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import pool_for
from on_ranks import on_every_rank
from recurrent_cases import where_cases

from seqpar_kernels import causal_conv1d, gated_delta_rule, selective_scan, ssd_scan
from seqpar_kernels.engine.gated_delta import chunk_gated_delta_rule
from seqpar_kernels.engine.state_space import discretised_dt, selective_from_zero, ssd_from_zero

DTYPE = torch.float64


def _inputs(total: int, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=DTYPE)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, dtype=DTYPE)

    return {
        "conv": (randn(2, total, 5), randn(5, 3)),
        "gated_delta": (randn(2, total, 2, 8), randn(2, total, 2, 8), randn(2, total, 4, 6), -rand(2, total, 4),
                        rand(2, total, 4)),
        "ssd": (randn(2, total, 4, 3), randn(2, total, 4), -rand(4), randn(2, total, 2, 5), randn(2, total, 2, 5)),
        "selective": (randn(2, total, 6), randn(2, total, 6), -rand(6, 4), randn(2, total, 4), randn(2, total, 4)),
    }  # fmt: skip


def _ours(op: str, inputs, where):
    if op == "conv":
        return causal_conv1d(*inputs, return_final_states=True, **where)
    if op == "gated_delta":
        return gated_delta_rule(*inputs, use_qk_l2norm=True, return_final_states=True, **where)
    if op == "ssd":
        return ssd_scan(*inputs, chunk_size=4, dt_softplus=True, return_final_states=True, **where)
    return selective_scan(*inputs, delta_softplus=True, return_final_states=True, **where)


def _reference_final(op: str, inputs):
    """The state after one whole sequence (batch 2 or 1): (batch, ...)."""
    if op == "conv":
        x, weight = inputs
        kernel = weight.shape[1]
        return torch.nn.functional.pad(x, (0, 0, kernel, 0))[:, -kernel:]
    if op == "gated_delta":
        return chunk_gated_delta_rule(*inputs, use_qk_l2norm=True)[1]
    if op == "ssd":
        x, dt, A, B, C = inputs
        return ssd_from_zero(x, discretised_dt(dt, None, True, None, DTYPE), A, B, C, 4)[1]
    u, delta, A, B, C = inputs
    return selective_from_zero(u, discretised_dt(delta, None, True, None, DTYPE), A, B, C)[1]


@on_every_rank
def run_final_states():
    failures = []
    generator = torch.Generator().manual_seed(9)
    total = 4 * dist.get_world_size() + 3
    all_inputs = _inputs(total, generator)
    for name, where, take, bounds in where_cases(total):
        for op, inputs in all_inputs.items():
            if bounds is not None:  # packed documents: one row
                inputs = tuple(x[:1] if x.dim() > 1 and x.shape[1] == total else x for x in inputs)
            local = tuple(take(x, 1) if x.dim() > 1 and x.shape[1] == total else x for x in inputs)
            _, finals = _ours(op, local, where)
            if bounds is None:
                expected = _reference_final(op, inputs)
            else:
                expected = torch.cat([
                    _reference_final(op, tuple(x[:, start:end] if x.dim() > 1 and x.shape[1] == total else x
                                               for x in inputs))
                    for start, end in zip(bounds[:-1], bounds[1:])
                ])  # fmt: skip
            if finals.shape != expected.shape or not torch.allclose(finals, expected.to(finals.dtype), atol=1e-9):
                failures.append(f"{name} {op}: {tuple(finals.shape)} vs {tuple(expected.shape)}")
    return failures


@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda size: f"P{size}")
def test_final_states_are_the_whole_sequences(world_size):
    for rank, failures in enumerate(pool_for(world_size).run(run_final_states)):
        assert not failures, f"rank {rank}: {failures[:6]}"
