"""sequence_parallel_cross_entropy and its _from_logits variant
(seqpar_kernels/parallel/cross_entropy.py) against the loss of one process holding
every token: F.cross_entropy(all logits upcast to fp32, all labels, reduction="mean");
with logit_scale / logit_softcap, of the logits so transformed in fp64.

On gloo ranks (world 1-4) every rank builds the same full batch from a seed and takes
its piece of the sequence: torch.tensor_split's, or uneven pieces with an empty rank,
or a rank whose labels are all ignore_index. Each rank compares the loss (the same on
every rank), its piece of the hidden (logits) gradient, and the weight gradient summed
over the ranks, with the single-process reference computed on that rank:
    fp32  loss within FP32_LOSS_TOLERANCE relative, gradients within
          FP32_GRAD_TOLERANCE of their largest value
    bf16  against the fp64 answer, at most ERROR_FACTOR x the error of the plain
          materialised computation in that dtype, plus a unit of roundoff of the
          result's dtype at its magnitude (reference.py's rule, for errors too small
          to measure); fp16 alike, in one process
Rank functions run every case of a world in one call (a pool.run is a round trip).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import pool_for
from on_ranks import on_every_rank, timeout_group

import seqpar_kernels as sp
from seqpar_kernels.engine.cross_entropy import DEFAULT_CHUNK_ELEMENTS, default_chunk_size
from seqpar_kernels.testing import peak_cpu_memory, without_profiler_chatter
from tools import reference

FP32_LOSS_TOLERANCE = 1e-6
FP32_GRAD_TOLERANCE = 1e-5
# The slack of the bf16 rule: a unit of roundoff of the result's dtype (the loss is
# fp32, the gradients bf16) at the exact tensor's magnitude.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@dataclass(frozen=True)
class Case:
    """A full batch (batch, seqlen, hidden) with a vocabulary, split over the ranks."""

    name: str
    batch: int = 2
    seqlen: int = 29  # tensor_split leaves pieces of 8 and 7 at 4 ranks, 10 and 9 at 3
    hidden: int = 16
    vocab: int = 50
    dtype: torch.dtype = torch.float32
    chunk_size: int | None = 7  # divides neither a piece nor the batch's tokens
    ignore_index: int = -100
    split: str = "even"  # even | empty rank | all ignored on the last rank | none real
    memory: str = "contiguous"  # or "hidden-major": hidden (hidden, batch, seq) in memory
    from_logits: bool = False
    seed: int = 0
    logit_softcap: float = 0.0  # what a model's forward does to its logits
    logit_scale: float = 1.0

    @property
    def transforms_logits(self) -> bool:
        return self.logit_softcap != 0.0 or self.logit_scale != 1.0


CASES = [
    Case("fp32"),
    Case("fp32 batch 1", batch=1, seqlen=37),
    Case("chunk_size 1", chunk_size=1),
    Case("default chunk_size", chunk_size=None),
    Case("chunk_size above the tokens", chunk_size=1000),
    Case("ignore_index 7", ignore_index=7),
    Case("hidden-major memory (strided)", memory="hidden-major"),
    Case("uneven pieces, an empty rank", split="empty rank"),
    Case("last rank all ignored", split="all ignored on the last rank"),
    Case("no real token anywhere", split="none real"),
    Case("bf16", dtype=torch.bfloat16, vocab=64, hidden=32),
    Case("bf16, chunk_size 1, empty rank", dtype=torch.bfloat16, chunk_size=1, split="empty rank"),
    Case("logit_softcap 3", logit_softcap=3.0),
    Case("logit_scale 0.37", logit_scale=0.37),
    Case(
        "logit_scale -1.7 and softcap 2, chunk_size 1, empty rank",
        logit_softcap=2.0,
        logit_scale=-1.7,
        chunk_size=1,
        split="empty rank",
    ),
    Case("logit_softcap 3, default chunk_size", logit_softcap=3.0, chunk_size=None),
    Case(
        "bf16, logit_softcap 3 and scale 0.8",
        dtype=torch.bfloat16,
        vocab=64,
        hidden=32,
        logit_softcap=3.0,
        logit_scale=0.8,
    ),
]
CASES += [replace(case, name=f"from logits: {case.name}", from_logits=True) for case in CASES
          if case.name in ("fp32", "ignore_index 7", "uneven pieces, an empty rank", "no real token anywhere",
                           "bf16", "hidden-major memory (strided)")]  # fmt: skip


def full_inputs(case: Case):
    """hidden (batch, seqlen, hidden), weight (vocab, hidden), labels (batch, seqlen):
    the same on every rank. About a fifth of the labels are ignore_index."""
    generator = torch.Generator().manual_seed(case.seed)
    hidden = torch.randn(case.batch, case.seqlen, case.hidden, generator=generator)
    weight = torch.randn(case.vocab, case.hidden, generator=generator) / case.hidden**0.5 * 2
    labels = torch.randint(0, case.vocab, (case.batch, case.seqlen), generator=generator)
    labels[torch.rand(labels.shape, generator=generator) < 0.2] = case.ignore_index
    if case.ignore_index == 7:
        assert (labels == -100).sum() == 0  # -100 would be out of range here
    if case.split == "none real":
        labels[:] = case.ignore_index
    if case.memory == "hidden-major":
        hidden = hidden.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    return hidden.to(case.dtype), weight.to(case.dtype), labels


def lengths_of(case: Case, world_size: int) -> list[int]:
    """Every rank's tokens along the sequence: torch.tensor_split's, or for "empty rank"
    none on rank 0 and rank r's share growing with r (29 tokens on 4 ranks: 0, 4, 9, 16)."""
    if case.split == "empty rank" and world_size > 1:
        weights = sum(range(world_size))
        lengths = [rank * case.seqlen // weights for rank in range(world_size)]
        lengths[-1] += case.seqlen - sum(lengths)
        return lengths
    return reference.even_lengths(case.seqlen, world_size)


def single_process(case: Case, hidden, weight, labels, dtype):
    """(loss, hidden gradient, weight gradient) of the materialised loss on the full
    batch, computed in `dtype` (the logits upcast to fp32 unless dtype is fp64)."""
    hidden = hidden.detach().to(dtype).requires_grad_()
    weight = weight.detach().to(dtype).requires_grad_()
    logits = hidden @ weight.t()
    logits = logits if dtype == torch.float64 else logits.float()
    logits = logits * case.logit_scale
    if case.logit_softcap:
        logits = case.logit_softcap * torch.tanh(logits / case.logit_softcap)
    loss = F.cross_entropy(logits.reshape(-1, case.vocab), labels.reshape(-1), ignore_index=case.ignore_index)
    if not (labels != case.ignore_index).any():
        loss = torch.nan_to_num(loss)  # the mean of nothing: nan; ours is 0 (documented)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def ours(case: Case, hidden, weight, labels, **options):
    """(loss, hidden or logits piece's gradient, weight gradient summed over the ranks)
    with this rank's piece (hidden, labels already cut)."""
    hidden = hidden.detach().requires_grad_()  # keeps the piece's strides
    weight = weight.detach().requires_grad_()
    if case.from_logits:
        loss = sp.sequence_parallel_cross_entropy_from_logits(hidden @ weight.t(), labels,
                                                              ignore_index=case.ignore_index, **options)  # fmt: skip
    else:
        loss = sp.sequence_parallel_cross_entropy(hidden, weight, labels, ignore_index=case.ignore_index,
                                                  chunk_size=case.chunk_size, logit_softcap=case.logit_softcap,
                                                  logit_scale=case.logit_scale, **options)  # fmt: skip
    loss.backward()
    weight_grad = weight.grad.float()
    group = options.get("group")
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(weight_grad, group=group)
    return loss.detach(), hidden.grad, weight_grad


def compare(case: Case, name: str, mine: torch.Tensor, exact: torch.Tensor, plain: torch.Tensor | None) -> str | None:
    """None when `mine` is close enough to `exact` (fp32: the tolerances; fp16/bf16:
    the rule against the plain materialised result in that dtype, `plain`), else what
    went wrong."""
    error = reference.max_error(mine, exact)
    size = reference.magnitude(exact)
    if case.dtype == torch.float32:
        bound = (FP32_LOSS_TOLERANCE if name == "loss" else FP32_GRAD_TOLERANCE) * max(size, 1e-30)
        if mine.numel() and exact.numel() and exact.abs().max() == 0:
            bound = 0.0  # no real token: exactly zero
    else:
        result_dtype = torch.float32 if name == "loss" else case.dtype
        bound = reference.ERROR_FACTOR * reference.max_error(plain, exact) + UNIT_ROUNDOFF[result_dtype] * size
    return None if error <= bound else f"{case.name}: {name} error {error:.3g} > {bound:.3g} (magnitude {size:.3g})"


@on_every_rank
def check_cases_on_ranks(cases: list[Case]) -> list[str]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    failures = []
    for case in cases:
        hidden, weight, labels = full_inputs(case)
        lengths = lengths_of(case, world_size)
        if case.split == "all ignored on the last rank":
            labels = labels.clone()
            labels[:, sum(lengths[:-1]) :] = case.ignore_index
        piece = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
        loss, hidden_grad, weight_grad = ours(case, hidden[:, piece], weight, labels[:, piece], group=timeout_group())
        # Every rank returns the same loss, to the bit.
        losses = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(losses, loss, group=timeout_group())
        if any(not torch.equal(other, loss) for other in losses):
            failures.append(f"{case.name}: ranks returned different losses {losses}")
        exact = single_process(
            case, hidden, weight, labels,
            torch.float64 if case.dtype != torch.float32 or case.transforms_logits else case.dtype,
        )  # fmt: skip
        plain = single_process(case, hidden, weight, labels, case.dtype) if case.dtype != torch.float32 else None
        for index, (name, mine) in enumerate(
            (("loss", loss), ("hidden grad", hidden_grad), ("weight grad", weight_grad))
        ):
            expected = exact[index][:, piece] if name == "hidden grad" else exact[index]
            yardstick = None
            if plain is not None:
                yardstick = plain[index][:, piece] if name == "hidden grad" else plain[index]
            failure = compare(case, name, mine, expected, yardstick)
            if failure:
                failures.append(f"rank {rank}: {failure}")
        if case.split == "none real" and (
            loss.item() != 0.0 or hidden_grad.abs().max() > 0 or weight_grad.abs().max() > 0
        ):
            failures.append(f"{case.name}: loss {loss.item()} and gradients must be exactly 0")
    return failures


def test_matches_one_process_holding_everything(ranks):
    failures = [failure for rank_failures in ranks.run(check_cases_on_ranks, CASES) for failure in rank_failures]
    assert not failures, "\n".join(failures)


def test_without_torch_distributed_is_one_process():
    # The test process has no process group: group=None means this process alone.
    assert not dist.is_initialized()
    fp16 = Case("fp16", dtype=torch.float16, vocab=64, hidden=32)
    for case in (CASES[0], CASES[3], CASES[-1], fp16):
        hidden, weight, labels = full_inputs(case)
        loss, hidden_grad, weight_grad = ours(case, hidden, weight, labels)
        exact = single_process(case, hidden, weight, labels, torch.float64)
        plain = single_process(case, hidden, weight, labels, case.dtype)
        for index, (name, mine) in enumerate(
            (("loss", loss), ("hidden grad", hidden_grad), ("weight grad", weight_grad))
        ):
            reference_result = plain if case.dtype == torch.float32 else exact
            assert compare(case, name, mine, reference_result[index], plain[index]) is None, name


# ----------------------------------------------------------------------------------
# A 2-D mesh
# ----------------------------------------------------------------------------------

_mesh = {}


def ring_ulysses_mesh():
    """DeviceMesh("cpu", [[0, 1], [2, 3]], ("ring", "ulysses")), made once per rank (its
    groups' creation is collective)."""
    if "mesh" not in _mesh:
        from torch.distributed.device_mesh import DeviceMesh

        _mesh["mesh"] = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("ring", "ulysses"))
    return _mesh["mesh"]


