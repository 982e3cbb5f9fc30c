"""Process groups by name, so that ops can take them as a string argument."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# The group name that means "no torch.distributed": one rank, collectives are copies.
SINGLE_PROCESS = ""


@dataclass(frozen=True)
class GroupInfo:
    name: str
    rank: int
    world_size: int


def resolve_group(group: dist.ProcessGroup | None) -> GroupInfo:
    """Rank, size and name of `group` (default: the world). Without an initialised
    torch.distributed, a single process is a world of one."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return GroupInfo(SINGLE_PROCESS, 0, 1)
    group = group if group is not None else dist.group.WORLD
    return GroupInfo(group.group_name, dist.get_rank(group), dist.get_world_size(group))


def group_from_name(name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(name)


def metadata_device(group: dist.ProcessGroup) -> torch.device:
    """Where small metadata tensors must live for this group's backend."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_ints(values: list[int], group_name: str) -> list[list[int]]:
    """Every rank's `values` (one list per rank, same length on every rank). One small
    collective; on NCCL it synchronises the host with the device."""
    if group_name == SINGLE_PROCESS:
        return [list(values)]
    group = group_from_name(group_name)
    local = torch.tensor(values, dtype=torch.int64, device=metadata_device(group))
    gathered = local.new_empty(dist.get_world_size(group) * len(values))
    # all_gather_single is the newer name (torch >= 2.14) of all_gather_into_tensor.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, local, group=group)
    return gathered.view(-1, len(values)).tolist()
