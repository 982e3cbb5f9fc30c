"""Builds seqpar_kernels._C with CMake (see CMakeLists.txt).

CPU kernels are always compiled. CUDA kernels are compiled when torch is a CUDA build
and a CUDA toolkit is found (CUDA_HOME, CUDA_PATH, /usr/local/cuda, or nvcc on PATH);
otherwise the build is CPU-only and says why. Environment knobs:
  SEQPAR_CUDA_ARCHS   CUDA architectures, e.g. "8.0+PTX;9.0a" (the default)
  SEQPAR_FORCE_CPU=1  skip the CUDA kernels even when CUDA is available
  MAX_JOBS            parallel compile jobs
"""

import os
import shutil
import subprocess
import sys
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


def find_cuda_home():
    """The CUDA toolkit root, or None. The nvcc on PATH may be a wrapper script,
    so a root must hold bin/nvcc and include/cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").exists() and (
            Path(candidate) / "include" / "cuda_runtime.h"
        ).exists():
            return Path(candidate)
    return None


def nvcc_version(cuda_home: Path) -> str:
    output = subprocess.run(
        [str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    # "Cuda compilation tools, release 13.0, V13.0.88"
    return output.split("release ")[1].split(",")[0]


def cuda_build_settings():
    """(cmake args, description) for the CUDA part of the build; no args when CPU-only."""
    import torch

    if os.environ.get("SEQPAR_FORCE_CPU") == "1":
        return [], "CPU kernels only (SEQPAR_FORCE_CPU=1)"
    if torch.version.cuda is None:
        return [], f"CPU kernels only (torch {torch.__version__} is not a CUDA build)"
    cuda_home = find_cuda_home()
    if cuda_home is None:
        return [], "CPU kernels only (no CUDA toolkit found; set CUDA_HOME to build the CUDA kernels)"
    toolkit = nvcc_version(cuda_home)
    if toolkit.split(".")[0] != torch.version.cuda.split(".")[0]:
        return [], (
            f"CPU kernels only (nvcc {toolkit} in {cuda_home} does not match torch's CUDA "
            f"{torch.version.cuda}; install a matching toolkit to build the CUDA kernels)"
        )
    archs = os.environ.get("SEQPAR_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    args = [
        f"-DSEQPAR_CUDA_ARCHS={archs}",
        f"-DCMAKE_CUDA_COMPILER={cuda_home / 'bin' / 'nvcc'}",
        f"-DCUDAToolkit_ROOT={cuda_home}",
    ]
    return args, f"CPU kernels and CUDA kernels (nvcc {toolkit}, archs {archs})"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, extension: Extension) -> None:
        import pybind11
        import torch

        target = Path(self.get_ext_fullpath(extension.name)).resolve()
        cuda_args, description = cuda_build_settings()
        # A build folder that outlives pip's temporary ones (editable installs get a new
        # build_temp each time), so a repeated install recompiles only what changed.
        flavour = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-{'cuda' if cuda_args else 'cpu'}"
        build_dir = ROOT / "build" / f"cmake-{flavour}"
        build_dir.mkdir(parents=True, exist_ok=True)
        log(f"building {description} against torch {torch.__version__}")
        configure = [
            "cmake",
            str(ROOT),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_PREFIX_PATH={pybind11.get_cmake_dir()}",
            f"-DSEQPAR_OUTPUT_DIR={build_dir / 'out'}",
            f"-DSEQPAR_WITH_CUDA={'ON' if cuda_args else 'OFF'}",
            *cuda_args,
        ]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run(configure, cwd=build_dir, check=True)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)
        # Copy then rename: processes that have the old module loaded keep a valid file.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_suffix(".tmp")
        shutil.copy2(build_dir / "out" / target.name, staging)
        os.replace(staging, target)
        log(f"built {description}; `python -m seqpar_kernels.info` shows what is installed")


setup(ext_modules=[CMakeExtension("seqpar_kernels._C")], cmdclass={"build_ext": CMakeBuild})
