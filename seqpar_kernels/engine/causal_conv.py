"""The causal depthwise convolution of hybrid models' mixers (short convolutions: Mamba's,
Gated DeltaNet's, LFM2's) over one rank's runs of the sequence, each run preceded by the
K - 1 inputs before it in its document (from other ranks: parallel/recurrent.py).

Layouts: x (B, S, C) this rank's rows; weight (C, K); bias (C,) or None; a halo
(B, K - 1, C). The convolution: out[t, c] = bias[c] + sum_i weight[c, i] x[t - K + 1 + i, c],
inputs before a document's start being 0, then the activation; computed in the weight's
dtype (as transformers' causal_conv1d_fn) and returned in x's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from seqpar_kernels.layouts import Run

ACTIVATIONS = (None, "silu", "swish")


def conv_runs(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, runs, halos) -> torch.Tensor:
    """The convolution of x's rows, run by run (runs: layouts.Run in local row order,
    covering every row), run r's inputs preceded by halos[r] (B, K - 1, C): returns
    (B, S, C) in x's dtype. Differentiable in x, weight, bias and the halos."""
    kernel = weight.shape[1]
    outputs = []
    for run, halo in zip(runs, halos):
        rows = x.narrow(1, run.local_start, run.length)
        inputs = rows if kernel == 1 else torch.cat([halo.to(rows.dtype), rows], dim=1)
        outputs.append(_convolve(inputs, weight, bias, activation)[:, inputs.shape[1] - run.length :])
    if not outputs:  # no rows: an empty output, still in x's graph
        return (x.narrow(1, 0, 0) * weight[:, 0].to(x.dtype)).to(x.dtype)
    if len(outputs) > 1:  # joined channels first, the layout causal_conv1d returns (no copy after)
        outputs = [torch.cat([out.transpose(1, 2) for out in outputs], dim=2).transpose(1, 2)]
    return outputs[0].to(x.dtype)


def _convolve(inputs: torch.Tensor, weight: torch.Tensor, bias, activation: str | None) -> torch.Tensor:
    """(B, L, C) -> (B, L, C): the causal convolution of `inputs` alone (zeros before)."""
    channels, kernel = weight.shape
    out = F.conv1d(inputs.transpose(1, 2).to(weight.dtype), weight.unsqueeze(1), bias, padding=kernel - 1,
                   groups=channels)[:, :, : inputs.shape[1]]  # fmt: skip
    if activation is not None:
        out = F.silu(out)
    return out.transpose(1, 2)


def conv_tails(x: torch.Tensor, runs, kernel: int) -> torch.Tensor:
    """(len(runs), B, K - 1, C): each run's last K - 1 inputs, zeros before a run shorter
    than that (what the runs after it in its document read before their first row)."""
    tails = []
    for run in runs:
        rows = x.narrow(1, run.local_start, run.length)[:, -(kernel - 1) :]
        tails.append(F.pad(rows, (0, 0, kernel - 1 - rows.shape[1], 0)))
    if not tails:
        return x.new_zeros((0, x.shape[0], kernel - 1, x.shape[2]))
    return torch.stack(tails)


def next_halo(halo: torch.Tensor, tail: torch.Tensor, run: Run) -> torch.Tensor:
    """The K - 1 inputs before the run after `run`: halo (those before `run`) followed by
    run's own rows (its tail's last min(length, K - 1) rows), the last K - 1 of them."""
    kept = min(run.length, tail.shape[1])
    return torch.cat([halo, tail[:, tail.shape[1] - kept :]], dim=1)[:, kept:]
