"""The package's Python custom ops and CUDA graphs: they cannot be captured.

Each copies host lists to the device on every call (sizes, document bounds: a pageable
host-to-device copy, which a capturing stream refuses) and most run NCCL inside, with
shapes that only the host knows. So:

    uncapturable_custom_op(name, **options)   torch.library.custom_op with the
        cudagraph_unsafe tag (torch releases that have it): torch.compile(mode=
        "reduce-overhead") then leaves the graphs that hold the op out of CUDA graphs
        (or runs the op between captured partitions), rather than capture it;
    refuse_capture(name, tensor)              in each op, for what captures it anyway
        (torch without the tag, torch.cuda.graph by hand): a RuntimeError naming the op,
        not a hang or a corrupt graph. A no-op for CPU tensors.
"""

from __future__ import annotations

import torch

# The tag torch.compile's CUDA graphs skip (torch._inductor.utils is_cudagraph_unsafe_fx_node);
# absent from older torch releases.
UNCAPTURABLE_TAGS = tuple(tag for tag in (getattr(torch._C.Tag, "cudagraph_unsafe", None),) if tag is not None)


def uncapturable_custom_op(name: str, **options):
    """torch.library.custom_op(name, **options), tagged cudagraph_unsafe where torch has the tag."""
    if UNCAPTURABLE_TAGS:
        options["tags"] = UNCAPTURABLE_TAGS
    return torch.library.custom_op(name, **options)


def refuse_capture(name: str, tensor: torch.Tensor) -> None:
    """Raises RuntimeError when `tensor` is a CUDA tensor and its device's current stream
    is capturing a CUDA graph."""
    if tensor.is_cuda:
        with torch.cuda.device(tensor.device):
            capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise RuntimeError(
                f"{name} cannot be captured in a CUDA graph: it copies host lists to the GPU and runs "
                "collectives on every call. Under torch.compile use a mode without CUDA graphs "
                '(mode="default" or "max-autotune-no-cudagraphs"), or a torch release whose '
                "reduce-overhead mode skips ops tagged cudagraph_unsafe."
            )
