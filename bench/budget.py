"""The run's time budget: this machine's speed measured first (the calibration), the plan's
estimates scaled to it, and each family's timed rounds sized so that the run ends within
its budget; sized again after every family from the time the families so far took.

    calibration   every rank at once, a second or two: a small matmul and a bf16
                  attention forward + backward (what the families time, on the cores the
                  ranks share), and a gloo round trip of 1 MiB; the slowest rank's median
    factor        this machine's seconds / the reference machine's (bench/plan.py's
                  REFERENCE) for the same probes: COMPUTE_WEIGHT of compute, the rest the
                  round trip
    a family      its declared seconds (bench/plan.py's SIZES) = fixed + timed, timed =
                  TIMED_SHARE of it (its timed rounds; the rest: building cases, warm-up,
                  checks, which stay whole); on this machine factor x (fixed + scale x timed)
    scale         of every family's timed rounds (bench/timing.py: the least and most
                  rounds and the seconds a case fills), the largest up to 1 that fits the
                  budget, MIN_SCALE at least; after each family, the scale of the rest is
                  sized again from what is left of the budget at the pace measured so far
                  (measured / estimated seconds), so a family that runs over its share
                  shrinks the rest's rounds, and the report says so

Cases, checks and every number reported stay: only how many timed rounds each median
takes changes. --quick keeps its few rounds (no budget); --full and the default take
--budget (the default run: bench/plan.py's DEFAULT_BUDGET_S; --full: none unless given).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.plan import RunPlan, duration

# The probes' seconds on the reference machine (4 gloo ranks on this project's 2 cores,
# load 3.4 with them): 80 to 105 ms and 7 to 20 ms over 15 calibrations there.
REFERENCE_COMPUTE_S = 0.085
REFERENCE_ROUND_TRIP_S = 0.011
# Every family computes far more than it exchanges on CPU ranks.
COMPUTE_WEIGHT = 0.8
# The share of each family's default seconds spent in timed rounds: its rows' reps x
# per-call seconds over its measured seconds in the reference run
# bench/results/cpu-intel-xeon-gloo4-20261128-0434 (rounded down where rows share a
# timed call: usp, varlen, hybrid, transformers); memory times its own single steps.
# The JSON's plan keeps each run's measured timed_s to correct them.
TIMED_SHARE = {
    "reshard": 0.65,
    "ulysses": 0.7,
    "kernels": 0.4,
    "ring": 0.6,
    "usp": 0.5,
    "varlen": 0.6,
    "variants": 0.45,
    "hybrid": 0.6,
    "loss": 0.6,
    "transformers": 0.6,
    "video": 0.5,
    "memory": 0.0,
    "inference": 0.3,
}
DEFAULT_TIMED_SHARE = 0.5
# The fewest rounds a budget leaves: a fifth of the default's (3 timed rounds at least,
# bench/timing.py), enough for a median.
MIN_SCALE = 0.2
# Seconds on the reference machine outside the families: the ranks' start and the
# calibration before the first family, the summary, figures and report after the last
# (measured: 21 s and 19 s at x3.8, 52 s in all at x5.1 with every family's figure).
START_S, FINISH_S = 6.0, 6.0
# A family counts as over its share beyond this much more than its estimate.
OVER_SHARE = 1.1


@dataclass(frozen=True)
class Calibration:
    compute_s: float  # the compute probe's median seconds on the slowest rank, every rank at once
    round_trip_s: float  # a 1 MiB all_reduce's median seconds (0 on one rank)

    def factor(self) -> float:
        """This machine's seconds per reference second (above 1: slower or busier)."""
        compute = self.compute_s / REFERENCE_COMPUTE_S
        if self.round_trip_s <= 0:  # one rank: nothing exchanged
            return compute
        return COMPUTE_WEIGHT * compute + (1 - COMPUTE_WEIGHT) * self.round_trip_s / REFERENCE_ROUND_TRIP_S

    def scaled(self, by: float) -> Calibration:
        """This calibration on a machine `by` times slower (tests: a busy machine)."""
        return Calibration(self.compute_s * by, self.round_trip_s * by)


REFERENCE = Calibration(REFERENCE_COMPUTE_S, REFERENCE_ROUND_TRIP_S)
PROBE_ROUNDS = 9


