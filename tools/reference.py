"""What the tests and the benchmarks compare against, and how close is close enough.

    attention(q, k, v, causal, scale)        plain attention, scores materialized, in
                                             the inputs' dtype (fp64 inputs: the exact
                                             answer the tests compare with)
    masked_attention(q, k, v, keep, scale)   the same under any mask of the keys each
                                             query sees (visible_at: by positions)
    sdpa(q, k, v, causal, scale)             torch's fused attention, in the inputs' dtype
                                             (sinks as one more key of value 0)
    with_grads(fn, leaves, dout[, make_inputs])  out and the leaves' gradients of any of them
    max_error(a, b)                          largest absolute difference, in fp64
    error_bound(dtype, yardstick, magnitude) the accuracy rule
    assert_within_rule(got, exact, yardstick, dtype, what)
                                             the rule on one tensor, as an assertion
    tf32_products()                          plain PyTorch's products as Triton's TF32
                                             ones (the yardstick of TF32 kernels)
    delta_rounding(...)                      its term for a flash-style backward's dq, dk
    rounded_out_error(fn, leaves, dout, dtype)  a flash-style backward's error from the
                                             rounded out its delta is taken from
    contiguous_piece(x, lengths, rank)       rank r's rows of a full sequence, rank r
                                             holding lengths[r] consecutive rows
    zigzag_piece(x, rank, world_size)        rank r's rows in the zigzag layout
    ring_piece(x, layout, rank, world_size)  either, for P equal pieces
    even_lengths(total, world_size)          torch.tensor_split's piece lengths

The accuracy rule (flash-attention's): against the fp64 answer, our error is at most
ERROR_FACTOR times the error of plain PyTorch computed in the same dtype on the whole
sequence (the yardstick), plus a slack of a unit of roundoff or so at the tensor's
magnitude (RELATIVE_SLACK) for errors that both are too small to measure, plus the
rounding of the fp32 log-sum-exp a blockwise backward rebuilds its probabilities from
(LSE_ROUNDOFFS), which only counts at large logits, plus for dq and dk the rounding of
the fp32 difference dp - delta every flash-style backward takes (delta_rounding), which
only shows where the exact gradient is about 0. Where a test measures them, the
yardstick is the largest error of the ways to compute attention in that dtype that torch
users have: plain PyTorch, torch's fused SDPA, the exact answer of the inputs rounded to
the dtype (their own rounding, which plain PyTorch's error can cancel by chance), and for
dq and dk a flash-style backward that errs only by its delta (rounded_out_error).

q: (batch, seqlen, nheads, headdim); k, v: (batch, seqlen, nheads_kv, headdim); nheads
% nheads_kv == 0. Outputs follow q's layout; lse is (batch, nheads, seqlen) fp32 (fp64
for fp64 inputs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ERROR_FACTOR = 2.0
# fp32 against fp64 at ordinary logits: what the fp32 cases of the tests allow.
FP32_TOLERANCE = 2e-5

# The slack of the rule, relative to the exact tensor's magnitude (floored at 1e-2, for
# tensors that are exactly 0): one unit of roundoff of fp16 and bf16, four of fp32. It
# only matters where plain PyTorch happens to be exact (one visible key, a tiny tensor)
# and ours is off by rounding. Over 1400 randomized cases (tests/test_randomized.py) ours
# needed beyond twice plain PyTorch's error at most 2.5 units in fp32, 0.2 in bf16, and
# in fp16 5e-7 where the exact gradient is 0.
RELATIVE_SLACK = {torch.float32: 4 * 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}

# The log-sum-exp kept in fp32 between forward and backward: a blockwise backward (the
# ring's) rebuilds every probability as exp(s - lse), so each carries a relative error of
# about |lse| units of fp32 roundoff, which grows with the logits. Measured on the whole
# sequence in one process (head dim 24, 8 key blocks, scale 9, |lse| up to 190): with
# every step exact in fp64 but the final lse rounded to fp32, dq/dk/dv err by 3.7e-4,
# 2.1e-4, 3.3e-5, against 7.3e-4, 4.8e-4, 2.1e-5 for torch's SDPA computed wholly in
# fp32; the ring erred by 1.2e-3, 9.6e-4, 1.4e-4, and keeping the blocks' lse in fp64
# before that rounding changed nothing. The rule allows LSE_ROUNDOFFS fp32 units of
# roundoff times |lse| at the tensor's magnitude for it; at ordinary logits (|lse| ~ 5)
# that is a few units.
LSE_ROUNDOFFS = 4

# delta_rounding's multiple of one dot product's typical rounding (sqrt 2 for two, times
# about 2 for the largest of a tensor's rows).
DELTA_ROUNDING_UNITS = 3.0


def default_scale(q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def _repeat_kv(k: torch.Tensor, num_heads: int) -> torch.Tensor:
    return k.repeat_interleave(num_heads // k.shape[2], dim=2)


def visible(length, causal=False, window_size=(-1, -1), chunk_size=None, cu_seqlens=None, device=None):
    """(length, length) bool: which key each query sees, written out from the definitions:
    the same document (cu_seqlens), then visible_at() of the offsets in the document
    (causal, window, chunks counted from the document's start)."""
    positions = torch.arange(length, device=device)
    bounds = torch.tensor(cu_seqlens if cu_seqlens is not None else [0, length], device=device)
    document = torch.searchsorted(bounds, positions, right=True) - 1
    offset = positions - bounds[document]
    keep = document[:, None] == document[None, :]
    return keep & visible_at(offset, offset, causal, window_size, chunk_size)


def visible_at(q_positions, k_positions, causal=False, window_size=(-1, -1), chunk_size=None):
    """(..., Sq, Sk) bool: which key each query sees by their positions ((..., Sq) and
    (..., Sk) int tensors, any values, any order), from the definitions: key <= query
    (causal), query - left <= key <= query + right (window_size (left, right), -1 no
    bound), the same chunk of chunk_size positions."""
    query, key = q_positions[..., :, None], k_positions[..., None, :]
    keep = torch.ones(torch.broadcast_shapes(query.shape, key.shape), dtype=torch.bool, device=query.device)
    if causal:
        keep &= key <= query
    left, right = window_size
    if left >= 0:
        keep &= key >= query - left
    if right >= 0:
        keep &= key <= query + right
    if chunk_size is not None:
        keep &= (query // chunk_size) == (key // chunk_size)
    return keep


def attention(q, k, v, causal=False, scale=None, *, window_size=(-1, -1), softcap=0.0, sinks=None, chunk_size=None,
              cu_seqlens=None):  # fmt: skip
    """(out, lse) of attention with the score matrix materialized, in q's dtype (the
    softmax in q's dtype too, as a plain PyTorch model computes it; the products as its
    GEMMs do: einsum_as_gemm). The variants, written
    out: visible()'s mask; softcap > 0: scores softcap * tanh(scores / softcap); sinks
    (H,): a logit per head in every row's softmax, with no value row. A row that sees no
    key (and has no sink) gives out 0 and lse -inf."""
    keep = visible(q.shape[1], causal, window_size, chunk_size, cu_seqlens, q.device)
    return masked_attention(q, k, v, keep, scale, softcap=softcap, sinks=sinks)


HALF_DTYPES = (torch.float16, torch.bfloat16)


def einsum_as_gemm(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum(equation, a, b) as a GEMM in a's dtype computes it: fp32 sums of the
    products, rounded once to the dtype (autograd's backward alike: fp32 products rounded
    to each input's dtype). Half precision goes through fp32 einsums, which give that on
    any CPU, where a bf16 matmul on one without bf16 instructions takes tens of times
    longer (measured: 512 x 512, 209 ms in bf16 against 3.4 ms in fp32 on a 2-core AMD EPYC)."""
    if a.dtype in HALF_DTYPES:
        return torch.einsum(equation, a.float(), b.float()).to(a.dtype)
    return torch.einsum(equation, a, b)


def masked_attention(q, k, v, keep, scale=None, *, softcap=0.0, sinks=None):
    """attention()'s (out, lse) where `keep` ((Sq, Sk), or (B, 1, Sq, Sk): per sequence)
    says which key each query sees; q (B, Sq, H, D), k and v (B, Sk, H_kv, D)."""
    scale = default_scale(q) if scale is None else scale
    k, v = _repeat_kv(k, q.shape[2]), _repeat_kv(v, q.shape[2])
    scores = einsum_as_gemm("bqhd,bkhd->bhqk", q, k) * scale  # (B, H, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    probabilities = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        probabilities = probabilities[..., :-1]
    out = einsum_as_gemm("bhqk,bkhd->bqhd", probabilities, v)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = scores.to(lse_dtype)
    # A row that sees no key: lse -inf, its gradient 0 (logsumexp's own backward gives NaN).
    empty = (scores == float("-inf")).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty[..., 0], float("-inf"))
    return out, lse


def sdpa(q, k, v, causal=False, scale=None, attn_mask=None, sinks=None):
    """(out, None) of torch's scaled_dot_product_attention in q's dtype, on (B, H, S, D)
    contiguous copies: the layout models hand it, for which torch runs its fused (flash)
    kernel. Which backend SDPA runs depends on the layout it is given, and its math
    backend is exact where the flash backward cancels (a one-hot softmax), so the
    yardstick fixes the layout. GQA/MQA kv heads are repeated, not passed with
    enable_gqa: on the CPU torch 2.6 runs its math backend for enable_gqa (dk exact to
    1e-11 on one-hot rows, where the flash backward errs by 2.2e-3), 2.13 and 2.14 the
    flash kernel either way. attn_mask: a boolean (S, S) mask of the keys each query
    sees (windows, chunks, documents; causal folded in), as a model hands SDPA a mask
    (a row that sees no key gives 0). sinks (H,): each head's sink logit, run as SDPA
    runs it for models whose kernels lack sinks: one more key of value 0 whose score is
    the sink (an additive float mask). A negative or zero scale is given as the same
    scores with a positive one (-q, or zero q with scale 1): SDPA's CPU kernel masks
    causal scores before scaling them and returns NaN otherwise."""
    scale = default_scale(q) if scale is None else scale
    if scale < 0:
        q, scale = -q, -scale
    elif scale == 0:
        q, scale = q * 0, 1.0
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    if sinks is not None:  # (S, S + 1) additive: 0 where a key is seen, -inf elsewhere, the sink last
        length = q.shape[1]
        keep = visible(length, causal, device=q.device) if attn_mask is None else attn_mask
        bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        bias = torch.cat([bias.expand(q.shape[2], -1, -1), sinks.to(q.dtype)[:, None, None].expand(-1, length, 1)], -1)
        k, v = (torch.cat([x, x.new_zeros(x[:, :1].shape)], dim=1) for x in (k, v))
        attn_mask = bias[None]  # (1, H, S, S + 1)
    if attn_mask is not None:  # a mask of the keys each query sees, causal folded in
        out = F.scaled_dot_product_attention(
            *(t.transpose(1, 2).contiguous() for t in (q, k, v)), attn_mask=attn_mask, scale=scale
        )
        return out.transpose(1, 2).nan_to_num(0.0), None
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2).contiguous() for t in (q, k, v)), is_causal=causal, scale=scale
    )
    return out.transpose(1, 2), None


def rounded_out_error(fn, leaves, dout, dtype, make_inputs=None) -> list[torch.Tensor]:
    """The error, in the leaves' gradients, of a flash-style backward in `dtype` that is
    exact but for taking delta = rowsum(dout * out) from out rounded to `dtype` (the out
    it saves, as flash-attention, cuDNN and torch's fused kernels do), to first order.

    fn(*make_inputs(*leaves)) -> (out (B, S, H, D), lse (B, H, S)) in fp64, as attention().
    Since d lse_i / d s_ij = p_ij, the change -p_ij x (delta'_i - delta_i) of dS is the
    gradient of -sum_i (delta'_i - delta_i) x lse_i, through the scores, their cap and
    mask. Plain attention's softmax backward has no such term: where one key (or a sink)
    takes nearly all of a row's weight, the row's dS is a small difference that this
    rounding, summed over the head dim, dominates. Returns one gradient change per leaf."""
    leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    out, lse = fn(*(make_inputs(*leaves) if make_inputs else leaves))
    exact_out = out.detach()
    delta_change = ((exact_out.to(dtype).double() - exact_out) * dout.double()).sum(-1).transpose(1, 2)
    lse.backward(-delta_change)
    return [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves]


def with_grads(fn, leaves, dout, make_inputs=None):
    """Runs out = fn(*make_inputs(*leaves)) (fn returns out or (out, lse); make_inputs:
    views, expands, casts, any differentiable ops, default none) and out.backward(dout),
    on fresh autograd copies of the leaves. Returns (out, lse or None, *gradients of the
    leaves)."""
    leaves = [leaf.detach().clone().requires_grad_() for leaf in leaves]
    result = fn(*(make_inputs(*leaves) if make_inputs else leaves))
    out, lse = result if isinstance(result, tuple) else (result, None)
    out.backward(dout)
    return (out.detach(), lse, *(leaf.grad for leaf in leaves))


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def magnitude(exact: torch.Tensor) -> float:
    return exact.abs().max().item() if exact.numel() else 0.0


def delta_rounding(
    head_dim: int, scale: float, dout_magnitude: float, v_magnitude: float, qk_magnitude: float
) -> float:
    """The fp32 rounding of a flash-style backward's dS = p * (dp - delta), in dq and dk.

    dp = dout . v and delta = rowsum(dout * out) are two fp32 dot products of head_dim
    terms up to |dout| |v| (|out| <= |v|), computed apart; plain PyTorch's softmax
    backward subtracts sum(p * dp) instead, which cancels exactly where one key takes all
    the weight. Each one's rounding is about sqrt(head_dim) fp32 units of |dout| |v| for
    random data (one standard deviation); the two are rounded apart (sqrt 2) and a tensor's
    largest error is its worst row's, a few deviations out: DELTA_ROUNDING_UNITS x
    sqrt(head_dim) units in all. It reaches dq (dk) through scale x |k| (|q|), and is what
    shows where the exact gradient is about 0: measured 7.2e-6 in dq and 1.1e-5 in dk (head
    dim 256, fp16, one query and one key), where plain PyTorch's error is exactly 0 and this
    gives 7.8e-5; 3.8e-6 in dq (head dim 160, fp32, every query seeing one key, 48 rows),
    where one deviation would give 3.2e-6."""
    return (
        DELTA_ROUNDING_UNITS * 2.0**-24 * math.sqrt(head_dim) * dout_magnitude * v_magnitude * abs(scale) * qk_magnitude
    )


def error_bound(
    dtype: torch.dtype,
    yardstick: float,
    exact_magnitude: float,
    lse_magnitude: float = 0.0,
    backward_rounding: float = 0.0,
) -> float:
    """The largest error the rule allows: ERROR_FACTOR x the yardstick (plain PyTorch's
    error in `dtype`) plus the slack at the exact tensor's magnitude, plus the rounding
    of an fp32 log-sum-exp as large as `lse_magnitude` (the exact lse's largest |value|),
    plus `backward_rounding` (delta_rounding, for dq and dk)."""
    magnitude = max(exact_magnitude, 1e-2)
    lse_rounding = LSE_ROUNDOFFS * 2.0**-24 * lse_magnitude * magnitude
    return ERROR_FACTOR * yardstick + RELATIVE_SLACK[dtype] * magnitude + lse_rounding + backward_rounding


def assert_within_rule(got, exact, yardstick, dtype: torch.dtype, what: str, rounding: float = 0.0) -> None:
    """The accuracy rule on one tensor: got's error against the fp64 answer `exact` at most
    error_bound(dtype, the yardstick's error against it, exact's magnitude) plus
    `rounding` (a rounding of got's own that the yardstick does not share). got, exact,
    yardstick: the same shape; NaN fails."""
    error, plain = max_error(got, exact), max_error(yardstick, exact)
    bound = error_bound(dtype, plain, magnitude(exact)) + rounding
    if not error <= bound:
        raise AssertionError(
            f"{what}: error {error:.3g} against the fp64 answer beyond the rule's {bound:.3g} "
            f"(plain PyTorch in {dtype} errs by {plain:.3g}; magnitude {magnitude(exact):.3g})"
        )


def tf32_truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 x as a GPU's tensor cores read it for a TF32 product that Triton's tl.dot feeds
    fp32 registers: the top 19 bits, 10 of mantissa (the low 13 dropped: toward zero, off
    by less than 2^-10 relative, where rounding to nearest would be off by 2^-11)."""
    return (x.detach().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


class _TF32Products(TorchDispatchMode):
    # Each product's operands (by position): mm/bmm (a, b); addmm/baddbmm (c, a, b).
    _OPERANDS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.bmm.default: (0, 1),
                 torch.ops.aten.addmm.default: (1, 2), torch.ops.aten.baddbmm.default: (1, 2)}  # fmt: skip

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args = list(args)
        for index in self._OPERANDS.get(func, ()):
            if args[index].dtype == torch.float32:
                args[index] = tf32_truncated(args[index])
        return func(*args, **(kwargs or {}))


def tf32_products() -> TorchDispatchMode:
    """A context manager: plain PyTorch's matrix products (whatever calls them: @, einsum,
    autograd's backward) as torch computes them on a GPU with TF32 allowed, the operands
    read as Triton's TF32 tl.dot reads them (tf32_truncated), the sums in fp32; on any
    device. The yardstick of a kernel whose products are TF32."""
    return _TF32Products()


def even_lengths(total: int, world_size: int) -> list[int]:
    """The lengths torch.tensor_split gives: the first total % P pieces one longer."""
    return [total // world_size + (rank < total % world_size) for rank in range(world_size)]


def contiguous_piece(x: torch.Tensor, lengths, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s rows of the full sequence x (along dim) when every rank holds its
    lengths[rank] consecutive rows, in rank order."""
    return x.narrow(dim, sum(lengths[:rank]), lengths[rank])


def zigzag_piece(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s rows of the full sequence x in the zigzag layout: chunks rank and
    2P-1-rank of the 2P chunks torch.tensor_split cuts dim into, concatenated."""
    chunks = torch.tensor_split(x, 2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def ring_piece(x: torch.Tensor, layout: str, rank: int, world_size: int, dim: int = 1, lengths=None) -> torch.Tensor:
    """Rank `rank`'s rows for ring_attention's `layout` ("contiguous" or "zigzag").
    lengths: contiguous only, every rank's rows (default: torch.tensor_split's)."""
    if layout == "zigzag":
        return zigzag_piece(x, rank, world_size, dim)
    return contiguous_piece(x, lengths or even_lengths(x.shape[dim], world_size), rank, dim)
