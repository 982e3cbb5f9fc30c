"""ring_attention and ulysses_attention take q, k, v (and receive dout) in any strides.

The layouts are the ones real models produce: q, k and v as slices of one fused
projection, (B, H, S, D) storage, a last dim that is not contiguous, batch-expanded
views; and gradients with odd strides from what consumes the output. Every path runs
them: the CPU ring (aten's kernels), the Triton ring (the CUDA path's kernels, in the
interpreter), Ulysses, and on a GPU the CUDA ring and Ulysses. Each is compared with
fp64 attention on the whole sequence.
"""

from __future__ import annotations

import pytest
import torch
from on_ranks import on_every_rank, rank_and_world, timeout_group
from test_step_backends import emulated_library_steps
from triton_interpreter import runs_triton_on

import seqpar_kernels as sp
from seqpar_kernels.engine.block_attention import CUDNN
from seqpar_kernels.testing import ring_attention_with_step_kernels
from tools import reference


def _same(x):
    return x


def _heads_major(x):
    """Stored as (B, H, S, D), as attention code that transposes after the projection."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _last_dim_transposed(x):
    """Stored with the head dim outermost: stride(-1) is not 1."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


def _head_dim_strided(x):
    """Every other element of a wider last dim: stride(-1) == 2."""
    return torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]


# name -> function of one (B, S, H, D) tensor giving the same values in another layout.
TENSOR_LAYOUTS = {
    "contiguous": _same,
    "heads-major": _heads_major,
    "last-dim-transposed": _last_dim_transposed,
    "head-dim-strided": _head_dim_strided,
}
# Layouts of q, k and v together (their leaves keep the same shapes).
QKV_LAYOUTS = {name: (lambda q, k, v, f=f: (f(q), f(k), f(v))) for name, f in TENSOR_LAYOUTS.items()}


def _fused_projection(q, k, v):
    """q, k, v as the head slices of one (B, S, H + 2 H_kv, D) projection output."""
    fused = torch.cat([q, k, v], dim=2)
    heads, kv_heads = q.shape[2], k.shape[2]
    return fused[:, :, :heads], fused[:, :, heads : heads + kv_heads], fused[:, :, heads + kv_heads :]


def _batch_expanded(q, k, v):
    """k and v as stride-0 views over the batch (one shared K/V for every sequence)."""
    return q, k[:1].expand(k.shape), v[:1].expand(v.shape)


QKV_LAYOUTS["fused-projection"] = _fused_projection
QKV_LAYOUTS["batch-expanded"] = _batch_expanded

# What consumes the output decides the strides of the gradient that comes back:
# name -> (loss of out, weights drawn with out's shape).
OUTPUT_CONSUMERS = {
    "plain": lambda out, weight: (out * weight).sum(),
    "transposed-head-dim": lambda out, weight: (out.transpose(-1, -2) * weight.transpose(-1, -2)).sum(),
    "heads-major": lambda out, weight: (out.transpose(1, 2) * weight.transpose(1, 2).contiguous()).sum(),
    "every-other-feature": lambda out, weight: (out[..., ::2] * weight[..., ::2]).sum(),
    "expanded-weight": lambda out, weight: (out * weight[:1, :, :1].expand(out.shape)).sum(),
}

B, H, H_KV, D, S_LOCAL = 2, 4, 2, 16, 4


def _full_inputs(world_size, device, seed):
    generator = torch.Generator().manual_seed(seed)
    total = S_LOCAL * world_size
    draw = lambda heads: torch.randn(B, total, heads, D, generator=generator, dtype=torch.float64)  # noqa: E731
    return [t.to(device) for t in (draw(H), draw(H_KV), draw(H_KV), draw(H))]


