"""What the tests of an integration with an optional library share: that the core package
never imports the library, and a rerun of chosen tests under the libraries' oldest supported
releases, which scripts/setup.sh installs into build/<name>-<version> (and which the rerun
puts first on PYTHONPATH).

    assert_never_imported("diffusers")
    run_under_oldest_releases({"diffusers": "0.35.2"}, [path], "selection")
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent


@functools.cache
def _modules_after_import() -> frozenset[str]:
    # One fresh interpreter for every library asked about: each start pays torch's import.
    code = "import json, sys, seqpar_kernels; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return frozenset(json.loads(result.stdout.splitlines()[-1]))


def assert_never_imported(name: str) -> None:
    """`import seqpar_kernels` in a fresh interpreter leaves the library `name` unimported."""
    imported = _modules_after_import()
    assert name not in imported, sorted(module for module in imported if module.split(".")[0] == name)


def run_under_oldest_releases(releases: dict[str, str], test_files: list[str], selection: str) -> None:
    """The tests of test_files that `selection` (pytest -k) picks, in one subprocess (one
    start of its rank pools) with each library of `releases` (name: version) at that
    release from build/; a library not installed there runs at the environment's release,
    and the test skips where none is."""
    paths = {name: REPOSITORY / "build" / f"{name}-{version}" for name, version in releases.items()}
    installed = {name: path for name, path in paths.items() if (path / name).is_dir()}
    if not installed:
        pytest.skip(f"none of {releases} is installed in build/ (scripts/setup.sh does it)")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([*map(str, installed.values()), os.environ.get("PYTHONPATH", "")])
    )
    for name in installed:
        found = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.__version__)"],
                               env=env, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        assert found == releases[name], (name, found)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *test_files, "-k", selection],
        env=env, cwd=REPOSITORY, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
