"""DeepSpeed-Ulysses attention (arXiv:2309.14509) with fused exchange packing.

Sequence-sharded q/k/v (B, S_local, H, D) become head-sharded full sequences with one
all-to-all, local attention runs, and a second all-to-all brings the output back.

    forward                                                  memory layout
    q (B, S_r, H, D), k/v (B, S_r, H_kv, D)                  as given (any strides)
      pack: rank j gets q heads [h_j, h_j + n_j) and the kv heads they read
      all_to_all_single (q, k, v in one buffer)
      unpack: rank i's (B, S_i, n, D) block lands at sequence offset i
    q (B, S, n, D), k/v (B, S, n_kv, D) logical             (B, n, S, D) in memory
      SDPA on the (B, n, S, D) views (no copy)
    out (B, n, S, D)
      pack: rank j gets sequence piece j of out, viewed as (B, S, n, D)
      all_to_all_single
      unpack: rank i's (B, S_r, n_i, D) block lands at head offset h_i
    out (B, S_r, H, D)                                       contiguous

Heads not divisible by P are split torch.tensor_split style. With GQA/MQA, each rank
receives exactly the kv heads its q heads read (a kv head shared by q heads on several
ranks is sent to each of them); K/V are never repeated. The backward is the autograd
of the pack/exchange/unpack ops, each the adjoint of the other: gradients of a kv head
sent to several ranks are summed in fp32.

The two exchanges, sequence_to_heads and heads_to_sequence (with the UlyssesPlan that
says who holds which rows and heads), are also the Ulysses half of USP
(seqpar_kernels/parallel/usp.py), which runs a ring between them instead of SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar_kernels.comm.exchange import exchange_blocks
from seqpar_kernels.comm.plan import interleave, kv_head_ranges
from seqpar_kernels.engine.local_ops import local_attention_forward
from seqpar_kernels.engine.steps import inputs_precision
from seqpar_kernels.groups import GroupInfo, resolve_group
from seqpar_kernels.layouts import offsets, tensor_split_ranges
from seqpar_kernels.parallel.attention_checks import AttentionCall, checked_attention_call, fold_scale_sign

# (B, S, H, D) logical shape stored as (B, H, S, D): the layout SDPA reads without a copy.
HEADS_MAJOR = (0, 2, 1, 3)


def uniform_head_runs(q_head_start: int, num_q: int, group_size: int) -> list[tuple[int, int, int, int]]:
    """Splits local q heads [q_head_start, +num_q) of the model into runs in which every
    kv head serves the same number of q heads, as SDPA's GQA needs. Returns
    (q_offset, q_count, kv_offset, kv_count) per run, offsets local. At most three runs:
    a partial first kv group, whole groups, a partial last group."""
    runs = []
    head, kv_base = 0, q_head_start // group_size
    while head < num_q:
        global_head = q_head_start + head
        in_group = global_head % group_size
        if in_group != 0 or num_q - head < group_size:  # a partial group: one kv head
            count = min(group_size - in_group, num_q - head)
            runs.append((head, count, global_head // group_size - kv_base, 1))
        else:  # whole groups
            groups = (num_q - head) // group_size
            count = groups * group_size
            runs.append((head, count, global_head // group_size - kv_base, groups))
        head += count
    return runs


def attend_by_head_runs(attend, q, k, v, q_head_start: int, group_size: int, sinks: torch.Tensor | None = None):
    """Attention of the model's q heads [q_head_start, +n) against the kv heads they
    read, one call of attend per uniform run of heads (uniform_head_runs), the runs'
    results joined along the heads.

    q (B, S, n, D), k (B, S, n_kv, D), v (B, S, n_kv, Dv): this rank's heads, any strides.
    attend(q_run, k_run, v_run, heads) -> (out (B, S, q_count, Dv), lse (B, q_count, S)
    or None): the attention of one run, `heads` the run's q heads of the model (a slice).
    sinks: the call's sink logits (H,) or None.
    Returns (out (B, S, n, Dv), lse (B, n, S) fp32 or None). With no heads on this rank
    (fewer heads than ranks): an empty out that stays in the autograd graph, so that
    this rank joins the backward exchanges like the others, and the sinks with it at
    weight 0, so that sinks.grad is zeros here (not None, which a data-parallel
    reduction of gradients would skip)."""
    outs, lses = [], []
    for q_offset, q_count, kv_offset, kv_count in uniform_head_runs(q_head_start, q.shape[2], group_size):
        heads = slice(q_head_start + q_offset, q_head_start + q_offset + q_count)
        out, lse = attend(
            q.narrow(2, q_offset, q_count), k.narrow(2, kv_offset, kv_count), v.narrow(2, kv_offset, kv_count), heads
        )
        outs.append(out)
        lses.append(lse)
    if not outs:
        # v's empty heads: the output's head dim is v's.
        empty = v.narrow(2, 0, 0).clone() if sinks is None else v.narrow(2, 0, 0).clone() + sinks[:0].sum()
        return empty, q.new_empty((q.shape[0], 0, q.shape[1]), dtype=torch.float32)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if lses[0] is None:
        return out, None
    return out, lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)


def _sdpa_run(causal: bool, scale: float):
    """attend for attend_by_head_runs by SDPA: the (B, S, n, D) runs as the (B, n, S, D)
    views it reads (the exchange lays them out so, no copy). In the inputs' dtype under
    autocast too, as the masked runs and the ring: out in q's dtype."""

    def attend(q, k, v, heads):
        with inputs_precision(q.device):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=causal,
                scale=scale,
                enable_gqa=q.shape[2] != k.shape[2],
            )
        return out.transpose(1, 2), None  # fmt: skip

    return attend


