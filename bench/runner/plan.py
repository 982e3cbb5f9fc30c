"""What a run will do and about how long it takes: each family's three sizes, declared by
its FAMILY, the plan printed before the first case, and the estimate of what is left
printed as the run goes.

    --quick   tiny shapes, few rounds: shows that everything runs (seconds a family)
    default   every family at representative sizes: every number, check and target of the
              suite, within DEFAULT_BUDGET_S (bench/runner/budget.py sizes its timed rounds to fit)
    --full    the suite's largest sizes (minutes a family on a CPU)

A family declares its sizes in its FAMILY (bench/runner/family.py) as Sizes(quick=Size(...),
default=Size(...), full=Size(...)): what each size runs, in a line, and about how many
seconds it takes on the reference machine (REFERENCE; `python -m bench --only <family>`
with --quick, none or --full, its CPU seconds and wall time: bench/README.md lists the
measurements), and on a GPU node where measured. A name `--only` takes runs its family and
those the family names to run after it; its estimate is the sum of theirs. As the run
goes, what is left is the remaining families' estimates scaled by the pace so far
(measured / estimated time of the families done), so a slower or busier machine than the
reference gets a later estimate after the first family.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # family.py imports Sizes from here
    from bench.runner.family import Family

SIZE_NAMES = ("quick", "default", "full")
# The machine the declared CPU seconds are for, a CI runner's: 2 cores, the default 4
# gloo ranks.
REFERENCE_CORES, REFERENCE_WORLD_SIZE = 2, 4
REFERENCE = f"{REFERENCE_WORLD_SIZE} gloo ranks on {REFERENCE_CORES} cores"
# The default run's budget (python -m bench, bench/runner/budget.py): with scripts/setup.sh
# already set up (12 s on the reference machine), setup and bench end inside 10 minutes on
# a 2-core machine like CI's, with a margin for the interpreter's start and a busier machine.
DEFAULT_BUDGET_S = 540.0


def size_name(quick: bool, full: bool) -> str:
    """The size the --quick and --full flags select: "quick", "full" or "default"."""
    return "quick" if quick else ("full" if full else "default")


@dataclass(frozen=True)
class Size:
    runs: str  # what this size runs on CPU, in a line: shapes, cases
    cpu_s: float  # seconds on REFERENCE (0 for a family that runs only on a GPU)
    gpu_runs: str = ""  # what it runs on GPUs, where that differs
    gpu_s: float | None = None  # seconds on one GPU node (every GPU over NCCL); None: not measured


@dataclass(frozen=True)
class Sizes:
    quick: Size
    default: Size
    full: Size

    def at(self, size: str) -> Size:
        if size not in SIZE_NAMES:
            raise ValueError(f"size must be one of {SIZE_NAMES}, got {size!r}")
        return getattr(self, size)


def family_estimate(families: tuple[Family, ...], size: str, on_gpu: bool) -> float | None:
    """Seconds of `families` at `size` (CPU or GPU), None where any is not measured."""
    total = 0.0
    for family in families:
        declared = family.sizes.at(size)
        seconds = declared.gpu_s if on_gpu else declared.cpu_s
        if seconds is None:
            return None
        total += seconds
    return total


def duration(seconds: float | None) -> str:
    """ "45 s", "3 min 20 s", "1 h 5 min"; "?" for None."""
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        minutes, rest = divmod(seconds, 60)
        return f"{minutes} min" + (f" {rest} s" if rest else "")
    hours, rest = divmod(seconds // 60, 60)
    return f"{hours} h" + (f" {rest} min" if rest else "")


def machine_note(world_size: int, backend: str, on_gpu: bool) -> str:
    """Where this run's machine differs from the one the estimates were measured on."""
    if on_gpu:
        return "for a GPU node where known, else '?'"
    cores = os.cpu_count() or 1
    if (cores, world_size) == (REFERENCE_CORES, REFERENCE_WORLD_SIZE):
        return f"estimates for {REFERENCE}, as this run"
    return f"estimates for {REFERENCE}; this run: {world_size} {backend} ranks on {cores} cores, so a rough guide"


