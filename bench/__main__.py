"""python -m bench: the seqpar-kernels microbenchmark suite.

    python -m bench                      4 CPU ranks over gloo, or every local GPU over NCCL:
                                         every family at representative sizes (minutes)
    python -m bench --full               the largest sizes (about 27 minutes on 2 cores)
    python -m bench --quick              tiny shapes, seconds (the CI smoke test)
    python -m bench --plan [--full]      what a run would do and about how long it takes
    python -m bench --short              the default sizes, fewer timed rounds, the dk/dv tiles only
                                         (the short GPU check: scripts/gpu_check.sh --short)
    python -m bench --only kernels       one family (repeatable): each module of bench/families/
                                         is one, python -m bench --help names them and what
                                         each measures; "ring" runs the ring's GPU overlap
                                         probe after it
    torchrun --nproc-per-node 8 -m bench one rank per GPU, started by torchrun

Prints the plan first (each family's sizes and about how long it takes: bench/runner/plan.py), a
line per family with the time left, one line per case as it goes, then a summary with the
targets (bench/runner/targets.py: bytes at theory, agreement, pack/unpack bandwidth and speed, ring
and USP accuracy, zigzag share of ideal, overlap, step kernel speed, the loss's memory bound;
the transformers modes' loss and gradients against one process's count as agreement) marked
met or not met, and writes <device>-<backend><P>-<date>[-quick|-full].csv, .json and .png
under --out.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.runner.family import found_families
from bench.runner.launch import Options, launch
from bench.runner.plan import DEFAULT_BUDGET_S

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def parse_options(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to spawn (default: all local GPUs with nccl, 4 with gloo; "
                             "ignored under torchrun)")  # fmt: skip
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl when CUDA GPUs are present, else gloo")  # fmt: skip
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (seconds)")
    sizes.add_argument("--full", action="store_true",
                       help="the largest sizes (default: representative sizes, minutes in all)")  # fmt: skip
    parser.add_argument("--plan", action="store_true",
                        help="print what the run would do and about how long it takes, and run nothing")  # fmt: skip
    parser.add_argument(
        "--short",
        action="store_true",
        help="the default sizes, 10 to 30 timed rounds a case, the dk/dv tiles of the sweep (the short GPU check)",
    )
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help=f"the run's time budget: timed rounds sized to end within it (default: "
                             f"{DEFAULT_BUDGET_S:.0f} for the default sizes, none for --quick and --full; "
                             f"0: none)")  # fmt: skip
    parser.add_argument("--measure-work", action="store_true",
                        help="meter each family's seconds by kind of work on rank 0 (float, half, exchange, host), "
                             "for the work shares a family declares; slows the run a little")  # fmt: skip
    families = found_families()
    parser.add_argument("--only", choices=list(families), action="append", default=None, metavar="FAMILY",
                        help="run only this family (repeatable; default: all, in this order): " +
                             "; ".join(f"{name}: {family.measures}" for name, family in families.items()))  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results directory (default: {DEFAULT_OUT})")  # fmt: skip
    args = parser.parse_args(argv)
    budget = args.budget if args.budget is not None else (None if args.quick or args.full else DEFAULT_BUDGET_S)
    return Options(
        budget_s=budget or None,  # 0: none
        started=time.monotonic(),
        world_size=args.world_size,
        backend=args.backend,
        quick=args.quick,
        full=args.full,
        plan_only=args.plan,
        only=tuple(dict.fromkeys(args.only or families)),  # in order, each once
        out=args.out,
        short=args.short,
        measure_work=args.measure_work,
    )


if __name__ == "__main__":
    launch(parse_options())
