"""The ranks a call runs on: a group, two groups (USP's Ulysses and ring groups) or a
DeviceMesh, resolved here for every function that takes them.

    resolve_grid(describe, mesh, ulysses_group, ring_group)    USP's 2-D grid (a Grid)
    resolve_ranks(describe, group=..., mesh=..., ...)          a group's GroupInfo, or a Grid
    reduction_groups(describe, group=..., mesh=..., ...)       the groups to all-reduce over in
                                                                turn so that every rank is summed

Resolving is local (no communication): a program passes the same kind of argument on every
rank, so every rank raises alike. That the groups really form a grid is checked by the
argument checks' gathers (parallel/checks.py checked_on_grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar_kernels.groups import GroupInfo, resolve_group
from seqpar_kernels.layouts import usp_rows

MESH_DIM_NAMES = ("ring", "ulysses")


@dataclass(frozen=True)
class Grid:
    """The two groups of a USP call: this rank is at ring index ring.rank (of R =
    ring.world_size slots) and Ulysses index ulysses.rank (of U)."""

    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    ulysses: GroupInfo
    ring: GroupInfo

    @property
    def piece(self) -> int:
        """This rank's sequence piece: i * U + j."""
        return self.ring.rank * self.ulysses.world_size + self.ulysses.rank

    @property
    def pieces(self) -> GroupInfo:
        """The grid as one group in piece order (for checking per-piece arguments)."""
        return GroupInfo("", self.piece, self.ring.world_size * self.ulysses.world_size)

    @property
    def group_names(self) -> tuple[str, str]:
        return self.ulysses.name, self.ring.name

    def rows(self, per_piece) -> list[list[int]]:
        """A per-piece list (e.g. every piece's length) as the grid's rows: rows[i] is
        ring slot i's Ulysses ranks' values (layouts.usp_rows)."""
        return usp_rows(per_piece, self.ulysses.world_size)


def resolve_grid(describe: str, mesh=None, ulysses_group=None, ring_group=None) -> Grid:
    """The groups from `mesh` (a 2-D DeviceMesh, dims found by name) or the two groups."""
    if mesh is not None:
        if ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{describe}: pass mesh= or ulysses_group= and ring_group=, not both")
        names = getattr(mesh, "mesh_dim_names", None)
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or sorted(names or ()) != sorted(MESH_DIM_NAMES):
            shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else type(mesh).__name__
            raise ValueError(
                f"{describe}: mesh must be a 2-D DeviceMesh with dims named {MESH_DIM_NAMES} (either "
                f"order), got {shape} with dims {names}"
            )
        ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    elif ulysses_group is None or ring_group is None:
        raise ValueError(
            f"{describe}: needs mesh= (a DeviceMesh with dims {MESH_DIM_NAMES}) or both ulysses_group= and "
            f"ring_group= (make_usp_groups), got ulysses_group={ulysses_group}, ring_group={ring_group}"
        )
    return Grid(ulysses_group, ring_group, resolve_group(ulysses_group), resolve_group(ring_group))


def is_grid_call(mesh=None, ulysses_group=None, ring_group=None) -> bool:
    """Whether a call names a grid (mesh, or either of the two groups) rather than a group."""
    return mesh is not None or ulysses_group is not None or ring_group is not None


def resolve_ranks(describe: str, *, group=None, mesh=None, ulysses_group=None, ring_group=None) -> GroupInfo | Grid:
    """`group`'s GroupInfo (default: the world; without torch.distributed a world of
    one), or the Grid of `mesh` or of the two groups. Not both kinds."""
    if is_grid_call(mesh, ulysses_group, ring_group):
        if group is not None:
            raise ValueError(f"{describe}: pass group= or mesh= (or ulysses_group= and ring_group=), not both")
        return resolve_grid(describe, mesh, ulysses_group, ring_group)
    return resolve_group(group)


def reduction_groups(
    describe: str, *, group=None, mesh=None, ulysses_group=None, ring_group=None, any_mesh: bool = False
) -> list[tuple[dist.ProcessGroup | None, GroupInfo]]:
    """(group, its GroupInfo) for each group to reduce over in turn so that every rank is
    summed: `group` (default: the world), or each dimension of the grid. any_mesh: `mesh`
    may be a DeviceMesh of any shape and dim names (each of its dimensions in turn)."""
    if any_mesh and mesh is not None:
        if group is not None or ulysses_group is not None or ring_group is not None:
            raise ValueError(f"{describe}: pass group= or mesh=, not both")
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"{describe}: mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        return [(each, resolve_group(each)) for each in mesh.get_all_groups()]
    ranks = resolve_ranks(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group)
    if isinstance(ranks, Grid):
        return [(ranks.ulysses_group, ranks.ulysses), (ranks.ring_group, ranks.ring)]
    return [(group, ranks)]
