"""The microbenchmark suite runs end to end (tiny shapes) and writes its CSV, JSON and
plot, with every case computing what its baseline or reference computes and volumes at
theory."""

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick_runs_and_writes_results(tmp_path):
    # A subprocess: the suite forks its ranks, which is unsafe from a process that has
    # already used OpenMP threads (as pytest's has).
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    csv_files = list(tmp_path.glob("*.csv"))
    assert len(csv_files) == 1 and list(tmp_path.glob("*.png")) and list(tmp_path.glob("*.json"))
    rows = list(csv.DictReader(csv_files[0].open()))
    assert {row["bench"] for row in rows} >= {"reshard", "ulysses"}
    # Data movement must be identical to the baseline's; attention must match the
    # reference within the 2x rule ("matches").
    assert all(row["check"] in ("identical", "matches") for row in rows), rows
    assert {row["bench"] for row in rows} >= {"ring", "ring-train"}
    assert all(row["volume_at_theory"] == "True" for row in rows if row["volume_at_theory"]), rows
