"""The ring's schedule and traffic: which scores each rank computes at each step
(zigzag balances causal work), the bytes each rank sends (comm_stats), and on one GPU
the driver's overlapped copies (seqpar_kernels/engine/ring_driver.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from on_ranks import rank_and_world

import seqpar_kernels as sp
from seqpar_kernels.attention_mask import AttentionMask
from seqpar_kernels.engine.step_backends import AUTO
from seqpar_kernels.engine.step_masks import dense_step_masks
from seqpar_kernels.engine.steps import StepSpec
from seqpar_kernels.groups import SINGLE_PROCESS
from seqpar_kernels.layouts import dense_slot_segments, zigzag_piece_lengths
from seqpar_kernels.traffic import ring_bytes

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# ----------------------------------------------------------------------------------
# the step schedule: which (query, key) scores each rank computes at each ring step
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingPieces:
    """Ranks holding `lengths` rows of one sequence, contiguous or in the zigzag layout."""

    lengths: tuple[int, ...]
    zigzag: bool

    @classmethod
    def of(cls, lengths, zigzag: bool):
        return cls(tuple(lengths), zigzag)


def global_positions(rank, pieces):
    """Global sequence positions of a rank's local rows (its K/V block's too)."""
    segments = dense_slot_segments(pieces.lengths, pieces.zigzag)[rank]
    return [start + i for start, length in segments for i in range(length)]


def _step_scores(step, rank, pieces):
    """The (query position, key position) pairs whose scores `rank` computes at causal
    ring step `step`, as the driver's step mask says: each block pair's rows x keys, a
    causal pair masked by local index (the diagonal's exact count)."""
    src = (rank - step) % len(pieces.lengths)
    mask = dense_step_masks(AttentionMask(True), pieces.lengths, pieces.zigzag).step(rank, src)
    if mask is None:
        return []
    rows, keys = global_positions(rank, pieces), global_positions(src, pieces)
    return [
        (rows[pair.q_start + i], keys[pair.kv_start + j])
        for pair in mask.pairs for i in range(pair.q_len) for j in range(pair.kv_len) if not pair.causal or j <= i
    ]  # fmt: skip


def causal_schedule(pieces):
    """(work[step][rank]: number of scores computed, every score computed, with repeats)."""
    world_size = len(pieces.lengths)
    work, computed = [], []
    for step in range(world_size):
        per_rank = [_step_scores(step, rank, pieces) for rank in range(world_size)]
        work.append([len(scores) for scores in per_rank])
        computed += [pair for scores in per_rank for pair in scores]
    return work, computed


def _causal_pairs(total):
    return sorted((q, k) for q in range(total) for k in range(q + 1))


@pytest.mark.parametrize("world_size", range(1, 9), ids=lambda size: f"P{size}")
def test_zigzag_causal_steps_do_equal_work_on_every_rank(world_size):
    for seqlen in (2, 4, 6, 10):
        for zigzag in (True, False):
            pieces = RingPieces.of([seqlen] * world_size, zigzag)
            work, computed = causal_schedule(pieces)
            unequal = [(step, per_rank) for step, per_rank in enumerate(work) if len(set(per_rank)) > 1]
            if zigzag:
                assert not unequal, f"P={world_size} S={seqlen}: zigzag work per rank differs at (step, work) {unequal}"
            elif world_size > 1:
                # The same check fails for the contiguous layout (rank r works r+1 steps).
                assert unequal, f"P={world_size} S={seqlen}: the contiguous layout looks balanced"
            # Both layouts: every causal score exactly once, nothing else.
            assert sorted(computed) == _causal_pairs(world_size * seqlen), (
                f"P={world_size} S={seqlen} zigzag={zigzag}: wrong scores"
            )


@pytest.mark.parametrize("world_size", range(1, 9), ids=lambda size: f"P{size}")
def test_uneven_pieces_compute_every_causal_score_once(world_size):
    # Contiguous pieces of any lengths (empty ones too), and the zigzag pieces of any
    # full length (chunks of two lengths; fewer rows than chunks).
    gen = torch.Generator().manual_seed(world_size)
    for _ in range(6):
        lengths = torch.randint(0, 7, (world_size,), generator=gen).tolist()
        pieces = RingPieces.of(lengths, False)
        assert sorted(causal_schedule(pieces)[1]) == _causal_pairs(sum(lengths)), f"contiguous {lengths}"
    for total in range(0, 4 * world_size + 3):
        pieces = RingPieces.of(zigzag_piece_lengths(total, world_size), True)
        work, computed = causal_schedule(pieces)
        assert sorted(computed) == _causal_pairs(total), f"P={world_size} zigzag of {total} rows: wrong scores"


# ----------------------------------------------------------------------------------
# comm_stats
# ----------------------------------------------------------------------------------


def measure_bytes(dtype):
    """(forward bytes, backward bytes, their formula (traffic.ring_bytes), forward calls,
    backward calls) per case."""
    rank, world_size = rank_and_world()
    uneven = [5, 0, 3, 1][:world_size]
    zigzag_uneven = zigzag_piece_lengths(4 * world_size + 3, world_size)
    results = []
    for layout, causal, heads_kv, lengths in (
        ("contiguous", True, 2, [6] * world_size), ("zigzag", True, 1, [6] * world_size),
        ("contiguous", False, 4, [6] * world_size), ("contiguous", True, 2, uneven),
        ("zigzag", True, 1, zigzag_uneven),
    ):  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        seqlen = lengths[rank]
        q = torch.randn(2, seqlen, 4, 64, generator=gen).to(dtype).requires_grad_()
        k = torch.randn(2, seqlen, heads_kv, 64, generator=gen).to(dtype).requires_grad_()
        v = torch.randn(2, seqlen, heads_kv, 64, generator=gen).to(dtype).requires_grad_()
        with sp.comm_stats() as forward:
            out = sp.ring_attention(q, k, v, causal=causal, layout=layout)
        with sp.comm_stats() as backward:
            # On CUDA the autograd engine runs the backward on a thread of its own:
            # run it on another thread here too, so bytes sent there must count.
            worker = threading.Thread(target=out.sum().backward)
            worker.start()
            worker.join()
        formula = ring_bytes(lengths, rank, batch=2, num_kv_heads=heads_kv, head_dim=64,
                             element_size=k.element_size())  # fmt: skip
        results.append((forward.bytes_sent, backward.bytes_sent, formula, forward.calls, backward.calls))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_comm_stats_count_the_ring(ranks, dtype):
    for per_case in ranks.run(measure_bytes, dtype):
        for fwd, bwd, formula, fwd_calls, bwd_calls in per_case:
            assert (fwd, bwd) == tuple(formula)  # K|V forward; K|V and fp32 dK|dV backward
            assert fwd_calls == ranks.world_size - 1
            assert bwd_calls == 2 * (ranks.world_size - 1)


def virtual_ring_results(monkeypatch, device, dtype, seqlen, heads, head_dim, layout, modes):
    """{mode: [out, dq, dk, dv] of ranks 0 and 3} of the ring driver of 4 ranks on one
    device (seqpar_kernels.testing.ReplacedExchange), causal, every receive buffer filled
    with NaN on the compute stream before its copy is posted: otherwise, from step 2 on,
    the spare buffer already holds this rank's K|V (the last step's), and a read racing
    ahead of the copy would give the same numbers. q, dout (1, seqlen, heads, head_dim); k, v
    (1, seqlen, heads // 4, head_dim)."""
    from seqpar_kernels.engine.ring_driver import ring_backward, ring_forward
    from seqpar_kernels.engine.step_backends import step_kernels_for
    from seqpar_kernels.testing import ReplacedExchange

    start = ReplacedExchange.start

    def start_into_nan(self, send, recv, hops=1):
        if self.mode != "none":  # "none": recv is send itself, nothing is copied
            recv.fill_(float("nan"))
        return start(self, send, recv, hops)

    monkeypatch.setattr(ReplacedExchange, "start", start_into_nan)

    gen = torch.Generator().manual_seed(22)
    q, k, v, dout = (
        torch.randn(1, seqlen, n, head_dim, generator=gen).to(device, dtype)
        for n in (heads, heads // 4, heads // 4, heads)
    )
    steps = step_kernels_for(AUTO, q)
    masks = dense_step_masks(AttentionMask(True), [seqlen] * 4, layout == "zigzag")
    options = (StepSpec(head_dim**-0.5), "", steps, masks)

    def ring(mode, rank):
        exchange = ReplacedExchange(mode, virtual_world_size=4, virtual_rank=rank)
        out, lse = ring_forward(q, k, v, *options, exchange=exchange)
        return [out, *ring_backward(dout, q, k, v, out, lse, *options, exchange=exchange)]

    return {mode: [ring(mode, rank) for rank in (0, 3)] for mode in modes}


def assert_copies_agree(results):
    """Every copying mode agrees bit for bit with the first, and with no exchange at all
    ("none") for out and dq: a block read before its copy landed, or overwritten while
    still read, would not (the copies deliver this rank's own K|V)."""
    first, *others = [mode for mode in results if mode != "none"]
    for rank, want in zip((0, 3), results[first]):
        for mode in others:
            got = results[mode][(0, 3).index(rank)]
            for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
                assert torch.equal(a, b), f"rank {rank} {name}: {first} differs from {mode}"
        alone = results["none"][(0, 3).index(rank)]
        for name, a, b in zip(("out", "dq"), want, alone):
            assert torch.isfinite(a).all(), f"rank {rank} {name}: not finite ({first})"
            assert torch.equal(a, b), f"rank {rank} {name}: {first} differs from no exchange"


@needs_gpu
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_gpu_virtual_ring_overlapped_copies_match_serial_copies(monkeypatch, layout):
    # The exchange is a device-to-device copy on a side stream ("copy", overlapped as
    # NCCL's would be) or on the compute stream ("serial_copy").
    results = virtual_ring_results(monkeypatch, "cuda", torch.bfloat16, 2048, 8, 128, layout,
                                   ("copy", "serial_copy", "none"))  # fmt: skip
    assert_copies_agree(results)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_virtual_ring_harness_dry_run_on_cpu(monkeypatch, layout):
    # The GPU test's harness, the same code with the copies on the CPU (no side stream
    # there: "serial_copy" only), so that a drift of the ring's interface fails here.
    results = virtual_ring_results(monkeypatch, "cpu", torch.float32, 12, 4, 16, layout, ("serial_copy", "none"))
    assert_copies_agree(results)


def test_ring_posts_and_waits_with_the_buffers_device_current(monkeypatch):
    # NCCL posts and waits on the current device's streams: Ring.start and RingWork.wait
    # run under device_guard of the buffers' device (a no-op for CPU ones).
    from seqpar_kernels.comm import ring as ring_module

    assert isinstance(ring_module.device_guard(torch.device("cuda", 1)), torch.cuda.device)
    assert ring_module.device_guard(torch.device("cuda", 1)).idx == 1
    with ring_module.device_guard(torch.device("cpu")):
        pass  # no CUDA call on CPU devices
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(("enter", self.device))

        def __exit__(self, *exc):
            entered.append(("exit", self.device))

    class Work:
        def wait(self):
            entered.append(("wait",))

    monkeypatch.setattr(ring_module, "device_guard", Recorder)
    monkeypatch.setattr(ring_module.dist, "batch_isend_irecv",
                        lambda ops: entered.append(("post", len(ops))) or [Work()])  # fmt: skip
    monkeypatch.setattr(ring_module.dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(ring_module.dist, "P2POp", lambda *arguments: arguments)
    ring = ring_module.Ring(SINGLE_PROCESS)
    ring.world_size, ring.group = 2, None
    send, recv = torch.zeros(3), torch.empty(3)
    ring.start(send, recv).wait()
    cpu = send.device
    assert entered == [("enter", cpu), ("post", 2), ("exit", cpu), ("enter", cpu), ("wait",), ("exit", cpu)]
