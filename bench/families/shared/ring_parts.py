"""The ring's parts timed apart, shared by the ring benchmark (bench/families/ring.py) and the
single-GPU overlap probe (bench/families/ring_probe.py): the ring driver run with its exchange
replaced (seqpar_kernels.testing's ReplacedExchange), and the timing candidate names of
the parts."""

from __future__ import annotations

import torch

from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.engine.ring_driver import ring_backward, ring_forward
from seqpar_kernels.engine.step_masks import dense_step_masks
from seqpar_kernels.engine.steps import StepSpec

# Timing candidates beside "ours" and "baseline": the ring with its exchange removed, and
# its exchanges with no compute.
COMPUTE_ONLY = "compute only"
EXCHANGE_ONLY = "exchange only"


def run_driver(q, k, v, dout, options, exchange, backward: bool) -> list[torch.Tensor]:
    """The ring driver's forward (and backward) called directly, its rings made by
    `exchange`: out [, dq, dk, dv]. options: (step spec, group name, step backend, step
    masks), as seqpar_kernels.engine.ring_driver.ring_forward takes them."""
    with torch.no_grad():
        out, lse = ring_forward(q, k, v, *options, exchange=exchange)
        if not backward:
            return [out]
        return [out, *ring_backward(dout, q, k, v, out, lse, *options, exchange=exchange)]


def driver_options(q, causal: bool, zigzag: bool, group_name: str, world_size: int, steps) -> tuple:
    """run_driver's options for a dense sequence of world_size pieces of q's length."""
    masks = dense_step_masks(AttentionMask(causal), [q.shape[1]] * world_size, zigzag)
    return (StepSpec(1.0 / q.shape[-1] ** 0.5), group_name, steps, masks)
