"""The gated delta rule (Gated DeltaNet's mixer: Qwen3-Next, Qwen3.5) in one process,
chunked, over one rank's runs of the sequence, each run from its own initial state; and
the per-run summaries the sequence-parallel op (parallel/gated_delta.py) passes on.

Per value head, with the state S (dk, dv):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

Two variants run the same code: Kimi's delta attention, g_t one log decay per key
channel (exp(g_t) the diagonal matrix diag(exp(g_t)), applied before the delta step),
where the decays inside a chunk no longer factor out of its pairwise products
(decayed_products: (C, C, dk) values a chunk, so chunks of CHANNEL_CHUNK_SIZE); and
linear attention (MiniMax's lightning attention), beta None: no delta, S_t = exp(g_t)
S_{t-1} + k_t v_t^T (T = I, W = 0 below).

q and k L2-normalised if asked (x / sqrt(|x|^2 + 1e-6)), then q scaled (dk**-0.5 by
default); each q/k head serves Hv // Hk consecutive value heads. Computed in fp32 (fp64
for fp64 inputs), as transformers' torch_chunk_gated_delta_rule computes it: chunks of
C positions (a run's last chunk padded with zeros, which change nothing: g = 0 keeps the
state, beta = 0 adds nothing), per chunk, gc the cumulative g inside it, G = gc[-1]:

    Gamma[i, j] = exp(gc_i - gc_j) (j <= i, else 0)
    A = strictly_lower((beta k) k^T * Gamma),   T = (I + A)^-1
    W = T (beta exp(gc) k),   U = T (beta v)                    the UT transform
    then, in chunk order from the run's initial state h:
    V' = U - W h                                                 the chunk's new values
    O = (exp(gc) q) h + tril(q k^T * Gamma) V'
    h <- exp(G) h + (exp(G - gc) k)^T V'

Only the last two lines are sequential: `chunk_states` runs them (a torch loop, or on
CUDA, for a decay per head, the Triton kernels of kernels/gated_delta_kernels.py, whose
products are TF32),
forward and backward; the rest are batched matmuls over every chunk, differentiated by
autograd.

Layouts: the public tensors (batch, seqlen, heads, dim) as transformers' (q, k (B, S, Hk,
dk), v (B, S, Hv, dv), g and beta (B, S, Hv)); inside, heads first: (B, Hv, L, dim), and
chunked (B, Hv, N, C, dim) with N the chunks of every run together.

A run's summary for the ranks after it: the recurrence is affine in the state entering a
run, S_after = M_r S_before + B_r. Running the chunks on the value [v | 0_dk] from the
state [0 | I_dk] gives both at once (the final state is [B_r | M_r]) and, per token, the
output's extra columns e_t = M_{<=t}^T q_t, so that once the state S_in entering the run
is known, o_t = o_t(zero start) + S_in^T e_t (`corrected`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqpar_kernels.engine.kernel_backend import chosen_backend
from seqpar_kernels.layouts import Run

CHUNK_SIZE = 64
# Per-channel decays make each chunk's pairwise products (C, C, dk): L x 16 x dk values.
CHANNEL_CHUNK_SIZE = 16
# transformers' l2norm: x * rsqrt(|x|^2 + eps), as the FLA library.
L2NORM_EPS = 1e-6
# The Triton state kernels hold a (dk, block of dv) fp32 state in registers.
TRITON_MAX_KEY_DIM = 256


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when any input is fp64 (references), else fp32 (transformers' reference)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32


def prepared(q, k, v, g, beta, scale: float | None, use_qk_l2norm: bool):
    """The inputs (B, S, Hk, dk), (B, S, Hk, dk), (B, S, Hv, dv), g (B, S, Hv) or per key
    channel (B, S, Hv, dk), beta (B, S, Hv) or None (no delta: linear attention) as the
    recurrence reads them: heads first (B, Hv, S, ...), in the compute dtype, q and k
    normalised if asked and expanded to the value heads, q scaled."""
    dtype = compute_dtype(*(x for x in (q, k, v, g, beta) if x is not None))
    group = v.shape[2] // k.shape[2]
    q, k, v, g = (x.transpose(1, 2).to(dtype) for x in (q, k, v, g))
    beta = None if beta is None else beta.transpose(1, 2).to(dtype)
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (q, k))
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if group > 1:
        q, k = (x.repeat_interleave(group, dim=1) for x in (q, k))
    return q, k, v, g, beta


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, use_qk_l2norm: bool = False,
                           initial_state: torch.Tensor | None = None, chunk_size: int | None = None,
                           backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gated delta rule over the whole sequence in one process (transformers'
    torch_chunk_gated_delta_rule with output_final_state). q, k (B, S, Hk, dk); v (B, S,
    Hv, dv); g (B, S, Hv), or per key channel (B, S, Hv, dk) (Kimi's delta attention:
    chunk_kimi_delta_attention); beta (B, S, Hv), or None for linear attention (no
    delta: S_t = exp(g_t) S_{t-1} + k_t v_t^T); initial_state (B, Hv, dk, dv) or None (zeros). Returns
    the output (B, S, Hv, dv) in q's dtype and the final state (B, Hv, dk, dv) in the
    compute dtype. Differentiable in every input and the initial state. backend: what
    runs the chunks' sequential part ("auto": Triton on CUDA fp32, else torch)."""
    out_dtype = q.dtype
    q, k, v, g, beta = prepared(q, k, v, g, beta, scale, use_qk_l2norm)
    batch, heads, length, key_dim = k.shape
    if initial_state is None:
        initial_state = v.new_zeros(batch, heads, key_dim, v.shape[-1])
    out, final = chunked(q, k, v, g, beta, [length], initial_state.to(v.dtype).unsqueeze(0), chunk_size, backend)
    return out.transpose(1, 2).to(out_dtype), final[0]