def _local_attention(q, k, v, call: AttentionCall, scale: float, q_head_start: int, group_size: int):
    """Attention of the model's q heads [q_head_start, +n) on the whole sequence after
    the exchange: q (B, S, n, D), k, v (B, S, n_kv, D), the ranks' pieces one after
    another. Returns out (B, S, n, D) in the same order."""
    order = None
    if call.varlen is not None and not call.varlen.layout.in_global_order:
        # The pieces concatenated in rank order are not the sequence in order: bring the
        # tokens into global order, where each document is one range, and back after.
        positions = call.varlen.layout.concatenated_positions().to(q.device)
        order = torch.argsort(positions)
        q, k, v = (x.index_select(1, order) for x in (q, k, v))
    attend = _sdpa_run(call.mask.causal, scale) if call.is_plain else _masked_run(call, scale)
    out, _ = attend_by_head_runs(attend, q, k, v, q_head_start, group_size, call.sinks)
    return out if order is None else out.index_select(1, positions)


def _masked_run(call: AttentionCall, scale: float):
    """attend for attend_by_head_runs under the call's mask (documents, a window,
    chunks), softcap and sinks (of the run's heads): the one-process attention op."""

    def attend(q, k, v, heads):
        return local_attention_forward(q, k, v, softmax_scale=scale, **call.op_arguments(heads))[0], None

    return attend


@dataclass(frozen=True)
class UlyssesPlan:
    """Who holds what around a Ulysses exchange over P ranks. Before: rank r holds rows
    [seq_starts[r], +seq_lens[r]) of the sequence, all heads. After: rank r holds the
    whole sequence (sum(seq_lens) rows) of q heads [head_starts[r], +head_counts[r])
    (torch.tensor_split of num_heads) and of the kv heads they read, [kv_starts[r],
    +kv_counts[r]) (ranges of ranks may overlap: a kv head serving q heads on several
    ranks goes to each)."""

    num_heads: int
    seq_lens: list[int]
    seq_starts: list[int]
    head_starts: list[int]
    head_counts: list[int]
    kv_starts: list[int]
    kv_counts: list[int]

    @classmethod
    def of(cls, seq_lens: list[int], num_heads: int, num_kv_heads: int) -> UlyssesPlan:
        """The plan of ranks holding seq_lens rows each, of num_heads q heads reading
        num_kv_heads kv heads (num_heads % num_kv_heads == 0)."""
        head_starts, head_counts = tensor_split_ranges(num_heads, len(seq_lens))
        kv_starts, kv_counts = kv_head_ranges(head_starts, head_counts, num_heads, num_kv_heads)
        return cls(num_heads, list(seq_lens), offsets(seq_lens), head_starts, head_counts, kv_starts, kv_counts)


def sequence_to_heads(q, k, v, plan: UlyssesPlan, info: GroupInfo):
    """Sequence-sharded -> head-sharded: q, k and v in one exchange.

    q: (B, S_r, H, D), k: (B, S_r, H_kv, D), v: (B, S_r, H_kv, Dv), this rank's rows, any
    strides. Returns q (B, S, n, D), k (B, S, n_kv, D) and v (B, S, n_kv, Dv): the whole sequence (S rows, in
    rank order) of this rank's heads in the plan, stored (B, n, S, D) in memory (what
    SDPA and the CPU flash kernels read without a copy)."""
    batch, head_dim, value_dim = q.shape[0], q.shape[3], v.shape[3]
    total_len = sum(plan.seq_lens)
    my_heads, my_kv_heads = plan.head_counts[info.rank], plan.kv_counts[info.rank]
    return exchange_blocks(
        [q, k, v], [2, 2, 2],
        interleave([plan.head_starts, plan.kv_starts, plan.kv_starts]),
        interleave([plan.head_counts, plan.kv_counts, plan.kv_counts]),
        [
            (batch, total_len, my_heads, head_dim),
            (batch, total_len, my_kv_heads, head_dim),
            (batch, total_len, my_kv_heads, value_dim),
        ],
        [1, 1, 1],
        interleave([plan.seq_starts] * 3),
        interleave([plan.seq_lens] * 3),
        info,
        out_dim_orders=[HEADS_MAJOR] * 3,
    )  # fmt: skip


