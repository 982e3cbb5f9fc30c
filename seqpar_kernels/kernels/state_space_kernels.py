"""Triton kernels of the state-space scans' GPU path (the kernels, then their launchers):
Mamba's selective scan over runs of rows, each from its initial state, and its backward;
the pass of Mamba2's SSD scan over its chunks' states, and its backward.

Per batch entry, run r (rows [start, end)), channel d and state n, from h = initial[r]:

    h_t = exp(delta_t[d] A[d, n]) h_{t-1} + delta_t[d] u_t[d] B_t[n],   y_t[d] = sum_n h_t C_t[n]
    final[r] = h after the run's last row

or, without input (u and B not read), h_t = exp(delta_t A) h_{t-1}: the share of the
state entering a run in its outputs.

The method of mamba_ssm's selective scan: a run's rows in chunks of CHUNK tokens; inside
a chunk the recurrence is an associative scan over the tokens (step (a1, b1) then step
(a2, b2) is the step (a1 a2, a2 b1 + b2)), parallel across threads; across chunks the
(BLOCK_D, N) state is carried in registers, and the state entering each chunk is saved
(chunk_states) for the backward. The backward walks the chunks last to first, recomputes
a chunk's states from the saved one and scans the gradient of the state backwards:

    G_t = dy_t[d] C_t[n] + exp(delta_{t+1} A) G_{t+1}        (the gradient of h_t; d_final after the run)
    x_t = G_t exp(delta_t A) h_{t-1} = G_t (h_t - delta_t u_t B_t)       (the gradient of delta_t A)
    du_t = delta_t sum_n G_t B_t        d_delta_t = sum_n (u_t G_t B_t + x_t A)
    dA = sum_t delta_t x_t              dB_t = sum_d G_t delta_t u_t       dC_t = sum_d dy_t h_t
    d_initial[r] = exp(delta_start A) G_start

dB, dC and dA sum over the programs of other channel blocks (and batch entries and runs,
for dA): atomic adds into zeroed tensors, in an unspecified order on a GPU. The adds are
relaxed: nothing reads the sums before the kernel ends, so the default acq_rel ordering
(a fence per add, from up to a thousand programs on one element at 8192 channels and 16
states) buys nothing.

Layouts, contiguous fp32: u, delta, y (B, L, D); A (D, N); B, C (B, L, N); initial, final
(R, B, D, N); chunk_states (B, K, D, N), K the chunks of every run together; runs int32
(R, 3): each run's first row, its end and its first chunk. A program holds one run of one
batch entry and one block of channels (the channels' states evolve independently); its
(CHUNK, BLOCK_D, BLOCK_N) tiles of a chunk's steps are what the launch sizes.

The SSD scan's pass over its chunks, per batch entry and head, from h = initial:

    entering[n] = h;   h <- decay[n] h + chunk_states[n]   (chunk after chunk);   final = h
    backward, from g = d_final, the chunks in reverse:
    d_chunk_states[n] = g;   d_decay[n] = sum(entering[n] g);   g <- d_entering[n] + decay[n] g
    d_initial = g

Layouts, contiguous fp32: chunk_states, entering (B, c, H, S), S = P N the state's
elements; decay (B, H, c); initial, final (B, H, S). A program holds BLOCK elements of
one batch entry's and head's state (they evolve independently); d_decay sums over the
programs of a head: relaxed atomic adds into zeros.

Grid axes 1 and 2 (batch, or batch x heads; runs) are at most MAX_GRID_YZ: a launch
beyond raises ValueError naming the axis (KernelLaunch).
"""

import math

import torch
import triton
import triton.language as tl

from .attention_step_tiles import KernelLaunch

__all__ = ["selective_scan_forward", "selective_scan_backward", "chunk_state_pass_forward", "chunk_state_pass_backward"]

