"""The causal-LM loss of one rank's tokens: sequence_parallel_cross_entropy (the LM head
fused in, logits chunk_size tokens at a time) against materialised logits.

Row (bench column "loss"), forward + backward (the hidden and weight gradients), fp32:
  ours      sequence_parallel_cross_entropy(hidden, weight, labels), default chunk_size
            (2**26 // vocab: 512 tokens at a 128K vocabulary)
  baseline  F.cross_entropy((hidden @ weight.T).float(), labels): every token's logits
            at once, as a model without a fused loss computes them
  columns   ours_peak_bytes / baseline_peak_bytes: the most the CPU allocator held
            during one forward + backward beyond what it held before (seqpar_kernels.
            testing.peak_cpu_memory: the allocator's own events under torch.profiler,
            the gradients included); peak_bound_bytes: ours' bound (LossCase.bound);
            ours_s / baseline_s: median seconds per forward + backward, timed side by
            side; speedup = baseline / ours

Memory per rank does not depend on the world size (the loss's collectives move two
numbers), so the family runs in one process: rank 0, with every core of the machine on
CPU (ours and the baseline alike) and a group of its own (the loss over the world would
wait for the other ranks), while the other ranks wait at a barrier. The sizes:
vocabulary 128K (131072), DEFAULT_TOKENS per rank (--full: FULL_TOKENS, 4K to 64K),
hidden size 64: the logits' size and the softmax work do not depend on the hidden size,
and 64 keeps the GEMMs of 64K tokens at about a minute per forward + backward on 2 cores.

The baseline holds about MATERIALISED_PEAK_FACTOR x the fp32 logits (the logits, their
log-softmax, the gradient), 12 GiB at 8K tokens x 128K: it is run only when that
estimate plus MEMORY_MARGIN fits in the memory available when the case starts
(/proc/meminfo's MemAvailable); above, the row says "not run" with the estimate, and
ours is timed alone.

check: the loss against F.cross_entropy over TOKENS_PER_SLICE-token slices of the
logits (an independent reference that fits at every size: the sum of the slices' sums
over the real tokens), and, where the baseline ran, both gradients against its; "matches"
within fp32 tolerances (LOSS_TOLERANCE relative; gradients GRAD_TOLERANCE of their
largest value), else "MISMATCH ...".
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import LOSS_BENCH, Row
from bench.runner.timing import time_side_by_side
from seqpar_kernels import sequence_parallel_cross_entropy
from seqpar_kernels.parallel.cross_entropy import default_chunk_size
from seqpar_kernels.testing import peak_cpu_memory

BASELINE_NOTE = (
    "loss: ours = sequence_parallel_cross_entropy (fused LM head, logits chunk_size tokens at a time) on "
    "one rank, baseline = materialised logits (hidden @ W.T, then F.cross_entropy), forward + backward, "
    "fp32; peak = the CPU allocator's most bytes held during the call; x = baseline time / ours"
)

VOCAB = 131072
HIDDEN = 64
# --full: up to 64K tokens, where the materialised logits (96 GiB) no longer fit; the
# default: two sizes at which both run, the materialised peak growing with the tokens
# while ours stays one chunk (at 4K the materialised call alone takes 13 s on 2 cores:
# --full's first size).
FULL_TOKENS = (4096, 8192, 16384, 32768, 65536)
DEFAULT_TOKENS = (1024, 2048)
# --quick: small enough for seconds, with chunks well below the tokens so that the
# bound still means something.
QUICK_VOCAB, QUICK_HIDDEN, QUICK_TOKENS, QUICK_CHUNK = 8192, 32, (256, 1024), 64
# Ignored labels (ignore_index) among the tokens.
IGNORED_SHARE = 0.1
# Measured: forward + backward of materialised fp32 logits peaks at 3.0 x the logits
# (1500 MiB at 4096 x 32000: the logits, the log-softmax, the gradient), plus the
# parameters' gradients.
MATERIALISED_PEAK_FACTOR = 3
MEMORY_MARGIN = 3 * 2**30
# Per case: the big ones take about a minute a call (FULL_TOKENS), so few rounds;
# small ones get more, up to seconds_per_case.
REPETITIONS = dict(warmup=1, reps=3, max_reps=10, seconds_per_case=20.0)
# The loss's independent reference: F.cross_entropy over this many tokens at a time.
TOKENS_PER_SLICE = 4096
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
MiB, GiB = 2**20, 2**30


@dataclass(frozen=True)
class LossCase:
    tokens: int
    vocab: int
    hidden: int
    chunk_size: int | None  # None: the function's default

    @property
    def chunk(self) -> int:
        return self.chunk_size or default_chunk_size(self.vocab)

    @property
    def logits_bytes(self) -> int:
        return self.tokens * self.vocab * 4

    @property
    def gradient_bytes(self) -> int:
        """The fp32 hidden and weight gradients."""
        return (self.tokens + self.vocab) * self.hidden * 4

    @property
    def bound(self) -> int:
        """Ours' peak at most: one chunk's fp32 logits with room for a second,
        the gradients, and 1 MiB for per-token vectors."""
        return 2 * self.chunk * self.vocab * 4 + self.gradient_bytes + MiB

    @property
    def materialised_estimate(self) -> int:
        return MATERIALISED_PEAK_FACTOR * self.logits_bytes + self.gradient_bytes

    @property
    def label(self) -> str:
        return f"T={self.tokens} V={self.vocab} H={self.hidden}"

    @property
    def shape(self) -> str:
        return (f"hidden ({self.tokens}, {self.hidden}) weight ({self.vocab}, {self.hidden}) "
                f"chunk_size {self.chunk}")  # fmt: skip


def loss_cases(ctx: Context) -> list[LossCase]:
    if ctx.quick:
        return [LossCase(tokens, QUICK_VOCAB, QUICK_HIDDEN, QUICK_CHUNK) for tokens in QUICK_TOKENS]
    return [LossCase(tokens, VOCAB, HIDDEN, None) for tokens in (FULL_TOKENS if ctx.full else DEFAULT_TOKENS)]


SIZES = Sizes(
    quick=Size("vocabulary 8192, 256 and 1024 tokens", 2),
    default=Size(
        f"vocabulary 128K, {' and '.join(f'{t // 1024}K' for t in DEFAULT_TOKENS)} tokens, both sides on every core",
        56,
    ),
    full=Size(
        f"vocabulary 128K, {', '.join(f'{t // 1024}K' for t in FULL_TOKENS)} tokens (materialised "
        "logits where they fit)",
        2661,
    ),
)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def baseline_fits(case: LossCase) -> tuple[bool, str]:
    """Whether the materialised baseline is run, and why (for the detail column)."""
    available = available_memory()
    estimate = f"materialised needs about {case.materialised_estimate / GiB:.1f} GiB " \
               f"({MATERIALISED_PEAK_FACTOR} x {case.logits_bytes / GiB:.1f} GiB of fp32 logits)"  # fmt: skip
    if available is None:
        return case.materialised_estimate + MEMORY_MARGIN <= 16 * GiB, f"{estimate}; available memory unknown"
    fits = case.materialised_estimate + MEMORY_MARGIN <= available
    return fits, f"{estimate}, {available / GiB:.1f} GiB available"


def _inputs(case: LossCase, ctx: Context):
    hidden = ctx.random((case.tokens, case.hidden), torch.float32, 20).requires_grad_()
    weight = (ctx.random((case.vocab, case.hidden), torch.float32, 21) / math.sqrt(case.hidden)).requires_grad_()
    generator = torch.Generator(device=ctx.device).manual_seed(22)
    labels = torch.randint(0, case.vocab, (case.tokens,), generator=generator, device=ctx.device)
    ignored = torch.rand(case.tokens, generator=generator, device=ctx.device) < IGNORED_SHARE
    return hidden, weight, labels.masked_fill(ignored, -100)


def sliced_loss(hidden, weight, labels) -> float:
    """The mean loss by F.cross_entropy over TOKENS_PER_SLICE tokens at a time (fp64 sum)."""
    total, count = 0.0, int((labels != -100).sum())
    with torch.no_grad():
        for start in range(0, labels.numel(), TOKENS_PER_SLICE):
            rows = slice(start, start + TOKENS_PER_SLICE)
            total += F.cross_entropy(hidden[rows] @ weight.t(), labels[rows], reduction="sum").double().item()
    return total / max(count, 1)


def relative_error(mine: torch.Tensor, expected: torch.Tensor) -> float:
    return (mine.double() - expected.double()).abs().max().item() / max(expected.abs().max().item(), 1e-30)


def measure_loss(case: LossCase, ctx: Context, group) -> Row:
    hidden, weight, labels = _inputs(case, ctx)

    def clear():
        hidden.grad = weight.grad = None

    def ours():
        loss = sequence_parallel_cross_entropy(hidden, weight, labels, group=group, chunk_size=case.chunk_size)
        loss.backward()
        return loss.detach()

    def baseline():
        loss = F.cross_entropy((hidden @ weight.t()).float(), labels)
        loss.backward()
        return loss.detach()

    fits, fit_note = baseline_fits(case)
    # Peaks first, each from a clean start (gradients freed outside the measured call).
    clear()
    loss, ours_peak = peak_cpu_memory(ours)
    ours_grads = (hidden.grad, weight.grad)
    expected_loss = sliced_loss(hidden, weight, labels)
    worst = {"loss": abs(loss.item() - expected_loss) / abs(expected_loss)}
    errors = [f"loss vs F.cross_entropy over {TOKENS_PER_SLICE}-token slices: relative error {worst['loss']:.1e}"]
    baseline_peak = None
    if fits:
        clear()
        _, baseline_peak = peak_cpu_memory(baseline)
        for name, mine, expected in zip(("hidden", "weight"), ours_grads, (hidden.grad, weight.grad)):
            worst[f"{name} grad"] = relative_error(mine, expected)
            errors.append(f"{name} grad vs materialised: {worst[name + ' grad']:.1e} of its largest value")
    del ours_grads
    clear()
    gc.collect()
    failed = [name for name, error in worst.items()
              if error > (LOSS_TOLERANCE if name == "loss" else GRAD_TOLERANCE)]  # fmt: skip
    check = "matches" if not failed else f"MISMATCH {', '.join(failed)}"

    loss_ctx = dataclasses.replace(ctx, **({} if ctx.quick else REPETITIONS))
    candidates = {"ours": lambda: (clear(), ours())}
    if fits:
        candidates["baseline"] = lambda: (clear(), baseline())
    timings = time_side_by_side(candidates, loss_ctx, collective=False)
    clear()
    detail = "; ".join([
        f"fp32, forward + backward, {IGNORED_SHARE:.0%} of labels ignored",
        f"ours peak {ours_peak / MiB:.1f} MiB (bound {case.bound / MiB:.1f} MiB: 2 chunks of fp32 logits "
        f"{2 * case.chunk * case.vocab * 4 / MiB:.0f} MiB + gradients {case.gradient_bytes / MiB:.1f} MiB + 1 MiB)",
        (f"materialised peak {baseline_peak / MiB:.1f} MiB ({baseline_peak / case.logits_bytes:.2f} x the logits); "
         if fits else "materialised not run: ") + fit_note,
        *errors,
    ])  # fmt: skip
    fields = dict(
        bench=LOSS_BENCH, case=case.label, shape=case.shape, dtype="fp32", check=check,
        ours_peak_bytes=ours_peak, baseline_peak_bytes=baseline_peak, peak_bound_bytes=case.bound, detail=detail,
    )  # fmt: skip
    if fits:
        return timed_row(ctx, timings, **fields)
    ours_timing = timings["ours"]
    return Row(
        world_size=ctx.world_size, backend=ctx.backend, device=ctx.device_name, ours_s=ours_timing.median_s,
        baseline_s=math.nan, speedup=math.nan, ours_faster_share=math.nan, noise=ours_timing.spread,
        reps=len(ours_timing.samples_s), **fields,
    )  # fmt: skip


def run(ctx: Context) -> list[Row]:
    rows = []
    # The loss's group: rank 0 alone (the world's other ranks wait at the barrier below, so
    # a loss over the world would wait for them). new_group is collective: every rank.
    group = dist.new_group([0]) if ctx.world_size > 1 else None
    if ctx.is_root:
        ctx.log(BASELINE_NOTE)
        with ctx.every_core():  # ours and the baseline alike
            ctx.log(f"loss: one process (rank 0, {torch.get_num_threads()} threads: every core, both sides); "
                    f"available memory {(available_memory() or 0) / GiB:.1f} GiB (the baseline runs where its "
                    f"estimate fits)")  # fmt: skip
            for case in loss_cases(ctx):
                rows += run_case(ctx, LOSS_BENCH, measure_loss, case, group)
    ctx.barrier()  # the other ranks wait here, leaving the cores to rank 0
    return rows


FAMILY = Family(
    name="loss",
    order=110,
    measures="the fused LM loss against materialised logits: peak memory and time (one process)",
    run=run,
    sizes=SIZES,
    timed_share=0.80,
    work={"float": 0.89, "host": 0.11},
    fewest_share=0.75,  # 1 warm-up + 3 to 10 timed rounds a case: measured 34 s of rounds at the fewest, 45 s at full
    metadata=lambda: {"loss_baseline": BASELINE_NOTE},
)
