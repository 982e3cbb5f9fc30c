"""The install report (`python -m seqpar_kernels.info`) and what the build compiled."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar_kernels import info
from seqpar_kernels.extension import build_info


def test_info_reports_this_install():
    report = info.collect()
    assert report["installed at"] == str(Path(info.__file__).resolve().parent)
    assert report["torch"] == torch.__version__
    assert report["built against torch"] == torch.__version__.split("+")[0]
    result = subprocess.run([sys.executable, "-m", "seqpar_kernels.info"], capture_output=True, text=True)
    assert result.returncode == 0 and "CUDA kernels compiled" in result.stdout, result.stderr


def _toolkit_major() -> str | None:
    """The CUDA major version of the toolkit at CUDA_HOME (default /usr/local/cuda)."""
    nvcc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    if not nvcc.exists():
        return None
    output = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    return output.split("release ")[1].split(".")[0] if "release " in output else None


@pytest.mark.skipif(os.environ.get("SEQPAR_FORCE_CPU") == "1", reason="CPU-only build asked for")
def test_cuda_kernels_compiled_wherever_a_matching_toolkit_is_present():
    # CI has no GPU but has nvcc and a CUDA build of torch: a build that quietly fell
    # back to CPU-only would stop compiling the .cu files there.
    if torch.version.cuda is None or _toolkit_major() != torch.version.cuda.split(".")[0]:
        pytest.skip("no CUDA build of torch with a matching toolkit here")
    built = build_info()
    assert built["cuda"], f"CPU-only build despite torch CUDA {torch.version.cuda} and a matching nvcc"
    assert built["cuda_archs"]
