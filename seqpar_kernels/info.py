"""`python -m seqpar_kernels.info`: what this install has."""

from __future__ import annotations

import platform
from pathlib import Path


def collect() -> dict:
    import torch
    import torch.distributed as dist

    import seqpar_kernels
    from seqpar_kernels.extension import build_info

    built = build_info()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    backends = []
    if dist.is_available():
        for name, available in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available() and torch.cuda.is_available()),
            ("mpi", dist.is_mpi_available()),
        ):
            if available:
                backends.append(name)
    return {
        "python": platform.python_version(),
        # Which install this is, when several are on sys.path (a venv over the system's).
        "installed at": str(Path(seqpar_kernels.__file__).resolve().parent),
        "torch": torch.__version__,
        "torch CUDA": torch.version.cuda or "none (CPU build)",
        "GPUs visible": torch.cuda.device_count(),
        "built against torch": built["torch"],
        "CUDA kernels compiled": "yes" if built["cuda"] else "no (CPU kernels only)",
        "CUDA architectures": built["cuda_archs"] or "-",
        "CUDA toolkit used": built["cuda_toolkit"] or "-",
        "triton": triton_version,
        "distributed backends usable": ", ".join(backends) or "none",
    }


def main() -> None:
    info = collect()
    width = max(len(key) for key in info)
    print("seqpar-kernels install")
    for key, value in info.items():
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    main()
