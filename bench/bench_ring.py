"""Ring attention against single-device attention of the same total size.

Rows (bench column):
  ring        ring_attention(q, k, v, causal=, layout=) forward on P ranks, each holding
              S_l rows of an S = P x S_l sequence, against one device running
              torch SDPA on the whole sequence
  ring-train  the same, forward + backward (dq, dk, dv)
  ring-step-fwd, ring-step-bwd   (GPU) the Triton step kernel, one step, full or causal,
              against SDPA's flash and cuDNN backends: TFLOP/s and fraction of peak
  ring-probe  (GPU) single-GPU overlap probe: a ring of P virtual steps on one GPU whose
              exchange is a device-to-device copy of the same bytes on a side stream

Per ring / ring-train case, four candidates timed side by side (interleaved):
  ours           the ring
  baseline       single-device SDPA over the whole sequence (the reference). Every rank
                 runs it at once and the slowest time counts, so that each copy gets the
                 share of the machine a ring rank gets: on a CPU whose cores the P ranks
                 share (4 gloo ranks, 2 cores) timing it on one rank while the others
                 idle would hand it a whole core where a ring rank has half of one. On
                 GPUs, one per rank, that is the same as timing one GPU alone.
                 ideal ring time = reference / P; time_ratio = ring / ideal (ideal 1.0).
  compute only   the ring driver with the exchange removed (seqpar_kernels.testing's
                 ReplacedExchange("none"): every step computes on the rank's own K|V):
                 the same kernels, no transfer. overlap_efficiency = compute only / ring.
  exchange only  the ring's exchanges alone (the same Ring/DoubleBuffer calls and
                 buffers, no compute); serial_s = compute only + exchange only
                 estimates a schedule without overlap (timed apart, the parts leave
                 out the ring's step-by-step coupling of the ranks).
Bytes sent (comm_stats) against theory: forward (P-1) x the local K+V bytes; forward +
backward adds (P-1) x (K+V bytes + fp32 dK+dV bytes).

check: "matches" when ours is as accurate as torch on one device: against an exact fp64
result (computed chunk by chunk, never S x S at once), ours errs at most 2x as much as
torch in the same dtype (plain attention or fused SDPA, whichever errs more), plus about
an ulp (fp32: 2e-5), for out and, in ring-train, dq, dk and dv; "MISMATCH ..." otherwise.
error_vs_plain: the flash-attention rule's measure (the ring tests' rule), ours' error /
plain torch's, at most 2 by that rule (judged in the summary, apart from check). The
errors (ours, plain, SDPA) are in the detail column. On GPU the check covers the
first kv head and its group of q heads (the exact reference of every head at S = P x 4K
would take minutes). ring-probe rows check that the copy, serial-copy and no-exchange
runs give identical results ("identical").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar_kernels import ring_attention
from seqpar_kernels.comm.groups import SINGLE_PROCESS, resolve_group
from seqpar_kernels.comm.ring import GRAD_KV_TAG, KV_TAG, DoubleBuffer, Ring
from seqpar_kernels.parallel.ring_driver import ring_backward, ring_forward
from seqpar_kernels.parallel.ring_steps import DEVICE_DEFAULT, step_kernels_for
from seqpar_kernels.testing import ReplacedExchange

from bench.context import Context
from bench.results import Row, short_dtype, timed_row
from bench.timing import time_side_by_side
from bench.verify import agreement, measure_volume

# The accuracy check (accuracy_verdict): against an exact fp64 result, ours errs at most
# ERROR_FACTOR x as much as torch in the same dtype, plus a slack of about one ulp at the
# values' scale (fp32: tests/test_ring_attention.py's 2e-5).
ERROR_FACTOR = 2.0
ERROR_SLACK = {torch.float32: 2e-5, torch.float16: 1e-5, torch.bfloat16: 1e-4}
# Query rows per chunk of the exact reference (memory: chunk x S fp64 per head).
REFERENCE_CHUNK = 1024
COMPUTE_ONLY = "compute only"
EXCHANGE_ONLY = "exchange only"
REFERENCE_NOTE = (
    "reference = torch SDPA over the whole sequence, run by every rank at once (slowest "
    "counts) so that each copy gets the machine share a ring rank gets; ideal ring time = "
    "reference / P; ratio = ring / ideal (1.0 ideal); overlap = compute-only / ring"
)


@dataclass(frozen=True)
class RingCase:
    batch: int
    local_len: int  # S_l, each rank's rows; the sequence has P x S_l
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str  # "contiguous" | "zigzag"
    causal: bool
    backward: bool  # forward + backward (ring-train) or forward only (ring)

    @property
    def bench(self) -> str:
        return "ring-train" if self.backward else "ring"

    @property
    def attention(self) -> str:
        return "MHA" if self.kv_heads == self.heads else ("MQA" if self.kv_heads == 1 else "GQA")

    def label(self, world_size: int) -> str:
        mask = "causal" if self.causal else "full"
        return (f"{self.layout[:6]} {mask} {self.attention} S={world_size * self.local_len} "
                f"{short_dtype(self.dtype)}")  # fmt: skip

    def shape(self, world_size: int) -> str:
        return (f"B={self.batch} S={world_size * self.local_len} (S_l={self.local_len}) "
                f"H={self.heads} H_kv={self.kv_heads} D={self.head_dim}")  # fmt: skip


def ring_cases(ctx: Context) -> list[RingCase]:
    """Contiguous full, contiguous causal, zigzag causal; MHA and GQA; bf16 (and fp32 on
    CPU); forward, then forward + backward (shorter: CPU backward is ~5x the forward)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    layouts = [("contiguous", False), ("contiguous", True), ("zigzag", True)]
    if ctx.quick:
        return [
            RingCase(1, 16, 4, 4, 16, bf16, "contiguous", False, False),
            RingCase(1, 16, 4, 2, 16, bf16, "zigzag", True, False),
            RingCase(1, 16, 4, 4, 16, fp32, "contiguous", True, True),
            RingCase(1, 16, 4, 2, 16, bf16, "zigzag", True, True),
        ]
    if ctx.on_gpu:
        shapes = [(4096, 32, 32, 128), (4096, 32, 8, 128)]
        dtypes = [bf16]
    else:
        shapes = [(512, 8, 8, 64), (512, 8, 2, 64)]  # S = 2048 on 4 ranks
        dtypes = [bf16, fp32]
    cases = []
    for backward in (False, True):
        for dtype in dtypes:
            for local_len, heads, kv_heads, head_dim in shapes:
                if dtype == fp32 and kv_heads != heads:
                    continue  # fp32: MHA only (GQA changes nothing dtype-specific)
                if backward and not ctx.on_gpu:
                    local_len //= 2  # CPU flash backward is slow; S = 1024 on 4 ranks
                for layout, causal in layouts:
                    cases.append(RingCase(1, local_len, heads, kv_heads, head_dim, dtype,
                                          layout, causal, backward))  # fmt: skip
    return cases


