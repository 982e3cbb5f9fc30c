"""DeepSeek Sparse Attention layers (DeepSeek-V3.2's and GLM-5's "indexed_attention")
under sequence parallelism: the model's own indexer over every rank's keys, then
sparse_attention over the keys it chose.

Such a layer calls its indexer (under no_grad: transformers trains no indexer) with
attention_mask[:, 0] and its cache, then the attention function with the top-k indices
(indices=, global rows). install() hooks each layer and indexer:
    the layer     its LayerMask becomes an IndexedMask: the mask, the SparsePlacement of
                  this forward (where every rank's tokens sit: the SequenceShard's
                  layout and documents, or the position ids), and, indexed as the model
                  indexes a 4-D mask, the (B, 1, S_local, T) bool of the keys each query
                  may see (causal, its document), which the indexer adds to its scores
    the indexer   it gets, in place of the cache (None in training), one whose
                  update_indexer returns every rank's indexer keys in global order, so
                  that the model's own code scores the whole sequence and takes
                  torch.topk over each full row: the model's indices, ties included
The attention function then runs sparse_attention on the IndexedMask's placement
(attention.py). GLM-5's "shared" layers reuse the previous layer's indices, global
rows already.

The placement's group: the mode's group under "ulysses" and "ring"; under "usp" one
group of every rank of this rank's U x R grid (install makes it once per model: the
mesh's sequence dims flattened, or a new group of the Ulysses peers' ring ranks). A USP
rank holds whole-head rows of its own piece, as a ring rank does, so the layer ignores
the Ulysses/ring split: the indexer gathers its keys over all P = U x R pieces, (P-1) x
S_r x B x D_i x element size bytes from rank r, and sparse_attention fetches only the
chosen K/V rows from whichever rank of the grid holds them
(traffic.sparse_attention_bytes with P ranks: at most (P-1) x S_r rows each way).

Refused at apply, naming what is missing (check): tensor parallelism, generation over a
KV cache, and models whose sparse attention runs on compressed keys: DeepSeek-V4 and
GLM-5-next.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from seqpar_kernels.groups import all_gather_ints, group_from_name
from seqpar_kernels.integrations.transformers.generation import running_step
from seqpar_kernels.integrations.transformers.masks import LayerMask
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.sparse import SparsePlacement, sparse_placement
from seqpar_kernels.parallel.training import SequenceShard

__all__ = ["IndexedMask", "INDEXED_LAYER_TYPES", "GridGroup", "check", "grid_group", "install", "global_rows"]

INDEXED_LAYER_TYPES = ("indexed_attention",)
# The model types whose indexed layers run here, and those refused with the reason.
INDEXED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
REFUSED_MODEL_TYPES = {
    "deepseek_v4": "its compressed sparse attention attends over keys that compressors pool from windows of "
    "compress_rates tokens (a window may straddle ranks, and the CSA window reads the previous window's half), "
    "beside a sliding window with sinks; the package has no sequence-parallel compressor nor an indexer over "
    "compressed keys",
    "glm5_next": "its indexer scores pooled key blocks (k-pool compression) and its linear-attention layers "
    "have no sequence-parallel mixer here",
}
_HOOKED = "seqpar_indexed_hooks"
_GRID = "seqpar_indexed_grid"


class IndexedMask:
    """A DSA layer's attention_mask under sequence parallelism (see the module's doc).
    mask: the LayerMask; placement: the SparsePlacement; [key]: the (B, 1, S_local, T)
    bool of the keys each query may see, indexed."""

    def __init__(self, mask: LayerMask, placement: SparsePlacement, batch: int):
        self.mask, self.placement = mask, placement
        self.allowed = placement.allowed()[None, None].expand(batch, 1, -1, -1)

    def __getitem__(self, key) -> torch.Tensor:
        return self.allowed[key]


class _IndexerKeys:
    """What a DSA indexer gets as its cache: update_indexer((B, S_local, D_i) keys)
    returns (B, T, D_i), every rank's keys in global order."""

    def __init__(self, placement: SparsePlacement):
        self.placement = placement

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return self.placement.gather(keys)


def _model_type(model) -> str:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.model_type.removesuffix("_text")


def check(model, settings: SequenceParallelism) -> bool:
    """Whether the model has DSA layers that install() runs; raises ValueError for a
    model or a parallelism it cannot run."""
    model_type = _model_type(model)
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"apply: {type(model).__name__} ({model_type}) cannot run sequence-parallel: "
                         f"{REFUSED_MODEL_TYPES[model_type]}")  # fmt: skip
    if model_type not in INDEXED_MODEL_TYPES:
        return False
    if settings.tensor_size > 1:
        raise ValueError(f"apply: {type(model).__name__}'s indexed (DSA) attention runs without tensor_dims (the "
                         f"indexer and sparse_attention take every head of a token); got mode={settings.mode!r}, "
                         f"tensor size {settings.tensor_size}")  # fmt: skip
    return True


class GridGroup:
    """USP's U x R grid as the one group a DSA layer's placement runs over.

    group         a process group of every rank of this rank's grid
    pieces        the sequence piece (i * U + j) of each of the group's ranks, in group
                  rank order (the placement's sizes go in that order)
    group_names   the (ulysses, ring) group names it was made for"""

    def __init__(self, group: dist.ProcessGroup, pieces: tuple[int, ...], group_names: tuple[str, ...]):
        self.group, self.pieces, self.group_names = group, pieces, group_names

    def __deepcopy__(self, memo) -> GridGroup:
        return self  # process groups are not copied: a copied model shares them

    def __reduce__(self):
        # Pickled by name; the group is looked up again where it is loaded.
        return _grid_group_named, (self.group.group_name, self.pieces, self.group_names)