def chunked(q, k, v, g, beta, lengths, initial, chunk_size: int | None = None, backend: str = "auto"):
    """The recurrence over consecutive runs of L positions, each from its own state.

    q, k (B, H, L, dk), v (B, H, L, dv), g (B, H, L) or per key channel (B, H, L, dk),
    beta (B, H, L) or None (no delta): prepared (heads first, compute dtype);
    chunk_size: None for CHUNK_SIZE (CHANNEL_CHUNK_SIZE per channel); lengths: the runs'
    lengths (summing to L); initial (R, B, H, dk, dv + E): the value read as [v | 0_E]
    (E extra zero columns: a transition's). Returns the output (B, H, L, dv + E) and
    every run's final state (R, B, H, dk, dv + E)."""
    batch, heads, length, key_dim = k.shape
    if chunk_size is None:
        chunk_size = CHANNEL_CHUNK_SIZE if g.dim() == 4 else CHUNK_SIZE
    rows, chunk_offsets, kept = _chunk_layout(lengths, chunk_size, length, q.device)
    chunks = chunk_offsets[-1]

    def chunk(x):  # (B, H, L, ...) -> (B, H, N, C, ...), zeros in the padding
        padded = F.pad(x, (0, 0, 0, 1) if x.dim() == 4 else (0, 1))
        picked = padded.index_select(2, rows)
        return picked.view(batch, heads, chunks, chunk_size, *x.shape[3:])

    q, k, v, g = (chunk(x) for x in (q, k, v, g))
    per_channel = g.dim() == 5
    # gc: the cumulative log decay inside each chunk, (B, H, N, C, dk) per channel, else (B, H, N, C, 1).
    gc = g.cumsum(-2) if per_channel else g.cumsum(-1).unsqueeze(-1)
    decay = gc[..., -1, :]  # the chunk's whole decay (B, H, N, dk or 1)
    k_decayed = k * (decay.unsqueeze(-2) - gc).exp()
    if beta is None:  # no delta: T = I, W = 0
        u, w = v, torch.zeros_like(k)
    else:
        beta = chunk(beta).unsqueeze(-1)
        k_beta = k * beta
        system = decayed_products(k_beta, k, gc)  # unit lower triangular once its diagonal is read as 1
        u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * gc.exp(), upper=False, unitriangular=True)
    u = F.pad(u, (0, initial.shape[-1] - v.shape[-1]))  # T [v | 0] = [T v | 0]
    decay = decay.exp() if per_channel else decay.exp().squeeze(-1)
    states, new_values, final = chunk_states(w, u, k_decayed, decay, initial, chunk_offsets, backend)
    out = (q * gc.exp()) @ states + decayed_products(q, k, gc) @ new_values
    out = out.reshape(batch, heads, chunks * chunk_size, out.shape[-1]).index_select(2, kept)
    return out, final


def decayed_products(a: torch.Tensor, b: torch.Tensor, gc: torch.Tensor) -> torch.Tensor:
    """P[i, j] = sum_c a_i[c] b_j[c] exp(gc_i[c] - gc_j[c]) for j <= i, else 0, per chunk:
    a, b (B, H, N, C, dk); gc (B, H, N, C, dk) or, one decay for every channel, (B, H, N,
    C, 1). Returns (B, H, N, C, C)."""
    size = gc.shape[-2]
    lower = torch.ones(size, size, dtype=torch.bool, device=gc.device).tril()
    if gc.shape[-1] == 1:
        gamma = (gc - gc.transpose(-1, -2)).masked_fill(~lower, float("-inf")).exp()
        return (a @ b.transpose(-1, -2)) * gamma
    # Per channel the decays do not factor out of the product: (C, C, dk) per chunk.
    gamma = (gc.unsqueeze(-2) - gc.unsqueeze(-3)).masked_fill(~lower.unsqueeze(-1), float("-inf")).exp()
    return torch.einsum("...ic,...jc,...ijc->...ij", a, b, gamma)


