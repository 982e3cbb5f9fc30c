"""Vision-language models under sequence parallelism: a batch's images and videos, when
their tokens are split across the ranks.

    sp_transformers.apply(model, "ring", layout="balanced")      # Qwen2.5-VL, Qwen3-VL, GLM-4.1V, ...
    batch = sp_transformers.shard_batch(batch, mode="ring", layout="balanced", model=model)
    hidden = model.model(**batch).last_hidden_state               # (B, S_local, hidden)

What the models of VISION_LANGUAGE_TYPES do with a full batch in one process: the vision
tower encodes pixel_values (the patches of every image, or of every video, one item
after another: (patches, channels x temporal patch x patch x patch)) into one feature per
placeholder token (image_grid_thw / video_grid_thw (N, 3): each item's temporal, height
and width patches, giving t x h x w / merge^2 features), attending within each frame
(one temporal patch of an item); the base model scatters the features into the
placeholder tokens' embeddings in order (input_ids == image_token_id, row-major over
(B, S); GLM-4.1V's video frames take the image token, mm_token_type_ids telling them
apart); Qwen3-VL adds features of early vision layers (deepstack) to the same tokens'
hidden states after its first decoder layers; the rotary positions are three rows
(time, height, width) that the model's get_rope_index computes over the whole sequence.

What shard_batch(..., model=model) gives each rank instead:
    position_ids    (3, B, S_local): get_rope_index over the full batch (each packed
                    document on its own), this rank's columns in the layout
    pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw: the frames that
                    this rank's placeholder tokens need (a frame whose tokens straddle
                    ranks: on each of them), consecutive frames of one item as one row
    sequence_shard  its vision entry (a VisionShard): which row of the tower's output
                    each of this rank's placeholder tokens takes
install() (apply() calls it) wraps the base model's get_image_features and
get_video_features on the model instance: while the base model runs a batch that holds
a VisionShard, they keep those rows (the deepstack features' too), so that the model's
own scatter fills this rank's placeholders. Each rank's backward reaches the tower
through its tokens' rows only: its share of the tower's gradient, which
all_reduce_gradients sums. A rank whose tokens hold no placeholder of a modality the
batch has still encodes that modality's first frame and keeps none of it: every rank
runs the tower alike (FSDP gathers its parameters there, and DDP expects them used).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from dataclasses import dataclass
from typing import Mapping

import torch

from seqpar_kernels.integrations.transformers.adapters import transformers_model
from seqpar_kernels.parallel.parallelism import SequenceParallelism
from seqpar_kernels.parallel.training import document_starts
from seqpar_kernels.parallel.training import shard_batch as shard_token_batch

__all__ = ["VISION_LANGUAGE_TYPES", "VIDEO_IN_IMAGE_TOKENS", "MULTIMODAL_KEYS", "EncodedFrames", "VisionShard",
           "shard_batch", "vision_language_base", "install"]  # fmt: skip

# The model types (config.model_type) built as the module docstring says, each checked
# against one process by tests/test_transformers_vision.py.
VISION_LANGUAGE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                         "cosmos3_omni", "glm4v", "glm4v_moe", "glm46v", "glm_ocr")  # fmt: skip
# Model types whose video frames take the image token (mm_token_type_ids tells them apart):
# their forward scatters a batch's images or its videos, not both.
VIDEO_IN_IMAGE_TOKENS = ("glm4v", "glm4v_moe", "glm46v", "glm_ocr")
# Per modality: the pixels' key, the grid's key, the config attribute of its placeholder token.
MODALITIES = {
    "image": ("pixel_values", "image_grid_thw", "image_token_id"),
    "video": ("pixel_values_videos", "video_grid_thw", "video_token_id"),
}
# Keys that only the rotary positions read (get_rope_index): not passed to the model.
POSITION_KEYS = ("mm_token_type_ids", "second_per_grid_ts")
MULTIMODAL_KEYS = (*(key for pixels, grid, _ in MODALITIES.values() for key in (pixels, grid)), *POSITION_KEYS)
# Attributes install() sets on the base model.
_HOOKS_ATTRIBUTE = "seqpar_vision_hooks"
_RUNNING_ATTRIBUTE = "seqpar_vision_running"


@dataclass(frozen=True, eq=False)
class EncodedFrames:
    """What one rank encodes of one modality, and what its placeholder tokens take.

    grid      (G, 3) int64 on the CPU: the frames this rank encodes, consecutive frames of
              one item as one row (t, h, w): the grid shard_batch returns
    rows      (N_local,) int64 on the CPU: for each of this rank's placeholder tokens of
              the modality, in their order here (row-major over (B, S_local)), its row of
              the tower's output for those frames
    features  the tower's output rows for those frames (sum of t x h x w / merge^2)"""

    grid: torch.Tensor
    rows: torch.Tensor
    features: int


