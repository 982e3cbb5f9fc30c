"""The state-space scans of hybrid models' mixers over one rank's runs of the sequence:
Mamba2's SSD scan (a scalar decay per head) and Mamba's selective scan (a decay per
channel and state). Each run is scanned from a zero state, summarised by its transition
and its final state, and corrected by the state entering it (from the runs before it,
on other ranks too: parallel/state_space.py).

Both scans are affine in the state entering a run: with log_decay_t the run's summed
log-decay from its first token through token t,

    state_t = exp(log_decay_t) * state_in + state_t(from zero)
    y_t     = y_t(from zero) + readout_t(exp(log_decay_t) * state_in)

so a run's summary is (exp(log_decay_last), final state from zero), and the state after
it is next_state(state_in) = exp(log_decay_last) * state_in + final. The runs of a rank's
rows are given as spans, (first row, length) each: `*_runs_from_zero` scans them,
`*_state_shares` gives what the states entering them add (the scan without input from
those states), `*_summaries` what the ranks after them need.

Layouts (sequence on dim 1; a run's rows narrowed from it; the compute dtype: fp32, fp64
for fp64 inputs):
    SSD        x (B, L, H, P), dt (B, L, H) (discretised), A (H,), B and C (B, L, G, N),
               G dividing H (head h reads group h // (H / G)); the state (B, H, P, N)
               h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,  y_t = h_t C_t
    selective  u (B, L, D), delta (B, L, D) (discretised), A (D, N), B and C (B, L, N);
               the state (B, D, N)
               h_t = exp(delta_t A) * h_{t-1} + delta_t u_t B_t,  y_t = h_t C_t
Everything is differentiable. The SSD scan is chunked torch einsums, batched over the
chunks; on CUDA the pass of the state from chunk to chunk runs in Triton kernels. The
selective scan is a torch recurrence on CPU and, on CUDA, Triton kernels. The kernels
are kernels/state_space_kernels.py's, forward and backward, in autograd.Functions.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from seqpar_kernels.engine.kernel_backend import chosen_backend

# The Triton kernels hold a chunk's (tokens, channels, states) tile in registers.
TRITON_MAX_STATE_SIZE = 256


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 inside, fp64 for fp64 inputs (references)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def discretised_dt(dt: torch.Tensor, bias, softplus: bool, limit=None, dtype=torch.float32) -> torch.Tensor:
    """dt + bias (bias broadcast over the last dim), softplus, clamped to limit (low, high)
    when given; in `dtype` (B, L, H) -> (B, L, H)."""
    dt = dt.to(dtype)
    if bias is not None:
        dt = dt + bias.to(dtype)
    if softplus:
        dt = F.softplus(dt)
    if limit is not None:
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): [i, j] = a[j + 1] + ... + a[i] for j <= i (the log-decay
    from token j to token i), -inf above the diagonal. Summed from masked copies, not
    as a difference of prefix sums, which would cancel."""
    length = a.shape[-1]
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., :, None].expand(*a.shape, length).masked_fill(~below, 0).cumsum(-2)
    return sums.masked_fill(~below.logical_or(torch.eye(length, dtype=torch.bool, device=a.device)), -math.inf)


