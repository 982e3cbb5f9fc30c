"""Checks made once per case before timing: do ours and the baseline agree (data
movement: bit for bit; attention: within the tests' accuracy rule against an exact
result), and does ours send exactly the theoretical volume. agreement and measure_volume
run on every rank and their verdict covers all; the attention check (judge_attention,
accuracy_verdict) judges the tensors it is given."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from bench.runner.context import Context
from seqpar_kernels import comm_stats
from tools.reference import ERROR_FACTOR, einsum_as_gemm, error_bound, magnitude, max_error

# Query rows per chunk of the exact reference (memory: chunk x S fp64 per head).
REFERENCE_CHUNK = 1024


def agreement(
    ctx: Context,
    ours: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    atol: float = 0.0,
    *,
    collective: bool = True,
) -> str:
    """ "identical", "max err <e>" (within atol) or "MISMATCH ...": values compared, not
    layouts. atol = 0 asks for bit-for-bit equality (pure data movement must be exact).
    collective: every rank calls this and the verdict covers all ranks' tensors;
    otherwise only this rank's."""
    shapes_match = all(a.shape == b.shape for a, b in zip(ours, expected)) and len(ours) == len(expected)
    error = float("inf")
    if shapes_match:
        error = max(max_error(a, b) for a, b in zip(ours, expected))
    if collective:
        error = ctx.reduce_over_ranks(torch.tensor([error], dtype=torch.float64)).item()
    if error == 0.0:
        return "identical"
    if error <= atol:
        return f"max err {error:.1e}"
    if error == float("inf"):
        return "MISMATCH (shapes differ)"
    return f"MISMATCH max err {error:.2e} > {atol:.0e}"


@dataclass(frozen=True)
class Volume:
    """Bytes this rank (rank 0 reports) sent, from comm_stats, and the formula's value;
    at_theory holds when they are equal on every rank."""

    measured: int
    theory: int
    at_theory: bool


def measure_volume(ctx: Context, fn: Callable[[], object], theory: int) -> Volume:
    """Runs fn once under comm_stats and compares the bytes sent with `theory`."""
    with comm_stats() as stats:
        fn()
    return volume_against_theory(ctx, stats.bytes_sent, theory)


def volume_against_theory(ctx: Context, measured: int, theory: int) -> Volume:
    """This rank's measured bytes against `theory`, judged on every rank (collective)."""
    equal = torch.tensor([int(measured == theory)])
    all_equal = bool(ctx.reduce_over_ranks(equal, op=dist.ReduceOp.MIN).item())
    return Volume(measured, theory, all_equal)


