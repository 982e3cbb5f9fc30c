"""The README's example is examples/quickstart.py, and it runs under torchrun."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_example_is_quickstart():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert block == (ROOT / "examples" / "quickstart.py").read_text()


def test_quickstart_runs_under_torchrun():
    # PYTHONFAULTHANDLER: a rank killed by a signal prints every thread's Python stack,
    # so a crash at teardown says where it happened.
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONFAULTHANDLER="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "rank 0 sent" in result.stdout and "rank 1 sent" in result.stdout
