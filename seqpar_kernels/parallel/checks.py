"""Argument checks of the public functions, run so that a bad input on any rank raises
on every rank.

    with CheckedOnEveryRank(describe, group, data_device, exchange) as checks:
        ...local checks, which raise ValueError...
        checks.share(local_size, agreed)
    checks.sizes                        every rank's local size
    checks.extras                       every rank's `extra` ints (extra_count=, share(extra=))
    checked_on_grid(describe, grid, ...)     the same over USP's two groups, nested, which
                                             also checks that they form a grid
    checked_over_groups(describe, groups, ...)   the same over groups in turn (a mesh)

Local checks (no communication):
    normalize_dim(dim, ndim, name, shape)   a dim argument in [0, ndim)
    check_tensor(x, describe)           a tensor with at least one dim
    check_bool(name, value)             a flag that must be a bool
    check_attention_inputs(q, k, v)     shapes, dtypes, devices, GQA heads, head dim
    resolve_softmax_scale(scale, q)     the default, and ValueError for a bad one
    check_local_sizes(sizes, ...)       per-rank sizes passed by the caller
    check_split_arguments(...)          a split's tensor and dim (every rank)
    check_gather_arguments(...)         a gather's tensor, dim and sizes (every rank)

The checks of the attention functions build on these (parallel/attention_checks.py).
"""

from __future__ import annotations

import os
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from seqpar_kernels.comm.grid import Grid
from seqpar_kernels.groups import GroupInfo, all_gather_ints

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
        self.exchange = (exchange or debug_checks_on()) and group.world_size > 1 and not torch.compiler.is_compiling()
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
            [self.local_size, 0 if failed else fingerprint(self.agreed), int(failed), *self.local_extra],
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
            f"than rank {majority[0]}; this rank ({self.group.rank}) passed {str(self.agreed):.400}"
        )

    def _gather_reasons(self, reason: str) -> list[str]:
        """Every rank's `reason` (empty for the good ranks), cut to _REASON_BYTES."""
        encoded = list(reason.encode()[:_REASON_BYTES])
        rows = all_gather_ints(
            [len(encoded), *encoded, *[0] * (_REASON_BYTES - len(encoded))], self.group.name, self.data_device
        )
        return [bytes(row[1 : 1 + row[0]]).decode(errors="replace") for row in rows]


def check_split_arguments(describe: str, x, dim, group: GroupInfo) -> int:
    """The checks of a split of the full sequence `x` (the same on every rank) along
    `dim` (split_sequence, zigzag_split), run so that a bad input on any rank raises on
    every rank. Returns dim in [0, x.dim())."""
    with CheckedOnEveryRank(describe, group, device_of(x), exchange=True) as checks:
        check_tensor(x, describe)
        dim = normalize_dim(dim, x.dim(), "dim", x.shape)
        checks.share(x.shape[dim], (x.dtype, tuple(x.shape), dim))
    return dim


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


def checked_on_grid(describe: str, grid: Grid, data_device, exchange: bool, local_checks):
    """CheckedOnEveryRank over USP's grid. local_checks() runs this rank's checks (raising
    ValueError) and returns (local_size, agreed, result): what CheckedOnEveryRank.share
    takes, plus what the caller keeps. Returns (result, row_lens, slot_lens): every
    Ulysses rank's local size in this slot, and every slot's total.

    Nested: the Ulysses group's gather first (inside the ring group's block), so that an
    error on a rank raises in its Ulysses group, then through the ring groups (each
    holds one member of that Ulysses group) on every rank.

    The grid. Each Ulysses group must be one ring slot (its members are the same ring
    rank i, of ring groups of one size R), and the ring groups its members belong to
    (identified by their smallest global rank), in Ulysses order, must be the same list
    for every member of a ring group. Then ring group j holds Ulysses index j of every
    slot and every slot meets the same ring groups: a grid. A ring group that fails the
    second check cannot share a Ulysses group with one that passes it (the list of a
    passing ring group's slots names every ring group through them), so every rank
    whose partners raise raises too.

    A plain function around the two `with` blocks (not a generator context manager):
    torch.compile traces it on every supported release."""
    # The messages name ranks by their rank in the group that raised.
    with CheckedOnEveryRank(f"{describe} (ring group)", grid.ring, data_device, exchange, extra_count=1) as slot_checks:
        with CheckedOnEveryRank(
            f"{describe} (Ulysses group)", grid.ulysses, data_device, exchange, extra_count=3
        ) as row_checks:
            local_size, agreed, result = local_checks()
            exchanging = row_checks.exchange or slot_checks.exchange
            # Read only when a gather runs: not while torch.compile traces.
            column = min(dist.get_process_group_ranks(grid.ring_group)) if exchanging else 0
            row_checks.share(local_size, agreed, extra=(grid.ring.rank, grid.ring.world_size, column))
        slots = [tuple(extra[:2]) for extra in row_checks.extras]
        if len(set(slots)) != 1:
            raise ValueError(
                f"{describe}: ulysses_group and ring_group do not form a grid: the ranks of a Ulysses group "
                f"must hold one ring slot (one ring rank, of ring groups of one size); Ulysses ranks "
                f"0..{grid.ulysses.world_size - 1} are (ring rank, ring size) {slots}"
            )
        columns = [extra[2] for extra in row_checks.extras]
        slot_checks.share(
            sum(row_checks.sizes), (agreed, grid.ulysses.world_size),
            extra=(fingerprint(columns) if exchanging else 0,),
        )  # fmt: skip
    if len({extra[0] for extra in slot_checks.extras}) != 1:
        raise ValueError(
            f"{describe}: ulysses_group and ring_group do not form a grid: the Ulysses groups of this "
            f"ring group's ranks meet different ring groups (this rank's Ulysses group meets the ring "
            f"groups whose first global ranks are {columns})"
        )
    return result, row_checks.sizes, slot_checks.sizes


def checked_over_groups(describe: str, groups: Sequence[tuple[object, GroupInfo]], data_device, local_checks) -> None:
    """Runs local_checks() (raising ValueError, else returning the metadata every rank
    must agree on) such that a bad input on any rank raises on every rank of the groups
    (each (group, GroupInfo), e.g. a mesh's dimensions): one small all-gather per group,
    nested as checked_on_grid nests its two. A rank that raised in one group carries its
    error into the next, so after the last group every rank has raised."""
    error, agreed = None, None
    for index, (_, info) in enumerate(groups):
        try:
            with CheckedOnEveryRank(describe, info, data_device, exchange=True) as checks:
                if error is not None:
                    raise error
                if index == 0:
                    agreed = local_checks()
                checks.share(0, agreed)
        except Exception as raised:  # noqa: BLE001 - carried into the next group, raised below
            error = raised
    if error is not None:
        raise error


def fingerprint(value) -> int:
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


# The floating-point dtypes the attention functions and the loss take.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
