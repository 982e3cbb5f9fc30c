"""Process groups by name, so that ops can take them as a string argument."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# The group name that means "no torch.distributed": one rank, collectives are copies.
SINGLE_PROCESS = ""


@dataclass(frozen=True)
class GroupInfo:
    name: str
    rank: int
    world_size: int
    # The group itself where it was resolved from one: torch.compile traces reading it,
    # not a lookup by name (a pybind call, which breaks the graph).
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def process_group(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else group_from_name(self.name)


def resolve_group(group: dist.ProcessGroup | None) -> GroupInfo:
    """Rank, size and name of `group` (default: the world). Without an initialised
    torch.distributed, a single process is a world of one."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return GroupInfo(SINGLE_PROCESS, 0, 1)
    group = group if group is not None else dist.group.WORLD
    return GroupInfo(group.group_name, dist.get_rank(group), dist.get_world_size(group), group)


def group_from_name(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def metadata_device(group: dist.ProcessGroup, data_device: torch.device | None = None) -> torch.device:
    """Where small metadata tensors must live for this group's backend: on NCCL, the
    GPU of the data the collective is about (`data_device`), which is this rank's
    GPU even when the caller never called torch.cuda.set_device; else the current
    CUDA device. On other backends, the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if data_device is not None and data_device.type == "cuda":
            return data_device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values, group_name: str, data_device: torch.device | None = None) -> list[list[int]]:
    """Every rank's `values` (a list of ints, or an integer tensor whose elements are
    read without a host sync before the gather; one row per rank, the same length on
    every rank). One small collective; on NCCL it synchronises the host with the
    device. `data_device`: see metadata_device."""
    if group_name == SINGLE_PROCESS:
        return [values.reshape(-1).tolist() if isinstance(values, torch.Tensor) else list(values)]
    group = group_from_name(group_name)
    device = metadata_device(group, data_device)
    if isinstance(values, torch.Tensor):
        local = values.reshape(-1).to(device=device, dtype=torch.int64)
    else:
        local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = local.new_empty(dist.get_world_size(group) * local.numel())
    # all_gather_single is the newer name (torch >= 2.14) of all_gather_into_tensor.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, local, group=group)
    return gathered.view(-1, local.numel()).tolist()
