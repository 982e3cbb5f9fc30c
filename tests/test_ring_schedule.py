"""The ring's schedule and traffic: which scores each rank computes at each step
(zigzag balances causal work), the bytes each rank sends (comm_stats), and on one GPU
the driver's overlapped copies (seqpar_kernels/parallel/ring_driver.py)."""

from __future__ import annotations

import threading

import pytest
import torch

import seqpar_kernels as sp
from on_ranks import rank_and_world
from seqpar_kernels.parallel.ring_driver import step_block
from seqpar_kernels.parallel.ring_steps import DEVICE_DEFAULT

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# ----------------------------------------------------------------------------------
# the step schedule: which (query, key) scores each rank computes at each ring step
# ----------------------------------------------------------------------------------


def _global_positions(rank, world_size, seqlen, zigzag):
    """Global sequence positions of a rank's local rows (its K/V block's too)."""
    if not zigzag:
        return list(range(rank * seqlen, (rank + 1) * seqlen))
    half = seqlen // 2
    return [chunk * half + i for chunk in (rank, 2 * world_size - 1 - rank) for i in range(half)]


def _step_scores(step, rank, world_size, seqlen, zigzag):
    """The (query position, key position) pairs whose scores `rank` computes at causal
    ring step `step`, as ring_driver.step_block says: its rows x the block's first
    kv_len keys, a causal block masked by local index (the diagonal's exact count)."""
    block = step_block(step, rank, world_size, seqlen, True, zigzag)
    if block is None:
        return []
    src = (rank - step) % world_size
    rows = _global_positions(rank, world_size, seqlen, zigzag)[block.q_start : block.q_start + block.q_len]
    keys = _global_positions(src, world_size, seqlen, zigzag)[: block.kv_len]
    return [(q, k) for i, q in enumerate(rows) for j, k in enumerate(keys) if not block.causal or j <= i]


def _causal_schedule(world_size, seqlen, zigzag):
    """(work[step][rank]: number of scores computed, every score computed, with repeats)."""
    work, computed = [], []
    for step in range(world_size):
        per_rank = [_step_scores(step, rank, world_size, seqlen, zigzag) for rank in range(world_size)]
        work.append([len(scores) for scores in per_rank])
        computed += [pair for scores in per_rank for pair in scores]
    return work, computed


@pytest.mark.parametrize("world_size", range(1, 9), ids=lambda size: f"P{size}")
def test_zigzag_causal_steps_do_equal_work_on_every_rank(world_size):
    for seqlen in (2, 4, 6, 10):
        total = world_size * seqlen
        causal_pairs = sorted((q, k) for q in range(total) for k in range(q + 1))
        for zigzag in (True, False):
            work, computed = _causal_schedule(world_size, seqlen, zigzag)
            unequal = [(step, per_rank) for step, per_rank in enumerate(work) if len(set(per_rank)) > 1]
            if zigzag:
                assert not unequal, f"P={world_size} S={seqlen}: zigzag work per rank differs at (step, work) {unequal}"
            elif world_size > 1:
                # The same check fails for the contiguous layout (rank r works r+1 steps).
                assert unequal, f"P={world_size} S={seqlen}: the contiguous layout looks balanced"
            # Both layouts: every causal score exactly once, nothing else.
            assert sorted(computed) == causal_pairs, f"P={world_size} S={seqlen} zigzag={zigzag}: wrong scores"


# ----------------------------------------------------------------------------------
# comm_stats
# ----------------------------------------------------------------------------------


def measure_bytes(dtype):
    rank, world_size = rank_and_world()
    results = []
    for layout, causal, heads_kv in (("contiguous", True, 2), ("zigzag", True, 1), ("contiguous", False, 4)):
        gen = torch.Generator().manual_seed(rank)
        q = torch.randn(2, 6, 4, 64, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(2, 6, heads_kv, 64, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(2, 6, heads_kv, 64, generator=gen).to(dtype).requires_grad_()
        with sp.comm_stats() as forward:
            out = sp.ring_attention(q, k, v, causal=causal, layout=layout)
        with sp.comm_stats() as backward:
            # On CUDA the autograd engine runs the backward on a thread of its own:
            # run it on another thread here too, so bytes sent there must count.
            worker = threading.Thread(target=out.sum().backward)
            worker.start()
            worker.join()
        kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
        grad_kv_bytes = 4 * (k.numel() + v.numel())  # fp32 dk|dv travel
        results.append(
            (forward.bytes_sent, (world_size - 1) * kv_bytes,
             backward.bytes_sent, (world_size - 1) * (kv_bytes + grad_kv_bytes),
             forward.calls, backward.calls)
        )  # fmt: skip
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_comm_stats_count_the_ring(ranks, dtype):
    for per_case in ranks.run(measure_bytes, dtype):
        for fwd, fwd_theory, bwd, bwd_theory, fwd_calls, bwd_calls in per_case:
            assert fwd == fwd_theory  # (P-1) x local KV bytes
            assert bwd == bwd_theory  # (P-1) x (KV bytes + fp32 dKV bytes)
            assert fwd_calls == ranks.world_size - 1
            assert bwd_calls == 2 * (ranks.world_size - 1)




@needs_gpu
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_gpu_virtual_ring_overlapped_copies_match_serial_copies(monkeypatch, layout):
    # The ring driver of P GPUs on one (seqpar_kernels.testing.ReplacedExchange): the
    # exchange is a device-to-device copy on a side stream ("copy", overlapped as NCCL's
    # would be) or on the compute stream ("serial_copy"). The copies deliver this rank's
    # own K|V, so both must agree bit for bit, and with no exchange at all ("none") for
    # out and dq: a block read before its copy landed, or overwritten while still read,
    # would not. Every receive buffer is filled with NaN on the compute stream before its
    # copy is posted: otherwise, from step 2 on, the spare buffer already holds this
    # rank's K|V (the last step's), and a read racing ahead of the copy would give the
    # same numbers.
    from seqpar_kernels.parallel.ring_driver import ring_backward, ring_forward
    from seqpar_kernels.parallel.ring_steps import step_kernels_for
    from seqpar_kernels.testing import ReplacedExchange

    start = ReplacedExchange.start

    def start_into_nan(self, send, recv):
        if self.mode != "none":  # "none": recv is send itself, nothing is copied
            recv.fill_(float("nan"))
        return start(self, send, recv)

    monkeypatch.setattr(ReplacedExchange, "start", start_into_nan)

    gen = torch.Generator().manual_seed(22)
    q, k, v, dout = (torch.randn(1, 2048, heads, 128, generator=gen).to("cuda", torch.bfloat16)
                     for heads in (8, 2, 2, 8))
    steps = step_kernels_for(DEVICE_DEFAULT, q.device)

    def ring(mode, rank):
        exchange = ReplacedExchange(mode, virtual_world_size=4, virtual_rank=rank)
        options = (True, 128**-0.5, layout == "zigzag", "", steps)
        out, lse = ring_forward(q, k, v, *options, exchange=exchange)
        return [out, *ring_backward(dout, q, k, v, out, lse, *options, exchange=exchange)]

    for rank in (0, 3):
        overlapped, serial, alone = ring("copy", rank), ring("serial_copy", rank), ring("none", rank)
        for name, a, b in zip(("out", "dq", "dk", "dv"), overlapped, serial):
            assert torch.equal(a, b), f"rank {rank} {name}: overlapped copies differ from serial ones"
        for name, a, b in zip(("out", "dq"), overlapped, alone):
            assert torch.equal(a, b), f"rank {rank} {name}: overlapped copies differ from no exchange"
