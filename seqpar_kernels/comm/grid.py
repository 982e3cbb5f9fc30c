"""The ranks a call runs on: a group, two groups (USP's Ulysses and ring groups) or a
DeviceMesh, resolved here for every function that takes them.

    resolve_grid(describe, mesh, ulysses_group, ring_group)    USP's 2-D grid (a Grid)
    resolve_mesh_dims(describe, mesh, sequence_dims, data_dims, tensor_dims)   which dims of
                                                                one mesh are the sequence's,
                                                                the data's and the tensor's
    resolve_ranks(describe, group=..., mesh=..., ...)          a group's GroupInfo, or a Grid
    reduction_groups(describe, group=..., mesh=..., ...)       the groups to all-reduce over in
                                                                turn so that every rank is summed
    all_reduce_sum(values, groups)                             values summed over those groups, in place

One mesh for every parallelism: mesh= with sequence_dims= (one dim, or USP's (ulysses,
ring) pair), data_dims= (the data replicas' dims) and tensor_dims= (the dims tensor
parallelism shards the attention's heads over); no reduction here runs over the tensor
dims or the mesh's unnamed ones (pipeline): every reduction runs over dims it names.

Resolving is local (no communication): a program passes the same kind of argument on every
rank, so every rank raises alike. That the groups really form a grid is checked by the
argument checks' gathers (parallel/checks.py checked_on_grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
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

    @classmethod
    def of(cls, ulysses_group: dist.ProcessGroup, ring_group: dist.ProcessGroup) -> Grid:
        return cls(ulysses_group, ring_group, resolve_group(ulysses_group), resolve_group(ring_group))

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


@dataclass(frozen=True)
class MeshDims:
    """Which named dims of one DeviceMesh the sequence is split over, which hold data
    replicas and which shard the model's tensors (nothing here reduces over the tensor
    dims, nor over dims named in none: pipeline). sequence: (dim,) for one group,
    (ulysses dim, ring dim) for USP; data: any number, in the user's order (e.g.
    ("dp_replicate", "dp_shard")); tensor: usually one ("tp")."""

    mesh: DeviceMesh
    sequence: tuple[str, ...]
    data: tuple[str, ...]
    tensor: tuple[str, ...] = ()

    def groups(self, names) -> list[tuple[dist.ProcessGroup, GroupInfo]]:
        """(group, its GroupInfo) of each named dim, in the order given."""
        return [(group, resolve_group(group)) for group in (self.mesh.get_group(name) for name in names)]

    def sequence_ranks(self) -> GroupInfo | Grid:
        """The sequence dim's GroupInfo, or USP's Grid of its (ulysses, ring) dims."""
        if len(self.sequence) == 1:
            return resolve_group(self.mesh.get_group(self.sequence[0]))
        return Grid.of(*(self.mesh.get_group(name) for name in self.sequence))

    @property
    def data_size(self) -> int:
        """How many data replicas there are: the product of the data dims' sizes."""
        return prod(self.mesh.size(self._index(name)) for name in self.data)

    @property
    def tensor_size(self) -> int:
        """How many ranks share each of the model's tensor-parallel layers: the product
        of the tensor dims' sizes (1 without tensor dims)."""
        return prod(self.mesh.size(self._index(name)) for name in self.tensor)

    @property
    def data_rank(self) -> int:
        """This rank's data replica, in [0, data_size): its coordinates in the data dims,
        row-major in the order data names them (which batch this rank reads)."""
        index = 0
        for name in self.data:
            index = index * self.mesh.size(self._index(name)) + self.mesh.get_local_rank(name)
        return index

    def _index(self, name: str) -> int:
        return self.mesh.mesh_dim_names.index(name)

    def flattened(self, names: tuple[str, ...], label: str) -> DeviceMesh:
        """A 1-D mesh over the named dims (their product, in the mesh's order): the dim
        itself for one name, else the dims flattened under `label` (torch's
        DeviceMesh._flatten, which torchtitan builds its meshes with: torch 2.14 has
        no public way to flatten dims)."""
        ordered = tuple(name for name in self.mesh.mesh_dim_names if name in names)
        if len(ordered) == 1:
            return self.mesh[ordered[0]]
        return self.mesh[ordered]._flatten(label)


def _dim_names(describe: str, argument: str, value, shapes: str) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{describe}: {argument} must be a dim name or a tuple of them, got {value!r} ({shapes})")
    return tuple(names)