@dataclass
class RunPlan:
    """The families of a run with their estimates; tracks what is done, so that what is
    left is the remaining estimates at the pace measured so far."""

    families: dict[str, tuple[Family, ...]]  # name -> the families it runs, in run order
    size: str
    on_gpu: bool
    own: dict[str, tuple[Family, ...]] = field(init=False)  # name -> the families it runs first
    runs_with: dict[str, str] = field(init=False)  # a name whose families all ran before -> where
    estimates: dict[str, float | None] = field(init=False)
    elapsed: dict[str, float] = field(default_factory=dict)  # finished family -> seconds
    # Per name, this machine's seconds per reference second (bench/runner/budget.py calibrates
    # them; empty: not calibrated): the other sizes' totals in the heading are scaled by them.
    factors: dict[str, float] = field(default_factory=dict)
    _started: float = field(default_factory=time.perf_counter)
    _family_started: float = 0.0

    def __post_init__(self) -> None:
        # A family two names run (the ring's probe) runs once, with the first of them.
        first: dict[str, str] = {}
        for name, families in self.families.items():
            for family in families:
                first.setdefault(family.name, name)
        self.own = {
            name: tuple(f for f in families if first[f.name] == name) for name, families in self.families.items()
        }
        self.runs_with = {
            name: first[families[0].name] for name, families in self.families.items() if not self.own[name]
        }
        self.estimates = self._estimates(self.size)

    def _estimates(self, size: str) -> dict[str, float | None]:
        return {name: family_estimate(own, size, self.on_gpu) for name, own in self.own.items()}

    @property
    def total_estimate(self) -> float | None:
        values = list(self.estimates.values())
        return None if None in values else sum(values)

    def lines(self, world_size: int, backend: str) -> list[str]:
        """The plan, printed before the first case: the run's estimate and the other sizes',
        then per family what it runs and about how long."""
        flags = {"quick": "--quick", "default": "no flag", "full": "--full"}
        if all(seconds is None for seconds in self.estimates.values()):
            lines = [f"plan: {self.size} sizes (how long they take is not measured on this kind of machine yet)"]
        else:
            others = "; ".join(f"{flags[size]}: about {self._total_text(size)}"
                               for size in SIZE_NAMES if size != self.size)  # fmt: skip
            note = "calibrated" if self.factors else machine_note(world_size, backend, self.on_gpu)
            lines = [f"plan: {self.size} sizes, about {self._total_text(self.size, self.estimates)} for the "
                     f"families ({others}; {note})"]  # fmt: skip
        width = max(len(name) for name in self.families)
        for name, own in self.own.items():
            if name in self.runs_with:
                lines.append(f"  {name:<{width}}  {duration(0):>10}  (runs with {self.runs_with[name]})")
                continue
            declared = [family.sizes.at(self.size) for family in own]
            runs = "; ".join(text for size in declared if (text := (self.on_gpu and size.gpu_runs) or size.runs))
            lines.append(f"  {name:<{width}}  {duration(self.estimates[name]):>10}  {runs or '(no sizes declared)'}")
        return lines

    def _total_text(self, size: str, estimates: dict[str, float | None] | None = None) -> str:
        """The families' estimates at `size` (on this machine: times their factors), summed, naming
        those without one."""
        if estimates is None:
            estimates = {name: None if seconds is None else seconds * self.factors.get(name, 1.0)
                         for name, seconds in self._estimates(size).items()}  # fmt: skip
        unknown = [name for name, seconds in estimates.items() if seconds is None]
        if len(unknown) == len(estimates):
            return "? (not measured)"
        known = duration(sum(seconds for seconds in estimates.values() if seconds is not None))
        return known + (f" + {', '.join(unknown)} (not measured)" if unknown else "")

    def pace(self) -> float:
        """Measured / estimated seconds over the finished families with estimates (1 before any)."""
        done = [(self.elapsed[name], self.estimates[name]) for name in self.elapsed if self.estimates[name]]
        estimated = sum(estimate for _, estimate in done)
        return sum(measured for measured, _ in done) / estimated if estimated > 0 else 1.0

    def left(self) -> float | None:
        """Seconds still to run: the unfinished families' estimates at the pace so far
        (None where one of them has no estimate)."""
        remaining = [self.estimates[name] for name in self.families if name not in self.elapsed]
        if None in remaining:
            return None
        return sum(remaining) * self.pace()

    def start(self, name: str) -> str:
        """The family's heading line."""
        self._family_started = time.perf_counter()
        return f"== {name} == (about {duration(self._scaled(self.estimates[name]))}; {self._left_text()})"

    def finish(self, name: str) -> str:
        """The line after the family: its time against the estimate, the run's so far, what is left."""
        self.elapsed[name] = time.perf_counter() - self._family_started
        return (f"{name}: {duration(self.elapsed[name])} (estimated {duration(self.estimates[name])}); "
                f"{duration(time.perf_counter() - self._started)} so far, {self._left_text()}")  # fmt: skip

    def record(self) -> dict:
        """The JSON's record of the plan: per family the estimate and, once run, the time."""
        return {name: {"estimate_s": self.estimates[name],
                       "elapsed_s": None if name not in self.elapsed else round(self.elapsed[name], 1)}
                for name in self.families}  # fmt: skip

    def _scaled(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds * self.pace()

    def _left_text(self) -> str:
        left = self.left()
        if left is None:
            return "time left unknown"
        if len(self.elapsed) == len(self.families):
            return "the summary next"
        return f"about {duration(left)} left in all"
