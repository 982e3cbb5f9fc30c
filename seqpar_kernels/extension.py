"""Loads the compiled extension, which registers the ops under torch.ops.seqpar."""

# torch first: the extension links torch's libraries (libc10, libtorch), which importing
# torch loads; a wheel's extension does not find them on its own.
import importlib

import torch  # noqa: F401

try:
    # By name: the compiled module has no source for the import graph's checks
    # (tests/test_imports.py), which would read a plain import as one of the package.
    _C = importlib.import_module("seqpar_kernels._C")
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        f"seqpar_kernels._C could not be loaded ({error}). Build it with "
        "`pip install --no-build-isolation -e .` (see README.md)."
    ) from error


def build_info() -> dict:
    """What the compiled extension contains: cuda (bool), cuda_archs, cuda_toolkit, torch."""
    return dict(_C.build_info())