def local_rows(case: RingCase, ctx: Context) -> torch.Tensor:
    """The global row indices this rank holds, in its local order (written out here
    rather than taken from zigzag_split, so that the check does not trust the layout
    code it checks)."""
    return rows_of(ctx.rank, ctx.world_size, case.local_len, case.layout, ctx.device)


def rows_of(rank: int, world_size: int, local_len: int, layout: str, device) -> torch.Tensor:
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    half = local_len // 2  # chunks rank and 2P-1-rank of 2P
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * half, (first + 1) * half, device=device),
                      torch.arange(second * half, (second + 1) * half, device=device)])  # fmt: skip


def full_inputs(case: RingCase, ctx: Context):
    """q (B, S, H, D), k, v (B, S, H_kv, D) and dout of the whole sequence: the same on
    every rank (seeded), so that every rank can run the reference."""
    seqlen = ctx.world_size * case.local_len
    q_shape = (case.batch, seqlen, case.heads, case.head_dim)
    kv_shape = (case.batch, seqlen, case.kv_heads, case.head_dim)
    return (ctx.random(q_shape, case.dtype, 10), ctx.random(kv_shape, case.dtype, 11),
            ctx.random(kv_shape, case.dtype, 12), ctx.random(q_shape, case.dtype, 13))  # fmt: skip


