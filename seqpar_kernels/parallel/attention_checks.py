"""The argument checks of the attention functions (ulysses_attention, ring_attention,
usp_attention), one preamble for the three, run once at the entry of each public call:

    with CheckedOnEveryRank(...) as checks:        (usp: checked_on_grid)
        call = check_attention_call(describe, q, k, v, ..., ranks=...)
        checks.share(q.shape[1], call.agreed)

check_attention_call runs every local check of a call (shapes, dtypes, devices, the
softmax scale, the layout, the step backend, a varlen plan, per-rank lengths) and returns
what the call needs afterwards: the scale, every rank's lengths where they are known
without a gather, the attention mask, and the metadata every rank must agree on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from seqpar_kernels.comm.grid import Grid
from seqpar_kernels.engine.masks import AttentionMask
from seqpar_kernels.engine.step_backends import check_step_backend
from seqpar_kernels.groups import GroupInfo, resolve_group
from seqpar_kernels.layouts import zigzag_piece_lengths
from seqpar_kernels.parallel.checks import SUPPORTED_DTYPES, check_bool, check_local_sizes
from seqpar_kernels.parallel.varlen import VarlenPlan

MAX_HEAD_DIM = 256
# The layouts of a dense sequence the ring takes (ring_attention, usp_attention).
RING_LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class AttentionCall:
    """An attention call's arguments once checked on this rank.

    scale     the softmax scale (may be <= 0: fold_scale_sign makes it positive)
    seq_lens  every rank's local length in piece order, where known without a gather
              (passed, or the varlen plan's); None: the checks' gather finds them
    mask      which keys each query attends (causal; the plan's documents)
    agreed    the metadata every rank of the call must pass alike"""

    scale: float
    seq_lens: list[int] | None
    mask: AttentionMask
    agreed: tuple


def check_attention_call(
    describe: str, q, k, v, *, causal, softmax_scale, seq_lens, varlen, ranks: GroupInfo | Grid,
    layout: str | None = None, step_backend: str | None = None, return_lse=None,
) -> AttentionCall:  # fmt: skip
    """Every local check of an attention call (no communication); raises ValueError
    naming what is wrong. ranks: the call's group (GroupInfo) or USP grid. layout and
    step_backend: the ring's (ring_attention, usp_attention), None for Ulysses."""
    check_attention_inputs(q, k, v)
    ring = step_backend is not None
    if ring:
        if q.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{describe} runs on CPU or CUDA tensors, got {q.device} ({describe_shapes(q, k, v)})")
        check_launchable(q)  # CUDA: GPUs older than sm_80, batch or heads over the grid limit
        if layout not in RING_LAYOUTS:
            raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
    check_bool("causal", causal)
    scale = resolve_softmax_scale(softmax_scale, q)
    if return_lse is not None:
        check_bool("return_lse", return_lse)
    if ring:
        check_step_backend(step_backend)
    pieces = ranks.pieces if isinstance(ranks, Grid) else ranks
    if varlen is not None:
        check_varlen_call(describe, varlen, q, ranks)
        if layout not in (None, "contiguous"):
            raise ValueError(f"{describe}: with varlen the plan sets the layout; pass no layout (got {layout!r})")
        if seq_lens is not None and list(seq_lens) != varlen.seq_lens:
            raise ValueError(f"{describe}: seq_lens={list(seq_lens)} differs from the varlen plan's {varlen.seq_lens}")
        seq_lens = varlen.seq_lens
    elif seq_lens is not None:
        seq_lens = check_local_sizes(seq_lens, pieces, q.shape[1], "seq_lens", q.shape, 1)
    mask = AttentionMask(causal, None if varlen is None else varlen.layout.cu_seqlens)
    batch, _, heads, head_dim = q.shape
    agreed = (batch, heads, k.shape[2], head_dim, causal, layout, q.dtype, scale, seq_lens, step_backend, return_lse)
    return AttentionCall(scale, seq_lens, mask, agreed)


def check_varlen_call(describe: str, plan, q: torch.Tensor, ranks: GroupInfo | Grid) -> None:
    """The local checks of an attention call given varlen=plan: a VarlenPlan made on the
    call's group or grid, batch 1, this rank's token count."""
    on_mesh = isinstance(ranks, Grid)
    if not isinstance(plan, VarlenPlan):
        raise ValueError(f"{describe}: varlen must be a VarlenPlan (varlen_plan(...)), got {type(plan).__name__}")
    if plan.on_mesh != on_mesh:
        made = "a mesh (usp_attention's)" if plan.on_mesh else "a group (ring or Ulysses)"
        raise ValueError(f"{describe}: varlen is a plan for {made}; build it with varlen_plan("
                         f"{'mesh=...' if on_mesh else 'group=...'})")  # fmt: skip
    if on_mesh:
        made_on = plan.grid.group_names
        if made_on != ranks.group_names:
            raise ValueError(
                f"{describe}: the varlen plan was made on the groups (Ulysses, ring) {made_on}, the call runs on "
                f"{ranks.group_names}"
            )
    else:
        plan_info = resolve_group(plan.group)
        if (plan_info.name, plan_info.world_size) != (ranks.name, ranks.world_size):
            raise ValueError(
                f"{describe}: the varlen plan was made for group {plan_info.name!r} of {plan_info.world_size} "
                f"ranks, the call runs on {ranks.name!r} of {ranks.world_size}"
            )
    piece = ranks.piece if on_mesh else ranks.rank
    if q.shape[0] != 1:
        raise ValueError(
            f"{describe}: packed sequences (varlen) take batch 1, the documents packed along the "
            f"sequence; got q of shape {tuple(q.shape)}"
        )
    if q.shape[1] != plan.seq_lens[piece]:
        raise ValueError(
            f"{describe}: q holds {q.shape[1]} tokens (shape {tuple(q.shape)}) where the varlen plan puts "
            f"{plan.seq_lens[piece]} on this rank ({piece}); every rank's: {plan.seq_lens}"
        )


def check_zigzag_lengths(lengths, info: GroupInfo, describe: str, shape) -> None:
    """Every rank's local length must be its zigzag piece of their sum (as zigzag_split
    cuts it), or the ranks would place their rows at other global positions than the
    zigzag layout says. Run on every rank with the same lengths: all raise alike."""
    total = sum(lengths)
    expected = zigzag_piece_lengths(total, info.world_size)
    wrong = [
        f"rank {rank} holds {length} rows where the layout puts {expected[rank]}"
        for rank, length in enumerate(lengths) if length != expected[rank]
    ]  # fmt: skip
    if wrong:
        raise ValueError(
            f"{describe}: local lengths {list(lengths)} are not the zigzag pieces of a sequence of "
            f"{total} rows (chunks r and 2P-1-r of torch.tensor_split into 2P = {2 * info.world_size}, "
            f"as zigzag_split makes them): {'; '.join(wrong)}. This rank ({info.rank}) has shape "
            f"{tuple(shape)}"
        )


def describe_shapes(q, k, v) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def check_attention_inputs(q, k, v) -> None:
    """q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
    headdim), one dtype among SUPPORTED_DTYPES, one device, nheads % nheads_kv == 0,
    1 <= headdim <= MAX_HEAD_DIM. Raises ValueError naming the shapes otherwise."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"{name} must be (batch, seqlen_local, nheads, headdim), got {shape}")
    shapes = describe_shapes(q, k, v)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k, v need one dtype among {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype} ({shapes})"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q, k, v must share batch and local sequence length, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have one head dim, got {shapes}")
    if q.shape[3] == 0:
        raise ValueError(f"head dim must be at least 1 ({shapes})")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[3]} exceeds {MAX_HEAD_DIM} ({shapes})")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads ({q.shape[2]}) must be a multiple of nheads_kv ({k.shape[2]}) ({shapes})")


def resolve_softmax_scale(softmax_scale, q: torch.Tensor) -> float:
    """The scale applied to q.k: `softmax_scale`, or 1/sqrt(headdim) for None. Any
    finite number is accepted, zero and negative ones included (see fold_scale_sign)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[3])
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a number or None, got {softmax_scale!r}")
    # Comparisons, not math.isfinite and float(): torch.compile traces a float argument
    # that changes between calls as a symbolic float, which those two cannot take.
    if not -math.inf < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return softmax_scale * 1.0


def fold_scale_sign(q: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with a positive scale that gives the same scores scale * q.k.

    The attention kernels mask a causal score with -inf BEFORE scaling it (aten's CPU
    flash kernel, which SDPA runs on CPUs): a zero scale then gives -inf * 0 = NaN and a
    negative one turns a masked score into +inf. So a negative scale is applied to q
    (-q with scale |scale|, exact in every dtype), and a zero scale, whose scores are all
    0 (uniform attention over the visible keys), becomes q * 0 with scale 1. Both stay
    differentiable: dq is -dq' or exactly 0. A positive scale returns q itself."""
    if softmax_scale > 0:
        return q, softmax_scale
    if softmax_scale < 0:
        return q.neg(), -softmax_scale
    return q.mul(0.0), 1.0


def check_launchable(q: torch.Tensor) -> None:
    """Raises ValueError naming q's shape when the ring's Triton step kernels cannot run
    on the CUDA tensor q (batch, seqlen_local, nheads, headdim): a GPU older than sm_80
    (no bf16 tensor cores), or batch or nheads above CUDA's grid limit. A CPU tensor
    passes. Local: the ring runs it before any collective."""
    if not q.is_cuda:
        return
    # Imported here: Triton is needed on GPUs only (CPU-only torch wheels lack it).
    from seqpar_kernels.kernels.attention_step_tiles import MAX_GRID_YZ, MIN_CAPABILITY

    properties = torch.cuda.get_device_properties(q.device)
    capability = 10 * properties.major + properties.minor
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"ring attention's Triton kernels need a GPU of compute capability 8.0 or newer (bf16 "
            f"tensor cores); {q.device} ({properties.name}) is sm_{capability} (q {tuple(q.shape)})"
        )
    if q.shape[0] > MAX_GRID_YZ or q.shape[2] > MAX_GRID_YZ:
        # Heads and batch index grid axes 1 and 2, which CUDA caps at 65535.
        raise ValueError(f"batch and nheads must be at most {MAX_GRID_YZ}, got q shape {tuple(q.shape)}")
