"""Any finite softmax_scale gives the exact answer: zero (uniform attention over the
visible keys), negative, and ordinary ones, causal or not, forward and backward, on
the ring's CPU and Triton paths and in Ulysses. Kernels that mask a causal score with
-inf before scaling it would return NaN rows for a zero or negative scale."""

from __future__ import annotations

import pytest
import torch
from on_ranks import on_every_rank, rank_and_world, timeout_group
from triton_interpreter import runs_triton_on

import seqpar_kernels as sp
from seqpar_kernels.engine.step_backends import AUTO
from seqpar_kernels.testing import ring_attention_with_step_kernels
from tools import reference

SCALES = (0.0, -0.3, -1.0, 0.25)
B, H, H_KV, D, S_LOCAL = 1, 4, 2, 8, 4


def _ring(layout, step_kernels=AUTO):
    return lambda q, k, v, causal, scale: ring_attention_with_step_kernels(
        q, k, v, step_kernels, causal=causal, softmax_scale=scale, layout=layout, group=timeout_group()
    )


def _ulysses(q, k, v, causal, scale):
    return sp.ulysses_attention(q, k, v, causal=causal, softmax_scale=scale, group=timeout_group())


@on_every_rank
def run_scales(path):
    rank, world_size = rank_and_world()
    layout = "zigzag" if path == "ring-zigzag" else "contiguous"
    attention = _ulysses if path == "ulysses" else _ring(layout, "triton" if path == "ring-triton" else AUTO)
    rows = lambda x, rank, world_size: reference.ring_piece(x, layout, rank, world_size)  # noqa: E731
    generator = torch.Generator().manual_seed(5)
    total = S_LOCAL * world_size
    q, k, v, dout = (
        torch.randn(B, total, heads, D, generator=generator, dtype=torch.float64) for heads in (H, H_KV, H_KV, H)
    )
    errors = {}
    for scale in SCALES:
        for causal in (False, True):
            exact = reference.with_grads(lambda q, k, v: reference.attention(q, k, v, causal, scale), (q, k, v), dout)
            ours = reference.with_grads(
                lambda q, k, v: attention(q, k, v, causal, scale),
                [rows(t, rank, world_size).float() for t in (q, k, v)],
                rows(dout, rank, world_size).float(),
            )
            errors[f"scale={scale} causal={causal}"] = max(
                reference.max_error(got, rows(expected, rank, world_size))
                for got, expected in zip(ours[:1] + ours[2:], exact[:1] + exact[2:])
            )
    return errors


@pytest.mark.parametrize(
    "path", ["ring", "ring-zigzag", pytest.param("ring-triton", marks=runs_triton_on("cpu")), "ulysses"]
)
def test_any_finite_scale_is_exact(ranks, path):
    if path == "ring-triton" and ranks.world_size not in (1, 2):
        pytest.skip("the interpreter is slow: world sizes 1 and 2")
    failures = [
        f"rank {rank} {name}: error {error:.3g}"
        for rank, errors in enumerate(ranks.run(run_scales, path))
        for name, error in errors.items()
        if not error <= 2e-5  # fp32 against fp64; NaN fails too
    ]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("function", [sp.ring_attention, sp.ulysses_attention], ids=lambda fn: fn.__name__)
def test_compiled_call_takes_a_scale_that_changes_between_calls(function):
    # torch.compile traces a float argument that changed since the last call as a
    # symbolic float: the scale's checks must take one (math.isfinite cannot), and every
    # scale must still give eager's answer.
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, S_LOCAL, heads, D, generator=gen) for heads in (H, H_KV, H_KV))

    def attention(q, k, v, scale):
        return function(q, k, v, causal=True, softmax_scale=scale)

    torch._dynamo.reset()  # this test's other function compiled the same code object
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    for scale in (0.5, 0.7, *SCALES):
        assert torch.equal(compiled(q, k, v, scale), attention(q, k, v, scale)), f"scale {scale}"
    # The check still raises; fullgraph compile reports the ValueError inside its own.
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="softmax_scale must be finite"):
        compiled(q, k, v, float("nan"))
