"""The source distribution holds everything the build needs: an sdist made from a copy of
this tree, installed CPU-only into a fresh virtual environment, compiles the extension
there and imports from there."""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The copy leaves out what a build or a checkout adds: without .git, setuptools' file
# finders (setuptools-scm, where installed) list nothing, and without an old *.egg-info
# its SOURCES.txt is not read back into the new sdist. The sdist then holds what
# MANIFEST.in and pyproject.toml select, as it does for anyone who builds one.
COPY_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.so")

# Measured on 2 busy cores: the CPU-only compile takes 1-3 minutes.
INSTALL_TIMEOUT_S = 1800


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _clean_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(extra)
    return env


def _build_sdist(source: Path, out_dir: Path) -> Path:
    # setuptools' PEP 517 hook, the one that `python -m build --sdist --no-isolation` and
    # pip call: no build front end to install, no package index needed.
    result = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))",
         str(out_dir)],
        cwd=source, capture_output=True, text=True, env=_clean_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, _tail(result.stdout + result.stderr)
    return out_dir / result.stdout.strip().splitlines()[-1]


def _tree_files(top: Path, pattern: str) -> set[str]:
    return {path.relative_to(top.parent).as_posix() for path in top.rglob(pattern) if path.is_file()}


def test_sdist_builds_and_installs_cpu_only_in_a_fresh_venv(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=COPY_IGNORE)
    sdist = _build_sdist(source, tmp_path / "dist")

    # Everything the build reads is in it: CMakeLists.txt and every file under csrc/
    # (headers and .cu files too), and every module of every subpackage.
    with tarfile.open(sdist) as archive:
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/"
        members = {name.removeprefix(prefix) for name in archive.getnames()}
    needed = {"CMakeLists.txt", "setup.py", "pyproject.toml", "README.md"}
    needed |= _tree_files(source / "csrc", "*") | _tree_files(source / "seqpar_kernels", "*.py")
    needed |= _tree_files(source / "seqpar_kernels", "*.json")  # the step backend table
    assert not needed - members, f"missing from {sdist.name}: {sorted(needed - members)}"
    assert not [name for name in members if name.endswith(".so")], "a compiled module in the sdist"

    # --system-site-packages: the venv reuses the installed torch, pybind11 and pip
    # (downloading torch would take gigabytes). --without-pip: that pip serves the venv,
    # installing into the venv's own site-packages, which come before the system's, so
    # the venv's seqpar_kernels wins over an editable install of this tree there.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)  # fmt: skip
    python = venv / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        # This python is itself a venv, whose packages --system-site-packages does not
        # reach (it means the base interpreter's): add them after the new venv's own.
        site_packages = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True, env=_clean_env(),
        ).stdout.strip()  # fmt: skip
        (Path(site_packages) / "_outer_venv.pth").write_text(
            "".join(f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages())
        )
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index",
         "--no-cache-dir", str(sdist)],
        cwd=tmp_path, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
        env=_clean_env(SEQPAR_FORCE_CPU="1", MAX_JOBS=str(os.cpu_count() or 1)),
    )  # fmt: skip
    log = install.stdout + install.stderr
    (tmp_path / "install.log").write_text(log)
    assert install.returncode == 0, _tail(log)
    assert "seqpar-kernels build: built CPU kernels only (SEQPAR_FORCE_CPU=1)" in log, _tail(log)

    # Run from tmp_path: `python -m` puts the working directory first on sys.path, and
    # from this tree's root that would import the tree's own package.
    info = subprocess.run([str(python), "-m", "seqpar_kernels.info"], cwd=tmp_path, capture_output=True,
                          text=True, env=_clean_env(), timeout=300)  # fmt: skip
    assert info.returncode == 0, info.stdout + info.stderr
    # "  key  value" lines (keys have single spaces, two or more stand before the value)
    report = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in info.stdout.splitlines()[1:])
    assert report.get("CUDA kernels compiled") == "no (CPU kernels only)", info.stdout
    # The venv's own install, not an editable install of this tree in the system's
    # site-packages nor the tree itself.
    location = Path(report.get("installed at", "")).resolve()
    assert location.is_relative_to(venv.resolve()), info.stdout
    # The data the package reads at run time came along: step_backend="auto"'s table.
    table = subprocess.run(
        [str(python), "-c", "from seqpar_kernels.engine.step_backends import step_backend_table as t; print(len(t()))"],
        cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), timeout=300,
    )  # fmt: skip
    assert table.returncode == 0 and table.stdout.strip() == "5", table.stdout + table.stderr