def chunked_attention(q, k, v, dout, causal: bool, scale: float, dtype: torch.dtype):
    """Attention of (B, S, H, D) q over (B, S, H_kv, D) k, v, and its gradients when dout
    is given, computed in `dtype` as plain attention computes it (scores, softmax and
    products in that dtype, each product as a GEMM computes it: einsum_as_gemm; the
    backward as autograd's: dS = P * (dP - rowsum(dP * P)),
    computed wide and rounded once, as torch's softmax backward does),
    one q head and REFERENCE_CHUNK query rows at a time: memory chunk x S, never S x S,
    no autograd graph. Rows are independent, so the chunks change nothing but the dK/dV
    sums over chunks, which are kept in fp32 (fp64 for fp64), as one matmul would. With
    GQA, each q head's dK/dV share is rounded to `dtype` before the kv head sums its
    group, as autograd through repeat_interleave'd K/V (plain GQA) does.
    fp64: the exact reference; the inputs' dtype: plain PyTorch attention, the yardstick
    of the accuracy rule. Returns ([out] or [out, dq, dk, dv] in `dtype`, the largest
    |log-sum-exp| of a row's scores: the rule's lse_magnitude, from the fp64 call)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, seqlen, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.empty_like(q)
    grads = dout is not None
    if grads:
        dout = dout.to(dtype)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        dq = torch.empty_like(q)
        dk, dv = torch.zeros_like(k, dtype=wide), torch.zeros_like(v, dtype=wide)
    lse_magnitude = 0.0
    columns = torch.arange(seqlen, device=q.device)
    for b in range(batch):
        for h in range(heads):
            kh, vh = k[b, :, h // group], v[b, :, h // group]  # (S, D)
            if grads:
                dk_head, dv_head = torch.zeros_like(kh, dtype=wide), torch.zeros_like(vh, dtype=wide)
            for start in range(0, seqlen, REFERENCE_CHUNK):
                rows = slice(start, min(start + REFERENCE_CHUNK, seqlen))
                qc = q[b, rows, h]
                scores = einsum_as_gemm("qd,kd->qk", qc, kh) * scale
                if causal:
                    scores.masked_fill_(columns[None, :] > columns[rows, None], float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                lse_magnitude = max(lse_magnitude, torch.logsumexp(scores, dim=-1).abs().max().item())
                out[b, rows, h] = einsum_as_gemm("qk,kd->qd", probs, vh)
                if grads:
                    doc = dout[b, rows, h]
                    dv_head += probs.T.to(wide) @ doc.to(wide)  # one GEMM's fp32 sum
                    dprobs = einsum_as_gemm("qd,kd->qk", doc, vh).to(wide)  # softmax's backward: one rounding
                    dscores = probs.to(wide) * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
                    dscores = dscores.to(dtype) * scale
                    dq[b, rows, h] = einsum_as_gemm("qk,kd->qd", dscores, kh)
                    dk_head += dscores.T.to(wide) @ qc.to(wide)
            if grads:
                dk[b, :, h // group] += dk_head.to(dtype)
                dv[b, :, h // group] += dv_head.to(dtype)
    return ([out, dq, dk.to(dtype), dv.to(dtype)] if grads else [out]), lse_magnitude


@dataclass(frozen=True)
class Accuracy:
    check: str  # "matches" or "MISMATCH ..."
    detail: str  # every tensor's error, plain torch's and SDPA's
    vs_plain: float  # the largest of ours' error / plain torch's error (rule: <= 2)


def accuracy_verdict(ours, plains, sdpas, exact, lse_magnitude: float, names, dtype) -> Accuracy:
    """Against the exact (fp64) result, each of ours is within the tests' accuracy rule
    (within_error_rule) with torch on one device in the same dtype as the yardstick,
    plain attention or fused SDPA, whichever errs more: "matches", else "MISMATCH ...".
    A bug (a wrong mask, block or layout) errs by orders of magnitude more.
    vs_plain is the flash-attention rule's measure (the ring tests' yardstick: ours'
    error / plain torch's error, at most ERROR_FACTOR; where plain torch's error is
    below the rule's slack, too small to measure, the slack stands in for it), kept
    apart: fused kernels that round partial results to the dtype (aten's CPU flash
    backward, per ring step here) can exceed it by an ulp's worth at long sequences, as
    torch's own SDPA does."""
    verdict, details, vs_plain = "matches", [], 0.0
    for name, mine, plain, fused, truth in zip(names, ours, plains, sdpas, exact):
        if mine.shape != truth.shape:
            shapes = f"{tuple(mine.shape)} != {tuple(truth.shape)}"
            return Accuracy(f"MISMATCH {name} shape {shapes}", "", math.inf)
        error, plain_error = max_error(mine, truth), max_error(plain, truth)
        sdpa_error = max_error(fused, truth)
        torch_error = max(plain_error, sdpa_error)
        details.append(f"{name} err {error:.1e} (plain {plain_error:.1e}, SDPA {sdpa_error:.1e})")
        slack = error_bound(dtype, 0.0, magnitude(truth), lse_magnitude)
        vs_plain = max(vs_plain, error / max(plain_error, slack))
        if not within_error_rule(error, torch_error, truth, lse_magnitude, dtype) and verdict == "matches":
            verdict = f"MISMATCH {name} err {error:.2e} > {ERROR_FACTOR:g}x torch's {torch_error:.2e}"
    if math.isnan(vs_plain):
        vs_plain = math.inf
    return Accuracy(verdict, "; ".join(details), vs_plain)


def checked_heads(on_gpu: bool, heads: int, kv_heads: int) -> tuple[slice, slice]:
    """(q heads, kv heads) an attention check covers: all on CPU; on GPU the first kv
    head and its group of q heads (dK/dV of that kv head depend on no other q head; the
    exact reference of every head at GPU lengths would take minutes)."""
    if not on_gpu:
        return slice(None), slice(None)
    return slice(0, heads // kv_heads), slice(0, 1)


def judge_attention(ours, sdpas, full, causal: bool, scale: float, heads: tuple[slice, slice]) -> Accuracy:
    """accuracy_verdict of sequence-parallel attention gathered whole: ours and sdpas
    ([out] or [out, dq, dk, dv] over the whole sequence; sdpas from torch SDPA on one
    device) against the exact result of full = (q, k, v, dout), for the q and kv heads
    in `heads` (checked_heads), with plain attention in the inputs' dtype as the
    other yardstick."""
    q, k, v, dout = full
    q_heads, kv_heads = heads
    backward = len(ours) > 1
    names = ["out", "dq", "dk", "dv"][: len(ours)]
    per_tensor = [q_heads, q_heads, kv_heads, kv_heads][: len(ours)]
    subset = (q[:, :, q_heads], k[:, :, kv_heads], v[:, :, kv_heads], dout[:, :, q_heads] if backward else None)
    exact, lse_magnitude = chunked_attention(*subset, causal, scale, torch.float64)
    plains, _ = chunked_attention(*subset, causal, scale, q.dtype)
    ours = [tensor[:, :, h] for tensor, h in zip(ours, per_tensor)]
    sdpas = [tensor[:, :, h] for tensor, h in zip(sdpas, per_tensor)]
    return accuracy_verdict(ours, plains, sdpas, exact, lse_magnitude, names, q.dtype)


def within_error_rule(error: float, yardstick: float, truth: torch.Tensor, lse_magnitude: float,
                      dtype: torch.dtype) -> bool:  # fmt: skip
    """The tests' accuracy rule (tools/reference.py: error_bound): at most ERROR_FACTOR x
    the yardstick's error plus a unit of roundoff or so at the exact tensor's magnitude
    and the rounding of an fp32 log-sum-exp as large as lse_magnitude; NaN is not."""
    return error <= error_bound(dtype, yardstick, magnitude(truth), lse_magnitude)
