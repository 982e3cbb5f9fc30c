"""The argument checks of the attention functions (ulysses_attention, ring_attention,
usp_attention): one preamble for the three, run once at the entry of each public call,
on every rank, before any collective; what it returns is trusted by everything below.

    call = checked_attention_call(describe, q, k, v, ranks, exchange=..., **arguments)

runs every local check of the call (check_attention_call: shapes, dtypes, devices, the
softmax scale, the layout, the step backend, a varlen plan, per-rank lengths, the mask)
inside one small all-gather (CheckedOnEveryRank, or checked_on_grid for USP's grid) so
that a bad input on any rank raises on every rank, learns every rank's length, checks
the zigzag layout's lengths, and returns the AttentionCall the algorithms run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.comm.grid import Grid
from seqpar_kernels.engine.attention_ops import mask_arguments
from seqpar_kernels.engine.step_backends import AUTO, STEP_BACKENDS
from seqpar_kernels.groups import GroupInfo, resolve_group
from seqpar_kernels.layouts import zigzag_piece_lengths
from seqpar_kernels.parallel.checks import (
    SUPPORTED_DTYPES,
    CheckedOnEveryRank,
    check_bool,
    check_local_sizes,
    checked_on_grid,
    device_of,
)
from seqpar_kernels.parallel.varlen import VarlenPlan

MAX_HEAD_DIM = 256
# The layouts of a dense sequence the ring takes (ring_attention, usp_attention).
RING_LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class AttentionCall:
    """An attention call's arguments once checked on every rank: what the algorithms
    below the public entry run, without checking again.

    scale        the softmax scale as given (may be <= 0: fold_scale_sign makes it positive)
    mask         which keys each query attends (causal, the plan's documents, a window,
                 chunks)
    softcap      scores capped as softcap * tanh(s / softcap); 0.0: not
    sinks        None, or the (nheads,) per-head sink logits
    seq_lens     every rank's local length, in group rank order (under USP: the ranks of
                 this rank's Ulysses group); None before the checks' gather
    slot_lens    under USP, every ring slot's length (the sum of its Ulysses group's);
                 else None
    layout       the ring's layout, "contiguous" or "zigzag" (Ulysses: "contiguous")
    step_backend what computes the ring's steps: AUTO or a name of the engine's STEP_KERNELS
    return_lse   whether the call returns the lse too
    varlen       the VarlenPlan of packed documents, or None
    agreed       the metadata every rank of the call must pass alike"""

    scale: float
    mask: AttentionMask
    softcap: float
    sinks: torch.Tensor | None
    seq_lens: list[int] | None
    slot_lens: list[int] | None
    layout: str
    step_backend: str
    return_lse: bool
    varlen: VarlenPlan | None
    agreed: tuple

    @property
    def zigzag(self) -> bool:
        return self.layout == "zigzag"

    @property
    def is_plain(self) -> bool:
        """Whether the call asks for nothing beyond causal or full attention."""
        return not self.mask.is_local and not self.mask.has_documents and self.softcap == 0.0 and self.sinks is None

    def with_lengths(self, seq_lens: list[int], slot_lens: list[int] | None = None) -> AttentionCall:
        """The same call over ranks holding seq_lens rows each (a USP grid's one group)."""
        return dataclasses.replace(self, seq_lens=list(seq_lens), slot_lens=slot_lens)

    def op_arguments(self, heads: slice | None = None) -> dict:
        """The mask, softcap and sinks as the engine's attention ops take them (and, with
        packed documents, the layout's segments); heads: the sinks of these q heads only
        (the heads a Ulysses rank holds)."""
        sinks = self.sinks if self.sinks is None or heads is None else self.sinks[heads]
        documents = None if self.varlen is None else self.varlen.cu_seqlens_tensor
        return dict(**mask_arguments(self.mask, documents), softcap=self.softcap, sinks=sinks)


def checked_attention_call(
    describe: str, q, k, v, ranks: GroupInfo | Grid, *, exchange: bool, causal=False, softmax_scale=None,
    seq_lens=None, varlen=None, layout: str | None = None, step_backend: str | None = None,
    step_backends=STEP_BACKENDS, return_lse=False, window_size=(-1, -1), softcap=0.0, sinks=None,
    attention_chunk_size=None, check_ranks=True,
) -> AttentionCall:  # fmt: skip
    """Every check of an attention call, so that a bad input on any rank raises
    ValueError on every rank: the local checks (check_attention_call) inside one small
    all-gather of every rank's length and metadata (exchange=False: the caller passed
    every rank's lengths, or check_ranks=False; then a local error raises on its rank
    only, see CheckedOnEveryRank), then the zigzag layout's lengths.
    ranks: the call's group (GroupInfo) or USP grid. Returns the AttentionCall, its
    lengths known."""

    def local_checks():
        call = check_attention_call(
            describe, q, k, v, causal=causal, softmax_scale=softmax_scale, seq_lens=seq_lens, varlen=varlen,
            ranks=ranks, layout=layout, step_backend=step_backend, step_backends=step_backends,
            return_lse=return_lse, window_size=window_size, softcap=softcap, sinks=sinks,
            attention_chunk_size=attention_chunk_size,
        )  # fmt: skip
        check_bool("check_ranks", check_ranks)
        return q.shape[1], call.agreed, call

    if isinstance(ranks, Grid):
        call, row_lens, slot_lens = checked_on_grid(describe, ranks, device_of(q), exchange, local_checks)
        if call.seq_lens is not None:  # every piece's, passed or the plan's: no gather needed
            by_slot = ranks.rows(call.seq_lens)
            row_lens, slot_lens = by_slot[ranks.ring.rank], [sum(row) for row in by_slot]
        call = call.with_lengths(row_lens, slot_lens)
        if call.zigzag:
            check_zigzag_lengths(slot_lens, ranks.ring, f"{describe} (the ring slots' lengths)", q.shape)
        return call
    with CheckedOnEveryRank(describe, ranks, device_of(q), exchange=exchange) as checks:
        _, agreed, call = local_checks()
        checks.share(q.shape[1], agreed)
    call = call.with_lengths(checks.sizes if call.seq_lens is None else call.seq_lens)
    if call.zigzag:
        check_zigzag_lengths(call.seq_lens, ranks, describe, q.shape)
    return call


def check_attention_call(
    describe: str, q, k, v, *, causal, softmax_scale, seq_lens, varlen, ranks: GroupInfo | Grid,
    layout: str | None = None, step_backend: str | None = None, step_backends=STEP_BACKENDS, return_lse=False,
    window_size=(-1, -1), softcap=0.0, sinks=None, attention_chunk_size=None,
) -> AttentionCall:  # fmt: skip
    """Every local check of an attention call (no communication); raises ValueError
    naming what is wrong. ranks: the call's group (GroupInfo) or USP grid. layout and
    step_backend: the ring's (ring_attention, usp_attention), None for Ulysses;
    step_backends: the names step_backend may take. Returns the AttentionCall with
    seq_lens where they are known without a gather (passed, or the plan's)."""
    check_attention_inputs(q, k, v)
    ring = step_backend is not None
    if ring:
        if q.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{describe} runs on CPU or CUDA tensors, got {q.device} ({describe_shapes(q, k, v)})")
        check_launchable(q)  # CUDA: GPUs older than sm_80, batch or heads over the grid limit
        if layout not in RING_LAYOUTS:
            raise ValueError(f"layout must be one of {RING_LAYOUTS}, got {layout!r}")
        if step_backend not in step_backends:
            raise ValueError(f"step_backend must be one of {tuple(step_backends)}, got {step_backend!r}")
    scale = resolve_softmax_scale(softmax_scale, q)
    check_bool("return_lse", return_lse)
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
    mask = AttentionMask.checked(causal, window_size, attention_chunk_size,
                                 None if varlen is None else varlen.layout.cu_seqlens)  # fmt: skip
    softcap = check_softcap(softcap)
    check_sinks(sinks, q)
    batch, _, heads, head_dim = q.shape
    sinks_kind = None if sinks is None else (tuple(sinks.shape), sinks.dtype)
    agreed = (batch, heads, k.shape[2], head_dim, v.shape[3], mask.causal, layout, q.dtype, scale, seq_lens,
              step_backend, return_lse, mask.window, softcap, sinks_kind, mask.chunk_size)  # fmt: skip
    return AttentionCall(scale, mask, softcap, sinks, seq_lens, None, layout or "contiguous",
                         step_backend or AUTO, return_lse, varlen, agreed)  # fmt: skip


def check_softcap(softcap) -> float:
    """softcap: a finite number >= 0 (0: no cap)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0: no capping), got {softcap!r:.80}")
    return softcap * 1.0


def check_sinks(sinks, q: torch.Tensor) -> None:
    """sinks: None, or a floating (nheads,) tensor on q's device."""
    if sinks is None:
        return
    heads = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,) or not sinks.is_floating_point():
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating (nheads,) = ({heads},) tensor, got {shape} (q {tuple(q.shape)})")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


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
    """q, k: (batch, seqlen_local, nheads / nheads_kv, headdim); v: (batch, seqlen_local,
    nheads_kv, headdim_v), headdim_v may differ from headdim (multi-head latent
    attention); one dtype among SUPPORTED_DTYPES, one device, nheads % nheads_kv == 0,
    both head dims in [1, MAX_HEAD_DIM]. Raises ValueError naming the shapes otherwise."""
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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must share batch, sequence length and heads, got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q, k, v must share batch and local sequence length, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have one head dim, got {shapes}")
    for name, head_dim in (("head dim", q.shape[3]), ("v head dim", v.shape[3])):
        if not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}], got {head_dim} ({shapes})")
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