def _chunked(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, L, ...) -> (B, ceil(L / chunk), chunk, ...), zeros after the last token."""
    pad = -t.shape[1] % chunk
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.view(t.shape[0], t.shape[1] // chunk, chunk, *t.shape[2:])


def ssd_from_zero(x, dt, A, B, C, chunk_size: int, backend: str = "auto"):
    """One run of the SSD scan from a zero state, chunk_size tokens at a time (the
    chunked form of transformers' mamba2_chunk_scan: within a chunk as masked attention,
    across chunks by the chunks' states). Inputs in the compute dtype, dt discretised.
    Returns y (B, L, H, P) and the final state (B, H, P, N). backend: what passes the
    state from chunk to chunk (states_entering_chunks)."""
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2:]
    if length == 0:
        return x.new_zeros(x.shape), x.new_zeros(batch, heads, head_dim, state_size)
    per_group = heads // groups
    chunk = min(chunk_size, length)
    count = -(-length // chunk)
    a = dt * A
    x_dt = _chunked(x * dt[..., None], chunk).view(batch, count, chunk, groups, per_group, head_dim)
    B_chunks, C_chunks = _chunked(B, chunk), _chunked(C, chunk)  # (B, c, l, G, N)
    # Zeros after the last token: decay 1 and no input, so the last chunk's state is the run's.
    a_chunks = _chunked(a, chunk).permute(0, 3, 1, 2)  # (B, H, c, l)
    cum = a_chunks.cumsum(-1)

    # Within each chunk: y_l = sum_{s <= l} exp(a[s+1..l]) (C_l . B_s) dt_s x_s.
    within = torch.exp(_segment_sums(a_chunks)).view(batch, groups, per_group, count, chunk, chunk)
    scores = torch.einsum("bclgn,bcsgn->bgcls", C_chunks, B_chunks)
    y_diag = torch.einsum("bgrcls,bcsgrp->bclgrp", scores.unsqueeze(2) * within, x_dt)

    # Each chunk's own final state, then the state entering every chunk (and leaving the last).
    to_end = torch.exp(cum[..., -1:] - cum).view(batch, groups, per_group, count, chunk)
    chunk_states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", B_chunks, to_end, x_dt)
    chunk_states = chunk_states.reshape(batch, count, heads, head_dim, state_size)
    entering, final = states_entering_chunks(chunk_states, cum[..., -1], backend)

    # Across chunks: y_l += exp(cum_l) C_l . (state entering the chunk).
    starts = entering.view(batch, count, groups, per_group, head_dim, state_size)
    from_start = torch.exp(cum).view(batch, groups, per_group, count, chunk)
    y_off = torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", C_chunks, starts, from_start)
    y = (y_diag + y_off).reshape(batch, count * chunk, heads, head_dim)[:, :length]
    return y, final


def states_entering_chunks(chunk_states: torch.Tensor, log_decays: torch.Tensor, backend: str = "auto"):
    """From a zero state, chunk after chunk, h <- exp(log_decays[n]) h + chunk_states[n]:
    the state entering each chunk (B, c, H, P, N) and the state after the last (B, H, P,
    N). chunk_states (B, c, H, P, N), log_decays (B, H, c).

    torch: as a matrix product per head, the (c + 1) x (c + 1) decays between chunks
    times the chunks' states (batched, no loop); "triton" (the default on CUDA fp32):
    the kernels' pass, chunk after chunk. The product's work grows with the square of the
    chunk count, the pass's with the count (a read of the chunks' states and a write of
    the entering ones, as the product's): at the default chunk of 256 tokens, 64 heads
    of 64 x 128 states, the product is c / 1000 of the scan's other work (c = 32 at 8k
    tokens a rank: 3%; c = 512 at 128k: half), which the pass saves for c dependent
    steps (a load each: about a microsecond, estimated)."""
    batch, count, heads = chunk_states.shape[:3]
    if _backend(backend, chunk_states) == "triton":
        initial = chunk_states.new_zeros(batch, *chunk_states.shape[2:])
        return _ChunkStatePass.apply(chunk_states, torch.exp(log_decays), initial)
    chunk_states = torch.cat([torch.zeros_like(chunk_states[:, :1]), chunk_states], dim=1)
    between = torch.exp(_segment_sums(F.pad(log_decays, (1, 0))))  # (B, H, c + 1, c + 1)
    entering = torch.einsum("bhij,bjhpn->bihpn", between, chunk_states)
    return entering[:, :count], entering[:, count]


def ssd_from_state(log_decay: torch.Tensor, C: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """What the state entering a run adds to its SSD output: exp(log_decay_t) C_t . state.
    log_decay (B, L, H), C (B, L, G, N), state (B, H, P, N) -> (B, L, H, P)."""
    batch, length, heads = log_decay.shape
    groups = C.shape[2]
    per_group = heads // groups
    grouped = state.view(batch, groups, per_group, *state.shape[2:])
    readout = torch.einsum("blgn,bgrpn->blgrp", C, grouped).reshape(batch, length, heads, -1)
    return readout * torch.exp(log_decay)[..., None]


def ssd_summaries(dt: torch.Tensor, A: torch.Tensor, spans, finals: torch.Tensor) -> torch.Tensor:
    """(R, B, H, 1 + P N): each run's decay exp(sum of dt A over its rows) (B, H), then its
    final state from zero (R, B, H, P, N) flattened."""
    decays = torch.stack([torch.exp((dt.narrow(1, start, length) * A).sum(1)) for start, length in spans])
    return torch.cat([decays[..., None], finals.flatten(3)], dim=-1)


def ssd_next_state(state: torch.Tensor, summary: torch.Tensor, run=None) -> torch.Tensor:
    """The state after a run from the state before it (B, H, P, N) and the run's summary."""
    decay, final = summary[..., 0], summary[..., 1:].view(state.shape)
    return decay[..., None, None] * state + final


