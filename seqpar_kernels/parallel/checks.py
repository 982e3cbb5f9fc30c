"""Argument checks of the public functions, run so that a bad input on any rank raises
on every rank.

    with CheckedOnEveryRank(describe, group, data_device, exchange) as checks:
        ...local checks, which raise ValueError...
        checks.share(local_size, agreed)
    checks.sizes                        every rank's local size
    checks.extras                       every rank's `extra` ints (extra_count=, share(extra=))

Local checks (no communication):
    normalize_dim(dim, ndim, name, shape)   a dim argument in [0, ndim)
    check_tensor(x, describe)           a tensor with at least one dim
    check_bool(name, value)             a flag that must be a bool
    check_attention_inputs(q, k, v)     shapes, dtypes, devices, GQA heads, head dim
    resolve_softmax_scale(scale, q)     the default, and ValueError for a bad one
    check_local_sizes(sizes, ...)       per-rank sizes passed by the caller
    check_gather_arguments(...)         a gather's tensor, dim and sizes (every rank)
    fold_scale_sign(q, scale)           a non-positive scale rewritten as a positive one
"""

from __future__ import annotations

import math
import os
import zlib
from typing import Sequence

import torch

from seqpar_kernels.comm.groups import GroupInfo, all_gather_ints

# SEQPAR_DEBUG=1 runs the every-rank check even where the caller skipped it (sizes passed,
# check_ranks=False).
DEBUG_VARIABLE = "SEQPAR_DEBUG"
# Bytes of each bad rank's message that reach the other ranks.
_REASON_BYTES = 480


def debug_checks_on() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "0") not in ("", "0")