def heads_to_sequence(x: torch.Tensor, plan: UlyssesPlan, info: GroupInfo, seq_dim: int = 1, heads_dim: int = 2):
    """Head-sharded -> sequence-sharded: the reverse of sequence_to_heads for one tensor.

    x: the whole sequence (along seq_dim) of this rank's q heads in the plan (along
    heads_dim), any strides: out (B, S, n, D) with the defaults, an lse (B, n, S) with
    seq_dim=2, heads_dim=1.
    Returns this rank's rows of all plan.num_heads heads, contiguous: (B, S_r, H, D),
    or (B, H, S_r) for the lse."""
    out_shape = list(x.shape)
    out_shape[seq_dim], out_shape[heads_dim] = plan.seq_lens[info.rank], plan.num_heads
    (out,) = exchange_blocks(
        [x], [seq_dim], plan.seq_starts, plan.seq_lens,
        [out_shape], [heads_dim], plan.head_starts, plan.head_counts,
        info,
    )  # fmt: skip
    return out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    seq_lens: list[int] | None = None,
    varlen=None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int | None = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across the ranks of `group`.

    q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
        headdim) with nheads % nheads_kv == 0 (GQA, MQA). Rank r holds the r-th piece
        of the sequence; pieces may differ in length. fp16, bf16 or fp32; head dim up
        to 256; v's head dim headdim_v may differ (multi-head latent attention: v
        travels at its own width); any strides.
    causal: mask by global position (rank order is sequence order).
    softmax_scale: default 1/sqrt(headdim).
    seq_lens: every rank's seqlen_local. If None they are exchanged, in the one small
        collective that also makes a bad input on any rank raise on every rank; under
        torch.compile they are assumed equal. Passing them skips that collective (see
        docs/api.md on bad inputs).
    varlen: a VarlenPlan (varlen_plan(cu_seqlens, group=group)) for packed documents:
        q, k, v are (1, plan.seq_lens[rank], heads, headdim), this rank's tokens in the
        plan's layout (plan.split makes them); attention stays inside each document
        (causal or not within it). After the exchange each rank holds whole documents
        of its heads and runs them varlen (torch's flash varlen kernels on GPUs for
        fp16/bf16; the step kernels over the document mask otherwise). The contiguous
        layout suits Ulysses best: the balanced one costs a reordering of the exchanged
        sequence into global order and back. seq_lens then comes from the plan.
    window_size, softcap, sinks, attention_chunk_size: as ring_attention's (the sliding
        window (left, right), capped scores, per-head sink logits, chunked attention).
        After the exchange a rank holds whole sequences of its heads, so every variant is
        local: the step backends over the whole sequence's mask (the Triton kernels on
        GPUs); each rank's sinks.grad holds its heads' gradients, the others 0.
    Returns (batch, seqlen_local, nheads, headdim_v), contiguous, in q's dtype.

    Bytes sent per call: (P-1)/P x (q + k + v + out bytes) when heads and sequence
    divide evenly (seqpar_kernels.traffic.ulysses_bytes for any split); two all-to-alls
    forward, two backward.
    """
    info = resolve_group(group)
    call = checked_attention_call(
        "ulysses_attention", q, k, v, info, exchange=seq_lens is None, causal=causal, softmax_scale=softmax_scale,
        seq_lens=seq_lens, varlen=varlen, window_size=window_size, softcap=softcap, sinks=sinks,
        attention_chunk_size=attention_chunk_size,
    )  # fmt: skip
    return run_ulysses_attention(q, k, v, call, info)


def run_ulysses_attention(q, k, v, call: AttentionCall, info: GroupInfo) -> torch.Tensor:
    """ulysses_attention once checked: call (its AttentionCall, every rank's length
    known) over the group `info`. Returns (B, S_r, H, D), contiguous."""
    num_heads = q.shape[2]
    plan = UlyssesPlan.of(call.seq_lens, num_heads, k.shape[2])
    q, scale = fold_scale_sign(q, call.scale)
    q_heads, k_heads, v_heads = sequence_to_heads(q, k, v, plan, info)  # (B, S, n, D) as (B, n, S, D)
    group_size = num_heads // k.shape[2]
    out_heads = _local_attention(q_heads, k_heads, v_heads, call, scale, plan.head_starts[info.rank], group_size)
    return heads_to_sequence(out_heads, plan, info)  # (B, S_r, H, D)
