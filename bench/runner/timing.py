"""The one timing helper: candidates timed side by side, interleaved, median of N."""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from bench.runner.context import Context


@dataclass(frozen=True)
class Timing:
    samples_s: tuple[float, ...]  # one per timed round, in round order

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def spread(self) -> float:
        """Interquartile range / median: how noisy the samples were."""
        samples, median = self.samples_s, self.median_s
        if median <= 0:
            return 0.0
        if len(samples) < 4:
            return (max(samples) - min(samples)) / median
        quartiles = statistics.quantiles(samples, n=4)
        return (quartiles[2] - quartiles[0]) / median


def share_faster(ours: Timing, baseline: Timing) -> float:
    """The fraction of rounds in which ours beat the baseline. Rounds pair the two calls
    made moments apart, so this sign test sees through drift that moves both: near 0.5
    the two are indistinguishable, near 0 or 1 one is faster beyond doubt."""
    pairs = list(zip(ours.samples_s, baseline.samples_s))
    return sum(mine < theirs for mine, theirs in pairs) / len(pairs)


def _time_once(fn: Callable[[], object], ctx: Context, collective: bool) -> float:
    """Seconds of one call of fn on this rank.

    collective: every rank calls fn together. A barrier first lines the ranks up, so that
    no rank's time includes waiting for a late peer to arrive at the collective."""
    ctx.sync()
    if collective:
        ctx.barrier()
    if ctx.on_gpu:
        # CUDA events time the device work, not the host's launch of it.
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()  # CPU ops (gloo collectives included) return when their work is done
    return time.perf_counter() - begin


# The fewest timed rounds of a case whatever the budget (bench/runner/budget.py): a median of three.
MIN_REPS = 3


def _repetitions(round_seconds: float, ctx: Context, collective: bool) -> int:
    """Timed rounds for a case: at least ctx.reps, more for cheap cases (up to
    ctx.max_reps) so that each case gets about ctx.seconds_per_case of samples: on
    shared cores a cheap case's median needs many samples to settle. All three scaled
    by ctx.repeat_scale (the budget's), never below MIN_REPS (or ctx.reps where fewer).
    Every rank must run the same number of rounds, so collective cases agree on the
    slowest estimate."""
    if collective:
        round_seconds = ctx.reduce_over_ranks(torch.tensor([round_seconds], dtype=torch.float64)).item()
    least = max(min(ctx.reps, MIN_REPS), round(ctx.reps * ctx.repeat_scale))
    most = max(least, round(ctx.max_reps * ctx.repeat_scale))
    affordable = int(ctx.seconds_per_case * ctx.repeat_scale / max(round_seconds, 1e-9))
    return max(least, min(most, affordable))


def warmup_rounds(ctx: Context) -> int:
    """Untimed rounds before timing: ctx.warmup scaled by the budget's ctx.repeat_scale as
    the timed rounds are, one at least (its time sizes the timed rounds)."""
    return max(1, min(ctx.warmup, round(ctx.warmup * ctx.repeat_scale)))


def time_side_by_side(
    candidates: Mapping[str, Callable[[], object]], ctx: Context, *, collective: bool = True
) -> dict[str, Timing]:
    """Median seconds per call of each candidate ({"ours": fn, "baseline": fn, ...}).

    Repetitions interleave the candidates (ours, baseline, baseline, ours, ...): clock
    speed, cache contents and the other ranks' load drift over a run, and interleaving
    exposes every candidate to the same drift, so their ratio stays fair even when the
    absolute times wander. The order flips every round so that neither candidate always
    runs on the caches the other left behind. Warm-up rounds come first (allocator,
    first-touch page faults, lazy initialisation in the backends); the last one also
    sizes the number of timed rounds (see _repetitions).

    collective: the candidates run a collective, so every rank must call this together;
        a sample is the slowest rank's time for that call (a collective is as fast as
        its slowest rank). Otherwise each rank times its own calls.
    """
    names = list(candidates)
    round_seconds = 0.0
    began = time.perf_counter()
    for _ in range(warmup_rounds(ctx)):
        begin = time.perf_counter()
        for name in names:
            candidates[name]()
        ctx.sync()
        round_seconds = time.perf_counter() - begin
    reps = _repetitions(round_seconds, ctx, collective)
    # Python's collector pausing inside one sample would be noise charged to one side.
    gc.collect()
    gc.disable()
    try:
        samples = torch.zeros(reps, len(names), dtype=torch.float64)
        for rep in range(reps):
            order = range(len(names)) if rep % 2 == 0 else reversed(range(len(names)))
            for index in order:
                samples[rep, index] = _time_once(candidates[names[index]], ctx, collective)
    finally:
        gc.enable()
        ctx.rounds_clock.seconds += time.perf_counter() - began
    if collective:
        samples = ctx.reduce_over_ranks(samples)
    return {name: Timing(tuple(samples[:, index].tolist())) for index, name in enumerate(names)}
