"""Linear attention with a decaying state over a sequence sharded across ranks: exact
against the recurrence over the whole sequence in one process (per document for packed
ones), forward and backward.

    gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, <where>)
        the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5), a decay per head
    kimi_delta_attention(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, <where>)
        Kimi's delta attention (Kimi Linear, Ling's BailingHybrid), a decay per key channel
    lightning_attention(q, k, v, slope, *, scale=1.0, <where>)
        MiniMax's lightning attention: no delta, a constant decay per head

<where>: the keyword arguments every mixer takes (parallel/recurrent.py's docstring):
group, or mesh / ulysses_group and ring_group; layout; seq_lens; varlen.

How the state travels (parallel/state_passing.py): the recurrence is affine in the state
entering a run of consecutive positions, S_after = M_r S_before + B_r, so each rank runs
its runs from a zero state and summarises each by (M_r (dk, dk), B_r (dk, dv)) per batch
entry and value head, in one chunked pass on the value [v | 0] from the state [0 | I]
(engine/gated_delta.py); the ranks gather every run's summary, each composes those
before its runs in their document into the state S_in entering each, and adds S_in^T
(M_{<=t}^T q_t) to each token's output (the same for all three: a per-channel decay or
no delta changes M_r, not its shape). Summary: batch x Hv x dk x (dk + dv) x 4 bytes
(fp32; 8 for fp64 inputs: traffic.gated_delta_summary_bytes); bytes
traffic.state_passing_bytes with it (none when every piece's runs start their documents).
"""

from __future__ import annotations

import math

import torch

from seqpar_kernels.engine.gated_delta import corrected, gated_delta_runs, next_state
from seqpar_kernels.parallel.recurrent import DTYPES
from seqpar_kernels.parallel.state_passing import SequenceRuns, laid_out

__all__ = ["gated_delta_rule", "kimi_delta_attention", "lightning_attention"]


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, use_qk_l2norm: bool = False, group=None, mesh=None, ulysses_group=None,
    ring_group=None, layout: str = "contiguous", seq_lens: list[int] | None = None, varlen=None,
    return_final_states: bool = False,
):  # fmt: skip
    """The gated delta rule over this rank's rows of a sharded sequence; per value head,

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

    from S = 0 at the sequence's (each document's) start, as transformers'
    torch_chunk_gated_delta_rule computes it on the whole sequence.

    q, k: (batch, seqlen_local, Hk, dk); v: (batch, seqlen_local, Hv, dv), Hv a multiple
    of Hk (q/k head i serves value heads i * Hv // Hk to (i + 1) * Hv // Hk - 1);
    g (the log decay, <= 0), beta: (batch, seqlen_local, Hv). q, k, v of one dtype (fp32,
    fp16, bf16 or fp64), g and beta of any of those; one device; any strides.
    scale: q's scale (None: dk**-0.5); use_qk_l2norm: q and k L2-normalised first
    (x / sqrt(|x|^2 + 1e-6), as use_qk_l2norm_in_kernel).
    <where>: the module docstring's (group or grid, layout, seq_lens, varlen).
    Returns (batch, seqlen_local, Hv, dv) in q's dtype, computed in fp32 (fp64 for fp64
    inputs), contiguous (as torch_chunk_gated_delta_rule returns it). Differentiable in
    q, k, v, g and beta.
    return_final_states: also return every sequence's final state S (sequences, Hv, dk,
    dv) in the compute dtype, on every rank (sequences: the batch, or the packed
    documents): what a cache keeps for the tokens after it.

    Bytes: every run's summary (traffic.gated_delta_summary_bytes) to every other rank
    forward, the gradients back: traffic.state_passing_bytes."""
    return _state_passed("gated_delta_rule", q, k, v, g, beta, "(batch, seqlen_local, Hv)", scale, use_qk_l2norm,
                         dict(group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                              layout=layout, seq_lens=seq_lens, varlen=varlen), return_final_states)  # fmt: skip


def kimi_delta_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, use_qk_l2norm: bool = False, group=None, mesh=None, ulysses_group=None,
    ring_group=None, layout: str = "contiguous", seq_lens: list[int] | None = None, varlen=None,
    return_final_states: bool = False,
):  # fmt: skip
    """Kimi's delta attention (KDA: the linear-attention layers of Kimi Linear and Ling's
    BailingHybrid) over this rank's rows of a sharded sequence: the gated delta rule with
    one decay per key channel; per value head,

        S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

    from S = 0 at the sequence's (each document's) start, as transformers'
    chunk_kimi_delta_attention and recurrent_kimi_delta_attention compute it on the whole
    sequence. Arguments, dtypes, return and bytes as gated_delta_rule's, but g: (batch,
    seqlen_local, Hv, dk), the log decay of each key channel (<= 0). On every device the
    chunks' sequential pass runs in torch (the Triton kernels take one decay per head)."""
    return _state_passed("kimi_delta_attention", q, k, v, g, beta, "(batch, seqlen_local, Hv, dk)", scale,
                         use_qk_l2norm, dict(group=group, mesh=mesh, ulysses_group=ulysses_group,
                                             ring_group=ring_group, layout=layout, seq_lens=seq_lens, varlen=varlen),
                         return_final_states)  # fmt: skip