# Elements of a chunk's (CHUNK, BLOCK_D, BLOCK_N) tile: 16 fp32 registers a thread for
# each live tile at 4 warps.
TILE_ELEMENTS = 2048
# Tokens per chunk, fewer where the states are many: a chunk's scan is log2(CHUNK) steps
# deep, and the chunks follow each other.
CHUNK = 16
# The Triton interpreter (CPU tensors): its scans call the combine function once per
# element in Python, so small tiles (CHUNK, TILE_ELEMENTS) keep the tests fast and still
# take several chunks per run and several channel blocks on short sequences.
INTERPRETER_TILE = (4, 32)
# What the launches' grid axes count (the names of KernelLaunch's limit errors).
SCAN_AXES = ("channel blocks", "batch", "runs")
CHUNK_PASS_AXES = ("state blocks", "batch x heads")


@triton.jit
def _linear_recurrence(a_earlier, b_earlier, a_later, b_later):
    # Two steps h -> a h + b, the earlier first, as one.
    return a_earlier * a_later, a_later * b_earlier + b_later


@triton.jit
def _program(runs_ptr, batches, channels, state_size, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    # Grid: (blocks of channels, B, runs). This program's batch entry, its run's rows
    # [start, end) and first chunk, its channel and state indices, and the offsets and
    # mask of its (BLOCK_D, BLOCK_N) tile in a (D, N) tensor, and of its run's state.
    batch = tl.cast(tl.program_id(1), tl.int64)
    run = tl.cast(tl.program_id(2), tl.int64)
    start = tl.load(runs_ptr + 3 * run)
    end = tl.load(runs_ptr + 3 * run + 1)
    first_chunk = tl.load(runs_ptr + 3 * run + 2)
    channel_index = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    state_index = tl.arange(0, BLOCK_N)
    tile = channel_index[:, None] * state_size + state_index[None, :]
    tile_mask = (channel_index < channels)[:, None] & (state_index < state_size)[None, :]
    run_state = (run * batches + batch) * channels * state_size + tile
    return batch, start, end, first_chunk, channel_index, state_index, tile, tile_mask, run_state


@triton.jit
def _chunk(batch, chunk_start, end, channel_index, state_index, length, channels, state_size, CHUNK: tl.constexpr):
    # The chunk of rows from chunk_start: the offsets and masks of its (CHUNK, BLOCK_D)
    # channel tiles and its (CHUNK, BLOCK_N) state tiles (rows past the run's end masked:
    # their delta 0 and input 0 make them steps that keep the state).
    rows = chunk_start + tl.arange(0, CHUNK)
    at_rows = batch * length + rows
    row_mask = rows < end
    by_channel = at_rows[:, None] * channels + channel_index[None, :]
    by_state = at_rows[:, None] * state_size + state_index[None, :]
    channel_tile_mask = row_mask[:, None] & (channel_index < channels)[None, :]
    return by_channel, channel_tile_mask, by_state, row_mask[:, None] & (state_index < state_size)[None, :]


@triton.jit
def _chunk_states(delta, decay, h, u_ptr, B_ptr, by_channel, channel_tile_mask, by_state, state_tile_mask,
                  HAS_INPUT: tl.constexpr):  # fmt: skip
    # The states after each of the chunk's steps (CHUNK, BLOCK_D, BLOCK_N) from h, and
    # the steps' inputs delta u B (0 without input).
    if HAS_INPUT:
        u = tl.load(u_ptr + by_channel, mask=channel_tile_mask, other=0.0)
        B = tl.load(B_ptr + by_state, mask=state_tile_mask, other=0.0)
        inputs = (delta * u)[:, :, None] * B[:, None, :]
        decays, added = tl.associative_scan((decay, inputs), 0, _linear_recurrence)
        return decays * h[None, :, :] + added, inputs, u, B
    else:
        return tl.cumprod(decay, 0) * h[None, :, :], 0.0, 0.0, 0.0


@triton.jit
def selective_scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, initial_ptr, y_ptr, final_ptr, chunk_states_ptr, runs_ptr,
    batches, length, channels, state_size, chunks,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INPUT: tl.constexpr,
    SAVE_STATES: tl.constexpr,
):  # fmt: skip
    batch, start, end, first_chunk, channel_index, state_index, tile, tile_mask, run_state = _program(
        runs_ptr, batches, channels, state_size, BLOCK_D, BLOCK_N
    )
    A = tl.load(A_ptr + tile, mask=tile_mask, other=0.0)
    h = tl.load(initial_ptr + run_state, mask=tile_mask, other=0.0)
    last = (tl.arange(0, CHUNK) == CHUNK - 1)[:, None, None]
    for chunk_start in range(start, end, CHUNK):
        by_channel, channel_tile_mask, by_state, state_tile_mask = _chunk(
            batch, chunk_start, end, channel_index, state_index, length, channels, state_size, CHUNK
        )
        if SAVE_STATES:
            chunk = batch * chunks + first_chunk + (chunk_start - start) // CHUNK
            tl.store(chunk_states_ptr + chunk * channels * state_size + tile, h, mask=tile_mask)
        delta = tl.load(delta_ptr + by_channel, mask=channel_tile_mask, other=0.0)
        decay = tl.exp(delta[:, :, None] * A[None, :, :])
        after, _, _, _ = _chunk_states(delta, decay, h, u_ptr, B_ptr, by_channel, channel_tile_mask, by_state,
                                       state_tile_mask, HAS_INPUT)  # fmt: skip
        C = tl.load(C_ptr + by_state, mask=state_tile_mask, other=0.0)
        tl.store(y_ptr + by_channel, tl.sum(after * C[:, None, :], 2), mask=channel_tile_mask)
        h = tl.sum(tl.where(last, after, 0.0), 0)
    tl.store(final_ptr + run_state, h, mask=tile_mask)