class CheckedOnEveryRank:
    """The argument checks of one call of a public function, such that a bad input on
    any subset of ranks raises ValueError on every rank instead of leaving the others
    waiting in the next collective.

    Inside the block, each rank runs its local checks and shares its local size and the
    metadata every rank must agree on (`agreed`: shapes, dims, dtype, options, anything
    printable). On leaving it, every rank takes part in one small all_gather of
    (local size, fingerprint of agreed, whether the block raised): a rank whose checks
    raised still joins it, and a second gather, run only then, brings every bad rank's
    message, so the others raise naming the bad ranks and their reasons (the bad ranks
    raise their own error). Ranks whose metadata differ raise alike. `sizes` then holds
    every rank's local size, and `extras` every rank's `extra_count` further ints (what
    a caller must learn from every rank besides the size: 0s from a rank that raised).

    exchange=False (the caller passed the sizes, or check_ranks=False) skips the
    collective unless SEQPAR_DEBUG=1: a local error then raises on its rank only, and
    `sizes` is this rank's size repeated. So does a group of one rank, and tracing under
    torch.compile (sizes cannot be read while tracing). On NCCL the gather synchronises
    the host with the GPU (`data_device`: the input's GPU, see metadata_device)."""

    def __init__(
        self, describe: str, group: GroupInfo, data_device: torch.device | None, exchange: bool, extra_count: int = 0
    ):
        self.describe, self.group, self.data_device = describe, group, data_device
        self.exchange = (
            (exchange or debug_checks_on()) and group.world_size > 1 and not torch.compiler.is_compiling()
        )
        self.local_size, self.agreed = 0, None
        # The same count on every rank (a rank that raises before share() sends 0s), so
        # every rank's row of the gather has the same length.
        self.local_extra = [0] * extra_count
        self.sizes: list[int] | None = None
        self.extras: list[list[int]] | None = None

    def share(self, local_size: int, agreed, extra: Sequence[int] = ()) -> None:
        assert len(extra) == len(self.local_extra), (len(extra), len(self.local_extra))
        self.local_size, self.agreed, self.local_extra = local_size, agreed, [int(value) for value in extra]

    def __enter__(self) -> CheckedOnEveryRank:
        return self

    def __exit__(self, error_type, error, traceback) -> bool:
        if not self.exchange:
            self.sizes = [self.local_size] * self.group.world_size
            self.extras = [self.local_extra] * self.group.world_size
            return False  # a local error raises on this rank
        failed = error is not None
        rows = all_gather_ints(
            [self.local_size, 0 if failed else _fingerprint(self.agreed), int(failed), *self.local_extra],
            self.group.name, self.data_device,
        )  # fmt: skip
        bad_ranks = [rank for rank, row in enumerate(rows) if row[2]]
        if bad_ranks:
            reasons = self._gather_reasons(f"{error_type.__name__}: {error}" if failed else "")
            if failed:
                return False  # this rank's own error, with its traceback
            raise ValueError(
                f"{self.describe}: bad input on rank(s) {bad_ranks} of {self.group.world_size}; "
                + "; ".join(f"rank {rank}: {reasons[rank]}" for rank in bad_ranks)
            )
        if any(row[1] != rows[0][1] for row in rows):
            raise ValueError(f"{self.describe}: {self._disagreement(rows)}")
        self.sizes = [row[0] for row in rows]
        self.extras = [row[3:] for row in rows]
        return False

    def _disagreement(self, rows: list[list[int]]) -> str:
        """Which ranks passed other metadata than the most ranks did."""
        by_fingerprint: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            by_fingerprint.setdefault(row[1], []).append(rank)
        majority = max(by_fingerprint.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        others = ", ".join(f"rank {rank}" for rank in range(len(rows)) if rank not in majority)
        return (
            f"ranks disagree on shapes, dims, dtype or options: {others} passed other metadata "
            f"than rank {majority[0]}; this rank ({self.group.rank}) passed {self.agreed}"
        )

    def _gather_reasons(self, reason: str) -> list[str]:
        """Every rank's `reason` (empty for the good ranks), cut to _REASON_BYTES."""
        encoded = list(reason.encode()[:_REASON_BYTES])
        rows = all_gather_ints(
            [len(encoded), *encoded, *[0] * (_REASON_BYTES - len(encoded))], self.group.name, self.data_device
        )
        return [bytes(row[1 : 1 + row[0]]).decode(errors="replace") for row in rows]


def check_gather_arguments(describe: str, x, dim, group: GroupInfo, sizes) -> tuple[int, list[int]]:
    """The checks of a gather of every rank's piece of `x` along `dim` (gather_sequence,
    zigzag_gather), run so that a bad input on any rank raises on every rank. `sizes`:
    every rank's length along dim, or None to find them in the metadata all_gather.
    Returns (dim in [0, x.dim()), every rank's length)."""
    with CheckedOnEveryRank(describe, group, device_of(x), exchange=sizes is None) as checks:
        check_tensor(x, describe)
        dim = normalize_dim(dim, x.dim(), "dim", x.shape)
        if sizes is not None:
            sizes = check_local_sizes(sizes, group, x.shape[dim], "sizes", x.shape, dim)
        checks.share(x.shape[dim], (x.dtype, tuple(x.shape[:dim]), tuple(x.shape[dim + 1 :]), sizes))
    return dim, checks.sizes if sizes is None else sizes


def _fingerprint(value) -> int:
    """A stable small integer for metadata that every rank must agree on."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def check_local_sizes(
    sizes: Sequence[int], group: GroupInfo, local_size: int, argument: str, shape, dim: int
) -> list[int]:
    """Checks user-passed per-rank sizes along `dim` (`argument` names the parameter):
    one per rank, this rank's equal to its local size. Returns them as a list."""
    if len(sizes) != group.world_size or sizes[group.rank] != local_size:
        raise ValueError(
            f"{argument}={list(sizes)} must list {group.world_size} ranks' sizes along dim "
            f"{dim}, with this rank's ({group.rank}) equal to {local_size} (local shape "
            f"{tuple(shape)})"
        )
    return list(sizes)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def normalize_dim(dim: int, ndim: int, name: str, shape) -> int:
    """`dim` (negative counts from the end) as an index in [0, ndim); `name` is the
    argument's name and `shape` the tensor's, for the message."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"{name} must be an int, got {dim!r} (tensor of shape {tuple(shape)})")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a tensor of shape {tuple(shape)}")
    return dim % ndim


def check_tensor(x, describe: str) -> None:
    """x must be a tensor with at least one dim (`describe` names the function)."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"{describe} needs a tensor with at least one dim, got {x!r:.80}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def device_of(x) -> torch.device | None:
    """x's device when x is a tensor (the metadata of a collective about it goes there
    on NCCL), else None."""
    return x.device if isinstance(x, torch.Tensor) else None


def describe_shapes(q, k, v) -> str:
    return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"


def check_attention_inputs(q, k, v) -> None:
    """q: (batch, seqlen_local, nheads, headdim); k, v: (batch, seqlen_local, nheads_kv,
    headdim), one dtype among SUPPORTED_DTYPES, one device, nheads % nheads_kv == 0,
    1 <= headdim <= MAX_HEAD_DIM. Raises ValueError naming the shapes otherwise."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"{name} must be (batch, seqlen_local, nheads, headdim), got {shape}")
    shapes = describe_shapes(q, k, v)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k, v need one dtype among {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype} ({shapes})"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {shapes}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q, k, v must share batch and local sequence length, got {shapes}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have one head dim, got {shapes}")
    if q.shape[3] == 0:
        raise ValueError(f"head dim must be at least 1 ({shapes})")
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[3]} exceeds {MAX_HEAD_DIM} ({shapes})")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"nheads ({q.shape[2]}) must be a multiple of nheads_kv ({k.shape[2]}) ({shapes})"
        )


def resolve_softmax_scale(softmax_scale, q: torch.Tensor) -> float:
    """The scale applied to q.k: `softmax_scale`, or 1/sqrt(headdim) for None. Any
    finite number is accepted, zero and negative ones included (see fold_scale_sign)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[3])
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise ValueError(f"softmax_scale must be a number or None, got {softmax_scale!r}")
    # Comparisons, not math.isfinite and float(): torch.compile traces a float argument
    # that changes between calls as a symbolic float, which those two cannot take.
    if not -math.inf < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return softmax_scale * 1.0