@dataclass(frozen=True, eq=False)
class VisionShard:
    """A vision-language batch's images and videos on one rank (None: the batch has
    none of that modality)."""

    image: EncodedFrames | None
    video: EncodedFrames | None


@dataclass(frozen=True)
class _Frame:
    """One frame of the full batch: its item (image or video), its first feature row and
    first patch row (in the full pixel_values), its height and width in patches."""

    item: int
    first_feature: int
    first_patch: int
    height: int
    width: int


def vision_language_base(model, describe: str) -> torch.nn.Module | None:
    """The base model (its vision tower `visual`, its `language_model`, get_rope_index and
    get_image_features) of a vision-language model of VISION_LANGUAGE_TYPES; None for a
    model without sub-models. ValueError for another model with sub-models."""
    config = getattr(model, "config", None)
    if not getattr(config, "sub_configs", None):
        return None
    base = getattr(model, "base_model", None)
    model_type = getattr(config, "model_type", None)
    parts = ("visual", "language_model", "get_rope_index", "get_image_features", "get_video_features")
    if model_type not in VISION_LANGUAGE_TYPES or base is None or not all(hasattr(base, part) for part in parts):
        raise ValueError(
            f"{describe}: {type(model).__name__} (model type {model_type!r}) has sub-models "
            f"({sorted(config.sub_configs)}); sequence parallelism runs text models and the vision-language models "
            f"{list(VISION_LANGUAGE_TYPES)} whole (vision tower and language model together)"
        )
    takes_types = "mm_token_type_ids" in inspect.signature(base.get_rope_index).parameters
    if model_type in VIDEO_IN_IMAGE_TOKENS and not takes_types:
        # Before transformers 5 its get_rope_index finds videos by their start and end tokens instead.
        raise ValueError(
            f"{describe}: {type(model).__name__} (model type {model_type!r}) runs sequence-parallel under "
            "transformers 5 and newer, whose get_rope_index takes mm_token_type_ids (its video frames take the "
            "image token)"
        )
    return base


def _placeholder_token(config, modality: str) -> int:
    """The token id of a modality's placeholders in input_ids (MODALITIES' attribute, or
    the image token for VIDEO_IN_IMAGE_TOKENS' videos)."""
    image = config.model_type in VIDEO_IN_IMAGE_TOKENS
    return getattr(config, MODALITIES["image" if image else modality][2])


