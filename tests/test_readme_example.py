"""The examples the README and the manual (docs/) show are the files in examples/ as they
are, and they run under torchrun: quickstart (2 ranks), usp (a 2 x 2 grid), varlen (4
ranks) and the transformers training example (3 ranks, where transformers is installed)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def shown_python_blocks() -> list[str]:
    """The Python blocks of the README and of every page of docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [block for page in pages for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def run_example(name: str, ranks: int) -> str:
    """examples/<name> under torchrun on `ranks` CPU ranks (gloo); returns its stdout."""
    # PYTHONFAULTHANDLER: a rank killed by a signal prints every thread's Python stack,
    # so a crash at teardown says where it happened.
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
         str(ROOT / "examples" / name)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("name", ["quickstart.py", "usp.py", "varlen.py"])
def test_the_docs_show_the_example_as_it_is(name):
    assert (ROOT / "examples" / name).read_text() in shown_python_blocks()


def test_quickstart_runs_under_torchrun():
    stdout = run_example("quickstart.py", 2)
    assert "rank 0 sent" in stdout and "rank 1 sent" in stdout


def test_usp_example_runs_under_torchrun():
    stdout = run_example("usp.py", 4)
    assert all(f"rank {rank}:" in stdout for rank in range(4)), stdout


def test_varlen_example_runs_under_torchrun_and_matches_attention_per_document():
    stdout = run_example("varlen.py", 4)
    errors = [float(match) for match in re.findall(r"max error ([0-9.e+-]+)", stdout)]
    assert len(errors) == 4 and max(errors) < 1e-5, stdout


def test_transformers_training_example_matches_one_process():
    pytest.importorskip("transformers")
    stdout = run_example("train_transformers_sp.py", 3)  # 3 ranks: USP on a 3 x 1 grid
    rows = re.findall(r"^\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.e+-]+)$", stdout, re.M)
    assert len(rows) == 9, stdout  # 3 steps x 3 modes
    for _step, single, parallel, _difference in rows:
        assert abs(float(single) - float(parallel)) <= 1e-5 * float(single), stdout