def _chunk_layout(lengths, chunk_size: int, length: int, device):
    """rows: (N * C,) each chunk slot's position (length: the zero row of the padding);
    chunk_offsets: every run's first chunk, and N last (R + 1 ints); kept: (L,) the slots
    of the positions, in order."""
    rows, kept, chunk_offsets, start = [], [], [0], 0
    for run_length in lengths:
        chunks = -(-run_length // chunk_size)
        kept.extend(range(len(rows), len(rows) + run_length))
        rows.extend(range(start, start + run_length))
        rows.extend([length] * (chunks * chunk_size - run_length))
        chunk_offsets.append(chunk_offsets[-1] + chunks)
        start += run_length
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return as_tensor(rows), chunk_offsets, as_tensor(kept)


def chunk_states(w, u, k_decayed, decay, initial, chunk_offsets, backend: str = "auto"):
    """The sequential part: from each run's initial state, chunk after chunk,

        states[n] = h;   new_values[n] = u[n] - w[n] h;   h <- decay[n] h + k_decayed[n]^T new_values[n]

    w, k_decayed (B, H, N, C, dk); u (B, H, N, C, dv); decay (B, H, N), or per key
    channel (B, H, N, dk) (h's rows decay apart); initial (R, B, H, dk, dv);
    chunk_offsets: run r's chunks are [chunk_offsets[r], chunk_offsets[r + 1]).
    Returns states (B, H, N, dk, dv), new_values (B, H, N, C, dv) and the final states
    (R, B, H, dk, dv). Differentiable in every tensor."""
    return _ChunkStates.apply(w, u, k_decayed, decay, initial, tuple(chunk_offsets), _backend(backend, w, decay))


def _backend(backend: str, w: torch.Tensor, decay: torch.Tensor) -> str:
    """The Triton kernels decay the state by one scalar a chunk: per-channel decays run in torch."""
    if backend == "triton" and decay.dim() != 3:
        raise ValueError("the Triton chunk-state kernels take one decay per head, not one per key channel")
    triton_fits = w.is_cuda and w.dtype == torch.float32 and w.shape[-1] <= TRITON_MAX_KEY_DIM
    return chosen_backend(backend, triton_fits and decay.dim() == 3)


class _ChunkStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, u, k_decayed, decay, initial, chunk_offsets, backend):
        if backend == "triton":
            from seqpar_kernels.kernels import gated_delta_kernels

            states, new_values, final = gated_delta_kernels.chunk_states_forward(
                w, u, k_decayed, decay, initial, chunk_offsets
            )
        else:
            states, new_values, final = _states_forward_loop(w, u, k_decayed, decay, initial, chunk_offsets)
        ctx.save_for_backward(w, k_decayed, decay, states, new_values)
        ctx.chunk_offsets, ctx.backend = chunk_offsets, backend
        return states, new_values, final

    @staticmethod
    def backward(ctx, d_states, d_new_values, d_final):
        w, k_decayed, decay, states, new_values = ctx.saved_tensors
        if ctx.backend == "triton":
            from seqpar_kernels.kernels import gated_delta_kernels

            d_after, d_values, d_initial = gated_delta_kernels.chunk_states_backward(
                w, k_decayed, decay, d_states, d_new_values, d_final, ctx.chunk_offsets
            )
        else:
            d_after, d_values, d_initial = _states_backward_loop(
                w, k_decayed, decay, d_states, d_new_values, d_final, ctx.chunk_offsets
            )
        # d_after[n]: the gradient of the state after chunk n; the rest is parallel over chunks.
        d_w = -(d_values @ states.transpose(-1, -2))
        d_k_decayed = new_values @ d_after.transpose(-1, -2)
        d_decay = (states * d_after).sum(-1)
        if decay.dim() == 3:
            d_decay = d_decay.sum(-1)
        return d_w, d_values, d_k_decayed, d_decay, d_initial, None, None


