"""The parallelism of a model's calls, as one value: SequenceParallelism.

    parallelism = SequenceParallelism.resolve("apply", "usp", "balanced", mesh=mesh)
    parallelism.piece_lengths(total)       every rank's token count, in piece order
    parallelism.take(x, dim)               this rank's piece of a full sequence (local, a view)
    parallelism.split(x, dim)              the same, checked on every rank (its backward gathers)
    parallelism.gather(x, dim, total)      the full sequence from every rank's piece
    parallelism.gather_consecutive(x, dim, lengths)  the same for pieces of any lengths, in order
    parallelism.attention(q, k, v, ...)    the mode's attention function on its groups
    parallelism.gather_ints(values, dev)   every rank's small ints, in piece order
    parallelism.agree(describe, value, d)  raises on every rank unless every rank's value is one
    parallelism.checked(describe, checks, d)  checks() on every rank: an error raises on every rank
    parallelism.reduction_kwargs()         the ranks a loss's sum and count are reduced over
    parallelism.data_rank, .data_size      which data replica this rank is, of how many
    parallelism.data_parallel_mesh(...)    the mesh FSDP2 (fully_shard) or DDP runs over
    parallelism.tensor_size, .tensor_mesh()  the tensor-parallel ranks (parallelize_module's mesh)

One mesh: resolve(..., mesh=mesh, sequence_dims="cp", data_dims=("dp_replicate",
"dp_shard"), tensor_dims="tp") splits the sequence over the mesh's "cp" dim (USP:
sequence_dims=(ulysses dim, ring dim)) and counts a loss over the data dims too; the
tensor dims (which shard the attention's heads before Ulysses splits them further) and
the mesh's unnamed dims (pipeline) are never reduced over.

Modes and layouts (the attention functions' names):
    "ulysses"  ulysses_attention over one group; layout "contiguous" only (Ulysses attends
               over whole sequences after its exchange, so no layout balances it better)
    "ring"     ring_attention over one group
    "usp"      usp_attention over a grid (a 2-D mesh, or a Ulysses group and a ring group)
    "dsp"      all_to_all_reshard over one group between two dims of a model's
               activations (diffusers' spatial-temporal transformers); no attention of its
               own; layout "contiguous" only
    "contiguous"  the rank at piece p (i * U + j under USP) holds the p-th
                  torch.tensor_split piece of the tokens
    "balanced"    causal work balanced across the ring: the zigzag layout of the ring
                  slots for a batch of whole sequences (a packed batch: the balanced
                  varlen layout, varlen_plan's)

The transformers integration (its attention functions, shard_batch, the loss, the
Trainer) and the diffusers integration all read this value; none re-derives piece sizes
or re-checks that ranks agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from seqpar_kernels.comm.grid import Grid, MeshDims, mesh_dims_of, resolve_ranks
from seqpar_kernels.engine.step_backends import STEP_BACKENDS
from seqpar_kernels.groups import SINGLE_PROCESS, GroupInfo, all_gather_ints, group_from_name, resolve_group
from seqpar_kernels.layouts import usp_piece_lengths, usp_piece_segments
from seqpar_kernels.parallel.checks import CheckedOnEveryRank, checked_on_grid
from seqpar_kernels.parallel.reshard import gather_sequence, split_sequence
from seqpar_kernels.parallel.ring import ring_attention, zigzag_gather_pieces, zigzag_split
from seqpar_kernels.parallel.ulysses import ulysses_attention
from seqpar_kernels.parallel.usp import usp_attention, usp_gather_pieces, usp_split
from seqpar_kernels.parallel.varlen import select_segments

ATTENTION_MODES = ("ulysses", "ring", "usp")
MODES = (*ATTENTION_MODES, "dsp")
LAYOUTS = ("contiguous", "balanced")


def check_options(describe: str, mode, layout, step_backend="auto", modes=ATTENTION_MODES) -> None:
    """ValueError for a mode (one of `modes`), layout or step backend that no
    SequenceParallelism takes (resolve runs it; a caller that makes its groups later,
    the Trainer, runs it first)."""
    if mode not in modes:
        raise ValueError(f"{describe}: mode must be one of {modes}, got {mode!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"{describe}: layout must be one of {LAYOUTS}, got {layout!r}")
    if step_backend not in STEP_BACKENDS:
        raise ValueError(f"{describe}: step_backend must be one of {STEP_BACKENDS}, got {step_backend!r}")
    if mode in ("ulysses", "dsp") and layout != "contiguous":
        raise ValueError(
            f"{describe}: mode={mode!r} takes layout='contiguous' only (got {layout!r}): it attends over whole "
            "sequences (Ulysses after its exchange, DSP within a frame or a position), so its work is balanced "
            "in any layout"
        )


@dataclass(frozen=True)
class SequenceParallelism:
    """A mode, a layout and the process groups it runs on, by name (a group's name
    stays valid in this process; the value itself cannot be copied to another).

    group_names: (group,) for "ulysses", "ring" and "dsp" ("" without torch.distributed:
    one process); (ulysses_group, ring_group) for "usp".
    step_backend: what computes the ring's steps (ring_attention's argument); not part
    of the comparison with a batch's sharding, which it does not change.
    mesh_dims: the mesh and its sequence, data and tensor dims where the value was
    resolved from mesh= with sequence_dims= (else None); neither is it part of the
    comparison: the data and tensor dims do not change how a replica's batch is sharded."""

    mode: str
    layout: str
    group_names: tuple[str, ...]
    step_backend: str = field(default="auto", compare=False)
    mesh_dims: MeshDims | None = field(default=None, compare=False, repr=False)

    @classmethod
    def resolve(
        cls, describe: str, mode, layout="contiguous", *, group=None, mesh=None, ulysses_group=None, ring_group=None,
        sequence_dims=None, data_dims=(), tensor_dims=(), step_backend="auto", modes=ATTENTION_MODES,
    ) -> SequenceParallelism:  # fmt: skip
        """The value of a public entry's arguments (apply(), shard_batch(), the Trainer's):
        ValueError, alike on every rank, for a bad mode (one of `modes`), layout, step
        backend, groups, or dims of the mesh (comm.grid.resolve_mesh_dims). Local: no
        communication.

        group / ulysses_group + ring_group / mesh (USP's 2-D ("ring", "ulysses") mesh):
        the sequence's ranks alone; or mesh= any DeviceMesh with named dims, with
        sequence_dims (one dim name; "usp": (ulysses dim, ring dim)), data_dims (the
        names of the dims that hold data replicas, any number) and tensor_dims (those
        tensor parallelism shards the model's layers over)."""
        check_options(describe, mode, layout, step_backend, modes)
        dims = mesh_dims_of(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                            sequence_dims=sequence_dims, data_dims=data_dims, tensor_dims=tensor_dims)  # fmt: skip
        if dims is not None and (len(dims.sequence) == 2) != (mode == "usp"):
            raise ValueError(
                f"{describe}: mode={mode!r} splits the sequence over "
                f"{'two dims, (ulysses dim, ring dim)' if mode == 'usp' else 'one dim'}, got "
                f"sequence_dims={dims.sequence} (mesh {tuple(mesh.shape)} with dims {mesh.mesh_dim_names})"
            )
        if dims is not None:
            ranks = dims.sequence_ranks()
        else:
            ranks = resolve_ranks(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group)
        if (mode == "usp") != isinstance(ranks, Grid):
            raise ValueError(
                f"{describe}: mode='usp' runs on mesh= (or ulysses_group= and ring_group=), not group="
                if mode == "usp" else
                f"{describe}: mode={mode!r} runs on group= (default: the world), not on a mesh"
            )  # fmt: skip
        names = ranks.group_names if isinstance(ranks, Grid) else (ranks.name,)
        return cls(mode, layout, names, step_backend, dims)

    # -- the ranks ------------------------------------------------------------------

    def __post_init__(self):
        # The groups are looked up by name once, here: under torch.compile a lookup by
        # name (a pybind call) would break the graph at every attention layer.
        groups = tuple(None if name == SINGLE_PROCESS else group_from_name(name) for name in self.group_names)
        object.__setattr__(self, "process_groups", groups)

    def __deepcopy__(self, memo) -> SequenceParallelism:
        return self  # an immutable value over this process's groups (a copied model shares them)

    def __reduce__(self):
        # Pickled by its fields; the groups are looked up again by name where it is loaded.
        return type(self), (self.mode, self.layout, self.group_names, self.step_backend, self.mesh_dims)

    def groups(self) -> tuple[dist.ProcessGroup | None, ...]:
        """The process groups (None: the single process)."""
        return self.process_groups

    def group_kwargs(self) -> dict:
        """The groups as the package's functions take them (group=, or ulysses_group= and
        ring_group=)."""
        groups = self.groups()
        if self.mode == "usp":
            return {"ulysses_group": groups[0], "ring_group": groups[1]}
        return {"group": groups[0]}

    def reduction_kwargs(self) -> dict:
        """The ranks a loss's sum and token count are reduced over, as the loss functions
        take them: the mesh's sequence and data dims (mesh_dims), else the groups."""
        if self.mesh_dims is None:
            return self.group_kwargs()
        dims = self.mesh_dims
        return {"mesh": dims.mesh, "sequence_dims": dims.sequence, "data_dims": dims.data}

    @property
    def data_size(self) -> int:
        """How many data replicas read different batches (1 without data dims)."""
        return 1 if self.mesh_dims is None else self.mesh_dims.data_size

    @property
    def data_rank(self) -> int:
        """Which of them this rank is, in [0, data_size): the index of the batch it reads
        (its coordinates in data_dims, row-major in their order)."""
        return 0 if self.mesh_dims is None else self.mesh_dims.data_rank

    def data_parallel_mesh(self, *, shard_sequence: bool = True, replicate_dims=()) -> DeviceMesh:
        """The DeviceMesh that FSDP2 (fully_shard(module, mesh=...)) or DDP
        (process_group=mesh.get_group()) runs over: the data dims, and with
        shard_sequence the sequence dims too (sequence ranks hold the same parameters,
        so FSDP may shard across them: torchtitan's dp_shard_cp), flattened into one dim;
        replicate_dims (some of data_dims): HSDP's replicated dims, flattened into a
        first dim of a 2-D mesh (replicate, shard). The wrapper averages the gradients
        over mesh.size() ranks where the loss's convention wants their sum: scale the
        loss by mesh.size() for the backward. Needs mesh_dims (resolved from mesh= with
        sequence_dims=)."""
        dims = self.mesh_dims
        if dims is None:
            raise ValueError(
                "data_parallel_mesh: this parallelism was not resolved from mesh= with sequence_dims= (and "
                f"data_dims=), so it knows no data dims (groups {self.group_names})"
            )
        replicate = tuple(replicate_dims)
        if any(name not in dims.data for name in replicate):
            raise ValueError(f"data_parallel_mesh: replicate_dims={replicate} must be some of data_dims={dims.data}")
        shard = tuple(name for name in dims.data if name not in replicate) + (dims.sequence if shard_sequence else ())
        if not shard:
            raise ValueError(f"data_parallel_mesh: nothing to shard over: data_dims={dims.data}, replicate_dims="
                             f"{replicate}, shard_sequence={shard_sequence}")  # fmt: skip
        shard_mesh = dims.flattened(shard, "_".join(shard))
        if not replicate:
            return shard_mesh
        replicate_mesh = dims.flattened(replicate, "_".join(replicate))
        return dims.mesh[(replicate_mesh.mesh_dim_names[0], shard_mesh.mesh_dim_names[0])]

    @property
    def tensor_size(self) -> int:
        """How many ranks share each tensor-parallel layer (1 without tensor dims)."""
        return 1 if self.mesh_dims is None else self.mesh_dims.tensor_size

    def tensor_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the tensor dims (flattened where there are several), which
        tensor parallelism (parallelize_module) shards the layers over. Needs tensor_dims."""
        dims = self.mesh_dims
        if dims is None or not dims.tensor:
            raise ValueError(f"tensor_mesh: this parallelism was not resolved from mesh= with tensor_dims= (groups "
                             f"{self.group_names})")  # fmt: skip
        return dims.flattened(dims.tensor, "_".join(dims.tensor))

    @property
    def ranks(self) -> GroupInfo | Grid:
        """The group's GroupInfo, or USP's Grid."""
        if self.mode == "usp":
            ulysses_group, ring_group = self.groups()
            return Grid.of(ulysses_group, ring_group)
        return resolve_group(self.groups()[0])

    def _shape(self) -> tuple[int, int, int, int]:
        """(ring slots R, Ulysses ranks U, this rank's ring index, its Ulysses index): a
        group is R ranks of one."""
        ranks = self.ranks
        if isinstance(ranks, Grid):
            return ranks.ring.world_size, ranks.ulysses.world_size, ranks.ring.rank, ranks.ulysses.rank
        return ranks.world_size, 1, ranks.rank, 0

    @property
    def piece(self) -> int:
        """This rank's piece of the sequence (i * U + j under USP)."""
        _, ulysses, ring_index, ulysses_index = self._shape()
        return ring_index * ulysses + ulysses_index

    @property
    def pieces(self) -> int:
        """How many pieces the sequence is cut into: the ranks of the group or grid."""
        ring, ulysses, _, _ = self._shape()
        return ring * ulysses

    @property
    def zigzag(self) -> bool:
        """Whether a batch of whole sequences is in the zigzag layout (balanced)."""
        return self.layout == "balanced"

    @property
    def dense_layout(self) -> str:
        """The attention functions' layout for a batch of whole sequences."""
        return "zigzag" if self.zigzag else "contiguous"

    # -- a sequence -----------------------------------------------------------------

    def piece_lengths(self, total: int) -> tuple[int, ...]:
        """Every piece's length, in piece order, for a sequence of `total` tokens."""
        ring, ulysses, _, _ = self._shape()
        return tuple(length for row in usp_piece_lengths(total, ulysses, ring, self.zigzag) for length in row)

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of x (the full sequence along dim, the same on every rank),
        local and unchecked: a view for one range (the zigzag layout's two: a cat).
        Differentiable: the gradient is this rank's piece, zero elsewhere."""
        ring, ulysses, ring_index, ulysses_index = self._shape()
        return select_segments(x, dim, usp_piece_segments(x.shape[dim], ulysses, ring, ring_index, ulysses_index,
                                                          self.zigzag))  # fmt: skip

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of x as take() gives it, by the split functions (one small
        collective checks that every rank passed the same x; a bad one raises on every
        rank); the backward gathers the gradient's pieces."""
        if self.mode == "usp":
            return usp_split(x, dim, layout=self.dense_layout, **self.group_kwargs())
        if self.zigzag:
            return zigzag_split(x, dim, self.groups()[0])
        return split_sequence(x, dim, self.groups()[0])

    def gather(self, x: torch.Tensor, dim: int, total: int) -> torch.Tensor:
        """The full sequence of `total` tokens along dim from every rank's piece x, on
        every rank (no checks: the pieces are piece_lengths(total)'s). Backward: this
        rank's piece of the gradient."""
        lengths = list(self.piece_lengths(total))
        if self.zigzag and not isinstance(self.ranks, Grid):
            return zigzag_gather_pieces(x, dim, self.groups()[0], self.ranks, lengths)
        return self.gather_consecutive(x, dim, lengths, self.dense_layout)

    def gather_consecutive(self, x: torch.Tensor, dim: int, lengths, layout: str = "contiguous") -> torch.Tensor:
        """The whole along dim from every rank's x, on every rank, where piece p's x holds
        lengths[p] rows and the pieces follow one another in piece order (layout
        "contiguous"; "zigzag": USP's ring slots in the zigzag layout). Backward: this
        rank's piece."""
        lengths = list(lengths)
        ranks = self.ranks
        if isinstance(ranks, Grid):
            rows = ranks.rows(lengths)
            return usp_gather_pieces(x, dim, ranks, layout, rows[ranks.ring.rank], [sum(r) for r in rows])
        return gather_sequence(x, dim, self.groups()[0], sizes=lengths)

    # -- attention ------------------------------------------------------------------

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options):
        """The mode's attention function on this value's groups, its layout for a batch
        of whole sequences (options may set another: varlen's) and step backend.
        q (B, S_r, H, D), k, v (B, S_r, H_kv, D) -> (B, S_r, H, D) [, lse]."""
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, **self.group_kwargs(), **options)
        if self.mode not in ("ring", "usp"):
            raise ValueError(f"mode={self.mode!r} has no attention function of its own")
        options = {"layout": self.dense_layout, "step_backend": self.step_backend, **options}
        function = ring_attention if self.mode == "ring" else usp_attention
        return function(q, k, v, **self.group_kwargs(), **options)

    # -- agreement across the ranks -------------------------------------------------

    def gather_ints(self, values, device: torch.device | None = None) -> list[int]:
        """Every rank's `values` (a list of ints, the same count on every rank), in piece
        order: one small all-gather per group (USP: the Ulysses group's, then the ring's)."""
        values = [int(value) for value in values]
        for name in self.group_names:
            values = [value for row in all_gather_ints(values, name, device) for value in row]
        return values

    def agree(self, describe: str, value, device: torch.device | None = None) -> None:
        """Raises ValueError on every rank unless every rank passed the same `value` (its
        repr is compared)."""
        self.checked(describe, lambda: (value, None), device)

    def checked(self, describe: str, local_checks, device: torch.device | None = None):
        """Runs local_checks() on this rank, which raises ValueError or returns (agreed,
        result), such that a rank's error raises on every rank, and so do ranks whose
        `agreed` values differ (their reprs are compared): one small all-gather per
        group, nested over USP's grid so that a disagreement in any Ulysses group
        reaches every rank. Returns this rank's result."""
        ranks = self.ranks
        if isinstance(ranks, Grid):
            return checked_on_grid(describe, ranks, device, True, lambda: (0, *local_checks()))[0]
        with CheckedOnEveryRank(describe, ranks, device, exchange=True) as checks:
            agreed, result = local_checks()
            checks.share(0, agreed)
        return result
