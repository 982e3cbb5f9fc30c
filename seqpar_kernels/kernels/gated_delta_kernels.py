"""Triton kernels of the gated delta rule's sequential part (the kernels, then their
launchers): the pass over the chunks of each run, from its initial state, and its
backward. The parallel parts (the UT transform, the outputs, the reductions over
chunks) are batched matmuls the caller runs (seqpar_kernels/engine/gated_delta.py).

Per batch entry and head, run r's chunks n in [chunk_offsets[r], chunk_offsets[r + 1]),
from h = initial[r]:

    forward     states[n] = h
                new_values[n] = u[n] - w[n] h                            (C, dv)
                h <- decay[n] h + k_decayed[n]^T new_values[n]           (dk, dv)
                final[r] = h
    backward    from dh = d_final[r], the chunks in reverse:
                d_after[n] = dh                     (the gradient of the state after chunk n)
                d_values[n] = d_new_values[n] + k_decayed[n] dh
                dh <- d_states[n] + decay[n] dh - w[n]^T d_values[n]
                d_initial[r] = dh

Layouts, contiguous fp32: w, k_decayed (B, H, N, C, dk); u, new_values, d_values
(B, H, N, C, dv); decay (B, H, N); states, d_after (B, H, N, dk, dv); initial, final
(R, B, H, dk, dv); chunk_offsets int32 (R + 1,). Each program holds one run's state for
one batch entry, head and block of dv columns in registers (the columns of the state
evolve independently: w, k_decayed and decay are shared by all), and walks its chunks.
The products are TF32 on the GPU (Triton's default for fp32, as flash-linear-attention's
kernels; the state and the sums stay fp32): fp32 products ("ieee") are lowered to FMA
loops that spill registers on sm_90 at dk 64 to 256, "tf32x3" spills at dk 128. TF32
rounds each operand to 2^-11 relative, well under the bf16 output's 2^-8; the torch
backend of engine/gated_delta.py computes the products in fp32. (The interpreter computes
them in fp32.)
"""

import torch
import triton
import triton.language as tl

from .attention_step_tiles import KernelLaunch

__all__ = ["chunk_states_forward", "chunk_states_backward"]

DOT_PRECISION = "tf32"


@triton.jit
def _program(chunk_offsets_ptr, batch_heads, key_dim, value_dim, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_V: tl.constexpr):  # fmt: skip
    # Grid: (blocks of dv, B * H, runs). This program's batch entry and head, its run's
    # chunks [first, end), the offsets of its run's state tile (dk, BLOCK_V), and the
    # offsets and masks of its state tile, of a chunk's (C, dk) key-side tile and of its
    # (C, BLOCK_V) value-side tile.
    head = tl.cast(tl.program_id(1), tl.int64)
    run = tl.cast(tl.program_id(2), tl.int64)
    first = tl.load(chunk_offsets_ptr + run)
    end = tl.load(chunk_offsets_ptr + run + 1)
    keys = tl.arange(0, BLOCK_K)
    columns = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    positions = tl.arange(0, CHUNK)
    key_mask = keys < key_dim
    column_mask = columns < value_dim
    state = keys[:, None] * value_dim + columns[None, :]
    state_mask = key_mask[:, None] & column_mask[None, :]
    key_side = positions[:, None] * key_dim + keys[None, :]
    value_side = positions[:, None] * value_dim + columns[None, :]
    run_state = (run * batch_heads + head) * key_dim * value_dim + state
    return head, first, end, run_state, state, state_mask, key_side, key_mask[None, :], value_side, column_mask[None, :]


@triton.jit
def _chunk_bases(head, n, chunks, key_dim, value_dim, CHUNK: tl.constexpr):
    # Where chunk n of this batch entry and head starts in a state tensor (B, H, N, dk,
    # dv), a key-side one (B, H, N, C, dk) and a value-side one (B, H, N, C, dv), in 64
    # bits (tl.cast: in the interpreter a loop index is a Python int).
    chunk = head * chunks + tl.cast(n, tl.int64)
    return chunk * key_dim * value_dim, chunk * CHUNK * key_dim, chunk * CHUNK * value_dim, chunk