# ----------------------------------------------------------------------------------
# shard_batch
# ----------------------------------------------------------------------------------


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    *,
    mode: str,
    group=None,
    mesh=None,
    ulysses_group=None,
    ring_group=None,
    sequence_dims=None,
    data_dims=(),
    layout: str = "contiguous",
    ignore_index: int = -100,
    model=None,
) -> dict:
    """This rank's piece of a batch for a transformers causal LM or vision-language model.

    batch: the full batch, the same on every rank: what parallel.training.shard_batch
        takes (input_ids, labels, attention_mask, position_ids, a flattening collator's
        keys), and a vision-language processor's keys:
            pixel_values         (patches, D): every image's patches, image after image
            image_grid_thw       (images, 3): each image's (t, h, w) in patches
            pixel_values_videos  (patches, D), video_grid_thw (videos, 3): the same for videos
            mm_token_type_ids    (batch, seqlen): 0 text, 1 image, 2 video (what
                                 get_rope_index reads, where the model's takes it)
            second_per_grid_ts   (videos,): seconds per temporal patch (Qwen2.5-VL)
        position_ids may also be (3, batch or 1, seqlen) multimodal positions of your
        own, or (4, ...) with the text positions (packed documents) first.
    mode, groups, layout, ignore_index: parallel.training.shard_batch's.
    model: the model apply() set up (or PEFT's wrapper of it); needed for a batch with
        images or videos (its config names their placeholder tokens, its get_rope_index
        gives the positions).
    Returns parallel.training.shard_batch's dict (input_ids, position_ids, shift_labels,
    attention_mask, sequence_shard: (B, S_local) each) for a text batch; for a
    vision-language batch also this rank's pixel_values / image_grid_thw and
    pixel_values_videos / video_grid_thw (the frames its tokens need, as the module
    docstring says), position_ids (3, B, S_local), and sequence_shard.vision.
    model.model(**everything but shift_labels) then runs as for a text model. ValueError,
    on every rank, for a batch whose pixels, grids and placeholder tokens disagree, an
    image crossing a packed document's end, a missing mm_token_type_ids, or ranks
    holding different images."""
    groups = dict(group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group,
                  sequence_dims=sequence_dims, data_dims=data_dims)  # fmt: skip
    if model is not None:
        model = transformers_model(model, "shard_batch")
    present = [key for key in MULTIMODAL_KEYS if batch.get(key) is not None]
    position_ids = batch.get("position_ids")
    three_d = isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3
    if not present and not three_d:
        return shard_token_batch(batch, mode=mode, layout=layout, ignore_index=ignore_index, **groups)
    describe = "shard_batch"
    if model is None:
        raise ValueError(
            f"{describe}: a vision-language batch ({present or 'position_ids ' + str(tuple(position_ids.shape))}) "
            "needs model=, the model apply() set up: its config names the image and video tokens, its "
            "get_rope_index gives the multimodal positions"
        )
    base = vision_language_base(model, describe)
    if base is None:
        raise ValueError(f"{describe}: got {present} for {type(model).__name__}, which has no vision tower")
    parallelism = SequenceParallelism.resolve(describe, mode, layout, **groups)
    full = parallelism.checked(describe, lambda: _checked_batch(describe, batch, model.config, base),
                               _device_of(batch))  # fmt: skip
    text = {key: value for key, value in batch.items() if key not in MULTIMODAL_KEYS and key != "position_ids"}
    if full.text_positions is not None:
        text["position_ids"] = full.text_positions
    local = shard_token_batch(text, mode=mode, layout=layout, ignore_index=ignore_index, **groups)
    shard = local["sequence_shard"]
    local["position_ids"] = shard.take(full.positions, dim=2).contiguous()  # (3, B, S_local)
    encoded = {}
    for modality, (pixels_key, grid_key, _) in MODALITIES.items():
        if modality in full.frames:
            frames = full.frames[modality]
            encoded[modality], local[pixels_key] = _encode_here(shard, full.placeholders[modality], frames,
                                                                batch[pixels_key], full.merge)  # fmt: skip
            local[grid_key] = encoded[modality].grid.to(batch[grid_key].device)
    local["sequence_shard"] = dataclasses.replace(shard, vision=VisionShard(encoded.get("image"), encoded.get("video")))
    return local


@dataclass
class _FullBatch:
    """What the checks found in a full vision-language batch."""

    positions: torch.Tensor  # (3, B, S) int64 multimodal rotary positions
    text_positions: torch.Tensor | None  # (B or 1, S): the text positions given, for the documents
    placeholders: dict  # modality -> (B, S) bool: its placeholder tokens
    frames: dict  # modality -> list[_Frame]
    merge: int