def _states_forward_loop(w, u, k_decayed, decay, initial, chunk_offsets):
    """chunk_states' forward in torch, one chunk at a time."""
    batch, heads, chunks = decay.shape[:3]
    states = w.new_empty(batch, heads, chunks, w.shape[-1], u.shape[-1])
    new_values = torch.empty_like(u)
    final = torch.empty_like(initial)
    for run, (first, end) in enumerate(zip(chunk_offsets[:-1], chunk_offsets[1:])):
        h = initial[run]
        for n in range(first, end):
            states[:, :, n] = h
            values = u[:, :, n] - w[:, :, n] @ h
            new_values[:, :, n] = values
            h = _row_decay(decay, n) * h + k_decayed[:, :, n].transpose(-1, -2) @ values
        final[run] = h
    return states, new_values, final


def _row_decay(decay: torch.Tensor, n: int) -> torch.Tensor:
    """Chunk n's decay of the state's rows, (B, H, 1 or dk, 1)."""
    return decay[:, :, n, None, None] if decay.dim() == 3 else decay[:, :, n, :, None]


def _states_backward_loop(w, k_decayed, decay, d_states, d_new_values, d_final, chunk_offsets):
    """chunk_states' sequential backward in torch: (the gradient of the state after every
    chunk (B, H, N, dk, dv), of every chunk's new values (B, H, N, C, dv), of the initial
    states (R, B, H, dk, dv)), the chunks in reverse."""
    d_after = torch.empty_like(d_states)
    d_values = torch.empty_like(d_new_values)
    d_initial = torch.empty_like(d_final)
    for run, (first, end) in enumerate(zip(chunk_offsets[:-1], chunk_offsets[1:])):
        dh = d_final[run]
        for n in range(end - 1, first - 1, -1):
            d_after[:, :, n] = dh
            values = d_new_values[:, :, n] + k_decayed[:, :, n] @ dh
            d_values[:, :, n] = values
            dh = d_states[:, :, n] + _row_decay(decay, n) * dh - w[:, :, n].transpose(-1, -2) @ values
        d_initial[run] = dh
    return d_after, d_values, d_initial


def gated_delta_runs(q, k, v, g, beta, runs: tuple[Run, ...], *, scale: float | None, use_qk_l2norm: bool,
                     transitions: bool, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recurrence over this rank's runs (layouts.Run, in local row order, covering the
    rows), each from a zero state. q, k (B, S, Hk, dk), v (B, S, Hv, dv), g, beta (B, S, Hv).

    Returns (out, summaries) in the compute dtype: out (B, S, Hv, dv + dk), the output
    from a zero state then, per token, e_t = M_{<=t}^T q_t ((B, S, Hv, dv) without
    transitions);
    summaries (len(runs), B, Hv, dk, dv + dk): each run's [final state from zero | its
    transition M_r] (M_r zeros without transitions: what a run starting its document
    needs, whose entering state is 0)."""
    q, k, v, g, beta = prepared(q, k, v, g, beta, scale, use_qk_l2norm)
    batch, heads, _, key_dim = k.shape
    value_dim = v.shape[-1]
    zero_state = v.new_zeros(len(runs), batch, heads, key_dim, value_dim)
    if transitions:  # the value [v | 0] from the state [0 | I]
        identity = torch.eye(key_dim, dtype=v.dtype, device=v.device).expand(len(runs), batch, heads, -1, -1)
        initial = torch.cat([zero_state, identity], dim=-1)
    else:
        initial = zero_state
    out, final = chunked(q, k, v, g, beta, [run.length for run in runs], initial, backend=backend)
    if not transitions:
        final = F.pad(final, (0, key_dim))
    return out.transpose(1, 2), final


def next_state(state: torch.Tensor, summary: torch.Tensor, run: Run) -> torch.Tensor:
    """The state after `run` from the state before it (B, Hv, dk, dv): M_r S + B_r, its
    summary (B, Hv, dk, dv + dk) being [B_r | M_r]."""
    value_dim = state.shape[-1]
    return summary[..., value_dim:] @ state + summary[..., :value_dim]


def corrected(out: torch.Tensor, runs: tuple[Run, ...], incoming, continues, value_dim: int) -> torch.Tensor:
    """The output (B, S, Hv, dv) of runs entered by the states `incoming` (each (B, Hv,
    dk, dv)): out (B, S, Hv, dv + dk) from gated_delta_runs; o_t + S_in^T e_t for the runs
    that continue a document (continues[r]), o_t as it is for the others (S_in = 0)."""
    if not runs:
        return out[..., :value_dim]
    pieces = []
    for run, state, continuing in zip(runs, incoming, continues):
        rows = out.narrow(1, run.local_start, run.length)
        piece = rows[..., :value_dim]
        if continuing:
            piece = piece + torch.einsum("bshi,bhiv->bshv", rows[..., value_dim:], state)
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