@on_every_rank
def mesh_equals_world(case: Case):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    hidden, weight, labels = full_inputs(case)
    lengths = lengths_of(case, world_size)
    piece = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
    by_mesh = ours(case, hidden[:, piece], weight, labels[:, piece], mesh=ring_ulysses_mesh())
    by_world = ours(case, hidden[:, piece], weight, labels[:, piece], group=timeout_group())
    return [tensor.tolist() for tensor in by_mesh], [tensor.tolist() for tensor in by_world]


def test_a_2d_mesh_reduces_over_all_its_ranks():
    for case in (CASES[0], CASES[7]):
        results = pool_for(4).run(mesh_equals_world, case)
        for by_mesh, by_world in results:
            # The 4 ranks' non-negative shares summed in two orders: each within 3 units of fp32
            # roundoff of the sum, so 6 apart at most.
            assert by_mesh[0] == pytest.approx(by_world[0], rel=2 * 3 * 2.0**-24, abs=0)
            assert by_mesh[1:] == by_world[1:]  # this rank's share: the same count, the same bits
        assert len({by_mesh[0] for by_mesh, _ in results}) == 1  # every rank the same loss


# ----------------------------------------------------------------------------------
# Gradients: tied weights, no grad, a second backward
# ----------------------------------------------------------------------------------