def _device_of(batch) -> torch.device | None:
    ids = batch.get("input_ids")
    return ids.device if isinstance(ids, torch.Tensor) else None


def _checked_batch(describe: str, batch, config, base) -> tuple[tuple, _FullBatch]:
    """The full batch's checks (ValueError), and what shard_batch builds on: (what every
    rank must agree on, the _FullBatch)."""
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"{describe}: input_ids must be an integer tensor (batch, seqlen), got {shape}")
    batch_size, seqlen = input_ids.shape
    ids = input_ids.cpu()
    merge = int(config.vision_config.spatial_merge_size)
    agreed, placeholders, frames, grids = [tuple(input_ids.shape)], {}, {}, {}
    given = [modality for modality, (pixels_key, grid_key, _) in MODALITIES.items()
             if batch.get(pixels_key) is not None or batch.get(grid_key) is not None]  # fmt: skip
    if config.model_type in VIDEO_IN_IMAGE_TOKENS and len(given) == len(MODALITIES):
        raise ValueError(f"{describe}: a {config.model_type} batch holds images or videos, not both: its video "
                         "frames take the image token, and its forward places either")  # fmt: skip
    for modality, (pixels_key, grid_key, _) in MODALITIES.items():
        pixels, grid = batch.get(pixels_key), batch.get(grid_key)
        if pixels is None and grid is None:
            continue
        if pixels is None or grid is None:
            raise ValueError(f"{describe}: {pixels_key} and {grid_key} come together; got only "
                             f"{pixels_key if grid is None else grid_key}")  # fmt: skip
        token = _placeholder_token(config, modality)
        placeholders[modality] = ids == token
        frames[modality] = _frames(describe, pixels, grid, int(placeholders[modality].sum()), merge,
                                   (pixels_key, grid_key, token))  # fmt: skip
        grids[grid_key] = grid
        agreed.append((modality, grid.tolist(), tuple(pixels.shape), str(pixels.dtype),
                       float(pixels.sum(dtype=torch.float64)),
                       float(torch.linalg.vector_norm(pixels, dtype=torch.float64))))  # fmt: skip
    mm_token_type_ids = batch.get("mm_token_type_ids")
    seconds = batch.get("second_per_grid_ts")
    if mm_token_type_ids is not None and (not isinstance(mm_token_type_ids, torch.Tensor)
                                          or tuple(mm_token_type_ids.shape) != (batch_size, seqlen)):  # fmt: skip
        shape = getattr(mm_token_type_ids, "shape", type(mm_token_type_ids).__name__)
        raise ValueError(f"{describe}: mm_token_type_ids must have input_ids' shape {(batch_size, seqlen)}, got "
                         f"{tuple(shape) if isinstance(shape, torch.Size) else shape}")  # fmt: skip
    if seconds is not None:
        # Passed on as given: the model multiplies in their dtype.
        values = torch.as_tensor(seconds).flatten().tolist()
        videos = len(grids["video_grid_thw"]) if "video_grid_thw" in grids else 0
        if len(values) != videos:
            raise ValueError(f"{describe}: second_per_grid_ts has {len(values)} values for {videos} videos")
    agreed.append((None if mm_token_type_ids is None else int(mm_token_type_ids.sum()),
                   None if seconds is None else values))  # fmt: skip

    position_ids = batch.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        if position_ids.shape[0] not in (3, 4) or position_ids.shape[1] not in (1, batch_size) \
                or position_ids.shape[2] != seqlen:  # fmt: skip
            raise ValueError(f"{describe}: multimodal position_ids must be (3 or 4, {batch_size} or 1, {seqlen}), "
                             f"got {tuple(position_ids.shape)}")  # fmt: skip
        positions = position_ids[-3:].expand(3, batch_size, seqlen).long()
        text_positions = position_ids[0] if position_ids.shape[0] == 4 else None
        agreed.append(int(positions.sum()))
    else:
        text_positions = position_ids
        documents = _documents(position_ids, batch_size, seqlen)
        arguments = dict(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids, second_per_grid_ts=seconds,
                         attention_mask=batch.get("attention_mask"), **grids)  # fmt: skip
        positions = _rope_positions(describe, base, arguments, documents, placeholders, frames)
    full = _FullBatch(positions.to(input_ids.device), text_positions, placeholders, frames, merge)
    return tuple(agreed), full


