"""Process-group plumbing: groups, exchange plans, collectives, comm_stats."""

from seqpar_kernels.comm.groups import GroupInfo, resolve_group
from seqpar_kernels.comm.plan import tensor_split_ranges
from seqpar_kernels.comm.stats import comm_stats

__all__ = ["GroupInfo", "resolve_group", "tensor_split_ranges", "comm_stats"]
