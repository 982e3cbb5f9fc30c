"""One step of blockwise attention: a K/V block folded into the running fp32 (out, lse),
or its share of the gradients added; shared by the ring (engine/ring_driver.py) and the
one-process attention (engine/local_attention.py).

    StepSpec(scale, softcap)          what every step of a call computes besides the mask
    forward_step / backward_step      one step under a StepMask, through a step backend
    inputs_precision(device)          autocast off: a step computes in its inputs' dtypes
    first_step_writes_every_row       whether step 0 may start from uninitialised state
    merge_sinks_ / sinks_gradient     per-head sink logits folded into the final result
    backward_inputs                   (dout, out, delta) of a backward given lse's gradient too

Layouts: q, out, dout, dq (B, S, H, D); k, v (B, S_k, H_kv, D); lse, delta (B, H, S) fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from seqpar_kernels.engine.step_backends import StepBackend
from seqpar_kernels.engine.step_masks import StepMask


@dataclass(frozen=True)
class StepSpec:
    """What every step of one attention call computes besides its mask.

    scale     the softmax scale, > 0 (a public call folds a negative or zero one into q:
              parallel/attention_checks.py fold_scale_sign)
    softcap   scores capped as softcap * tanh(scale * q.k / softcap) before the softmax;
              0.0: not"""

    scale: float
    softcap: float = 0.0


def inputs_precision(device: torch.device):
    """A context in which torch ops on `device` compute in their inputs' dtypes: autocast
    (a model's forward under torch.autocast, on any device type) switched off. Under it a
    matmul of fp32 operands returns bf16/fp16, which would round the fp32 statistics
    (scores, lse, the running out) that the steps and the decode partials keep."""
    if not torch.amp.is_autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def forward_step(steps: StepBackend, mask: StepMask, q, k, v, out, lse, spec: StepSpec, first_step=False) -> None:
    """Folds the rows of one step's K/V block that `mask` selects into (out, lse), in the
    inputs' dtypes under autocast too (inputs_precision). first_step: (out, lse) hold
    nothing yet and the step kernels write every row (first_step_writes_every_row)."""
    with inputs_precision(q.device):
        if mask.uses_intervals and steps.takes_intervals:
            steps.forward_intervals(q, k, v, out, lse, spec, mask.intervals(q.device), first_step=first_step)
            return
        for block in mask.blocks:
            q_rows = lambda x: x.narrow(1, block.q_start, block.q_len)  # noqa: E731
            kv_rows = lambda x: x.narrow(1, block.kv_start, block.kv_len)  # noqa: E731
            arguments = (q_rows(q), kv_rows(k), kv_rows(v), q_rows(out), lse.narrow(2, block.q_start, block.q_len),
                         spec)  # fmt: skip
            if block.mask is None:
                steps.forward(*arguments, block.causal, first_step=first_step)
            else:
                steps.forward_masked(*arguments, block.mask, block.empty_rows)


def first_step_writes_every_row(steps: StepBackend, mask: StepMask | None, seqlen: int) -> bool:
    """Whether the step kernels' first step writes every row of (out, lse) under `mask`
    (step 0's), so that the running state need not be initialised: kernels that say so
    (first_step_writes_every_row) write every row of each launch, and the launch covers
    all rows (one interval launch, or one unmasked block of every row)."""
    if mask is None or not steps.first_step_writes_every_row:
        return False
    if mask.uses_intervals and steps.takes_intervals:
        return True
    (block, *others) = mask.blocks
    return not others and block.mask is None and block.q_start == 0 and block.q_len == seqlen


def backward_step(
    steps: StepBackend, mask: StepMask, dout, q, k, v, out, lse, delta, dq, grad_kv, spec: StepSpec
) -> None:  # fmt: skip
    """Adds one step's share of the gradients (the rows `mask` selects): to dq, and to
    the block's dK|dV accumulator, which grad_kv() returns as (dk, dv) once it is here
    (it may still be arriving from the previous rank: the step kernels compute what they
    can before they ask for it). In the inputs' dtypes under autocast too."""
    with inputs_precision(q.device):
        if mask.uses_intervals and steps.takes_intervals:
            steps.backward_intervals(dout, q, k, v, out, lse, delta, dq, grad_kv, spec, mask.intervals(q.device))
            return
        for block in mask.blocks:
            q_rows = lambda x: x.narrow(1, block.q_start, block.q_len)  # noqa: E731
            kv_rows = lambda x: x.narrow(1, block.kv_start, block.kv_len)  # noqa: E731
            stat_rows = lambda x: None if x is None else x.narrow(2, block.q_start, block.q_len)  # noqa: E731
            block_grad_kv = lambda kv_rows=kv_rows: tuple(kv_rows(t) for t in grad_kv())  # noqa: E731
            arguments = (
                q_rows(dout), q_rows(q), kv_rows(k), kv_rows(v), q_rows(out), stat_rows(lse), stat_rows(delta),
                q_rows(dq), block_grad_kv, spec,
            )  # fmt: skip
            if block.mask is None:
                steps.backward(*arguments, block.causal)
            else:
                steps.backward_masked(*arguments, block.mask)


def backward_inputs(steps: StepBackend, out, dout, grad_lse=None):
    """(dout, out, delta) the backward steps read, once per call; grad_lse: None, or the
    gradient of the final lse (B, H, S) fp32. d lse / d s_j is p_j, so a score's gradient
    p_j (dout.v_j - delta) becomes p_j (dout.v_j - (delta - grad_lse)): kernels that take
    delta get it lowered by grad_lse; kernels that compute rowsum(dout * out) themselves
    (prepare_backward gives None) get dout with a column of ones and out with a column
    of -grad_lse, and v gains a zero column in the step (AtenSteps), which leaves
    dout.v_j as it is."""
    delta = steps.prepare_backward(out, dout)
    if grad_lse is None:
        return dout, out, delta
    if delta is not None:
        return dout, out, delta - grad_lse
    lowered = -grad_lse.transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1) fp32
    dout = torch.cat([dout, torch.ones_like(lowered, dtype=dout.dtype)], dim=-1)
    # out in fp32, so that grad_lse is not rounded to a bf16 out (the CPU kernels read fp32).
    return dout, torch.cat([out.float(), lowered], dim=-1), None


def merge_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Folds per-head sink logits (H,) into the final fp32 out (B, S, H, D) and lse
    (B, H, S), in place: each row's softmax denominator gains exp(sinks[h]), with no value
    row, so lse' = logaddexp(lse, sink) and out' = out * exp(lse - lse')."""
    sink = sinks.to(device=lse.device, dtype=torch.float32)[None, :, None]
    merged = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - merged).transpose(1, 2).unsqueeze(-1))
    lse.copy_(merged)


def sinks_gradient(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                   grad_lse: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """d loss / d sinks (H,) of this rank's rows, given the final (sink-merged) out, lse:
    a sink's probability is exp(sink - lse), and d out / d sink = -p_sink * out, so the
    gradient is -sum over rows of p_sink * (rowsum(dout * out) - grad_lse), grad_lse
    (B, H, S) the gradient of lse (d lse / d sink = p_sink), or None. In sinks' dtype."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (B, H, S)
    if grad_lse is not None:
        delta = delta - grad_lse
    p_sink = torch.exp(sinks.float()[None, :, None] - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