def sdpa(q, k, v, causal: bool) -> torch.Tensor:
    """torch SDPA on (B, S, H, D) tensors (passed as (B, H, S, D) views, as the ring passes
    its blocks to aten); returns (B, S, H, D)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=causal, enable_gqa=q.shape[2] != k.shape[2],
    )  # fmt: skip
    return out.transpose(1, 2)


def leaves(*tensors):
    return [tensor.detach().clone().requires_grad_() for tensor in tensors]


def chunked_attention(q, k, v, dout, causal: bool, scale: float, dtype: torch.dtype):
    """Attention of (B, S, H, D) q over (B, S, H_kv, D) k, v, and its gradients when dout
    is given, computed in `dtype` as plain attention computes it (scores, softmax and
    products in that dtype; the backward as autograd's: dS = P * (dP - rowsum(dP * P)),
    computed wide and rounded once, as torch's softmax backward does),
    one q head and REFERENCE_CHUNK query rows at a time: memory chunk x S, never S x S,
    no autograd graph. Rows are independent, so the chunks change nothing but the dK/dV
    sums over chunks, which are kept in fp32 (fp64 for fp64), as one matmul would. With
    GQA, each q head's dK/dV share is rounded to `dtype` before the kv head sums its
    group, as autograd through repeat_interleave'd K/V (plain GQA) does.
    fp64: the exact reference; the inputs' dtype: plain PyTorch attention, the yardstick
    of the accuracy rule. Returns [out] or [out, dq, dk, dv] in `dtype`."""
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
    columns = torch.arange(seqlen, device=q.device)
    for b in range(batch):
        for h in range(heads):
            kh, vh = k[b, :, h // group], v[b, :, h // group]  # (S, D)
            if grads:
                dk_head, dv_head = torch.zeros_like(kh, dtype=wide), torch.zeros_like(vh, dtype=wide)
            for start in range(0, seqlen, REFERENCE_CHUNK):
                rows = slice(start, min(start + REFERENCE_CHUNK, seqlen))
                qc = q[b, rows, h]
                scores = (qc @ kh.T) * scale
                if causal:
                    scores.masked_fill_(columns[None, :] > columns[rows, None], float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                out[b, rows, h] = probs @ vh
                if grads:
                    doc = dout[b, rows, h]
                    dv_head += probs.T.to(wide) @ doc.to(wide)  # one GEMM's fp32 sum
                    dprobs = (doc @ vh.T).to(wide)  # softmax's backward: one rounding
                    dscores = probs.to(wide) * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
                    dscores = dscores.to(dtype) * scale
                    dq[b, rows, h] = dscores @ kh
                    dk_head += dscores.T.to(wide) @ qc.to(wide)
            if grads:
                dk[b, :, h // group] += dk_head.to(dtype)
                dv[b, :, h // group] += dv_head.to(dtype)
    return [out, dq, dk.to(dtype), dv.to(dtype)] if grads else [out]


@dataclass(frozen=True)
class Accuracy:
    check: str  # "matches" or "MISMATCH ..."
    detail: str  # every tensor's error, plain torch's and SDPA's
    vs_plain: float  # the largest of ours' error / plain torch's error (rule: <= 2)


def accuracy_verdict(ours, plains, sdpas, exact, names, dtype) -> Accuracy:
    """Against the exact (fp64) result, each of ours errs at most ERROR_FACTOR x as much
    as torch on one device in the same dtype, plain attention or fused SDPA, whichever
    errs more, plus a one-ulp slack: "matches", else "MISMATCH ...". A bug (a wrong
    mask, block or layout) errs by orders of magnitude more.
    vs_plain is the flash-attention rule's measure (the ring tests' rule: at most 2x
    plain torch's error), kept apart: fused kernels that round partial results to the
    dtype (aten's CPU flash backward, per ring step here) can exceed it by an ulp's worth
    at long sequences, as torch's own SDPA does."""
    verdict, details, vs_plain = "matches", [], 0.0
    for name, mine, plain, fused, truth in zip(names, ours, plains, sdpas, exact):
        if mine.shape != truth.shape:
            shapes = f"{tuple(mine.shape)} != {tuple(truth.shape)}"
            return Accuracy(f"MISMATCH {name} shape {shapes}", "", math.inf)
        error, plain_error = max_error(mine, truth), max_error(plain, truth)
        sdpa_error = max_error(fused, truth)
        torch_error = max(plain_error, sdpa_error)
        details.append(f"{name} err {error:.1e} (plain {plain_error:.1e}, SDPA {sdpa_error:.1e})")
        vs_plain = max(vs_plain, error / max(plain_error, ERROR_SLACK[dtype]))
        if not within_error_rule(error, torch_error, dtype) and verdict == "matches":
            verdict = f"MISMATCH {name} err {error:.2e} > {ERROR_FACTOR:g}x torch's {torch_error:.2e}"
    if math.isnan(vs_plain):
        vs_plain = math.inf
    return Accuracy(verdict, "; ".join(details), vs_plain)


def within_error_rule(error: float, torch_error: float, dtype: torch.dtype) -> bool:
    """At most ERROR_FACTOR x torch's error plus a one-ulp slack; NaN is not."""
    return error <= ERROR_FACTOR * torch_error + ERROR_SLACK[dtype]


def max_error(tensor: torch.Tensor, truth: torch.Tensor) -> float:
    return (tensor.double() - truth).abs().max().item() if truth.numel() else 0.0


def gather_rows(local: torch.Tensor, case: RingCase, ctx: Context) -> torch.Tensor | None:
    """Every rank's (B, S_l, ...) piece put back in sequence order, on rank 0 (None
    elsewhere). A plain all_gather, not seqpar's gather: the check trusts no seqpar code."""
    pieces = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(pieces, local.contiguous())
    if not ctx.is_root:
        return None
    full = local.new_empty((local.shape[0], ctx.world_size * local.shape[1], *local.shape[2:]))
    for rank, piece in enumerate(pieces):
        full[:, rows_of(rank, ctx.world_size, case.local_len, case.layout, ctx.device)] = piece
    return full


def check_heads(case: RingCase, ctx: Context) -> tuple[slice, slice]:
    """(q heads, kv heads) the check covers: all on CPU; on GPU the first kv head and
    its group of q heads (dK/dV of that kv head depend on no other q head)."""
    if not ctx.on_gpu:
        return slice(None), slice(None)
    return slice(0, case.heads // case.kv_heads), slice(0, 1)


def check_ring(case, ctx, full, ours_local, scale) -> Accuracy:
    """Gathers ours to rank 0 and judges it there (accuracy_verdict)."""
    q, k, v, dout = full
    gathered = [gather_rows(tensor, case, ctx) for tensor in ours_local]
    if not ctx.is_root:
        return Accuracy("(checked on rank 0)", "", math.nan)
    qh, kvh = check_heads(case, ctx)
    names, heads = (["out", "dq", "dk", "dv"], [qh, qh, kvh, kvh]) if case.backward else (["out"], [qh])
    if case.backward:
        q_, k_, v_ = leaves(q, k, v)
        out = sdpa(q_, k_, v_, case.causal)
        sdpas = [out, *torch.autograd.grad(out, (q_, k_, v_), dout)]
    else:
        with torch.no_grad():
            sdpas = [sdpa(q, k, v, case.causal)]
    subset = (q[:, :, qh], k[:, :, kvh], v[:, :, kvh], dout[:, :, qh] if case.backward else None)
    exact = chunked_attention(*subset, case.causal, scale, torch.float64)
    plains = chunked_attention(*subset, case.causal, scale, case.dtype)
    ours = [tensor[:, :, h] for tensor, h in zip(gathered, heads)]
    sdpas = [tensor.detach()[:, :, h] for tensor, h in zip(sdpas, heads)]
    return accuracy_verdict(ours, plains, sdpas, exact, names, case.dtype)


def theory_bytes(case: RingCase, ctx: Context) -> int:
    """Bytes a rank sends: (P-1) x its K+V bytes per ring pass; the backward's second
    pass also carries the fp32 dK|dV accumulator."""
    kv_numel = 2 * case.batch * case.local_len * case.kv_heads * case.head_dim
    per_step = kv_numel * case.dtype.itemsize
    if case.backward:
        per_step += kv_numel * case.dtype.itemsize + kv_numel * 4
    return (ctx.world_size - 1) * per_step


def exchange_only(case: RingCase, ctx: Context, group_name: str):
    """The ring's exchanges alone: the same Ring and DoubleBuffer calls on buffers of the
    same sizes, posted and waited for in the ring's order, with no compute between.
    None when there is nothing to exchange (one rank)."""
    if ctx.world_size == 1:
        return None
    kv_numel = 2 * case.batch * case.local_len * case.kv_heads * case.head_dim
    kv_buffer = torch.zeros(kv_numel, dtype=case.dtype, device=ctx.device)
    grad_buffer = torch.zeros(kv_numel, dtype=torch.float32, device=ctx.device)
    steps = ctx.world_size - 1

    def run():
        kv = DoubleBuffer(Ring(group_name, KV_TAG), kv_buffer)
        for _ in range(steps):
            kv.post()
            kv.advance()
        if case.backward:
            kv = DoubleBuffer(Ring(group_name, KV_TAG), kv_buffer)
            grads = DoubleBuffer(Ring(group_name, GRAD_KV_TAG), grad_buffer)
            for _ in range(steps):
                kv.post()
                grads.post()
                kv.advance()
                grads.advance()

    return run


def run_driver(q, k, v, dout, options, exchange, backward: bool) -> list[torch.Tensor]:
    """The ring driver's forward (and backward) called directly, its rings made by
    `exchange`: out [, dq, dk, dv]. options: (causal, scale, zigzag, group name, step
    kernels), as seqpar_kernels.parallel.ring_driver.ring_forward takes them."""
    with torch.no_grad():
        out, lse = ring_forward(q, k, v, *options, exchange=exchange)
        if not backward:
            return [out]
        return [out, *ring_backward(dout, q, k, v, out, lse, *options, exchange=exchange)]


def measure_ring(case: RingCase, ctx: Context) -> Row:
    full = full_inputs(case, ctx)
    rows = local_rows(case, ctx)
    q, k, v, dout = (tensor.index_select(1, rows) for tensor in full)
    scale = 1.0 / math.sqrt(case.head_dim)

    if case.backward:
        q_l, k_l, v_l = leaves(q, k, v)
        q_f, k_f, v_f = leaves(*full[:3])
        dout_f = full[3]

        def ours():
            out = ring_attention(q_l, k_l, v_l, causal=case.causal, layout=case.layout)
            return [out.detach(), *torch.autograd.grad(out, (q_l, k_l, v_l), dout)]

        def reference():
            out = sdpa(q_f, k_f, v_f, case.causal)
            return torch.autograd.grad(out, (q_f, k_f, v_f), dout_f)
    else:

        @torch.no_grad()
        def ours():
            return [ring_attention(q, k, v, causal=case.causal, layout=case.layout)]

        @torch.no_grad()
        def reference():
            return sdpa(*full[:3], case.causal)

    options = (case.causal, scale, case.layout == "zigzag", resolve_group(None).name,
               step_kernels_for(DEVICE_DEFAULT, q.device))  # fmt: skip

    def compute_only():
        return run_driver(q, k, v, dout, options, ReplacedExchange("none"), case.backward)

    accuracy = check_ring(case, ctx, full, ours(), scale)
    volume = measure_volume(ctx, ours, theory_bytes(case, ctx))
    candidates = {"ours": ours, "baseline": reference, COMPUTE_ONLY: compute_only}
    exchange = exchange_only(case, ctx, resolve_group(None).name)
    if exchange is not None:
        candidates[EXCHANGE_ONLY] = exchange
    timings = time_side_by_side(candidates, ctx)
    return ring_row(case, ctx, timings, accuracy, volume)


def ring_row(case, ctx, timings, accuracy: Accuracy, volume) -> Row:
    world_size = ctx.world_size
    ring_s, reference_s = timings["ours"].median_s, timings["baseline"].median_s
    compute_s = timings[COMPUTE_ONLY].median_s
    exchange_s = timings[EXCHANGE_ONLY].median_s if EXCHANGE_ONLY in timings else None
    ideal_s = reference_s / world_size
    passes = 2 if case.backward else 1  # the backward is a second ring pass
    return timed_row(
        ctx, timings,
        bench=case.bench, case=case.label(world_size), shape=case.shape(world_size),
        dtype=short_dtype(case.dtype), check=accuracy.check, layout=case.layout,
        error_vs_plain=accuracy.vs_plain,
        bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory,
        volume_at_theory=volume.at_theory,
        ideal_s=ideal_s, time_ratio=ring_s / ideal_s,
        compute_only_s=compute_s, exchange_only_s=exchange_s,
        overlap_efficiency=compute_s / ring_s,
        serial_s=None if exchange_s is None else compute_s + exchange_s,
        compute_per_step_s=compute_s / (passes * world_size),
        transfer_per_step_s=None if exchange_s is None else exchange_s / (passes * (world_size - 1)),
        detail=accuracy.detail,
    )  # fmt: skip


# ----------------------------------------------------------------------------------
# GPU: the Triton step kernel against SDPA's flash and cuDNN backends
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCase:
    batch: int
    seqlen: int  # q and k/v rows of the one step
    heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    backward: bool

    @property
    def bench(self) -> str:
        return "ring-step-bwd" if self.backward else "ring-step-fwd"

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{mask} S={self.seqlen} D={self.head_dim} {short_dtype(self.dtype)}"

    @property
    def shape(self) -> str:
        return f"B={self.batch} S_q=S_k={self.seqlen} H={self.heads} D={self.head_dim}"

    @property
    def flops(self) -> float:
        """Matmul FLOPs: forward 2 matmuls (4 B H S^2 D), backward 2.5x (5 matmuls, the
        recomputation of the scores included), as flash-attention counts; causal half."""
        forward = 4 * self.batch * self.heads * self.seqlen**2 * self.head_dim
        return forward * (2.5 if self.backward else 1.0) * (0.5 if self.causal else 1.0)


def step_cases(ctx: Context) -> list[StepCase]:
    """S = 4K, 8K, 16K, D = 128, bf16, 32 heads (--quick: 512 rows, 4 heads)."""
    seqlens, heads = ((512,), 4) if ctx.quick else ((4096, 8192, 16384), 32)
    cases = []
    for backward in (False, True):
        for seqlen in seqlens:
            for causal in (False, True):
                cases.append(StepCase(1, seqlen, heads, 128, torch.bfloat16, causal, backward))
    return cases


def sdpa_backends():
    """{name: SDPBackend} of the SDPA kernels the step kernel is compared with."""
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def sdpa_with(backend, q, k, v, causal):
    """SDPA restricted to one backend: raises (never falls back) when it cannot run."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return sdpa(q, k, v, causal)


def usable_backends(case: StepCase, q, k, v) -> tuple[dict, list[str]]:
    """The SDPA backends that run this case, and why the others cannot (said in the
    row's detail and the log: a missing backend must not pass unnoticed). Raises when
    none runs."""
    usable, missing = {}, []
    for name, backend in sdpa_backends().items():
        try:
            inputs = leaves(q, k, v) if case.backward else (q, k, v)
            out = sdpa_with(backend, *inputs, case.causal)
            if case.backward:  # a backend may run forward only
                torch.autograd.grad(out, inputs, torch.ones_like(out))
        except RuntimeError as error:
            missing.append(f"{name} unavailable: {str(error).strip().splitlines()[0][:160]}")
        else:
            usable[name] = backend
    if not usable:
        raise RuntimeError(f"no SDPA backend among {list(sdpa_backends())} runs {case.shape}: {missing}")
    return usable, missing


def step_candidates(case: StepCase, backends: dict, q, k, v, dout) -> dict:
    """{"ours": fn, <backend name>: fn, ...}, each fn returning what it computes: the
    forward output, or (dq, dk, dv). Ours is one ring step from a fresh running
    (out, lse) = (0, -inf); its backward includes the delta = rowsum(dout * out) pass
    (SDPA's backward computes its own)."""
    from seqpar_kernels.kernels import attention_step_launch as kernels

    mode = kernels.MASK_CAUSAL if case.causal else kernels.MASK_FULL
    scale = 1.0 / math.sqrt(case.head_dim)
    fp32 = dict(dtype=torch.float32, device=q.device)
    out = torch.zeros(q.shape, **fp32)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), **fp32)
    kernels.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    out_low, final_lse = out.to(q.dtype), lse.clone()  # the backward's saved results
    if not case.backward:  # the forward's first (checked) call starts from scratch
        out.zero_()
        lse.fill_(float("-inf"))
    dq, dk, dv = torch.zeros(q.shape, **fp32), torch.zeros(k.shape, **fp32), torch.zeros(v.shape, **fp32)

    # Timed calls do not reset the running results (that would add passes over fp32
    # tensors SDPA does not make): each forward merges the same block again, as a later
    # ring step merges into a running (out, lse) (out stays, lse grows by ln 2); each
    # backward adds to dq, dk, dv. The first call (the check's) starts from scratch.
    def ours_forward():
        kernels.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
        return [out]

    def ours_backward():
        delta = kernels.attention_backward_preprocess(out_low, dout)
        kernels.attention_step_backward(q, k, v, out_low, dout, final_lse, delta, dq, dk, dv,
                                        softmax_scale=scale, mask_mode=mode)  # fmt: skip
        return [dq, dk, dv]

    candidates = {"ours": ours_backward if case.backward else ours_forward}
    for name, backend in backends.items():
        if case.backward:
            inputs = leaves(q, k, v)
            graph = sdpa_with(backend, *inputs, case.causal)  # the backward runs the same backend

            def theirs(graph=graph, inputs=inputs):
                return list(torch.autograd.grad(graph, inputs, dout, retain_graph=True))
        else:

            def theirs(backend=backend):
                return [sdpa_with(backend, q, k, v, case.causal)]

        candidates[name] = theirs
    return candidates


def check_step(case: StepCase, candidates: dict, q, k, v, dout) -> tuple[Accuracy, list[str], list[str]]:
    """Every candidate against the exact result on the first head.

    Returns ours' verdict (accuracy_verdict's rule, SDPA error from the first trusted
    backend), the SDPA backends trusted as baselines, and a note for each one that is
    not: a backend whose error exceeds ERROR_FACTOR x plain torch's (plus the slack) is
    not timed against, so a broken baseline cannot make ours look slow or fast."""
    head = slice(0, 1)
    results = {name: [t[:, :, head] for t in fn()] for name, fn in candidates.items()}
    names = ["dq", "dk", "dv"] if case.backward else ["out"]
    subset = (q[:, :, head], k[:, :, head], v[:, :, head], dout[:, :, head] if case.backward else None)
    scale = 1.0 / math.sqrt(case.head_dim)
    exact = chunked_attention(*subset, case.causal, scale, torch.float64)
    plains = chunked_attention(*subset, case.causal, scale, case.dtype)
    if case.backward:
        exact, plains = exact[1:], plains[1:]
    trusted, untrusted = [], []
    for backend in (name for name in candidates if name != "ours"):
        errors = [(name, max_error(theirs, truth), max_error(plain, truth))
                  for name, theirs, plain, truth in zip(names, results[backend], plains, exact)]
        wrong = [f"{name} err {error:.1e} > {ERROR_FACTOR:g}x plain {plain_error:.1e}"
                 for name, error, plain_error in errors
                 if not within_error_rule(error, plain_error, case.dtype)]
        if wrong:
            untrusted.append(f"{backend} not used as a baseline: {', '.join(wrong)}")
        else:
            trusted.append(backend)
    if not trusted:
        raise RuntimeError(f"no SDPA backend computes {case.shape} within the error rule: {untrusted}")
    accuracy = accuracy_verdict(results["ours"], plains, results[trusted[0]], exact, names, case.dtype)
    return accuracy, trusted, untrusted


def measure_step(case: StepCase, ctx: Context) -> Row:
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v, dout = (ctx.random(shape, case.dtype, seed) for seed in (20, 21, 22, 23))
    backends, missing = usable_backends(case, q, k, v)
    for reason in missing:
        ctx.log(f"WARNING {case.bench} {case.label}: {reason}")
    candidates = step_candidates(case, backends, q, k, v, dout)
    accuracy, trusted, untrusted = check_step(case, candidates, q, k, v, dout)
    for note in untrusted:
        ctx.log(f"WARNING {case.bench} {case.label}: {note}")
    candidates = {name: fn for name, fn in candidates.items() if name == "ours" or name in trusted}
    timings = time_side_by_side(candidates, ctx, collective=False)
    tflops = {name: case.flops / timing.median_s / 1e12 for name, timing in timings.items()}
    best = max(trusted, key=lambda name: tflops[name])
    timings["baseline"] = timings[best]
    peak, peak_source = ctx.peak_flops
    rates = ", ".join(f"{name} {tflops[name]:.3g}" for name in trusted)
    detail = "; ".join([f"TFLOP/s: ours {tflops['ours']:.3g}, {rates}; baseline = {best}",
                        *missing, *untrusted, accuracy.detail])  # fmt: skip
    return timed_row(
        ctx, timings,
        bench=case.bench, case=case.label, shape=case.shape, dtype=short_dtype(case.dtype),
        check=accuracy.check, error_vs_plain=accuracy.vs_plain,
        ours_tflops=tflops["ours"], baseline_tflops=tflops[best],
        peak_tflops=peak, peak_tflops_source=peak_source,
        ours_fraction_of_peak_tflops=None if peak is None else tflops["ours"] / peak,
        detail=detail,
    )  # fmt: skip


# ----------------------------------------------------------------------------------
# GPU: the single-GPU overlap probe
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeCase:
    local_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    steps: int  # P, virtual ranks
    layout: str
    causal: bool
    backward: bool

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        kind = "MHA" if self.kv_heads == self.heads else "GQA"
        direction = "fwd+bwd" if self.backward else "fwd"
        return f"{self.layout[:6]} {mask} {kind} S_l={self.local_len} P={self.steps} {direction}"

    @property
    def shape(self) -> str:
        return (f"B=1 S_l={self.local_len} H={self.heads} H_kv={self.kv_heads} D={self.head_dim} "
                f"P={self.steps} virtual")  # fmt: skip


def probe_cases(ctx: Context) -> list[ProbeCase]:
    """Per step, 4K rows: compute far above the copy; 1K rows with GQA: the copy is a
    larger share (it still runs at HBM speed, faster than any link would carry it)."""
    bf16 = torch.bfloat16
    if ctx.quick:
        return [ProbeCase(256, 4, 4, 128, bf16, 4, "contiguous", False, False),
                ProbeCase(256, 4, 2, 128, bf16, 4, "zigzag", True, True)]  # fmt: skip
    return [
        ProbeCase(4096, 32, 32, 128, bf16, 8, "contiguous", False, False),
        ProbeCase(4096, 32, 32, 128, bf16, 8, "zigzag", True, False),
        ProbeCase(1024, 32, 8, 128, bf16, 8, "contiguous", False, False),
        ProbeCase(4096, 32, 32, 128, bf16, 8, "contiguous", False, True),
        ProbeCase(4096, 32, 32, 128, bf16, 8, "zigzag", True, True),
    ]


def measure_probe(case: ProbeCase, ctx: Context) -> Row:
    """A ring of case.steps virtual ranks on this GPU alone (virtual rank 0): the ring
    driver as it runs on P GPUs, its exchange replaced (seqpar_kernels.testing's
    ReplacedExchange)
    by a device-to-device copy of the same bytes on a side stream ("ours"), the same
    copy on the compute stream (serial schedule: "baseline"), no exchange (compute only),
    and the copies alone (exchange only)."""
    q_shape = (1, case.local_len, case.heads, case.head_dim)
    kv_shape = (1, case.local_len, case.kv_heads, case.head_dim)
    shapes = {30: q_shape, 31: kv_shape, 32: kv_shape, 33: q_shape}
    q, k, v, dout = (ctx.random(shape, case.dtype, seed) for seed, shape in shapes.items())
    scale = 1.0 / math.sqrt(case.head_dim)
    steps = case.steps
    # One process: a group of one rank acting as a ring of case.steps.
    options = (case.causal, scale, case.layout == "zigzag", SINGLE_PROCESS, step_kernels_for(DEVICE_DEFAULT, q.device))

    def ring_with(mode):
        return lambda: run_driver(q, k, v, dout, options, ReplacedExchange(mode, steps), case.backward)

    kv_numel = 2 * k.numel()
    kv_buffer = torch.zeros(kv_numel, dtype=case.dtype, device=ctx.device)
    grad_buffer = torch.zeros(kv_numel, dtype=torch.float32, device=ctx.device)

    def copies_only():
        copies = ReplacedExchange("copy", steps)
        buffers = [kv_buffer, kv_buffer, grad_buffer] if case.backward else [kv_buffer]
        for buffer in buffers:  # forward K|V; backward K|V and dK|dV
            ring = DoubleBuffer(copies(SINGLE_PROCESS, KV_TAG), buffer)
            for _ in range(steps - 1):
                ring.post()
                ring.advance()

    candidates = {"ours": ring_with("copy"), "baseline": ring_with("serial_copy"),
                  COMPUTE_ONLY: ring_with("none"), EXCHANGE_ONLY: copies_only}  # fmt: skip
    # The copies deliver this rank's own K|V, as "none" leaves it in place: out (and dq)
    # must agree bit for bit, a copy read before it lands would not; dK|dV too between
    # the two copy schedules ("none" does not carry the dK|dV accumulator at all).
    results = {name: candidates[name]() for name in ("ours", "baseline", COMPUTE_ONLY)}
    same_kv = 2 if case.backward else 1  # out, dq
    check = agreement(
        ctx, results["ours"] + results["ours"][:same_kv],
        results["baseline"] + results[COMPUTE_ONLY][:same_kv], collective=False,
    )  # fmt: skip
    timings = time_side_by_side(candidates, ctx, collective=False)
    overlapped_s, serial_s = timings["ours"].median_s, timings["baseline"].median_s
    compute_s, copies_s = timings[COMPUTE_ONLY].median_s, timings[EXCHANGE_ONLY].median_s
    passes = 2 if case.backward else 1
    per_step = kv_numel * case.dtype.itemsize * passes + (kv_numel * 4 if case.backward else 0)
    copied = (steps - 1) * per_step
    detail = (f"overlapped {compute_s / overlapped_s:.2f}, serial {compute_s / serial_s:.2f} "
              f"(compute only / time); {copied / 2**20:.0f} MiB copied, "
              f"{copied / copies_s / 1e9:.0f} GB/s")  # fmt: skip
    return timed_row(
        ctx, timings,
        bench="ring-probe", case=case.label, shape=case.shape, dtype=short_dtype(case.dtype),
        check=check, layout=case.layout,
        compute_only_s=compute_s, exchange_only_s=copies_s,
        overlap_efficiency=compute_s / overlapped_s, serial_s=serial_s,
        compute_per_step_s=compute_s / (passes * steps),
        transfer_per_step_s=copies_s / (passes * (steps - 1)),
        detail=detail,
    )  # fmt: skip


# ----------------------------------------------------------------------------------


def run(ctx: Context) -> list[Row]:
    rows = []
    ctx.log(REFERENCE_NOTE)
    for case in ring_cases(ctx):
        reason = unsupported(case, ctx)
        if reason:
            ctx.log(f"skipped {case.bench} {case.label(ctx.world_size)}: {reason}")
            continue
        rows.append(ctx.run_case(None, measure_ring, case))
    if not ctx.on_gpu:
        ctx.log("ring-step-fwd/bwd, ring-probe: GPU only (not run on CPU)")
        return rows
    # One GPU's kernels and streams: rank 0 alone while the other ranks wait.
    if ctx.is_root:
        for bench, measure, cases in ((None, measure_step, step_cases(ctx)),
                                      ("ring-probe", measure_probe, probe_cases(ctx))):
            for case in cases:
                rows.append(ctx.run_case(bench, measure, case))
    ctx.barrier()
    return rows


def unsupported(case: RingCase, ctx: Context) -> str | None:
    if case.layout == "zigzag" and case.local_len % 2:
        return "zigzag needs an even local length"
    return None