def _frames(describe: str, pixels, grid, placeholders: int, merge: int, names) -> list[_Frame]:
    """The frames of one modality's items, after checking that the pixels, the grid and
    the placeholder tokens agree."""
    pixels_key, grid_key, token_id = names
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() \
            or not bool((grid > 0).all()):  # fmt: skip
        shape = tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__
        raise ValueError(f"{describe}: {grid_key} must be a positive integer tensor (items, 3), got {shape}")
    rows = [tuple(int(value) for value in row) for row in grid.tolist()]
    if any(height % merge or width % merge for _, height, width in rows):
        raise ValueError(f"{describe}: {grid_key} {rows}: heights and widths must be multiples of the vision "
                         f"tower's spatial_merge_size {merge}")  # fmt: skip
    patches = sum(t * height * width for t, height, width in rows)
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 2 or pixels.shape[0] != patches:
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise ValueError(f"{describe}: {pixels_key} must be (patches, features) with the {patches} patches of "
                         f"{grid_key} {rows}, got {shape}")  # fmt: skip
    if patches // (merge * merge) != placeholders:
        raise ValueError(f"{describe}: input_ids hold {placeholders} placeholder tokens (id {token_id}) but "
                         f"{grid_key} {rows} gives {patches // (merge * merge)} features")  # fmt: skip
    frames, feature, patch = [], 0, 0
    for item, (t, height, width) in enumerate(rows):
        for _ in range(t):
            frames.append(_Frame(item, feature, patch, height, width))
            feature += height * width // (merge * merge)
            patch += height * width
    return frames


def _documents(position_ids, batch_size: int, seqlen: int) -> list[tuple[int, int]] | None:
    """The packed documents' (start, end) of a one-row batch whose text positions
    restart; None otherwise (the rows are whole sequences)."""
    if position_ids is None or position_ids.dim() != 2 or batch_size != 1 or position_ids.shape[-1] != seqlen:
        return None  # parallel.training.shard_batch checks the text positions' shape
    starts = document_starts(position_ids.cpu())
    return list(zip([0, *starts], [*starts, seqlen])) if starts else None


def _rope_positions(describe, base, arguments: dict, documents, placeholders: dict, frames: dict) -> torch.Tensor:
    """(3, B, S) int64: the model's get_rope_index over the full batch, or over each
    packed document with its own items."""
    accepted = inspect.signature(base.get_rope_index).parameters
    if "mm_token_type_ids" in accepted and arguments["mm_token_type_ids"] is None:
        raise ValueError(
            f"{describe}: {type(base).__name__}.get_rope_index needs mm_token_type_ids (batch, seqlen) for the "
            "multimodal positions: pass the processor's"
        )

    def rope_index(**given) -> torch.Tensor:
        with torch.no_grad():
            return base.get_rope_index(**{k: v for k, v in given.items() if k in accepted and v is not None})[0]

    if documents is None:
        return rope_index(**arguments).long()
    # Each item's first and last placeholder token's column (the batch is one row).
    spans = {modality: _item_spans(mask[0], frames[modality]) for modality, mask in placeholders.items()}
    pieces = []
    for start, end in documents:
        given = {key: value[:, start:end] if key in ("input_ids", "mm_token_type_ids") and value is not None
                 else None for key, value in arguments.items()}  # fmt: skip
        for modality, (_, grid_key, _) in MODALITIES.items():
            inside = [item for item, (first, last) in enumerate(spans.get(modality, [])) if start <= first < end]
            for item in inside:
                if spans[modality][item][1] >= end:
                    raise ValueError(f"{describe}: {modality} {item}'s tokens cross the end of the packed document "
                                     f"[{start}, {end})")  # fmt: skip
            if inside:
                given[grid_key] = arguments[grid_key][inside]
                if modality == "video" and arguments["second_per_grid_ts"] is not None:
                    given["second_per_grid_ts"] = [arguments["second_per_grid_ts"][item] for item in inside]
        if any(given.get(MODALITIES[m][1]) is not None for m in MODALITIES):
            pieces.append(rope_index(**given).long())
        else:  # text alone: the positions of a text model
            pieces.append(torch.arange(end - start, device=given["input_ids"].device).expand(3, 1, end - start))
    return torch.cat(pieces, dim=2)