@triton.jit
def selective_scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, chunk_states_ptr, dy_ptr, d_final_ptr,
    du_ptr, d_delta_ptr, dA_ptr, dB_ptr, dC_ptr, d_initial_ptr, runs_ptr,
    batches, length, channels, state_size, chunks,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INPUT: tl.constexpr,
):  # fmt: skip
    batch, start, end, first_chunk, channel_index, state_index, tile, tile_mask, run_state = _program(
        runs_ptr, batches, channels, state_size, BLOCK_D, BLOCK_N
    )
    A = tl.load(A_ptr + tile, mask=tile_mask, other=0.0)
    # The gradient of the state after the chunk's last row, from the rows after the chunk;
    # d_states: of the state after each of the chunk's rows.
    d_state = tl.load(d_final_ptr + run_state, mask=tile_mask, other=0.0)
    dA = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    positions = tl.arange(0, CHUNK)
    first = (positions == 0)[:, None, None]
    count = tl.cdiv(end - start, CHUNK)
    for step in range(0, count):  # the run's chunks last to first
        index = count - 1 - step
        chunk_start = start + index * CHUNK
        by_channel, channel_tile_mask, by_state, state_tile_mask = _chunk(
            batch, chunk_start, end, channel_index, state_index, length, channels, state_size, CHUNK
        )
        chunk = batch * chunks + first_chunk + index
        h = tl.load(chunk_states_ptr + chunk * channels * state_size + tile, mask=tile_mask, other=0.0)
        delta = tl.load(delta_ptr + by_channel, mask=channel_tile_mask, other=0.0)
        decay = tl.exp(delta[:, :, None] * A[None, :, :])
        after, inputs, u, B = _chunk_states(delta, decay, h, u_ptr, B_ptr, by_channel, channel_tile_mask, by_state,
                                            state_tile_mask, HAS_INPUT)  # fmt: skip
        # Each row's next decay inside the chunk (1 for its last row: d_state holds what follows).
        next_rows = (positions < CHUNK - 1) & (chunk_start + positions + 1 < end)
        next_delta = tl.load(delta_ptr + by_channel + channels, mask=channel_tile_mask & next_rows[:, None], other=0.0)
        next_decay = tl.exp(next_delta[:, :, None] * A[None, :, :])
        dy = tl.load(dy_ptr + by_channel, mask=channel_tile_mask, other=0.0)
        C = tl.load(C_ptr + by_state, mask=state_tile_mask, other=0.0)
        onward, read_out = tl.associative_scan((next_decay, dy[:, :, None] * C[:, None, :]), 0, _linear_recurrence,
                                               reverse=True)  # fmt: skip
        d_states = read_out + onward * d_state[None, :, :]
        d_exponent = d_states * (after - inputs)
        d_delta = tl.sum(d_exponent * A[None, :, :], 2)
        if HAS_INPUT:
            read_B = tl.sum(d_states * B[:, None, :], 2)
            tl.store(du_ptr + by_channel, delta * read_B, mask=channel_tile_mask)
            d_delta += u * read_B
            tl.atomic_add(
                dB_ptr + by_state, tl.sum(d_states * (delta * u)[:, :, None], 1), mask=state_tile_mask, sem="relaxed"
            )
        tl.store(d_delta_ptr + by_channel, d_delta, mask=channel_tile_mask)
        tl.atomic_add(dC_ptr + by_state, tl.sum(dy[:, :, None] * after, 1), mask=state_tile_mask, sem="relaxed")
        dA += tl.sum(d_exponent * delta[:, :, None], 0)
        d_state = tl.sum(tl.where(first, decay * d_states, 0.0), 0)
    tl.store(d_initial_ptr + run_state, d_state, mask=tile_mask)
    tl.atomic_add(dA_ptr + tile, dA, mask=tile_mask, sem="relaxed")


