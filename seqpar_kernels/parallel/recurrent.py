"""The mixers of hybrid models, sequence-parallel: their state passed across ranks.

    causal_conv1d(x, weight, bias=None, *, activation=None, <where>)    short convolutions
    ssd_scan, selective_scan (parallel/state_space.py)                  Mamba2's and Mamba's scans
    gated_delta_rule (parallel/gated_delta.py)                          Gated DeltaNet's delta rule
    kimi_delta_attention, lightning_attention (parallel/gated_delta.py) Kimi's and MiniMax's

<where>, the same keyword arguments for every mixer: the ranks and the layout the
sequence is sharded in, as the attention functions take them:
    group=None                    ulysses and ring modes (default: the world), or
    mesh=None / ulysses_group=None, ring_group=None     USP's grid
    layout="contiguous"           or "zigzag" (the balanced layout of whole sequences)
    seq_lens=None                 every rank's length in piece order (skips the gather)
    varlen=None                   a VarlenPlan for packed documents: the state restarts at
                                  every document's start
Every call checks its arguments on every rank (one small all-gather per group, as the
attention functions), so that a bad input or options that differ between ranks raise on
every rank.

How the state travels (parallel/state_passing.py): each rank summarises each run of its
rows (a run: consecutive positions of one document) by a fixed-size value, the ranks
gather every run's summary in one all-to-all, and each composes the summaries before its
runs. A convolution of kernel K passes each run's last K - 1 inputs: bytes
seqpar_kernels.traffic.state_passing_bytes.
"""

from __future__ import annotations

import torch

from seqpar_kernels.engine.causal_conv import ACTIVATIONS, conv_runs, conv_tails, next_halo
from seqpar_kernels.parallel.checks import SUPPORTED_DTYPES
from seqpar_kernels.parallel.state_passing import SequenceRuns, laid_out

__all__ = ["causal_conv1d"]

# The attention's dtypes, and fp64 for references.
DTYPES = (*SUPPORTED_DTYPES, torch.float64)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    layout: str = "contiguous",
    seq_lens: list[int] | None = None,
    varlen=None,
    return_final_states: bool = False,
):
    """The causal depthwise convolution of a sequence sharded across ranks (the short
    convolutions of Mamba, Gated DeltaNet and LFM2 mixers).

    x: (batch, seqlen_local, channels), this rank's rows; fp32, fp16 or bf16; any strides.
    weight: (channels, kernel); bias: (channels,) or None, on x's device.
    activation: None, or "silu" ("swish"), applied after the convolution.
    <where>: the module docstring's (group or grid, layout, seq_lens, varlen).
    Returns (batch, seqlen_local, channels) in x's dtype: out[t] = bias + sum_i weight[:, i]
    x[t - kernel + 1 + i], inputs before the sequence's (or the document's) start taken as
    0, computed in the weight's dtype (transformers' causal_conv1d_fn on the whole
    sequence), then the activation; laid out channels first as causal_conv1d_fn returns
    it (out.transpose(1, 2) is contiguous), whatever the pieces. Differentiable in x,
    weight and bias (each rank's weight and bias gradients are its rows' share:
    all_reduce_gradients sums them).

    return_final_states: also return every sequence's last kernel inputs (zeros before a
        shorter one's first), (sequences, kernel, channels): the state a cache keeps for
        the tokens after it (sequences: the batch, or the packed documents).

    Each rank needs the last kernel - 1 inputs before each of its runs: every rank's
    runs' last kernel - 1 rows travel in one all-to-all (the same back in the backward;
    with return_final_states, kernel rows a run)."""
    describe = "causal_conv1d"

    def local_checks():
        if not x.is_floating_point() or x.dtype not in DTYPES or x.dim() != 3:
            raise ValueError(f"{describe}: x must be (batch, seqlen_local, channels) of {DTYPES}, "
                             f"got {tuple(x.shape)} {x.dtype}")  # fmt: skip
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != x.shape[2] \
                or weight.shape[1] < 1 or weight.device != x.device:  # fmt: skip
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{describe}: weight must be (channels, kernel) = ({x.shape[2]}, K >= 1) on {x.device}, "
                             f"got {shape}")  # fmt: skip
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (x.shape[2],)
                                 or bias.device != x.device):  # fmt: skip
            raise ValueError(f"{describe}: bias must be None or ({x.shape[2]},) on {x.device}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{describe}: activation must be one of {ACTIVATIONS}, got {activation!r}")

    agreed = (describe, x.shape[0] if isinstance(x, torch.Tensor) else None, tuple(getattr(weight, "shape", ())),
              getattr(x, "dtype", None), getattr(weight, "dtype", None), bias is None, activation)  # fmt: skip
    runs = SequenceRuns.of(describe, x, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout, seq_lens=seq_lens, varlen=varlen, agreed=agreed,
                           local_checks=local_checks, inputs=(weight, bias))  # fmt: skip
    kernel = weight.shape[1]
    # A cache keeps the last `kernel` inputs; the convolution reads kernel - 1 before each row.
    kept = kernel if return_final_states else kernel - 1
    zero = x.new_zeros((x.shape[0], kept, x.shape[2]))
    if kept == 0:
        return laid_out(conv_runs(x, weight, bias, activation, runs.mine, [zero] * len(runs.mine)), x.dtype,
                        channels_first=True)  # fmt: skip
    gathered = runs.gather(conv_tails(x, runs.mine, kept + 1))
    halos = [halo[:, kept - (kernel - 1) :] for halo in runs.incoming(gathered, next_halo, zero)]
    out = laid_out(runs.joined(conv_runs(x, weight, bias, activation, runs.mine, halos), gathered), x.dtype,
                   channels_first=True)  # fmt: skip
    if return_final_states:
        return out, runs.final_states(gathered, next_halo, zero)
    return out