def _item_spans(placeholders_row: torch.Tensor, frames: list[_Frame]) -> list[tuple[int, int]]:
    """Each item's (first, last) placeholder column in a row of placeholder flags."""
    columns = torch.nonzero(placeholders_row).flatten().tolist()
    firsts: dict[int, int] = {}
    for frame in frames:
        firsts.setdefault(frame.item, frame.first_feature)
    starts = [firsts[item] for item in sorted(firsts)]
    return [(columns[start], columns[end - 1]) for start, end in zip(starts, [*starts[1:], len(columns)])]


def _encode_here(shard, placeholders: torch.Tensor, frames: list[_Frame], pixels: torch.Tensor, merge: int):
    """(EncodedFrames, this rank's pixels) of one modality: the frames holding the
    features this rank's placeholder tokens take (the first frame where they take none)."""
    flat = placeholders.flatten()
    feature_of_token = (torch.cumsum(flat.long(), 0) - 1).masked_fill(~flat, -1).view_as(placeholders)
    local = shard.take(feature_of_token, dim=1).flatten()
    needed = local[local >= 0]  # each placeholder's feature row, in this rank's order
    firsts = torch.tensor([frame.first_feature for frame in frames], dtype=torch.long)
    frame_of = torch.searchsorted(firsts, needed, right=True) - 1
    encoded = sorted(set(frame_of.tolist())) or [0]
    # Runs of consecutive frames of one item: one grid row, one slice of the pixels.
    runs: list[list[int]] = []
    for index in encoded:
        previous = runs[-1][-1] if runs else None
        if previous is not None and previous + 1 == index and frames[previous].item == frames[index].item:
            runs[-1].append(index)
        else:
            runs.append([index])
    grid = torch.tensor([[len(run), frames[run[0]].height, frames[run[0]].width] for run in runs], dtype=torch.long)
    pieces = [pixels.narrow(0, frames[run[0]].first_patch, len(run) * frames[run[0]].height * frames[run[0]].width)
              for run in runs]  # fmt: skip
    sizes = torch.tensor([frames[index].height * frames[index].width // (merge * merge) for index in encoded])
    offsets = torch.zeros(len(frames), dtype=torch.long)
    offsets[torch.tensor(encoded)] = torch.cumsum(sizes, 0) - sizes  # each encoded frame's first output row
    rows = offsets[frame_of] + needed - firsts[frame_of]
    local_pixels = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return EncodedFrames(grid, rows, int(sizes.sum())), local_pixels


# ----------------------------------------------------------------------------------
# The base model's hooks and wrappers
# ----------------------------------------------------------------------------------


def install(base: torch.nn.Module) -> None:
    """Set up the base model of a vision-language model (vision_language_base's) for
    batches made by shard_batch, replacing an earlier install: a pre-hook and a hook
    around its forward (the batch's VisionShard is the running one), and on the
    instance, get_image_features and get_video_features that keep the rows of the
    running VisionShard. A forward given pixels without a VisionShard raises."""
    for handle in getattr(base, _HOOKS_ATTRIBUTE, ()):
        handle.remove()
    setattr(base, _RUNNING_ATTRIBUTE, None)
    hooks = (base.register_forward_pre_hook(_before, with_kwargs=True),
             base.register_forward_hook(_after, with_kwargs=True, always_call=True))  # fmt: skip
    setattr(base, _HOOKS_ATTRIBUTE, hooks)
    # Bound to the instance (a deep copy rebinds them to the copy); the class's own method runs inside.
    base.get_image_features = types.MethodType(_image_features, base)
    base.get_video_features = types.MethodType(_video_features, base)


def _before(module, args, kwargs):
    vision = getattr(kwargs.get("sequence_shard"), "vision", None)
    for modality, (pixels_key, _, _) in MODALITIES.items():
        given = kwargs.get(pixels_key) is not None
        planned = vision is not None and getattr(vision, modality) is not None
        if given and vision is None:
            raise ValueError(
                f"{type(module).__name__}: got {pixels_key} without shard_batch's plan of the features this rank's "
                "tokens take: pass the model the batch shard_batch(batch, ..., model=model) made (generate over a "
                "sharded cache takes text prompts only)"
            )
        if given != planned:
            raise ValueError(
                f"{type(module).__name__}: the batch's sequence_shard plans {modality}s but {pixels_key} is "
                f"{'given' if given else 'missing'}: pass the model every key shard_batch returned"
            )
    setattr(module, _RUNNING_ATTRIBUTE, vision)


def _after(module, args, kwargs, output):
    setattr(module, _RUNNING_ATTRIBUTE, None)


def _image_features(self, *args, **kwargs):
    return _kept_rows(self, "get_image_features", "image", args, kwargs)


def _video_features(self, *args, **kwargs):
    return _kept_rows(self, "get_video_features", "video", args, kwargs)


def _kept_rows(module, name: str, modality: str, args, kwargs):
    """module's own `name` (get_image_features or get_video_features); while a batch with
    a VisionShard runs, only the rows its placeholder tokens of `modality` take, in
    their order: (features,) in place of the per-item features, the same for each
    deepstack layer's."""
    original = getattr(type(module), name)
    vision = getattr(module, _RUNNING_ATTRIBUTE, None)
    if vision is None:
        return original(module, *args, **kwargs)
    # A nested call (Qwen3-VL encodes videos through get_image_features) encodes as asked.
    setattr(module, _RUNNING_ATTRIBUTE, None)
    try:
        output = original(module, *args, **kwargs)
    finally:
        setattr(module, _RUNNING_ATTRIBUTE, vision)
    frames: EncodedFrames = getattr(vision, modality)

    def kept(per_item):
        features = per_item if isinstance(per_item, torch.Tensor) else torch.cat(list(per_item))
        if features.shape[0] != frames.features:
            raise ValueError(
                f"{type(module).__name__}.{name}: the vision tower gave {features.shape[0]} features for this "
                f"rank's frames {frames.grid.tolist()}, the plan expects {frames.features}: pass the model the "
                "batch shard_batch made"
            )
        return (features.index_select(0, frames.rows.to(features.device)),)

    if isinstance(output, (tuple, list)) and all(isinstance(each, torch.Tensor) for each in output):
        return kept(output)  # transformers 4: the per-item features
    if getattr(output, "pooler_output", None) is None:
        raise ValueError(f"{type(module).__name__}.{name} returned {type(output).__name__}, whose features "
                         "sequence parallelism cannot find (no pooler_output)")  # fmt: skip
    output.pooler_output = kept(output.pooler_output)
    if getattr(output, "deepstack_features", None) is not None:  # Qwen3-VL: one per deepstack layer
        output.deepstack_features = [kept(layer) for layer in output.deepstack_features]
    return output