def lightning_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, *, scale: float = 1.0, group=None,
    mesh=None, ulysses_group=None, ring_group=None, layout: str = "contiguous", seq_lens: list[int] | None = None,
    varlen=None, return_final_states: bool = False,
):  # fmt: skip
    """Lightning attention (MiniMax's linear-attention layers: MiniMaxLightningAttention)
    over this rank's rows of a sharded sequence: linear attention with one decay rate per
    head; per value head h,

        S_t = exp(-slope_h) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)

    i.e. o_t = scale sum_{s <= t} exp(-slope_h (t - s)) (q_t . k_s) v_s, from S = 0 at the
    sequence's (each document's) start, as MiniMaxLightningAttention's blocks compute it.
    q, k (batch, seqlen_local, Hk, dk), v (batch, seqlen_local, Hv, dv) as gated_delta_rule's;
    slope: (Hv,) the decay rates (>= 0; MiniMax's slope_rate), differentiable; scale: q's
    scale (MiniMax: 1). Dtypes, layouts, return and bytes as gated_delta_rule's."""
    return _state_passed("lightning_attention", q, k, v, slope, None, "(Hv,)", scale, False,
                         dict(group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                              layout=layout, seq_lens=seq_lens, varlen=varlen), return_final_states)  # fmt: skip


def _state_passed(describe: str, q, k, v, g, beta, gate_shape: str, scale, use_qk_l2norm: bool, where: dict,
                  return_final_states: bool):  # fmt: skip
    """The delta rule (beta a tensor) or linear attention (beta None) over this rank's
    rows, the state passed across the ranks: the public functions' body. gate_shape
    names g's expected shape: (batch, seqlen_local, Hv), (batch, seqlen_local, Hv, dk),
    or "(Hv,)": a decay rate per head, g = -rate at every token."""

    def local_checks():
        tensors = {"q": q, "k": k, "v": v, "g": g, **({} if beta is None else {"beta": beta})}
        for name, x in tensors.items():
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype not in DTYPES:
                kind = f"{x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{describe}: {name} must be a tensor of {DTYPES}, got {kind}")
            if x.device != q.device:
                raise ValueError(f"{describe}: every input must be on q's device {q.device}, {name} is on {x.device}")
        if q.dim() != 4 or k.shape != q.shape or q.shape[2] < 1 or q.shape[3] < 1:
            raise ValueError(f"{describe}: q and k must be (batch, seqlen_local, Hk, dk) alike, "
                             f"got {tuple(q.shape)} and {tuple(k.shape)}")  # fmt: skip
        if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[3] < 1 or v.shape[2] % max(q.shape[2], 1):
            raise ValueError(f"{describe}: v must be (batch, seqlen_local, Hv, dv) with Hv a multiple of "
                             f"q's {q.shape[2]} heads, got {tuple(v.shape)} for q {tuple(q.shape)}")  # fmt: skip
        expected = {"(Hv,)": (v.shape[2],), "(batch, seqlen_local, Hv, dk)": (*v.shape[:3], q.shape[3])}.get(
            gate_shape, tuple(v.shape[:3]))  # fmt: skip
        gates = {"slope" if gate_shape == "(Hv,)" else "g": (g, gate_shape, expected)}
        if beta is not None:
            gates["beta"] = (beta, "(batch, seqlen_local, Hv)", tuple(v.shape[:3]))
        for name, (x, named, shape) in gates.items():
            if tuple(x.shape) != shape:
                raise ValueError(f"{describe}: {name} must be {named} = {shape}, got {tuple(x.shape)}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{describe}: q, k and v must be of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not 0 < scale < math.inf):  # fmt: skip
            raise ValueError(f"{describe}: scale must be None or a positive finite number, got {scale!r}")
        if not isinstance(use_qk_l2norm, bool):
            raise ValueError(f"{describe}: use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")

    agreed = (describe, *(_all_but_length(x) for x in (q, k, v, g, beta)), scale, use_qk_l2norm)
    runs = SequenceRuns.of(describe, q, agreed=agreed, local_checks=local_checks, inputs=(k, v, g, beta), **where)
    if gate_shape == "(Hv,)":
        g = -g.reshape(1, 1, -1).expand(v.shape[:3])
    continues = [run.start > runs.bounds[run.document] for run in runs.mine]
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)
    if not return_final_states and not any(run.start > runs.bounds[run.document] for piece in runs.pieces
                                           for run in piece):  # fmt: skip
        # Every run starts its document: no state crosses a rank.
        out, _ = gated_delta_runs(q, k, v, g, beta, runs.mine, transitions=False, **options)
        return laid_out(out, q.dtype)
    out, summaries = gated_delta_runs(q, k, v, g, beta, runs.mine, transitions=any(continues), **options)
    gathered = runs.gather(summaries)
    zero = gathered.new_zeros(gathered.shape[1:-1] + (v.shape[3],))
    incoming = runs.incoming(gathered, next_state, zero)
    value_dim = v.shape[3]
    out = laid_out(runs.joined(corrected(out, runs.mine, incoming, continues, value_dim), gathered), q.dtype)
    if return_final_states:
        return out, runs.final_states(gathered, next_state, zero)
    return out


def _all_but_length(x):
    """What every rank's x must agree on: its shape but the local length, and its dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return type(x).__name__
    return (x.shape[0], *x.shape[2:], x.dtype)
