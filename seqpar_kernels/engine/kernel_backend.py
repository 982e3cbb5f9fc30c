"""Which backend runs a recurrence's sequential part (engine/gated_delta.py,
engine/state_space.py): torch, or the Triton kernels of seqpar_kernels/kernels/."""

from __future__ import annotations

import importlib.util


def chosen_backend(backend: str, triton_fits: bool) -> str:
    """The backend that runs ("torch" or "triton"): `backend` as asked, or for "auto"
    Triton where its kernels fit the tensors (triton_fits: CUDA, fp32, sizes the kernels
    hold in registers) and triton is installed, else torch."""
    if backend == "auto":
        return "triton" if triton_fits and importlib.util.find_spec("triton") is not None else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    return backend