@triton.jit
def chunk_states_fwd_kernel(
    w_ptr, u_ptr, k_decayed_ptr, decay_ptr, initial_ptr, states_ptr, new_values_ptr, final_ptr, chunk_offsets_ptr,
    batch_heads, chunks, key_dim, value_dim,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head, first, end, run_state, state, state_mask, key_side, key_mask, value_side, value_mask = _program(
        chunk_offsets_ptr, batch_heads, key_dim, value_dim, CHUNK, BLOCK_K, BLOCK_V
    )
    h = tl.load(initial_ptr + run_state, mask=state_mask, other=0.0)
    for n in range(first, end):
        at_state, at_keys, at_values, chunk = _chunk_bases(head, n, chunks, key_dim, value_dim, CHUNK)
        tl.store(states_ptr + at_state + state, h, mask=state_mask)
        w = tl.load(w_ptr + at_keys + key_side, mask=key_mask, other=0.0)
        u = tl.load(u_ptr + at_values + value_side, mask=value_mask, other=0.0)
        values = u - tl.dot(w, h, input_precision=DOT_PRECISION)
        tl.store(new_values_ptr + at_values + value_side, values, mask=value_mask)
        k_decayed = tl.load(k_decayed_ptr + at_keys + key_side, mask=key_mask, other=0.0)
        h = h * tl.load(decay_ptr + chunk) + tl.dot(tl.trans(k_decayed), values, input_precision=DOT_PRECISION)
    tl.store(final_ptr + run_state, h, mask=state_mask)


@triton.jit
def chunk_states_bwd_kernel(
    w_ptr, k_decayed_ptr, decay_ptr, d_states_ptr, d_new_values_ptr, d_final_ptr,
    d_after_ptr, d_values_ptr, d_initial_ptr, chunk_offsets_ptr,
    batch_heads, chunks, key_dim, value_dim,
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    head, first, end, run_state, state, state_mask, key_side, key_mask, value_side, value_mask = _program(
        chunk_offsets_ptr, batch_heads, key_dim, value_dim, CHUNK, BLOCK_K, BLOCK_V
    )
    dh = tl.load(d_final_ptr + run_state, mask=state_mask, other=0.0)
    for step in range(first, end):  # the run's chunks last to first
        at_state, at_keys, at_values, chunk = _chunk_bases(head, first + end - 1 - step, chunks, key_dim, value_dim,
                                                           CHUNK)  # fmt: skip
        tl.store(d_after_ptr + at_state + state, dh, mask=state_mask)
        k_decayed = tl.load(k_decayed_ptr + at_keys + key_side, mask=key_mask, other=0.0)
        d_new_values = tl.load(d_new_values_ptr + at_values + value_side, mask=value_mask, other=0.0)
        values = d_new_values + tl.dot(k_decayed, dh, input_precision=DOT_PRECISION)
        tl.store(d_values_ptr + at_values + value_side, values, mask=value_mask)
        w = tl.load(w_ptr + at_keys + key_side, mask=key_mask, other=0.0)
        d_state = tl.load(d_states_ptr + at_state + state, mask=state_mask, other=0.0)
        dh = d_state + dh * tl.load(decay_ptr + chunk) - tl.dot(tl.trans(w), values, input_precision=DOT_PRECISION)
    tl.store(d_initial_ptr + run_state, dh, mask=state_mask)


# What the launches' grid axes count (the names of KernelLaunch's limit errors).
GRID_AXES = ("blocks of dv", "batch x heads", "runs")


def launch_of(kernel, key_dim: int, value_dim: int, chunk_size: int) -> KernelLaunch:
    """How `kernel` (either pass) is launched: the whole dk per program (tl.dot needs 16
    or more), dv in blocks of 32 columns (16 at dk 256) and 8 warps from dk 128, which
    sm_80 and sm_90 compile without spilling registers (tests/test_gated_delta_kernels.py)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"the chunk size must be a power of two of at least 16, got {chunk_size}")
    block_k = max(16, triton.next_power_of_2(key_dim))
    block_v = min(max(16, triton.next_power_of_2(value_dim)), 32 if block_k <= 128 else 16)
    constexprs = dict(CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, DOT_PRECISION=DOT_PRECISION)
    return KernelLaunch(kernel, constexprs, num_warps=4 if block_k <= 64 else 8, num_stages=1)


def _launch(kernel, w, value_dim: int, chunk_offsets, *args):
    """kernel over (blocks of dv, B * H, runs) with args, then the chunk offsets and sizes."""
    batch, heads, chunks, chunk_size, key_dim = w.shape
    launch = launch_of(kernel, key_dim, value_dim, chunk_size)
    grid = (triton.cdiv(value_dim, launch.constexprs["BLOCK_V"]), batch * heads, len(chunk_offsets) - 1)
    if min(grid) > 0:
        offsets = torch.tensor(chunk_offsets, dtype=torch.int32, device=w.device)
        launch(grid, *args, offsets, batch * heads, chunks, key_dim, value_dim, axes=GRID_AXES)


def chunk_states_forward(w, u, k_decayed, decay, initial, chunk_offsets):
    """The forward pass (module docstring): returns (states (B, H, N, dk, dv), new_values
    (B, H, N, C, dv), final (R, B, H, dk, dv)), fp32."""
    w, u, k_decayed, decay, initial = (x.contiguous() for x in (w, u, k_decayed, decay, initial))
    batch, heads, chunks, _, key_dim = w.shape
    states = w.new_empty(batch, heads, chunks, key_dim, u.shape[-1])
    new_values = torch.empty_like(u)
    final = torch.empty_like(initial)
    _launch(chunk_states_fwd_kernel, w, u.shape[-1], chunk_offsets, w, u, k_decayed, decay, initial,
            states, new_values, final)  # fmt: skip
    return states, new_values, final


def chunk_states_backward(w, k_decayed, decay, d_states, d_new_values, d_final, chunk_offsets):
    """The backward pass (module docstring): returns (d_after (B, H, N, dk, dv), d_values
    (B, H, N, C, dv), d_initial (R, B, H, dk, dv)), fp32."""
    w, k_decayed, decay, d_states, d_new_values, d_final = (
        x.contiguous() for x in (w, k_decayed, decay, d_states, d_new_values, d_final)
    )
    d_after = torch.empty_like(d_states)
    d_values = torch.empty_like(d_new_values)
    d_initial = torch.empty_like(d_final)
    _launch(chunk_states_bwd_kernel, w, d_new_values.shape[-1], chunk_offsets, w, k_decayed, decay, d_states,
            d_new_values, d_final, d_after, d_values, d_initial)  # fmt: skip
    return d_after, d_values, d_initial
