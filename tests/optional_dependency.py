"""What the tests of an integration with an optional library share: that the core package
never imports the library, and a rerun of the integration's test file under the library's
oldest supported release, which scripts/setup.sh installs into build/<name>-<version>
(and which the rerun puts first on PYTHONPATH).

    assert_never_imported("diffusers")
    run_under_oldest_release("diffusers", "0.35.2", __file__, "-k selection")

The rerun sets SEQPAR_<NAME>_OLDEST=1, which the file's own rerun test skips on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


def oldest_marker(name: str) -> str:
    """The environment variable a rerun under the oldest release sets."""
    return f"SEQPAR_{name.upper()}_OLDEST"


def assert_never_imported(name: str) -> None:
    """`import seqpar_kernels` leaves the library `name` unimported."""
    code = f"import sys, seqpar_kernels; sys.exit({name!r} in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def run_under_oldest_release(name: str, version: str, test_files: str | list[str], selection: str) -> None:
    """The tests of test_files (one path or several, run in one session: they share its
    rank pools) that `selection` (pytest -k) picks, in a subprocess whose `name` is
    release `version` from build/ (skipped where the set-up could not install it)."""
    path = REPOSITORY / "build" / f"{name}-{version}"
    if not (path / name).is_dir():
        pytest.skip(f"{name} {version} is not installed in {path} (scripts/setup.sh does it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
               **{oldest_marker(name): "1"})  # fmt: skip
    found = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__version__)"],
                           env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert found == version
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         *([test_files] if isinstance(test_files, str) else test_files), "-k", selection],
        env=env, cwd=REPOSITORY, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