def test_tied_embedding_and_lm_head():
    generator = torch.Generator().manual_seed(1)
    embedding = torch.nn.Embedding(40, 12)
    ids = torch.randint(0, 40, (2, 17), generator=generator)
    labels = torch.randint(0, 40, (2, 17), generator=generator)
    layer = torch.nn.Linear(12, 12)

    def gradients(loss_of):
        embedding.zero_grad(set_to_none=True)
        layer.zero_grad(set_to_none=True)
        hidden = torch.tanh(layer(embedding(ids)))
        loss_of(hidden, embedding.weight).backward()
        return embedding.weight.grad.clone(), layer.weight.grad.clone()

    mine = gradients(lambda hidden, weight: sp.sequence_parallel_cross_entropy(hidden, weight, labels, chunk_size=5))
    expected = gradients(lambda hidden, weight: F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten()))
    for got, want in zip(mine, expected):
        assert reference.max_error(got, want) <= FP32_GRAD_TOLERANCE * reference.magnitude(want)


def test_no_grad_and_inputs_without_grad():
    hidden, weight, labels = full_inputs(CASES[0])
    with torch.no_grad():
        loss = sp.sequence_parallel_cross_entropy(hidden.requires_grad_(), weight, labels, chunk_size=4)
    assert loss.grad_fn is None and loss.dtype == torch.float32 and loss.shape == ()
    expected = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten())
    assert loss.item() == pytest.approx(expected.item(), rel=FP32_LOSS_TOLERANCE)
    # Only the weight needs a gradient: the hidden one is never made.
    weight = weight.clone().requires_grad_()
    sp.sequence_parallel_cross_entropy(hidden.detach(), weight, labels).backward()
    assert weight.grad is not None


