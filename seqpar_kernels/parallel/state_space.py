"""The state-space scans of hybrid models, sequence-parallel: the state passed across ranks.

    ssd_scan(x, dt, A, B, C, *, chunk_size=256, D=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, inf), <where>)                     Mamba2's SSD scan
    selective_scan(u, delta, A, B, C, *, D=None, z=None, delta_bias=None,
                   delta_softplus=False, <where>)                Mamba's selective scan

<where>: the ranks and the layout, as every mixer of parallel/recurrent.py takes them
(group, or mesh / ulysses_group and ring_group; layout; seq_lens; varlen: the state
restarts at every document's start).

How: each rank scans each of its runs (consecutive rows of one document) from a zero
state (engine/state_space.py), keeping its output and its final state. The scan is
affine in the state entering a run, so a run's summary is its transition (its total
decay) and its final state; the ranks gather every run's summary in one all-to-all
(fp32), compose the states entering their runs (S -> decay * S + final over the runs
before, in the document), and add each entering state's share to the output (the scan
without input from that state: exp(cumulative decay) times the state, read out by C). Autograd gives exact
gradients; the backward sends each summary's gradient back to its run's rank.

Bytes (seqpar_kernels.traffic.state_passing_bytes, summary_bytes per run; 4 bytes an
element, 8 for fp64 inputs): SSD batch x H x (1 + P x N) x 4; selective batch x D x N x 2 x 4.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from seqpar_kernels.engine.state_space import (
    compute_dtype,
    discretised_dt,
    selective_next_state,
    selective_runs_from_zero,
    selective_state_shares,
    selective_summaries,
    ssd_next_state,
    ssd_runs_from_zero,
    ssd_state_shares,
    ssd_summaries,
)
from seqpar_kernels.parallel.checks import SUPPORTED_DTYPES
from seqpar_kernels.parallel.state_passing import SequenceRuns, laid_out

__all__ = ["ssd_scan", "selective_scan"]

# The attention's dtypes, and fp64 for references.
DTYPES = (*SUPPORTED_DTYPES, torch.float64)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    layout: str = "contiguous",
    seq_lens: list[int] | None = None,
    varlen=None,
    return_final_states: bool = False,
):
    """Mamba2's SSD scan (the mixers of Bamba, Falcon-H1, GraniteMoeHybrid, Nemotron-H)
    of a sequence sharded across ranks.

    x: (batch, seqlen_local, heads, head_dim), this rank's rows; dt: (batch, seqlen_local,
    heads); A: (heads,); B and C: (batch, seqlen_local, groups, state_size), heads a
    multiple of groups (head h reads group h // (heads / groups)); D, dt_bias: (heads,) or
    None. fp32, fp16, bf16 or fp64, on one device.
    dt is discretised as transformers' mamba2_chunk_scan does: clamp(softplus(dt + dt_bias),
    *dt_limit) (softplus when dt_softplus). Per head, with the state h (head_dim, state_size):
        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t
    from a zero state at the sequence's (or the document's) start.
    chunk_size: the tokens of a run scanned at once (the result is the same up to
    rounding whatever it is; memory grows with it).
    <where>: the module docstring's (group or grid, layout, seq_lens, varlen).
    return_final_states: also return every sequence's final state (sequences, heads,
    head_dim, state_size) in the compute dtype, on every rank (sequences: the batch, or
    the packed documents): what a cache keeps for the tokens after it.
    Returns y (batch, seqlen_local, heads, head_dim) in x's dtype, computed in fp32 (fp64
    for fp64 x), contiguous: transformers' mamba2_chunk_scan on the whole sequence.
    Differentiable in every tensor input (each rank's A, D and dt_bias gradients are its
    rows' share: all_reduce_gradients sums them).

    Each run's summary travels: batch x heads x (1 + head_dim x state_size) elements."""
    describe = "ssd_scan"

    def local_checks():
        _check_tensor(describe, "x", x, 4, DTYPES)
        batch, length, heads, _ = x.shape
        device = x.device
        _check_tensor(describe, "dt", dt, 3, DTYPES, (batch, length, heads), device)
        _check_tensor(describe, "A", A, 1, DTYPES, (heads,), device)
        _check_tensor(describe, "B", B, 4, DTYPES, None, device)
        if B.shape[:2] != x.shape[:2] or B.shape[2] < 1 or heads % B.shape[2]:
            raise ValueError(
                f"{describe}: B must be (batch, seqlen_local, groups, state_size) = ({batch}, {length}, G, N) "
                f"with G dividing {heads} heads, got {tuple(B.shape)}"
            )
        _check_tensor(describe, "C", C, 4, DTYPES, tuple(B.shape), device)
        for name, value in (("D", D), ("dt_bias", dt_bias)):
            if value is not None:
                _check_tensor(describe, name, value, 1, DTYPES, (heads,), device)
        _check_chunk_size(describe, chunk_size)
        limit_ok = isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
        if not (limit_ok and all(isinstance(bound, (int, float)) for bound in dt_limit) and dt_limit[0] <= dt_limit[1]):
            raise ValueError(f"{describe}: dt_limit must be (low, high) with low <= high, got {dt_limit!r}")

    agreed = (describe, *_shapes_and_dtypes(x, dt, A, B, C, D, dt_bias), chunk_size, bool(dt_softplus),
              tuple(dt_limit) if isinstance(dt_limit, (tuple, list)) else dt_limit)  # fmt: skip
    runs = SequenceRuns.of(describe, x, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout, seq_lens=seq_lens, varlen=varlen, agreed=agreed,
                           local_checks=local_checks, inputs=(dt, A, B, C, D, dt_bias))  # fmt: skip
    dtype = compute_dtype(x)
    batch, _, heads, head_dim = x.shape
    state_size = B.shape[3]
    x_f, B_f, C_f, A_f = x.to(dtype), B.to(dtype), C.to(dtype), A.to(dtype)
    dt_f = discretised_dt(dt, dt_bias, dt_softplus, dt_limit, dtype)

    zero = x_f.new_zeros((batch, heads, head_dim, state_size))
    y = _scan_runs(runs, functools.partial(ssd_runs_from_zero, x_f, dt_f, A_f, B_f, C_f, chunk_size=chunk_size),
                   functools.partial(ssd_summaries, dt_f, A_f), ssd_next_state,
                   functools.partial(ssd_state_shares, dt_f, A_f, C_f), zero,
                   summary_shape=(batch, heads, 1 + head_dim * state_size), empty=(batch, 0, heads, head_dim),
                   inputs=(x, dt, A, B, C, D, dt_bias), final_states=return_final_states)  # fmt: skip
    y, finals = y if return_final_states else (y, None)
    if D is not None:
        y = y + D.to(dtype)[:, None] * x_f
    y = laid_out(y, x.dtype)
    return (y, finals) if return_final_states else y


def selective_scan(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    layout: str = "contiguous",
    seq_lens: list[int] | None = None,
    varlen=None,
    return_final_states: bool = False,
):
    """Mamba's selective scan (the mixers of Jamba, Mamba, FalconMamba) of a sequence
    sharded across ranks.

    Layouts: the sequence on dim 1, as every op of the package (transformers'
    mamba_selective_scan takes u, delta, z (batch, channels, seqlen) and B, C (batch,
    state_size, seqlen): transpose(1, 2) of these).
    u, delta: (batch, seqlen_local, channels), this rank's rows; A: (channels, state_size);
    B and C: (batch, seqlen_local, state_size); D, delta_bias: (channels,) or None; z:
    (batch, seqlen_local, channels) or None. fp32, fp16, bf16 or fp64, on one device.
    delta is discretised as softplus(delta + delta_bias) (softplus when delta_softplus).
    Per channel d, with the state h (channels, state_size):
        h_t = exp(delta_t A) * h_{t-1} + delta_t u_t B_t,   y_t = h_t C_t + D u_t,
        then y_t * silu(z_t)
    from a zero state at the sequence's (or the document's) start.
    <where>: the module docstring's (group or grid, layout, seq_lens, varlen).
    return_final_states: also return every sequence's final state (sequences, channels,
    state_size) in the compute dtype, on every rank (ssd_scan's).
    Returns (batch, seqlen_local, channels) in u's dtype, computed in fp32 (fp64 for fp64
    u), laid out channels first (transpose(1, 2) contiguous): transformers'
    mamba_selective_scan on the whole sequence, as it returns it. Differentiable in every
    tensor input (each rank's A, D and delta_bias gradients are its rows' share:
    all_reduce_gradients sums them).

    Each run's summary travels: batch x channels x state_size x 2 elements."""
    describe = "selective_scan"

    def local_checks():
        _check_tensor(describe, "u", u, 3, DTYPES)
        batch, length, channels = u.shape
        device = u.device
        _check_tensor(describe, "delta", delta, 3, DTYPES, tuple(u.shape), device)
        _check_tensor(describe, "A", A, 2, DTYPES, None, device)
        if A.shape[0] != channels or A.shape[1] < 1:
            raise ValueError(f"{describe}: A must be (channels, state_size) = ({channels}, N), got {tuple(A.shape)}")
        for name, value in (("B", B), ("C", C)):
            _check_tensor(describe, name, value, 3, DTYPES, (batch, length, A.shape[1]), device)
        for name, value in (("D", D), ("delta_bias", delta_bias)):
            if value is not None:
                _check_tensor(describe, name, value, 1, DTYPES, (channels,), device)
        if z is not None:
            _check_tensor(describe, "z", z, 3, DTYPES, tuple(u.shape), device)

    agreed = (describe, *_shapes_and_dtypes(u, delta, A, B, C, D, z, delta_bias), bool(delta_softplus))
    runs = SequenceRuns.of(describe, u, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout, seq_lens=seq_lens, varlen=varlen, agreed=agreed,
                           local_checks=local_checks, inputs=(delta, A, B, C, D, z, delta_bias))  # fmt: skip
    dtype = compute_dtype(u)
    batch, _, channels = u.shape
    u_f, B_f, C_f, A_f = u.to(dtype), B.to(dtype), C.to(dtype), A.to(dtype)
    delta_f = discretised_dt(delta, delta_bias, delta_softplus, dtype=dtype)

    zero = u_f.new_zeros((batch, channels, A.shape[1]))
    y = _scan_runs(runs, functools.partial(selective_runs_from_zero, u_f, delta_f, A_f, B_f, C_f),
                   functools.partial(selective_summaries, delta_f, A_f), selective_next_state,
                   functools.partial(selective_state_shares, delta_f, A_f, C_f), zero,
                   summary_shape=(batch, channels, 2 * A.shape[1]), empty=(batch, 0, channels),
                   inputs=(u, delta, A, B, C, D, z, delta_bias), final_states=return_final_states)  # fmt: skip
    y, finals = y if return_final_states else (y, None)
    if D is not None:
        y = y + D.to(dtype) * u_f
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = laid_out(y, u.dtype, channels_first=True)
    return (y, finals) if return_final_states else y


def _scan_runs(runs: SequenceRuns, from_zero, summaries, next_state, shares, zero, *, summary_shape, empty,
               inputs, final_states=False):  # fmt: skip
    """The scan of this rank's rows, run by run: every run from a zero state (from_zero(spans)
    -> y, the final states; spans: the runs' (first local row, length)), the runs'
    summaries (summaries(spans, finals): (R, *summary_shape)) gathered from every rank, and
    what the state entering each run adds (next_state composes them from `zero`;
    shares(spans, states) -> y's shape) for the runs that continue a document.
    Returns (batch, seqlen_local, ...) in the compute dtype; `empty` is its shape when
    this rank holds no rows, then still in the graph of `inputs`. final_states: also
    every sequence's state after its last run (SequenceRuns.final_states)."""
    spans = [(run.local_start, run.length) for run in runs.mine]
    if spans:
        out, finals = from_zero(spans)
        per_run = summaries(spans, finals)
    else:  # no rows: an empty output, still in every input's graph (their gradients: empty or zeros)
        out, per_run = zero.new_zeros(empty), zero.new_zeros((0, *summary_shape))
        for tensor in inputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                out = out + tensor.reshape(-1)[:0].sum().to(out.dtype)  # 0 exactly, whatever the values
    gathered = runs.gather(per_run)
    entering = runs.incoming(gathered, next_state, zero)
    continuing = [(span, state) for span, state in zip(spans, entering) if state is not zero]
    if continuing:
        out = out + shares([span for span, _ in continuing], torch.stack([state for _, state in continuing]))
    out = runs.joined(out, gathered)
    return (out, runs.final_states(gathered, next_state, zero)) if final_states else out


def _check_tensor(describe, name, value, dims, dtypes, shape=None, device=None):
    if not isinstance(value, torch.Tensor) or value.dim() != dims or value.dtype not in dtypes:
        got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{describe}: {name} must be a {dims}-D tensor of {dtypes}, got {got}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{describe}: {name} must be {tuple(shape)}, got {tuple(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{describe}: {name} must be on {device}, got {value.device}")


def _check_chunk_size(describe, chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{describe}: chunk_size must be a positive int, got {chunk_size!r}")


def _shapes_and_dtypes(*tensors):
    """What every rank must agree on of the inputs: the shapes past the sequence's dims
    (the batch too), the dtypes, which are None."""
    described = []
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            shape = tuple(tensor.shape)
            described.append((shape[:1] + shape[2:] if tensor.dim() >= 3 else shape, tensor.dtype))
        else:
            described.append(type(tensor).__name__)
    return described
