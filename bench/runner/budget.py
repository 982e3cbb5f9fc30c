"""The run's time budget: this machine's speed measured first (the calibration), the plan's
estimates scaled to it, and each family's timed rounds sized so that the run ends within
its budget; sized again after every family from the time the families so far took.

    calibration   every rank at once, a few seconds: one probe per kind of work
                  (bench/runner/work.py: fp32 and bf16 matmul + attention forward +
                  backward on the cores the ranks share, a gloo round trip of 1 MiB; host
                  work at the fp32 pace); the slowest rank's lower quartile of each
    factor        of a family: its declared work shares (FAMILY.work) weighting each kind's
                  this machine's seconds / the reference machine's (bench/runner/plan.py's
                  REFERENCE): a family spending its time in bf16 gets slower on a CPU
                  without bf16 instructions, an fp32 one does not
    a family      its declared seconds (its FAMILY's sizes) = fixed + timed, timed =
                  its timed_share of it (its warm-up and timed rounds; the rest: building
                  cases, checks, which stay whole); on this machine factor x (fixed +
                  max(scale, fewest_share) x timed), fewest_share the share of its rounds
                  it keeps at the fewest (3 timed rounds a case, 1 warm-up)
    scale         of every family's timed rounds (bench/runner/timing.py: the least and most
                  rounds and the seconds a case fills), the largest up to 1 that fits the
                  budget less its RESERVE, MIN_SCALE at least; after each family, the scale
                  of the rest is sized again from what is left of it at the pace measured
                  so far (measured / estimated seconds), never above the first plan's, so a
                  family that runs over its share shrinks the rest's rounds, and the report
                  says so

Cases, checks and every number reported stay: only how many timed rounds each median
takes changes. --quick keeps its few rounds (no budget); --full and the default take
--budget (the default run: bench/runner/plan.py's DEFAULT_BUDGET_S; --full: none unless given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bench.runner.plan import RunPlan, duration
from bench.runner.work import HOST_WORK, PROBED, probe_seconds

# The probes' seconds (lower quartiles) on the reference machine (bench/runner/plan.py's REFERENCE: 4 gloo
# ranks on 2 cores, idle but for them), by kind of work (bench/runner/work.py).
REFERENCE_SECONDS = {"float": 0.048, "half": 0.095, "exchange": 0.0078}
# The fewest rounds a budget leaves: a fifth of the default's (3 timed rounds at least,
# bench/runner/timing.py), enough for a median.
MIN_SCALE = 0.2
# Seconds on the reference machine outside the families: the ranks' start and the
# calibration before the first family, the summary, figures and report after the last.
START_S, FINISH_S = 6.0, 6.0
# A family counts as over its share beyond this much more than its estimate.
OVER_SHARE = 1.1
# The share of the budget the plan leaves for its estimates' error: the probes' readings
# move by about a tenth from one calibration to the next (a plan to the whole budget,
# its scale raised as early families ran under their estimates, ended 46 s over 540 s).
RESERVE = 0.08


@dataclass(frozen=True)
class Calibration:
    """Each kind's probe's seconds (lower quartile) on the slowest rank, every rank at once
    (exchange: 0 on one rank, where nothing is exchanged)."""

    seconds: dict[str, float]

    def ratio(self, kind: str) -> float:
        """This machine's seconds per reference second at one kind of work (host work at
        the float probe's: work.PROBED)."""
        if kind not in PROBED or (kind == "exchange" and self.seconds["exchange"] <= 0):
            return self.ratio("float")
        return self.seconds[kind] / REFERENCE_SECONDS[kind]

    def factor(self, work: dict[str, float] = HOST_WORK) -> float:
        """This machine's seconds per reference second for work split by kind as `work`
        (above 1: slower or busier)."""
        return sum(share * self.ratio(kind) for kind, share in work.items() if share)

    def scaled(self, by: float) -> Calibration:
        """This calibration on a machine `by` times slower (tests: a busy machine)."""
        return Calibration({kind: seconds * by for kind, seconds in self.seconds.items()})

    def text(self) -> str:
        """Each kind's probe against the reference's."""
        return ", ".join(f"{kind} x{self.ratio(kind):.2f} ({self.seconds[kind] * 1e3:.1f} ms vs "
                         f"{REFERENCE_SECONDS[kind] * 1e3:.1f} ms)" for kind in PROBED)  # fmt: skip


REFERENCE = Calibration(REFERENCE_SECONDS)


