"""Builds seqpar_kernels._C with CMake.

Every build decision is made here, once, and handed to CMake as a cache variable that
CMakeLists.txt requires and only carries out: which torch to build against (its root,
version, C++ ABI and OpenMP), whether to compile the CUDA kernels, with which toolkit and
for which architectures. This file decides because it is what pip runs, it already has
torch imported, and its "seqpar-kernels build: ..." lines are what `pip install -v` shows.

CPU kernels are always compiled. CUDA kernels are compiled when torch is a CUDA build and
a CUDA toolkit whose major version matches torch's CUDA is found (CUDA_HOME, CUDA_PATH,
/usr/local/cuda, or nvcc on PATH); otherwise the build is CPU-only and says why.
Environment knobs:
  SEQPAR_CUDA_ARCHS   CUDA architectures, e.g. "8.0+PTX;9.0a" (the default)
  SEQPAR_FORCE_CPU=1  skip the CUDA kernels even when CUDA is available
  MAX_JOBS            parallel compile jobs (default: one per core)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# Native code for sm_80 (which sm_86/sm_89 also run) and sm_90a, and compute_80 PTX that
# the driver compiles at first use on GPUs newer than both (Blackwell: sm_100, sm_120):
# without it the kernels would fail there with "no kernel image is available".
DEFAULT_CUDA_ARCHS = "8.0+PTX;9.0a"


def log(message: str) -> None:
    print(f"seqpar-kernels build: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class CudaToolkit:
    root: Path
    version: str  # nvcc's full version, e.g. "13.0.88"

    @property
    def nvcc(self) -> Path:
        return self.root / "bin" / "nvcc"

    @property
    def major(self) -> str:
        return self.version.split(".")[0]


@dataclass(frozen=True)
class BuildPlan:
    cmake_args: list[str]
    with_cuda: bool
    description: str  # "CPU kernels only (why)" or "CPU kernels and CUDA kernels (...)"


def find_cuda_home() -> Path | None:
    """The CUDA toolkit root, or None. The nvcc on PATH may be a wrapper script (it is on
    some machines), so a root must hold bin/nvcc and include/cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for candidate in candidates:
        if (
            candidate
            and (Path(candidate) / "bin" / "nvcc").exists()
            and (Path(candidate) / "include" / "cuda_runtime.h").exists()
        ):
            return Path(candidate)
    return None


def cuda_toolkit(root: Path) -> CudaToolkit:
    output = subprocess.run(
        [str(root / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    # "Cuda compilation tools, release 13.0, V13.0.88"
    match = re.search(r"release [\d.]+, V(\d+\.\d+\.\d+)", output) or re.search(r"release (\d+\.\d+)", output)
    if match is None:
        raise RuntimeError(f"cannot read the CUDA version from `{root / 'bin' / 'nvcc'} --version`:\n{output}")
    return CudaToolkit(root, match.group(1))


def torch_settings(torch) -> list[str]:
    """CMake cache variables for the torch this build compiles against: the headers and
    libraries under its root, the version the module reports, and the two settings that
    must agree with torch's own build (C++ ABI, OpenMP)."""
    return [
        f"-DSEQPAR_TORCH_ROOT={Path(torch.__file__).resolve().parent}",
        f"-DSEQPAR_TORCH_VERSION={torch.__version__.split('+')[0]}",
        f"-DSEQPAR_TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-DSEQPAR_TORCH_OPENMP={'ON' if torch.backends.openmp.is_available() else 'OFF'}",
    ]


def cuda_plan(torch) -> BuildPlan:
    """Whether to compile the CUDA kernels, and with what."""

    def cpu_only(why: str) -> BuildPlan:
        return BuildPlan(["-DSEQPAR_WITH_CUDA=OFF"], False, f"CPU kernels only ({why})")

    if os.environ.get("SEQPAR_FORCE_CPU") == "1":
        return cpu_only("SEQPAR_FORCE_CPU=1")
    if torch.version.cuda is None:
        return cpu_only(f"torch {torch.__version__} is not a CUDA build")
    root = find_cuda_home()
    if root is None:
        return cpu_only("no CUDA toolkit found; set CUDA_HOME to build the CUDA kernels")
    toolkit = cuda_toolkit(root)
    if toolkit.major != torch.version.cuda.split(".")[0]:
        return cpu_only(
            f"nvcc {toolkit.version} in {root} does not match torch's CUDA {torch.version.cuda}; "
            "install a matching toolkit to build the CUDA kernels"
        )
    archs = os.environ.get("SEQPAR_CUDA_ARCHS") or DEFAULT_CUDA_ARCHS
    args = [
        "-DSEQPAR_WITH_CUDA=ON",
        f"-DCMAKE_CUDA_COMPILER={toolkit.nvcc}",
        f"-DSEQPAR_CUDA_VERSION={toolkit.version}",
        f"-DSEQPAR_CUDA_ARCHS={archs}",
    ]
    return BuildPlan(args, True, f"CPU kernels and CUDA kernels (nvcc {toolkit.version} in {root}, archs {archs})")


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, extension: Extension) -> None:
        import pybind11
        import torch

        target = Path(self.get_ext_fullpath(extension.name)).resolve()
        plan = cuda_plan(torch)
        # A build folder that outlives pip's temporary ones (editable installs get a new
        # build_temp each time), so a repeated install recompiles only what changed.
        flavour = (
            f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-"
            f"{'cuda' if plan.with_cuda else 'cpu'}"
        )
        build_dir = ROOT / "build" / f"cmake-{flavour}"
        build_dir.mkdir(parents=True, exist_ok=True)
        log(f"building {plan.description} against torch {torch.__version__}")
        configure = [
            "cmake",
            str(ROOT),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={pybind11.get_cmake_dir()}",
            f"-DSEQPAR_OUTPUT_DIR={build_dir / 'out'}",
            *torch_settings(torch),
            *plan.cmake_args,
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)
        # Copy then rename: processes that have the old module loaded keep a valid file.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(".tmp")
        shutil.copy2(build_dir / "out" / target.name, staging)
        os.replace(staging, target)
        log(f"built {plan.description}; `python -m seqpar_kernels.info` shows what is installed")


setup(ext_modules=[CMakeExtension("seqpar_kernels._C")], cmdclass={"build_ext": CMakeBuild})