@triton.jit
def _chunk_pass_program(heads, size, BLOCK: tl.constexpr):
    # Grid: (blocks of S, B * H). This program's batch entry, head, and elements of the
    # state with their mask.
    batch_head = tl.cast(tl.program_id(1), tl.int64)
    elements = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return batch_head, batch_head // heads, batch_head % heads, elements, elements < size


@triton.jit
def chunk_state_pass_fwd_kernel(chunk_states_ptr, decay_ptr, initial_ptr, entering_ptr, final_ptr, heads, chunks, size,
                                BLOCK: tl.constexpr):  # fmt: skip
    batch_head, batch, head, elements, mask = _chunk_pass_program(heads, size, BLOCK)
    h = tl.load(initial_ptr + batch_head * size + elements, mask=mask, other=0.0)
    for n in range(0, chunks):
        at = ((batch * chunks + n) * heads + head) * size + elements
        tl.store(entering_ptr + at, h, mask=mask)
        chunk_state = tl.load(chunk_states_ptr + at, mask=mask, other=0.0)
        h = tl.load(decay_ptr + batch_head * chunks + n) * h + chunk_state
    tl.store(final_ptr + batch_head * size + elements, h, mask=mask)


@triton.jit
def chunk_state_pass_bwd_kernel(decay_ptr, entering_ptr, d_entering_ptr, d_final_ptr, d_chunk_states_ptr, d_decay_ptr,
                                d_initial_ptr, heads, chunks, size, BLOCK: tl.constexpr):  # fmt: skip
    batch_head, batch, head, elements, mask = _chunk_pass_program(heads, size, BLOCK)
    # The gradient of the state after the chunk (after the last: d_final).
    d_state = tl.load(d_final_ptr + batch_head * size + elements, mask=mask, other=0.0)
    for step in range(0, chunks):  # the chunks last to first
        n = chunks - 1 - step
        at = ((batch * chunks + n) * heads + head) * size + elements
        tl.store(d_chunk_states_ptr + at, d_state, mask=mask)
        entering = tl.load(entering_ptr + at, mask=mask, other=0.0)
        tl.atomic_add(d_decay_ptr + batch_head * chunks + n, tl.sum(entering * d_state, 0), sem="relaxed")
        d_entering = tl.load(d_entering_ptr + at, mask=mask, other=0.0)
        d_state = d_entering + tl.load(decay_ptr + batch_head * chunks + n) * d_state
    tl.store(d_initial_ptr + batch_head * size + elements, d_state, mask=mask)