def fold_scale_sign(q: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with a positive scale that gives the same scores scale * q.k.

    The attention kernels mask a causal score with -inf BEFORE scaling it (aten's CPU
    flash kernel, which SDPA runs on CPUs): a zero scale then gives -inf * 0 = NaN and a
    negative one turns a masked score into +inf. So a negative scale is applied to q
    (-q with scale |scale|, exact in every dtype), and a zero scale, whose scores are all
    0 (uniform attention over the visible keys), becomes q * 0 with scale 1. Both stay
    differentiable: dq is -dq' or exactly 0. A positive scale returns q itself."""
    if softmax_scale > 0:
        return q, softmax_scale
    if softmax_scale < 0:
        return q.neg(), -softmax_scale
    return q.mul(0.0), 1.0


def check_launchable(q: torch.Tensor) -> None:
    """Raises ValueError naming q's shape when the ring's Triton step kernels cannot run
    on the CUDA tensor q (batch, seqlen_local, nheads, headdim): a GPU older than sm_80
    (no bf16 tensor cores), or batch or nheads above CUDA's grid limit. A CPU tensor
    passes. Local: the ring runs it before any collective."""
    if not q.is_cuda:
        return
    # Imported here: Triton is needed on GPUs only (CPU-only torch wheels lack it).
    from seqpar_kernels.kernels.attention_step_tiles import MAX_GRID_YZ, MIN_CAPABILITY

    properties = torch.cuda.get_device_properties(q.device)
    capability = 10 * properties.major + properties.minor
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"ring attention's Triton kernels need a GPU of compute capability 8.0 or newer (bf16 "
            f"tensor cores); {q.device} ({properties.name}) is sm_{capability} (q {tuple(q.shape)})"
        )
    if q.shape[0] > MAX_GRID_YZ or q.shape[2] > MAX_GRID_YZ:
        # Heads and batch index grid axes 1 and 2, which CUDA caps at 65535.
        raise ValueError(f"batch and nheads must be at most {MAX_GRID_YZ}, got q shape {tuple(q.shape)}")