def _grid_group_named(name: str, pieces: tuple[int, ...], group_names: tuple[str, ...]) -> GridGroup:
    return GridGroup(group_from_name(name), pieces, group_names)


def grid_group(settings: SequenceParallelism) -> GridGroup:
    """The group of every rank of this rank's USP grid: the mesh's sequence dims
    flattened (settings from mesh= with sequence_dims=), the Ulysses or ring group
    where the other has one rank, else a new group of the ring ranks of every Ulysses
    peer. Collective: every rank of the grid calls it (apply does, on every rank)."""
    ulysses_group, ring_group = settings.groups()
    grid = settings.ranks
    dims = settings.mesh_dims
    if dims is not None:
        group = dims.flattened(dims.sequence, "_".join(dims.sequence)).get_group()
    elif grid.ring.world_size == 1 or grid.ulysses.world_size == 1:
        group = ulysses_group if grid.ring.world_size == 1 else ring_group
    else:
        rings = all_gather_ints(dist.get_process_group_ranks(ring_group), grid.ulysses.name)
        ranks = sorted({rank for ring in rings for rank in ring})
        size = grid.ulysses.world_size * grid.ring.world_size
        if len(ranks) != size:
            raise ValueError(f"apply: the ring groups of this rank's Ulysses group ({grid.ulysses.world_size} ranks) "
                             f"hold {len(ranks)} ranks, not the {size} of a {grid.ulysses.world_size} x "
                             f"{grid.ring.world_size} grid: make the groups with make_usp_groups")  # fmt: skip
        group = dist.new_group(ranks, use_local_synchronization=True)
    pieces = tuple(piece for (piece,) in all_gather_ints([settings.piece], group.group_name))
    return GridGroup(group, pieces, settings.group_names)


def install(model, settings: SequenceParallelism) -> None:
    """Hooks every DSA layer and indexer of the model (once), and gives each layer the
    group its placement runs over under USP (made once here: collective over the grid)."""
    layers = [module for module in model.modules() if hasattr(module, "indexer") and hasattr(module, "kv_b_proj")]
    grid = grid_group(settings) if settings.mode == "usp" and layers else None
    for module in layers:
        setattr(module, _GRID, grid)
        if getattr(module, _HOOKED, False):
            continue
        module.register_forward_pre_hook(_enter_layer, with_kwargs=True)
        if module.indexer is not None:  # GLM-5's shared layers have none
            module.indexer.register_forward_pre_hook(_enter_indexer, with_kwargs=True)
        setattr(module, _HOOKED, True)


def global_rows(shard: SequenceShard | None, position_ids, device) -> torch.Tensor:
    """(S_local,) int64: the row of each of this rank's tokens in the full sequence (the
    packed row under varlen). Without a shard, the position ids (checked to be those)."""
    if shard is None:
        return position_ids[0]
    return shard.take(torch.arange(sum(shard.seq_lens), device=device), dim=0)


def _enter_layer(module, args, kwargs):
    describe = f"indexed (DSA) attention in {type(module).__name__}"
    mask, hidden = kwargs.get("attention_mask"), kwargs.get("hidden_states", args[0] if args else None)
    if kwargs.get("cache") is not None or running_step() is not None:
        raise ValueError(f"{describe}: generation over a KV cache is not sequence-parallel for DSA layers; pass "
                         "use_cache=False")  # fmt: skip
    if not isinstance(mask, LayerMask) or not mask.causal or mask.is_local:
        raise ValueError(f"{describe}: the layer's mask is {mask!r}; DSA layers take the causal mask transformers "
                         "builds through masking_utils (no window, no chunks)")  # fmt: skip
    settings = module.seqpar_parallelism
    shard, position_ids = kwargs.get("sequence_shard"), kwargs.get("position_ids")
    if shard is None and position_ids is None:
        raise ValueError(f"{describe}: pass position_ids or shard_batch's batch (where this rank's tokens sit)")
    varlen = shard.varlen if shard is not None else None
    group, seq_lens = settings.groups()[0], None if shard is None else list(shard.seq_lens)
    if settings.mode == "usp":
        grid = getattr(module, _GRID, None)
        if grid is None or grid.group_names != settings.group_names:
            raise ValueError(f"{describe}: the layer runs USP over groups {settings.group_names}, but apply() made "
                             f"its grid group for {None if grid is None else grid.group_names}: call apply() with "
                             "the groups the model runs on")  # fmt: skip
        # The shard lists the pieces in piece order, the placement wants the grid group's rank order.
        group, seq_lens = grid.group, None if seq_lens is None else [seq_lens[piece] for piece in grid.pieces]
    try:
        placement = sparse_placement(hidden.shape[1], group=group,
                                     rows=global_rows(shard, position_ids, hidden.device),
                                     seq_lens=seq_lens,
                                     cu_seqlens=None if varlen is None else list(varlen.layout.cu_seqlens),
                                     device=hidden.device)  # fmt: skip
    except ValueError as error:  # raised on every rank alike: the ranks' rows are gathered first
        if shard is not None:
            raise
        raise ValueError(f"{describe}: position_ids {tuple(position_ids.shape)} are not every rank's global "
                         "positions (counted from 0 on every rank, or packed documents): pass the model the batch "
                         f"made by shard_batch ({error})") from error  # fmt: skip
    kwargs["attention_mask"] = IndexedMask(mask, placement, hidden.shape[0])
    if module.indexer is not None:
        module.indexer.seqpar_placement = placement
    return args, kwargs


def _enter_indexer(indexer, args, kwargs):
    kwargs["cache"] = _IndexerKeys(indexer.seqpar_placement)
    return args, kwargs
