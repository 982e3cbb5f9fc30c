"""Loads the compiled extension, which registers the ops under torch.ops.seqpar."""

try:
    from seqpar_kernels import _C
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "seqpar_kernels._C is not built. Install the package with "
        "`pip install --no-build-isolation -e .` (see README.md)."
    ) from error


def build_info() -> dict:
    """What the compiled extension contains: cuda (bool), cuda_archs, cuda_toolkit, torch."""
    return dict(_C.build_info())
