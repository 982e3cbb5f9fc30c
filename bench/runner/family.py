"""What a benchmark family provides, and finding the families: every module of
bench/families/ (bar shared/, the helpers several of them use) declares one module-level
FAMILY = Family(...), and the runner knows the families only through it.

    name      what `python -m bench --only` selects it by: the module's name with "-" for "_"
    order     where it runs in a whole run (smaller first)
    measures  what it times, against what, in a line (the --only help)
    run       run(ctx): its cases on one rank, each row recorded through ctx (bench/runner/cases.py)
    sizes     what --quick, the default and --full run and about how long (bench/runner/plan.py)
    timed_share  the share of its default seconds spent in timed rounds, which a budget
              scales (bench/runner/budget.py): its rows' reps x per-call seconds over its
              measured seconds in the reference run bench/results/cpu-intel-xeon-gloo4-20261128-0434
              (rounded down where rows share a timed call); the JSON's plan keeps each run's
              measured timed_s to correct it
    fewest_share  the share of its warm-up and timed rounds it keeps at the fewest (a
              case's 1 warm-up and 3 timed rounds, bench/runner/timing.py, against its
              declared): DEFAULT_FEWEST_SHARE with the suite's 3 + 15, more for a family of
              fewer rounds a case (the transformers' 1 + 5: 4 of 6)
    work      how its default seconds on the reference machine split between the kinds of
              work (bench/runner/work.py: float, half, exchange, host), shares adding up to
              1, from `python -m bench --only <family> --measure-work` there: the
              calibration weighs this machine's speed at each kind by them
    metadata  metadata(): what the run's JSON records about it where it runs (its baseline's
              note, why a part was skipped); an entry whose value is None is left out
    then      the families that run right after it under its name (ring: the ring's probe),
              each at most once a run
    preload   modules imported once before CPU ranks fork where it runs, which they then
              share (transformers: the library and its Llama, about 6 s of CPU a rank)
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from bench.runner.context import Context
from bench.runner.plan import Sizes
from bench.runner.work import DEFAULT_WORK, check_work

# The share of a case's rounds the fewest keep with the suite's repetitions (bench/runner/launch.py's
# REPETITIONS: 3 warm-up + 15 timed; the fewest: 1 + 3).
DEFAULT_FEWEST_SHARE = (1 + 3) / (3 + 15)

# The one folder of bench/families/ that holds no family: the helpers several families share.
SHARED = "shared"


def no_metadata() -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    name: str
    order: int
    measures: str
    run: Callable[[Context], object]
    sizes: Sizes
    timed_share: float = 0.5
    fewest_share: float = 0.0  # 0: DEFAULT_FEWEST_SHARE
    work: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WORK))
    metadata: Callable[[], dict] = no_metadata
    then: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sizes, Sizes):
            raise ValueError(f"family {self.name!r}: sizes must be a Sizes, got {self.sizes!r}")
        if not 0.0 <= self.timed_share <= 1.0:
            raise ValueError(f"family {self.name!r}: timed_share must be within [0, 1], got {self.timed_share}")
        object.__setattr__(self, "work", check_work(self.work, f"family {self.name!r}"))
        object.__setattr__(self, "fewest_share", self.fewest_share or DEFAULT_FEWEST_SHARE)
        if not 0.0 < self.fewest_share <= 1.0:
            raise ValueError(f"family {self.name!r}: fewest_share must be within (0, 1], got {self.fewest_share}")
        if self.name in self.then:
            raise ValueError(f"family {self.name!r} names itself in then={self.then}")


def family_modules() -> list[str]:
    """The names of bench/families/' modules that must each declare FAMILY."""
    import bench.families

    return sorted(info.name for info in pkgutil.iter_modules(bench.families.__path__) if info.name != SHARED)


@functools.cache  # found on first use: a family's module imports this one
def found_families() -> dict[str, Family]:
    """Every family of bench/families/, by name, in run order. Raises ValueError naming the
    module whose FAMILY is missing or malformed, or the families `then` names that are not there."""
    found = []
    for module_name in family_modules():
        family = getattr(importlib.import_module(f"bench.families.{module_name}"), "FAMILY", None)
        if not isinstance(family, Family):
            raise ValueError(f"bench/families/{module_name}.py must declare FAMILY = Family(...), got {family!r}")
        if family.name.replace("-", "_") != module_name:
            raise ValueError(f"bench/families/{module_name}.py declares the family {family.name!r}: its name "
                             f"must be the module's, with '-' for '_'")  # fmt: skip
        found.append(family)
    families = {family.name: family for family in sorted(found, key=lambda family: (family.order, family.name))}
    for family in families.values():
        missing = [name for name in family.then if name not in families]
        if missing:
            raise ValueError(f"family {family.name!r} runs {missing} after it, which bench/families/ lacks")
    return families


def runs() -> dict[str, tuple[Family, ...]]:
    """What each name --only takes runs, in run order: the family, then those its `then` names."""
    families = found_families()
    return {name: (family, *(families[other] for other in family.then)) for name, family in families.items()}