def launch_of(kernel, channels: int, state_size: int, has_input: bool, save_states: bool = True,
              interpreted: bool = False) -> KernelLaunch:  # fmt: skip
    """How `kernel` (either pass) is launched: every state of a channel in one program
    (BLOCK_N, the states padded to a power of two), CHUNK tokens (fewer from 256 states)
    and as many channels as fill TILE_ELEMENTS, 4 warps, which sm_80 and sm_90 compile
    without spilling registers (tests/test_state_space_kernels.py); INTERPRETER_TILE's
    sizes when interpreted."""
    most_tokens, elements = INTERPRETER_TILE if interpreted else (CHUNK, TILE_ELEMENTS)
    block_n = triton.next_power_of_2(state_size)
    chunk = max(1, min(most_tokens, elements // block_n))
    block_d = max(1, min(triton.next_power_of_2(channels), elements // (chunk * block_n)))
    constexprs = dict(CHUNK=chunk, BLOCK_D=block_d, BLOCK_N=block_n, HAS_INPUT=has_input)
    if kernel is selective_scan_fwd_kernel:
        constexprs["SAVE_STATES"] = save_states
    return KernelLaunch(kernel, constexprs, num_warps=4, num_stages=1)


def run_table(spans, chunk: int, device) -> tuple[torch.Tensor, int]:
    """The kernels' runs (R, 3) int32 (first row, end, first chunk) of spans ((first row,
    length) each), and the chunks of every run together."""
    rows, chunks = [], 0
    for start, length in spans:
        rows.append((start, start + length, chunks))
        chunks += triton.cdiv(length, chunk)
    return torch.tensor(rows, dtype=torch.int32, device=device).view(-1, 3), chunks


def selective_scan_forward(u, delta, A, B, C, initial, spans, save_states: bool):
    """The forward pass (module docstring) over the runs of spans ((first row, length)
    each, in any order, not overlapping); u and B None: without input. Returns y (B, L, D)
    (zeros in rows of no run), final (R, B, D, N) and the states entering every chunk
    (B, K, D, N) (K 0 unless save_states), fp32."""
    has_input = u is not None
    delta, A, C, initial = (x.contiguous() for x in (delta, A, C, initial))
    u, B = (u.contiguous(), B.contiguous()) if has_input else (delta, C)  # not read without input
    batch, length, channels = delta.shape
    state_size = A.shape[1]
    launch = launch_of(selective_scan_fwd_kernel, channels, state_size, has_input, save_states, not delta.is_cuda)
    table, chunks = run_table(spans, launch.constexprs["CHUNK"], delta.device)
    y = delta.new_zeros(batch, length, channels)
    final = torch.empty_like(initial)
    chunk_states = delta.new_empty(batch, chunks if save_states else 0, channels, state_size)
    grid = (triton.cdiv(channels, launch.constexprs["BLOCK_D"]), batch, len(spans))
    if min(grid) > 0:
        launch(grid, u, delta, A, B, C, initial, y, final, chunk_states, table, batch, length, channels, state_size,
               chunks, axes=SCAN_AXES)  # fmt: skip
    return y, final, chunk_states


def selective_scan_backward(u, delta, A, B, C, chunk_states, dy, d_final, spans):
    """The backward pass (module docstring) of selective_scan_forward's, from the
    gradients of y (B, L, D) and final (R, B, D, N). Returns (du, d_delta, dA, dB, dC,
    d_initial), fp32; du and dB None without input."""
    has_input = u is not None
    delta, A, C, chunk_states, dy, d_final = (x.contiguous() for x in (delta, A, C, chunk_states, dy, d_final))
    u, B = (u.contiguous(), B.contiguous()) if has_input else (delta, C)
    batch, length, channels = delta.shape
    state_size = A.shape[1]
    launch = launch_of(selective_scan_bwd_kernel, channels, state_size, has_input, interpreted=not delta.is_cuda)
    table, chunks = run_table(spans, launch.constexprs["CHUNK"], delta.device)
    # Zeros: rows of no run keep them, and dA, dB and dC are sums of the programs' adds.
    d_delta, dA, dC = torch.zeros_like(delta), torch.zeros_like(A), torch.zeros_like(C)
    du, dB = (torch.zeros_like(u), torch.zeros_like(B)) if has_input else (None, None)
    d_initial = torch.empty_like(d_final)
    grid = (triton.cdiv(channels, launch.constexprs["BLOCK_D"]), batch, len(spans))
    if min(grid) > 0:
        launch(grid, u, delta, A, B, C, chunk_states, dy, d_final, d_delta if du is None else du, d_delta, dA,
               dC if dB is None else dB, dC, d_initial, table, batch, length, channels, state_size, chunks,
               axes=SCAN_AXES)  # fmt: skip
    return du, d_delta, dA, dB, dC, d_initial


def chunk_pass_launch_of(kernel, size: int, interpreted: bool = False) -> KernelLaunch:
    """How `kernel` (either pass over the SSD chunks' states) is launched: blocks of 1024
    of a state's S elements (8 a thread at 4 warps; INTERPRETER_TILE's elements when
    interpreted, several blocks on the tests' small states)."""
    block = min(INTERPRETER_TILE[1] if interpreted else 1024, triton.next_power_of_2(size))
    return KernelLaunch(kernel, dict(BLOCK=block), num_warps=4, num_stages=1)


def chunk_state_pass_forward(chunk_states, decay, initial):
    """The SSD chunks' forward pass (module docstring): chunk_states (B, c, H, P, N),
    decay (B, H, c), initial (B, H, P, N). Returns (entering (B, c, H, P, N), final (B, H,
    P, N)), fp32."""
    chunk_states, decay, initial = (x.contiguous() for x in (chunk_states, decay, initial))
    batch, chunks, heads = chunk_states.shape[:3]
    size = math.prod(initial.shape[2:])
    entering, final = torch.empty_like(chunk_states), torch.empty_like(initial)
    launch = chunk_pass_launch_of(chunk_state_pass_fwd_kernel, size, not decay.is_cuda)
    grid = (triton.cdiv(size, launch.constexprs["BLOCK"]), batch * heads)
    if min(grid) > 0:
        launch(grid, chunk_states, decay, initial, entering, final, heads, chunks, size, axes=CHUNK_PASS_AXES)
    return entering, final


def chunk_state_pass_backward(decay, entering, d_entering, d_final):
    """The SSD chunks' backward pass (module docstring) from forward's decay and entering
    and the gradients of entering and final. Returns (d_chunk_states (B, c, H, P, N),
    d_decay (B, H, c), d_initial (B, H, P, N)), fp32."""
    decay, entering, d_entering, d_final = (x.contiguous() for x in (decay, entering, d_entering, d_final))
    batch, chunks, heads = entering.shape[:3]
    size = math.prod(d_final.shape[2:])
    d_chunk_states, d_initial = torch.empty_like(entering), torch.empty_like(d_final)
    d_decay = torch.zeros_like(decay)  # the sum of every block's add
    launch = chunk_pass_launch_of(chunk_state_pass_bwd_kernel, size, not decay.is_cuda)
    grid = (triton.cdiv(size, launch.constexprs["BLOCK"]), batch * heads)
    if min(grid) > 0:
        launch(
            grid,
            decay,
            entering,
            d_entering,
            d_final,
            d_chunk_states,
            d_decay,
            d_initial,
            heads,
            chunks,
            size,
            axes=CHUNK_PASS_AXES,
        )
    return d_chunk_states, d_decay, d_initial