def _errors_by_layout(attention, device, causal, rank, world_size, consumers=tuple(OUTPUT_CONSUMERS),
                      dtype=torch.float32):  # fmt: skip
    """For each q/k/v layout and each output consumer: the largest error of out and of
    the q, k, v gradients against fp64 attention on the whole sequence, as a fraction of
    what is allowed: fp32 inputs TOLERANCE relative to each exact tensor's magnitude;
    fp16/bf16 inputs the accuracy rule (tools/reference.py error_bound) against plain
    attention in that dtype."""
    full = _full_inputs(world_size, device, seed=3)  # q, k, v, consumer weight
    if dtype != torch.float32:
        full = [t.to(dtype).double() for t in full]  # the exact answer of the rounded inputs
    piece = lambda t: reference.contiguous_piece(t, [S_LOCAL] * world_size, rank)  # noqa: E731
    local = [piece(t).to(dtype) for t in full]

    def outputs(function, tensors, weight, layout, consumer):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = function(*layout(*leaves), causal=causal)
        consumer(out, weight).backward()
        return [out.detach(), *(leaf.grad for leaf in leaves)]

    errors = {}
    for layout_name, layout in QKV_LAYOUTS.items():
        for consumer_name in consumers:
            consumer = OUTPUT_CONSUMERS[consumer_name]
            # The layout goes into the exact answer too: an expanded view has other values.
            exact = [piece(e) for e in outputs(lambda *t, causal: reference.attention(*t, causal=causal)[0],
                                               full[:3], full[3], layout, consumer)]  # fmt: skip
            if dtype == torch.float32:
                allowed = [TOLERANCE * max(1.0, reference.magnitude(e)) for e in exact]
            else:
                plain = outputs(lambda *t, causal: reference.attention(*t, causal=causal)[0],
                                [t.to(dtype) for t in full[:3]], full[3].to(dtype), layout, consumer)  # fmt: skip
                allowed = [reference.error_bound(dtype, reference.max_error(piece(p), e), reference.magnitude(e))
                           for p, e in zip(plain, exact)]  # fmt: skip
            got = outputs(attention, local[:3], local[3], layout, consumer)
            errors[f"{layout_name}/{consumer_name}"] = max(
                reference.max_error(g, e) / a for g, e, a in zip(got, exact, allowed)
            )
    return errors


def _ring(q, k, v, causal):
    return sp.ring_attention(q, k, v, causal=causal, group=timeout_group())


def _triton_ring(q, k, v, causal):
    return ring_attention_with_step_kernels(q, k, v, "triton", causal=causal, group=timeout_group())


def _ulysses(q, k, v, causal):
    return sp.ulysses_attention(q, k, v, causal=causal, group=timeout_group())


@on_every_rank
def run_layouts(path, causal):
    cpu = torch.device("cpu")
    if path == "ring-triton":
        # The interpreter is slow: every layout, with a gradient of transposed strides (the
        # contiguous one every other test takes).
        return _errors_by_layout(_triton_ring, cpu, causal, *rank_and_world(), consumers=("transposed-head-dim",))
    return _errors_by_layout({"ring": _ring, "ulysses": _ulysses}[path], cpu, causal, *rank_and_world())


# fp32 against fp64, relative to each tensor's magnitude: aten's CPU kernel with a
# q whose last dim is not contiguous errs by 1e16 and more.
TOLERANCE = 2e-5


def _failures(errors_per_rank):
    return [
        f"rank {rank} {name}: error {error:.3g} x what is allowed"
        for rank, errors in enumerate(errors_per_rank)
        for name, error in errors.items()
        if not error <= 1.0
    ]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("path", ["ring", "ulysses"])
def test_cpu_paths_take_any_layout(ranks, path, causal):
    failures = _failures(ranks.run(run_layouts, path, causal))
    assert not failures, "\n".join(failures)


@runs_triton_on("cpu")
def test_triton_ring_takes_any_layout(ranks):
    # Causal only: its ring at 3 ranks runs the unmasked blocks of a full mask too.
    if ranks.world_size != 3:
        pytest.skip("the interpreter is slow: one world size, whose ring has every kind of step")
    failures = _failures(ranks.run(run_layouts, "ring-triton", True))
    assert not failures, "\n".join(failures)


def _aten_ring(q, k, v, causal):
    return sp.ring_attention(q, k, v, causal=causal, step_backend="aten")


# On one GPU (a world of one): name -> (attention, dtype). fp32 runs the Triton kernels;
# bf16 with step_backend="aten" the library kernels (cuDNN on sm_90 and newer).
CUDA_PATHS = {
    "ring": (sp.ring_attention, torch.float32),
    "ulysses": (sp.ulysses_attention, torch.float32),
    "ring-aten-bf16": (_aten_ring, torch.bfloat16),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("path", CUDA_PATHS)
def test_cuda_paths_take_any_layout(path, causal):
    attention, dtype = CUDA_PATHS[path]
    errors = _errors_by_layout(attention, torch.device("cuda"), causal, 0, 1, dtype=dtype)
    failures = _failures([errors])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_layouts_harness_dry_run_on_cpu(causal):
    # The GPU test's bf16 case on CPU tensors, its library calls emulated
    # (test_step_backends: the cuDNN stand-ins check that every tensor comes dense).
    steps = emulated_library_steps(CUDNN)
    errors = _errors_by_layout(lambda q, k, v, causal: ring_attention_with_step_kernels(q, k, v, steps, causal=causal),
                               torch.device("cpu"), causal, 0, 1, dtype=torch.bfloat16)  # fmt: skip
    failures = _failures([errors])
    assert not failures, "\n".join(failures)