def _compute_probe() -> None:
    """One round of what the families time: a matmul and a causal bf16 attention step."""
    a = torch.ones(256, 256)
    (a @ a).sum().item()
    q, k, v = (torch.full((1, 4, 256, 64), 0.01, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def _median_seconds(call, rounds: int) -> float:
    call()  # warm-up: lazy initialisation, first-touch pages
    samples = []
    for _ in range(rounds):
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def calibrate(world_size: int, barrier, reduce_max) -> Calibration:
    """Every rank calls this together: the probes' medians, the slowest rank's.

    barrier(): lines the ranks up; reduce_max(tensor) -> the elementwise max over ranks."""
    barrier()
    compute = _median_seconds(_compute_probe, PROBE_ROUNDS)
    round_trip = 0.0
    if world_size > 1:
        payload = torch.zeros(2**18)  # 1 MiB of fp32
        barrier()
        round_trip = _median_seconds(lambda: dist.all_reduce(payload), PROBE_ROUNDS)
    slowest = reduce_max(torch.tensor([compute, round_trip], dtype=torch.float64))
    return Calibration(*slowest.tolist())


@dataclass
class Budget:
    """The plan sized to this machine and a budget: sets plan.estimates (this machine's
    seconds at the scale of each family's rounds) and re-sizes after each family."""

    plan: RunPlan
    calibration: Calibration | None  # None: not calibrated (GPUs), the declared estimates
    budget_s: float | None  # None: no budget, every family's rounds as declared
    reference: dict[str, float | None] = field(init=False)  # the declared seconds per family
    scale: float = field(init=False)  # of the timed rounds of the families still to run
    planned: dict[str, float | None] = field(init=False)  # the estimates printed before the first family
    scales: dict[str, float] = field(default_factory=dict)  # family -> the scale it ran with
    notes: list[str] = field(default_factory=list)  # families over their share, and what it did to the rest
    fits: bool = True  # the plan fits the budget at MIN_SCALE or more

    def __post_init__(self) -> None:
        self.reference = dict(self.plan.estimates)
        self.plan.factor = self.factor
        start = None if self.budget_s is None else self.budget_s - START_S * self.factor
        self.scale = self._fit(list(self.plan.families), start, pace=1.0)
        self._set_estimates(list(self.plan.families))
        self.planned = dict(self.plan.estimates)
        fixed, _ = self.parts(list(self.plan.families))
        if self.budget_s is not None and self.planned_total() > self.budget_s * OVER_SHARE:
            self.fits = False
            self.notes.append(
                f"the plan does not fit the budget of {duration(self.budget_s)}: about "
                f"{duration(self.planned_total())} at the fewest rounds (x{MIN_SCALE}); the cases and checks alone "
                f"take about {duration(fixed + self.overhead())} on this machine"
            )

    @property
    def factor(self) -> float:
        return 1.0 if self.calibration is None else self.calibration.factor()

    def overhead(self) -> float:
        return (START_S + FINISH_S) * self.factor

    def parts(self, names: list[str]) -> tuple[float, float]:
        """This machine's (fixed, timed) seconds of the families `names`, at scale 1."""
        fixed = timed = 0.0
        for name in names:
            seconds = self.reference[name] or 0.0
            share = TIMED_SHARE.get(name, DEFAULT_TIMED_SHARE) if self.plan.size != "quick" else 0.0
            fixed += seconds * (1 - share) * self.factor
            timed += seconds * share * self.factor
        return fixed, timed

    def _fit(self, names: list[str], seconds_left: float | None, pace: float) -> float:
        """The largest scale up to 1 (MIN_SCALE at least) at which `names` fit seconds_left,
        the families' time being pace x (fixed + scale x timed) and the run's finish after."""
        if seconds_left is None or self.plan.size == "quick":
            return 1.0
        fixed, timed = self.parts(names)
        room = seconds_left / pace - fixed - FINISH_S * self.factor
        if timed <= 0:
            return 1.0
        return min(1.0, max(MIN_SCALE, room / timed))

    def _set_estimates(self, names: list[str]) -> None:
        for name in names:
            if self.reference[name] is None:
                continue
            fixed, timed = self.parts([name])
            self.plan.estimates[name] = fixed + self.scale * timed

    def planned_total(self) -> float:
        """The run's planned seconds: the families' and the start and finish."""
        return sum(seconds or 0.0 for seconds in self.planned.values()) + self.overhead()

    def plan_lines(self, world_size: int, backend: str, cores: int) -> list[str]:
        """The plan printed before the first family: its heading, the calibration and the
        budget, then per family what it runs and about how long on this machine."""
        heading, *families = self.plan.lines(world_size, backend)
        return [heading, *self._lines(world_size, backend, cores), *families]

    def _lines(self, world_size: int, backend: str, cores: int) -> list[str]:
        """What the plan's heading adds: the calibration, the budget and the scale."""
        text = self._calibration_text(f"this machine ({world_size} {backend} ranks on {cores} cores, now) takes")
        if self.budget_s is None:
            budget = f"no budget: every family's timed rounds as declared; about {duration(self.planned_total())}"
        else:
            budget = (f"budget {duration(self.budget_s)}: timed rounds x{self.scale:.2f} of the declared; "
                      f"about {duration(self.planned_total())} with the start (ranks, calibration) and the finish "
                      f"(summary, figures, report)")  # fmt: skip
        return [text, budget] + self.notes

    def _calibration_text(self, machine: str) -> str:
        """The calibration against the reference's, or why there is none."""
        if self.calibration is None:
            return "not calibrated (the probes time CPU work): the declared GPU estimates"
        return (f"calibrated: {machine} x{self.factor:.2f} the reference's time (compute probe "
                f"{self.calibration.compute_s * 1e3:.1f} ms vs {REFERENCE.compute_s * 1e3:.1f} ms, 1 MiB round trip "
                f"{self.calibration.round_trip_s * 1e3:.2f} ms vs {REFERENCE.round_trip_s * 1e3:.2f} ms)")  # fmt: skip

    def start(self, name: str) -> float:
        """The scale of the family's timed rounds, recorded."""
        self.scales[name] = self.scale
        return self.scale

    def finish(self, name: str, elapsed_s: float, run_elapsed_s: float) -> str | None:
        """After a family (elapsed_s: its seconds, run_elapsed_s: the run's so far, the same
        on every rank): sizes the rest again; says so where the family ran over its share."""
        names = [other for other in self.plan.families if other not in self.plan.elapsed and other != name]
        before = self.scale
        if self.budget_s is not None:
            self.scale = self._fit(names, self.budget_s - run_elapsed_s, self.plan.pace())
            self._set_estimates(names)
        estimate = self.plan.estimates[name]
        if not estimate or elapsed_s <= estimate * OVER_SHARE:
            return None
        note = f"{name} took {duration(elapsed_s)} of its {duration(estimate)}"
        if self.budget_s is not None and names:
            note += f": the rest's timed rounds x{before:.2f} -> x{self.scale:.2f}"
        self.notes.append(note)
        return note

    def record(self, run_elapsed_s: float | None) -> dict:
        """The JSON's record: the budget, the calibration, the plan against the time taken."""
        return {
            "budget_s": self.budget_s,
            "planned_s": round(self.planned_total(), 1),
            "elapsed_s": None if run_elapsed_s is None else round(run_elapsed_s, 1),
            "within_budget": None if run_elapsed_s is None or self.budget_s is None
            else run_elapsed_s <= self.budget_s,
            "fits": self.fits,
            "factor": round(self.factor, 3),
            "calibration": None if self.calibration is None else asdict(self.calibration),
            "reference_calibration": asdict(REFERENCE),
            "scales": {name: round(scale, 3) for name, scale in self.scales.items()},
            "notes": list(self.notes),
        }  # fmt: skip

    def family_record(self, timed_s: dict[str, float]) -> dict:
        """The JSON's plan: per family the estimate printed first (planned_s), the last
        one before it ran (estimate_s), the time it took, its timed rounds' seconds and
        their scale."""
        record = self.plan.record()
        for name, entry in record.items():
            planned = self.planned.get(name)
            entry.update(planned_s=None if planned is None else round(planned, 1),
                         repeat_scale=None if name not in self.scales else round(self.scales[name], 3),
                         timed_s=None if name not in timed_s else round(timed_s[name], 1))  # fmt: skip
            if entry["estimate_s"] is not None:
                entry["estimate_s"] = round(entry["estimate_s"], 1)
        return record

    def report_lines(self, run_elapsed_s: float) -> list[str]:
        """The report's account of the time: the run against its plan and budget, the
        calibration, each family against its estimate, what the budget did."""
        lines = [self.summary_line(run_elapsed_s) + ".", "",
                 self._calibration_text("this machine took") + ".", "",
                 "| family | planned | estimate when it started | took | timed rounds x |",
                 "|---|---|---|---|---|"]  # fmt: skip
        for name in self.plan.families:
            took = self.plan.elapsed.get(name)
            scale = self.scales.get(name)
            lines.append(f"| {name} | {duration(self.planned.get(name))} | {duration(self.plan.estimates[name])} | "
                         f"{'not run' if took is None else duration(took)} | "
                         f"{'-' if scale is None else f'{scale:.2f}'} |")  # fmt: skip
        if self.notes:
            lines += [""] + [f"- budget: {note}" for note in self.notes]
        return lines

    def summary_line(self, run_elapsed_s: float) -> str:
        """The run's time against its plan and budget."""
        against = "" if self.budget_s is None else f", budget {duration(self.budget_s)}"
        within = "" if self.budget_s is None else (" (within it)" if run_elapsed_s <= self.budget_s else " (OVER it)")
        return f"time: {duration(run_elapsed_s)}, planned {duration(self.planned_total())}{against}{within}"
