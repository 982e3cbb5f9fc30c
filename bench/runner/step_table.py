"""python -m bench.runner.step_table RESULTS [--table PATH]: writes the step backend a GPU run
measured into this checkout's table of step_backend="auto"
(seqpar_kernels/engine/step_backends.json), from the run's results.

The GPU bench (python -m bench --only ring-step) records the backend it measured in its
JSON ("step_backend": the GPU family, the entry, what was compared) and writes it into
the table of the checkout it runs in. A run on another machine (scripts/gpu_check.sh
--short on a rented GPU) brings back only its results folder: this command applies the
folder's entry to the checkout it is run in. RESULTS is that folder, or the JSON itself.
The other families' entries stay as they are.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.runner import hardware
from seqpar_kernels.engine.step_backends import record_measured_step_backend

# The table of this checkout: the source tree's, never an installed package's copy.
SOURCE_TABLE = hardware.REPO_ROOT / "seqpar_kernels" / "engine" / "step_backends.json"
# The key of a results JSON that holds the measurement (bench/families/ring_step.py).
RESULTS_KEY = "step_backend"


def measurement(document: dict) -> dict:
    """The results JSON's step-backend measurement: {"family", "entry", "summary",
    "cases"}; entry is None where none was recorded (a check failed). Raises ValueError
    when the run measured none (ring-step did not run on a GPU)."""
    if RESULTS_KEY not in document:
        raise ValueError("the run measured no step backend (python -m bench --only ring-step on a GPU does)")
    return document[RESULTS_KEY]


def results_document(path: Path) -> tuple[Path, dict]:
    """(the JSON, its contents): `path` itself, or the one JSON in the folder `path` that
    holds a measurement."""
    if path.is_file():
        return path, json.loads(path.read_text())
    found = []
    for candidate in sorted(path.glob("*.json")):
        try:
            document = json.loads(candidate.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(document, dict) and RESULTS_KEY in document:
            found.append((candidate, document))
    if len(found) != 1:
        names = [str(candidate) for candidate, _ in found]
        raise ValueError(f"{path}: expected one results JSON with a step-backend measurement, found {names or 'none'}")
    return found[0]


def write_entry(family: str, entry: dict, table: Path | None = None) -> Path:
    """Writes `entry` ({"backend", "measured": true, "basis"}) as `family`'s in `table`
    (default: SOURCE_TABLE)."""
    table = table or SOURCE_TABLE
    record_measured_step_backend(family, entry["backend"], entry["basis"], path=str(table))
    return table


def apply(results: Path, table: Path | None = None) -> str:
    """Writes the measurement in `results` into `table` (default: SOURCE_TABLE); returns
    what it wrote. Raises ValueError when the results hold no entry to write."""
    table = table or SOURCE_TABLE
    path, document = results_document(results)
    measured = measurement(document)
    if measured["entry"] is None:
        raise ValueError(f"{path}: {measured['family']}: no backend recorded: {measured['summary']}")
    write_entry(measured["family"], measured["entry"], table)
    return f"{measured['family']}: {measured['entry']['backend']} ({measured['entry']['basis']}) written to {table}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.runner.step_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("results", type=Path, help="a results folder, or a results JSON")
    parser.add_argument("--table", type=Path, default=SOURCE_TABLE,
                        help=f"the table to write (default: {SOURCE_TABLE})")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        print(apply(args.results, args.table))
    except ValueError as error:
        raise SystemExit(f"python -m bench.runner.step_table: {error}") from None


if __name__ == "__main__":
    main()