def selective_from_zero(u, delta, A, B, C, chunk_size: int | None = None):
    """One run of the selective scan from a zero state: the recurrence itself, in chunks
    of chunk_size tokens (default about sqrt(L)) run side by side, then the chunks' states
    carried from chunk to chunk (L / chunk + chunk steps of (B, D, N) multiply-adds, not L;
    no exponent of a long sum, so nothing overflows). Inputs in the compute dtype, delta
    discretised. Returns y (B, L, D) and the final state (B, D, N)."""
    batch, length, channels = u.shape
    if length == 0:
        return u.new_zeros(u.shape), u.new_zeros(batch, channels, A.shape[1])
    chunk = chunk_size or max(1, math.isqrt(length))
    chunk = min(chunk, length)
    count = -(-length // chunk)
    a = delta[..., None] * A  # (B, L, D, N)
    inputs = (delta * u)[..., None] * B[:, :, None, :]
    # Zeros after the last token: decay 1 and no input, so the last chunk's state is the run's.
    a_chunks, input_chunks = _chunked(a, chunk), _chunked(inputs, chunk)  # (B, c, l, D, N)
    decays = torch.exp(a_chunks)
    state = torch.zeros_like(input_chunks[:, :, 0])
    local = []
    for step in range(chunk):  # every chunk from a zero state at once
        state = decays[:, :, step] * state + input_chunks[:, :, step]
        local.append(state)
    local = torch.stack(local, dim=2)  # (B, c, l, D, N)
    chunk_decays = torch.exp(a_chunks.sum(2))  # (B, c, D, N)
    carried = [torch.zeros_like(local[:, 0, 0])]
    for index in range(count - 1):
        carried.append(chunk_decays[:, index] * carried[-1] + local[:, index, -1])
    entering = torch.stack(carried, dim=1)  # (B, c, D, N)
    states = local + torch.exp(a_chunks.cumsum(2)) * entering[:, :, None]
    final = chunk_decays[:, -1] * entering[:, -1] + local[:, -1, -1]
    states = states.reshape(batch, count * chunk, channels, -1)[:, :length]
    y = torch.einsum("bldn,bln->bld", states, C)
    return y, final


def selective_from_state(log_decay: torch.Tensor, C: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """What the state entering a run adds to its selective-scan output:
    sum_n C_t[n] exp(log_decay_t[d, n]) state[d, n]. log_decay (B, L, D, N), C (B, L, N),
    state (B, D, N) -> (B, L, D)."""
    return torch.einsum("bldn,bdn,bln->bld", torch.exp(log_decay), state, C)


def selective_summaries(delta: torch.Tensor, A: torch.Tensor, spans, finals: torch.Tensor) -> torch.Tensor:
    """(R, B, D, 2 N): each run's decay exp(A sum of delta over its rows) (B, D, N), then
    its final state from zero (R, B, D, N)."""
    decays = torch.stack([torch.exp(delta.narrow(1, start, length).sum(1)[..., None] * A) for start, length in spans])
    return torch.cat([decays, finals], dim=-1)


def selective_next_state(state: torch.Tensor, summary: torch.Tensor, run=None) -> torch.Tensor:
    """The state after a run from the state before it (B, D, N) and the run's summary."""
    decay, final = summary.split(state.shape[-1], dim=-1)
    return decay * state + final


def ssd_runs_from_zero(x, dt, A, B, C, spans, chunk_size: int):
    """The SSD scan of each run of spans ((first row, length) each, in row order, one at
    least) from a zero state (ssd_from_zero's inputs, over every row). Returns y (B, L, H,
    P), zeros in rows of no run, and the final states (R, B, H, P, N)."""
    scans = [ssd_from_zero(*(t.narrow(1, start, length) for t in (x, dt)), A,
                           *(t.narrow(1, start, length) for t in (B, C)), chunk_size)
             for start, length in spans]  # fmt: skip
    return _placed([y for y, _ in scans], spans, x.shape), torch.stack([final for _, final in scans])


def ssd_state_shares(dt, A, C, spans, states: torch.Tensor) -> torch.Tensor:
    """What the states (R, B, H, P, N) entering the runs of spans add to their SSD
    outputs (ssd_from_state of each): (B, L, H, P), zeros in rows of no run."""
    shares = [ssd_from_state((dt.narrow(1, start, length) * A).cumsum(1), C.narrow(1, start, length), state)
              for (start, length), state in zip(spans, states)]  # fmt: skip
    return _placed(shares, spans, (*dt.shape, states.shape[3]))


def selective_runs_from_zero(u, delta, A, B, C, spans, backend: str = "auto"):
    """The selective scan of each run of spans ((first row, length) each, in row order,
    one at least) from a zero state (selective_from_zero's inputs, over every row).
    Returns y (B, L, D), zeros in rows of no run, and the final states (R, B, D, N).
    backend: "triton" (the kernels), "torch" (selective_from_zero run by run) or "auto"
    (Triton on CUDA fp32 with up to TRITON_MAX_STATE_SIZE states)."""
    if _backend(backend, delta, A.shape[1]) == "triton":
        initial = delta.new_zeros(len(spans), delta.shape[0], *A.shape)
        return _SelectiveScanKernels.apply(u, delta, A, B, C, initial, tuple(spans))
    scans = [selective_from_zero(*(t.narrow(1, start, length) for t in (u, delta)), A,
                                 *(t.narrow(1, start, length) for t in (B, C)))
             for start, length in spans]  # fmt: skip
    return _placed([y for y, _ in scans], spans, u.shape), torch.stack([final for _, final in scans])


def selective_state_shares(delta, A, C, spans, states: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """What the states (R, B, D, N) entering the runs of spans add to their selective-scan
    outputs (selective_from_state of each; the Triton kernels scan without input from
    them): (B, L, D), zeros in rows of no run."""
    if _backend(backend, delta, A.shape[1]) == "triton":
        return _SelectiveScanKernels.apply(None, delta, A, None, C, states, tuple(spans))[0]
    shares = [selective_from_state((delta.narrow(1, start, length)[..., None] * A).cumsum(1),
                                   C.narrow(1, start, length), state)
              for (start, length), state in zip(spans, states)]  # fmt: skip
    return _placed(shares, spans, delta.shape)


def _placed(pieces, spans, shape) -> torch.Tensor:
    """The runs' rows (each (B, length, ...), one run at least) at their spans of a tensor
    of `shape` (B, L, ...), zeros between them."""
    parts, row = [], 0
    for piece, (start, length) in zip(pieces, spans):
        if start > row:
            parts.append(piece.new_zeros(piece.shape[0], start - row, *piece.shape[2:]))
        parts.append(piece)
        row = start + length
    if row < shape[1]:
        parts.append(pieces[0].new_zeros(shape[0], shape[1] - row, *shape[2:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _backend(backend: str, x: torch.Tensor, state_size: int = 0) -> str:
    # state_size: the states of a channel the selective scan's kernels hold in registers.
    fits = x.is_cuda and x.dtype == torch.float32 and state_size <= TRITON_MAX_STATE_SIZE
    return chosen_backend(backend, fits)


class _SelectiveScanKernels(torch.autograd.Function):
    """The Triton kernels' scan of runs from their initial states: (u, delta, A, B, C,
    initial (R, B, D, N), spans) -> (y (B, L, D), final (R, B, D, N)); u and B None:
    without input. The backward reads the states entering every chunk, saved by the
    forward (R x L / CHUNK x B x D x N fp32)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, initial, spans):
        from seqpar_kernels.kernels import state_space_kernels

        y, final, chunk_states = state_space_kernels.selective_scan_forward(
            u, delta, A, B, C, initial, spans, save_states=any(ctx.needs_input_grad)
        )
        ctx.save_for_backward(u, delta, A, B, C, chunk_states)
        ctx.spans = spans
        return y, final

    @staticmethod
    def backward(ctx, dy, d_final):
        from seqpar_kernels.kernels import state_space_kernels

        grads = state_space_kernels.selective_scan_backward(*ctx.saved_tensors, dy, d_final, ctx.spans)
        return *grads, None


class _ChunkStatePass(torch.autograd.Function):
    """The Triton kernels' pass over the SSD chunks' states from an initial state:
    (chunk_states (B, c, H, P, N), decays (B, H, c), initial (B, H, P, N)) -> (entering
    (B, c, H, P, N), final (B, H, P, N))."""

    @staticmethod
    def forward(ctx, chunk_states, decays, initial):
        from seqpar_kernels.kernels import state_space_kernels

        entering, final = state_space_kernels.chunk_state_pass_forward(chunk_states, decays, initial)
        ctx.save_for_backward(decays, entering)
        return entering, final

    @staticmethod
    def backward(ctx, d_entering, d_final):
        from seqpar_kernels.kernels import state_space_kernels

        return state_space_kernels.chunk_state_pass_backward(*ctx.saved_tensors, d_entering, d_final)
