"""The ring's parts timed apart, shared by the ring benchmark (bench_ring.py) and the
single-GPU overlap probe (bench_ring_probe.py): the ring driver run with its exchange
replaced (seqpar_kernels.testing's ReplacedExchange), and the timing candidate names of
the parts."""

from __future__ import annotations

import torch

from seqpar_kernels.parallel.ring_driver import ring_backward, ring_forward

# Timing candidates beside "ours" and "baseline": the ring with its exchange removed, and
# its exchanges with no compute.
COMPUTE_ONLY = "compute only"
EXCHANGE_ONLY = "exchange only"


def run_driver(q, k, v, dout, options, exchange, backward: bool) -> list[torch.Tensor]:
    """The ring driver's forward (and backward) called directly, its rings made by
    `exchange`: out [, dq, dk, dv]. options: (causal, scale, zigzag, group name, step
    kernels), as seqpar_kernels.parallel.ring_driver.ring_forward takes them."""
    with torch.no_grad():
        out, lse = ring_forward(q, k, v, *options, exchange=exchange)
        if not backward:
            return [out]
        return [out, *ring_backward(dout, q, k, v, out, lse, *options, exchange=exchange)]