def calibrate(world_size: int, barrier, reduce_max) -> Calibration:
    """Every rank calls this together: each kind's probe (bench/runner/work.py), the
    slowest rank's.

    barrier(): lines the ranks up; reduce_max(tensor) -> the elementwise max over ranks."""
    mine = probe_seconds(world_size, barrier)
    slowest = reduce_max(torch.tensor([mine[kind] for kind in PROBED], dtype=torch.float64))
    return Calibration(dict(zip(PROBED, slowest.tolist())))


@dataclass
class Budget:
    """The plan sized to this machine and a budget: sets plan.estimates (this machine's
    seconds at the scale of each family's rounds) and re-sizes after each family."""

    plan: RunPlan
    calibration: Calibration | None  # None: not calibrated (GPUs), the declared estimates
    budget_s: float | None  # None: no budget, every family's rounds as declared
    reference: dict[str, float | None] = field(init=False)  # the declared seconds per family
    scale: float = field(init=False)  # of the timed rounds of the families still to run
    first_scale: float = field(init=False)  # the first plan's: the most the rest's may take
    planned: dict[str, float | None] = field(init=False)  # the estimates printed before the first family
    scales: dict[str, float] = field(default_factory=dict)  # family -> the scale it ran with
    notes: list[str] = field(default_factory=list)  # families over their share, and what it did to the rest
    fits: bool = True  # the plan fits the budget at MIN_SCALE or more

    def __post_init__(self) -> None:
        self.reference = dict(self.plan.estimates)
        if self.calibration is not None:
            self.plan.factors = {name: self.family_factor(name) for name in self.plan.families}
        start = None if self.budget_s is None else self.budget_s * (1 - RESERVE) - START_S * self.factor
        self.scale = self.first_scale = self._fit(list(self.plan.families), start, pace=1.0)
        self._set_estimates(list(self.plan.families))
        self.planned = dict(self.plan.estimates)
        fixed, _ = self.parts(list(self.plan.families))
        if self.budget_s is not None and self.planned_total() > self.budget_s:
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

    def family_factor(self, name: str) -> float:
        """This machine's seconds per reference second for the family `name`'s kinds of work."""
        own = self.plan.own[name]
        if self.calibration is None or not own:
            return self.factor
        return self.calibration.factor(own[0].work)

    def parts(self, names: list[str]) -> tuple[float, float]:
        """This machine's (fixed, timed) seconds of the families `names`, at scale 1."""
        fixed = timed = 0.0
        for name in names:
            seconds = (self.reference[name] or 0.0) * self.family_factor(name)
            share = self.plan.families[name][0].timed_share if self.plan.size != "quick" else 0.0
            fixed += seconds * (1 - share)
            timed += seconds * share
        return fixed, timed

    def seconds_at(self, name: str, scale: float) -> float:
        """This machine's seconds of the family `name` with its timed rounds at `scale`:
        fixed + timed x max(scale, its fewest_share), the share of its rounds it keeps at
        the fewest (a family of few rounds a case keeps most of them)."""
        fixed, timed = self.parts([name])
        fewest = self.plan.families[name][0].fewest_share
        return fixed + timed * max(scale, fewest)

    def _fit(self, names: list[str], seconds_left: float | None, pace: float) -> float:
        """The largest scale up to 1 (MIN_SCALE at least) at which `names` fit seconds_left,
        the families' time being pace x seconds_at(scale) and the run's finish after."""
        if seconds_left is None or self.plan.size == "quick":
            return 1.0
        room = seconds_left / pace - FINISH_S * self.factor

        def total(scale: float) -> float:
            return sum(self.seconds_at(name, scale) for name in names if self.reference[name])

        if total(1.0) <= room:
            return 1.0
        low, high = MIN_SCALE, 1.0
        for _ in range(40):  # bisection: the total grows with the scale
            middle = (low + high) / 2
            low, high = (middle, high) if total(middle) <= room else (low, middle)
        return low

    def _set_estimates(self, names: list[str]) -> None:
        for name in names:
            if self.reference[name] is None:
                continue
            self.plan.estimates[name] = self.seconds_at(name, self.scale)

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
        return (f"calibrated: {machine} per kind of work this much of the reference's time "
                f"({self.calibration.text()}); each family's estimate follows its own kinds")  # fmt: skip

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
            # Never above the first plan's scale: time a family leaves goes to the reserve.
            left = self.budget_s * (1 - RESERVE) - run_elapsed_s
            self.scale = min(self.first_scale, self._fit(names, left, self.plan.pace()))
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
            "calibration": None if self.calibration is None else self.calibration.seconds,
            "reference_calibration": REFERENCE.seconds,
            "family_factors": {name: round(self.family_factor(name), 3) for name in self.plan.families},
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