def test_scaled_loss_scales_the_gradients_and_a_second_backward_raises():
    hidden, weight, labels = full_inputs(CASES[0])
    hidden.requires_grad_()
    loss = sp.sequence_parallel_cross_entropy(hidden, weight, labels, chunk_size=6)
    (loss * 0.25).backward(retain_graph=True)
    expected_loss = F.cross_entropy((hidden @ weight.t()).flatten(0, 1), labels.flatten())
    expected = torch.autograd.grad(expected_loss * 0.25, hidden)[0]
    assert reference.max_error(hidden.grad, expected) <= FP32_GRAD_TOLERANCE * reference.magnitude(expected)
    with pytest.raises(RuntimeError, match="backward called twice"):
        loss.backward()


# ----------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------


def _bad_calls():
    hidden, weight, labels = full_inputs(CASES[0])  # hidden (2, 29, 16), weight (50, 16)
    ce, from_logits = sp.sequence_parallel_cross_entropy, sp.sequence_parallel_cross_entropy_from_logits
    out_of_range = labels.clone()
    out_of_range[1, 3] = 50
    negative = labels.clone()
    negative[0, 0] = -1
    return {
        "leading shapes differ": (
            lambda: ce(hidden, weight, labels[:, :-1]),
            r"shift_labels must have shape \(2, 29\)",
        ),
        "hidden size vs weight": (lambda: ce(hidden, weight[:, :8], labels), r"lm_head_weight \(50, 8\)"),
        "weight not 2-D": (lambda: ce(hidden, weight[0], labels), r"\(vocab, hidden\)"),
        "float labels": (lambda: ce(hidden, weight, labels.float()), "must hold integers"),
        "dtype mismatch": (lambda: ce(hidden, weight.double(), labels), "dtype and device"),
        "fp64 inputs": (lambda: ce(hidden.double(), weight.double(), labels), "must be one of"),
        "chunk_size 0": (lambda: ce(hidden, weight, labels, chunk_size=0), "chunk_size must be a positive int"),
        "chunk_size 2.5": (lambda: ce(hidden, weight, labels, chunk_size=2.5), "chunk_size must be a positive int"),
        "chunk_size True": (lambda: ce(hidden, weight, labels, chunk_size=True), "chunk_size must be a positive int"),
        "label = vocab": (lambda: ce(hidden, weight, out_of_range), r"holds 50, outside \[0, 50\)"),
        "label -1": (lambda: ce(hidden, weight, negative), r"holds -1, outside \[0, 50\)"),
        "logits: label = vocab": (lambda: from_logits(hidden @ weight.t(), out_of_range), "outside"),
        "logits: leading shapes differ": (lambda: from_logits(hidden @ weight.t(), labels[0]), "must have shape"),
        "group and mesh": (lambda: ce(hidden, weight, labels, group=object(), mesh=object()), "not both"),
        "mesh not a DeviceMesh": (lambda: ce(hidden, weight, labels, mesh=[0, 1]), "DeviceMesh"),
        "logit_softcap < 0": (lambda: ce(hidden, weight, labels, logit_softcap=-1.0), "logit_softcap must be"),
        "logit_softcap inf": (lambda: ce(hidden, weight, labels, logit_softcap=float("inf")), "logit_softcap must be"),
        "logit_softcap True": (lambda: ce(hidden, weight, labels, logit_softcap=True), "logit_softcap must be"),
        "logit_scale nan": (lambda: ce(hidden, weight, labels, logit_scale=float("nan")), "logit_scale must be"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_inputs_raise_value_error(name):
    call, message = _bad_calls()[name]
    with pytest.raises(ValueError, match=message):
        call()


@on_every_rank
def bad_labels_on_the_last_rank():
    rank, world_size = dist.get_rank(), dist.get_world_size()
    hidden, weight, labels = full_inputs(CASES[0])
    labels = labels.tensor_split(world_size, dim=1)[rank].clone()
    if rank == world_size - 1:
        labels[0, 0] = 1000
    try:
        sp.sequence_parallel_cross_entropy(hidden.tensor_split(world_size, dim=1)[rank], weight, labels,
                                           group=timeout_group())  # fmt: skip
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_bad_label_on_one_rank_raises_on_every_rank(ranks):
    messages = ranks.run(bad_labels_on_the_last_rank)
    assert "holds 1000" in messages[-1]
    assert all("bad input on rank(s)" in message and "holds 1000" in message for message in messages[:-1])


# ----------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------


def test_default_chunk_size_keeps_a_chunk_of_fp32_logits_at_the_budget():
    assert default_chunk_size(131072) == 512 and default_chunk_size(32000) == DEFAULT_CHUNK_ELEMENTS // 32000
    assert default_chunk_size(2**27) == 1
    assert default_chunk_size(131072, buffers=2) == 256  # a softcap's tanh takes a second buffer


def test_peak_cpu_memory_measures_a_known_allocation():
    def allocate():
        first = torch.empty(2**20)  # 4 MiB
        second = torch.empty(2**21)  # 8 MiB: 12 MiB held
        del first
        third = torch.empty(2**19)  # 2 MiB in the 4 MiB freed: still 12 MiB at most
        return second.numel() + third.numel()

    result, peak = peak_cpu_memory(allocate)
    assert result == 2**21 + 2**19 and peak == 12 * 2**20


# A fresh process, so that the profiler starts for the first time inside the measurement
# (kineto's one-time lines come then): two measurements, the first of a function that
# prints to stderr itself, the second of one that raises.
QUIET_PROFILER = """
import os, torch
from seqpar_kernels.testing import peak_cpu_memory, without_profiler_chatter

def allocate():
    os.write(2, b"the measured function's own line\\n")
    return torch.empty(2**20)

print("peak", peak_cpu_memory(allocate)[1])
from_before = [torch.empty(2**18)]
print("freed", peak_cpu_memory(from_before.clear)[1])  # the allocator's unknown-size warning
try:
    peak_cpu_memory(lambda: 1 / 0)
except ZeroDivisionError:
    print("raised")
"""


def test_peak_cpu_memory_prints_nothing_that_reads_as_a_failure():
    result = subprocess.run([sys.executable, "-c", QUIET_PROFILER], capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["peak", str(4 * 2**20), "freed", "0", "raised"], result.stdout
    # Without the filter: "USDT: ... profiler_start" / "profiler_stop" at every start and stop,
    # "[W ... CPUAllocator.cpp ...] Memory block of unknown size ..." when the block from
    # before is freed, and "ERROR: ... gpuGetDeviceCount failed with code 35" in a CUDA build without a GPU.
    assert result.stderr == "the measured function's own line\n", result.stderr


def test_only_the_profilers_routine_lines_are_dropped():
    start = "USDT:2026-11-26 08:12:35 7351:7351 SyncActivityProfilerHandler.cpp:39] profiler_start\n"
    stop = "USDT:2026-11-26 08:12:35 7351:7351 SyncActivityProfilerHandler.cpp:46] profiler_stop\n"
    no_gpu = "ERROR:2026-11-26 08:12:35 7351:7351 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n"
    failure = "ERROR:2026-11-26 08:12:35 7351:7351 CuptiActivityProfiler.cpp:250] failed to enable activities\n"
    unknown_block = ("[rank0]:[W1126 12:43:52.891947534 CPUAllocator.cpp:245] Memory block of unknown size was "
                     "allocated before the profiling started, profiler results will not include the deallocation "
                     "event\n")  # fmt: skip
    text = start + failure + unknown_block + no_gpu + "a warning of torch's\n" + stop
    assert without_profiler_chatter(text, gpu_available=False) == failure + "a warning of torch's\n"
    # With a GPU, kineto failing to count the devices is a real failure.
    assert without_profiler_chatter(text, gpu_available=True) == failure + no_gpu + "a warning of torch's\n"


@pytest.mark.parametrize("logit_softcap", [0.0, 30.0])
def test_forward_and_backward_hold_one_chunk_of_logits_not_all(logit_softcap):
    # With a softcap, half the tokens per chunk, as the default chunk_size takes them.
    buffers = 2 if logit_softcap else 1
    tokens, vocab, hidden_size, chunk = 4096, 32000, 64, 256 // buffers
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(tokens, hidden_size, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, hidden_size, generator=generator) / 8).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)

    def step():
        sp.sequence_parallel_cross_entropy(hidden, weight, labels, chunk_size=chunk,
                                           logit_softcap=logit_softcap).backward()  # fmt: skip

    _, peak = peak_cpu_memory(step)
    chunk_logits = chunk * vocab * 4
    # One chunk's fp32 logits (worked on in place; with a softcap, its tanh too) with room
    # for one more, the fp32 weight gradient, the hidden gradient, and 1 MiB for per-token
    # vectors.
    bound = (buffers + 1) * chunk_logits + vocab * hidden_size * 4 + tokens * hidden_size * 4 + 2**20
    materialised = tokens * vocab * 4
    assert peak < bound, (peak, bound)
    assert peak < materialised / 10, (peak, materialised)
    assert peak > chunk_logits  # the measurement sees the chunk