def resolve_mesh_dims(describe: str, mesh, sequence_dims, data_dims=(), tensor_dims=()) -> MeshDims:
    """The sequence's, the data's and the tensor's dims of `mesh`, checked once: ValueError naming the
    mesh's dims for a mesh without named dims, a name it lacks, a name given twice, or
    other than one or two sequence dims. Local: every rank passes the same arguments and
    raises alike."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not isinstance(mesh, DeviceMesh) or not names:
        shape = tuple(mesh.shape) if isinstance(mesh, DeviceMesh) else type(mesh).__name__
        raise ValueError(
            f"{describe}: sequence_dims=, data_dims= and tensor_dims= name dims of mesh=, a DeviceMesh with named dims "
            f"(init_device_mesh(..., mesh_dim_names=...)), got {shape} with dims {names}"
        )
    shapes = f"mesh {tuple(mesh.shape)} with dims {tuple(names)}"
    sequence = _dim_names(describe, "sequence_dims", sequence_dims, shapes)
    data = _dim_names(describe, "data_dims", data_dims, shapes)
    tensor = _dim_names(describe, "tensor_dims", tensor_dims, shapes)
    named = (*sequence, *data, *tensor)
    given = f"sequence_dims={sequence}, data_dims={data}, tensor_dims={tensor}"
    if len(sequence) not in (1, 2):
        raise ValueError(
            f"{describe}: sequence_dims names one dim (ulysses, ring) or USP's two (ulysses dim, ring dim), "
            f"got {sequence} ({shapes})"
        )
    missing = [name for name in named if name not in names]
    if missing:
        raise ValueError(f"{describe}: the mesh has no dims {missing}; {given} ({shapes})")
    repeated = sorted({name for name in named if named.count(name) > 1})
    if repeated:
        raise ValueError(
            f"{describe}: {repeated} named more than once in {given}: each dim is the sequence's, the data's, the "
            f"tensor's, or none of them ({shapes})"
        )
    return MeshDims(mesh, sequence, data, tensor)


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
    return Grid.of(ulysses_group, ring_group)


def mesh_dims_of(describe: str, *, group=None, mesh=None, ulysses_group=None, ring_group=None, sequence_dims=None,
                 data_dims=(), tensor_dims=()) -> MeshDims | None:  # fmt: skip
    """The MeshDims of a call that names the dims of mesh= (sequence_dims=, and
    data_dims= and tensor_dims=), checked (resolve_mesh_dims); None for a call that does
    not."""
    if sequence_dims is None:
        for argument, value in (("data_dims", data_dims), ("tensor_dims", tensor_dims)):
            if value:
                raise ValueError(f"{describe}: {argument}={value!r} needs sequence_dims= naming the sequence's dims "
                                 "of mesh=")  # fmt: skip
        return None
    if group is not None or ulysses_group is not None or ring_group is not None:
        raise ValueError(f"{describe}: sequence_dims= names dims of mesh=; pass no group= or ulysses_group= and "
                         "ring_group= with it")  # fmt: skip
    return resolve_mesh_dims(describe, mesh, sequence_dims, data_dims, tensor_dims)


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
    describe: str, *, group=None, mesh=None, ulysses_group=None, ring_group=None, sequence_dims=None, data_dims=(),
    any_mesh: bool = False, over_data: bool = True,
) -> list[tuple[dist.ProcessGroup | None, GroupInfo]]:  # fmt: skip
    """(group, its GroupInfo) for each group to reduce over in turn so that every rank is
    summed: `group` (default: the world), or each dimension of the grid; with
    sequence_dims, each dim of `mesh` it names, then (over_data) each of data_dims.
    any_mesh: `mesh` without sequence_dims may be a DeviceMesh of any shape and dim names
    (each of its dimensions in turn)."""
    dims = mesh_dims_of(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                        sequence_dims=sequence_dims, data_dims=data_dims)  # fmt: skip
    if dims is not None:
        return dims.groups(dims.sequence + (dims.data if over_data else ()))
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


def all_reduce_sum(values: torch.Tensor, groups) -> torch.Tensor:
    """values summed over every rank of the groups (over each group in turn), in place.
    Every rank gets the same bytes: each group's all-reduce hands all its members one
    result, and the ranks of a later group hold equal inputs from the earlier ones."""
    for group, info in groups:
        if info.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values
