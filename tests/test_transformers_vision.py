"""Vision-language models under sequence parallelism
(seqpar_kernels/integrations/transformers/vision.py): small random Qwen2-VL, Qwen2.5-VL,
Qwen3-VL (deepstack), Qwen3-VL-MoE, Cosmos3-Omni, Qwen3.5 (Gated DeltaNet) and its MoE,
GLM-4.1V (video frames in the image token), GLM-4.5V, GLM-4.6V and GLM-OCR models (a
vision tower of 2 blocks; images of 4 to 12 features, a video of 2 frames) through apply +
shard_batch(model=) + causal_lm_loss + all_reduce_gradients on gloo ranks must give
transformers' own single-process run's loss and every parameter's gradient, the vision
tower's included: images straddling rank boundaries (checked to happen at every world
size above 1), two images of different sizes and a video in one batch, padded and packed
batches, world sizes 1 to 4 and a USP grid, three AdamW steps; the Trainer with a
collator of the test's own; and what cannot be honoured raises.

The single-process reference: the model on the full batch (under transformers 4 with
an attention mask of ones, as its processor gives), its multimodal positions
computed by itself (packed batches: each document alone, the loss the mean over all
their targets).
"""

from __future__ import annotations

import copy
import inspect
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_transformers_integration as integration  # noqa: E402
from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402

# The families whose video frames take the image token (their start and end tokens are named
# after images); transformers 4's get_rope_index finds their videos otherwise (not supported).
from seqpar_kernels.integrations.transformers.vision import VIDEO_IN_IMAGE_TOKENS  # noqa: E402

VOCAB = 96
IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93
TEXT = 80  # text tokens are drawn below this
PATCH_FEATURES = 3 * 2 * 2 * 2  # channels x temporal patch x patch x patch
TRANSFORMERS_4 = transformers.__version__.startswith("4.")


def _rope(**extra) -> dict:
    """The text config's multimodal rotary settings, as this release names them."""
    if TRANSFORMERS_4:
        return {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3], **extra}}
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], **extra}}


# Qwen2.5-VL's tower: windows of 2 x 2 features, then full attention; Qwen3-VL's: deepstack
# features of both blocks, added after both decoder layers.
_QWEN25_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, window_size=8,
                      fullatt_block_indexes=[1], tokens_per_second=2)  # fmt: skip
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                     num_position_embeddings=16, deepstack_visual_indexes=[0, 1])  # fmt: skip
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
# Qwen3.5's tower: Qwen3-VL's without deepstack; its language model: Gated DeltaNet (2 q/k
# heads serving 4 value heads of 16, a convolution of kernel 3), then gated attention.
_QWEN35_VISION = {key: value for key, value in _QWEN3_VISION.items() if key != "deepstack_visual_indexes"}
_GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=3)  # fmt: skip
# GLM-4.1V's tower: position embeddings of a 4 x 4 patch grid interpolated to each frame's.
_GLM4V_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, image_size=8)
# GLM's and Qwen3.5's language models rotate part of each head: half here (mrope_section sums
# to a quarter; transformers 4 names no "mrope" type for GLM).
_HALF_ROTARY = dict(
    mrope_section=[1, 1, 2], partial_rotary_factor=0.5, **({"type": "default"} if TRANSFORMERS_4 else {})
)
_QWEN35_TEXT = dict(head_dim=16, rope=_HALF_ROTARY, layer_types=["linear_attention", "full_attention"],
                    **_GATED_DELTA)  # fmt: skip
# GLM-4.5V's language model: a dense first layer, then routed experts and a shared one.
_GLM4V_MOE = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1
)
# (config class, model class, vision settings, text settings, whether video frames are
# separated by timestamps); text settings' "rope": the rotary settings' own.
FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=1, num_heads=2), {}, False),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", _QWEN25_VISION, {}, False),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", _QWEN3_VISION, dict(head_dim=16), True),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", _QWEN3_VISION,
                     dict(head_dim=16, **_MOE), True),
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", _GLM4V_VISION, dict(rope=_HALF_ROTARY), True),
    "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", _GLM4V_VISION,
                  dict(rope=_HALF_ROTARY, **_GLM4V_MOE), True),
    "cosmos3_omni": ("Cosmos3OmniConfig", "Cosmos3OmniForConditionalGeneration", _QWEN3_VISION, dict(head_dim=16),
                     True),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", _QWEN35_VISION, _QWEN35_TEXT, True),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", _QWEN35_VISION,
                    dict(_QWEN35_TEXT, shared_expert_intermediate_size=32, **_MOE), True),
    "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration", _GLM4V_VISION, dict(rope=_HALF_ROTARY), True),
    "glm_ocr": ("GlmOcrConfig", "GlmOcrForConditionalGeneration", _GLM4V_VISION, dict(rope=_HALF_ROTARY), True),
}  # fmt: skip


def _here(family: str) -> bool:
    return hasattr(transformers, FAMILIES[family][1]) and not (TRANSFORMERS_4 and family in VIDEO_IN_IMAGE_TOKENS)


def _model(family: str, seed: int = 0):
    """A tiny random model of the family on eager attention (fp32)."""
    config_class, model_class, vision, text, _ = FAMILIES[family]
    text = dict(text)
    start_end = "image" if family in VIDEO_IN_IMAGE_TOKENS else "vision"
    config = getattr(transformers, config_class)(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                         **_rope(**text.pop("rope", {})), **text),
        vision_config=dict(patch_size=2, spatial_merge_size=2, temporal_patch_size=2, **vision),
        image_token_id=IMAGE, video_token_id=VIDEO,
        **{f"{start_end}_start_token_id": VISION_START, f"{start_end}_end_token_id": VISION_END},
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    model.set_attn_implementation("eager")
    return model


# ----------------------------------------------------------------------------------
# Batches: segments of text, images and videos
# ----------------------------------------------------------------------------------

# What each kind of batch holds, row by row (packed: document by document, in one row).
# Images of 6 and 12 features, a video of 2 frames of 4 features: 9 to 40 tokens per row.
CONTENTS = {
    "dense": [[("text", 3), ("image", (1, 4, 6)), ("text", 4), ("video", (2, 4, 4)), ("text", 5)],
              [("text", 2), ("image", (1, 6, 8)), ("text", 18)]],
    "padded": [[("text", 3), ("image", (1, 4, 6)), ("text", 4), ("video", (2, 4, 4)), ("text", 5)],
               [("text", 2), ("image", (1, 6, 8)), ("text", 5)]],
    "packed": [[("text", 2), ("image", (1, 4, 6)), ("text", 3)], [("text", 5)],
               [("text", 1), ("video", (2, 4, 4)), ("image", (1, 6, 8)), ("text", 2)]],
    "images": [[("text", 3), ("image", (1, 4, 6)), ("text", 2), ("image", (1, 6, 8)), ("text", 4)]],
    "padded_images": [[("text", 3), ("image", (1, 4, 6)), ("text", 4)],
                      [("text", 2), ("image", (1, 6, 8)), ("text", 9)]],
    "videos": [[("text", 3), ("video", (2, 4, 4)), ("text", 4)], [("text", 2), ("video", (2, 4, 6)), ("text", 2)]],
}  # fmt: skip


def _segment_tokens(kind: str, grid, timestamps: bool, generator) -> list[int]:
    """A segment's tokens: text, or an item's placeholders between vision start and end
    (a video separated into frames by two timestamp tokens each, for Qwen3-VL)."""
    if kind == "text":
        return torch.randint(0, TEXT, (grid,), generator=generator).tolist()
    t, h, w = grid
    token = IMAGE if kind == "image" else VIDEO
    if kind == "video" and timestamps:
        frame = [VISION_START] + [token] * (h * w // 4) + [VISION_END]
        return [value for _ in range(t) for value in torch.randint(0, TEXT, (2,), generator=generator).tolist() + frame]
    return [VISION_START] + [token] * (t * h * w // 4) + [VISION_END]


def _batch(family: str, kind: str, seed: int = 1, contents=None) -> tuple[dict, list[tuple[dict, int]]]:
    """The full batch for shard_batch (the same on every rank), and the reference's
    inputs: [(the model's keyword arguments, weight)], one call for the whole batch or
    one per packed document. contents: the rows' segments (default: CONTENTS[kind])."""
    timestamps = FAMILIES[family][4]
    generator = torch.Generator().manual_seed(seed)
    rows, items = [], {"image": [], "video": []}
    for segments in contents or CONTENTS[kind]:
        tokens, row_items = [], {"image": [], "video": []}
        for segment, grid in segments:
            tokens += _segment_tokens(segment, grid, timestamps, generator)
            if segment != "text":
                pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_FEATURES, generator=generator)
                row_items[segment].append((grid, pixels))
        rows.append((tokens, row_items))
        for modality in items:
            items[modality] += row_items[modality]

    def encoded(tokens_rows, item_lists, mask=None) -> dict:
        length = max(len(tokens) for tokens in tokens_rows)
        ids = torch.zeros(len(tokens_rows), length, dtype=torch.long)
        for row, tokens in enumerate(tokens_rows):
            ids[row, : len(tokens)] = torch.tensor(tokens)
        labels = ids.masked_fill((ids == IMAGE) | (ids == VIDEO), -100)
        types = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
        if family in VIDEO_IN_IMAGE_TOKENS:
            ids = ids.masked_fill(ids == VIDEO, IMAGE)
        inputs = {"input_ids": ids, "labels": labels if mask is None else labels.masked_fill(mask == 0, -100),
                  "mm_token_type_ids": types}  # fmt: skip
        if mask is not None:
            inputs["attention_mask"] = mask
        for modality, (pixels_key, grid_key) in (("image", ("pixel_values", "image_grid_thw")),
                                                 ("video", ("pixel_values_videos", "video_grid_thw"))):  # fmt: skip
            if item_lists[modality]:
                inputs[pixels_key] = torch.cat([pixels for _, pixels in item_lists[modality]])
                inputs[grid_key] = torch.tensor([grid for grid, _ in item_lists[modality]])
        if item_lists["video"] and family == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([0.5] * len(item_lists["video"]))
        return inputs

    if kind == "packed":
        whole = encoded([[token for tokens, _ in rows for token in tokens]], items)
        whole["position_ids"] = torch.cat([torch.arange(len(tokens)) for tokens, _ in rows])[None]
        documents = [encoded([tokens], row_items) for tokens, row_items in rows]
        targets = [int((document["labels"][0, 1:] != -100).sum()) for document in documents]
        return whole, [(document, count) for document, count in zip(documents, targets)]
    mask = None
    if kind.startswith("padded"):
        mask = torch.zeros(len(rows), max(len(tokens) for tokens, _ in rows), dtype=torch.long)
        for row, (tokens, _) in enumerate(rows):
            mask[row, : len(tokens)] = 1
    whole = encoded([tokens for tokens, _ in rows], items, mask)
    return whole, [(whole, 1)]


def _reference_loss(model, inputs: list[tuple[dict, int]]) -> torch.Tensor:
    """The single-process loss: the model's own (its positions computed by itself), the
    mean over every call's targets."""
    accepted = inspect.signature(model.forward).parameters
    total = sum(weight for _, weight in inputs)
    loss = 0.0
    for arguments, weight in inputs:
        if TRANSFORMERS_4 and "attention_mask" not in arguments:
            # Without a mask transformers 4 reads the positions' time row as packed documents.
            arguments = dict(arguments, attention_mask=torch.ones_like(arguments["input_ids"]))
        loss = loss + model(**{key: value for key, value in arguments.items() if key in accepted}).loss * weight
    return loss / total


def _sp_loss(model, batch: dict, mode: str, layout: str, groups: dict) -> tuple[torch.Tensor, list[str]]:
    """The sequence-parallel loss, and the items whose tokens this rank holds only some of."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    local = sp_transformers.shard_batch(batch, mode=mode, layout=layout, model=model, **groups)
    shift_labels = local.pop("shift_labels")
    hidden = model.model(**local).last_hidden_state  # (B, S_local, hidden)
    return sp_transformers.causal_lm_loss(model, hidden, shift_labels, **groups), _split_items(batch, local)


def _split_items(batch: dict, local: dict) -> list[str]:
    """The images and videos (e.g. "image 1") some but not all of whose placeholder
    tokens are among this rank's."""
    split = []
    for modality, token_type, grid_key in (("image", 1, "image_grid_thw"), ("video", 2, "video_grid_thw")):
        if grid_key not in batch:
            continue
        placeholders = (batch["mm_token_type_ids"] == token_type).flatten()
        feature_of_token = (torch.cumsum(placeholders.long(), 0) - 1).masked_fill(~placeholders, -1)
        here = local["sequence_shard"].take(feature_of_token.view_as(batch["input_ids"]), dim=1).flatten()
        ends = torch.cumsum(batch[grid_key].prod(dim=1) // 4, 0)  # each item's features end
        counts = torch.bincount(torch.searchsorted(ends, here[here >= 0], right=True), minlength=len(ends))
        sizes = torch.diff(ends, prepend=ends.new_zeros(1))
        split += [f"{modality} {item}" for item in range(len(ends)) if 0 < counts[item] < sizes[item]]
    return split


# ----------------------------------------------------------------------------------
# Parity with one process
# ----------------------------------------------------------------------------------


@on_every_rank
def run_vision_cases(cases: list[dict]) -> tuple[list[str], set[str]]:
    """Per case: the loss and every parameter's gradient (summed over the ranks) against
    the single-process model's; with steps, the losses of that many AdamW steps. Returns
    the failures and the items whose tokens straddle this rank's boundary."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    failures, split_items = [], set()
    for case in cases:
        groups = integration._parallelism(case["mode"], case.get("ulysses", 2))
        batch, reference_inputs = _batch(case["family"], case["kind"])
        reference = _model(case["family"])
        model = copy.deepcopy(reference)
        sp_transformers.apply(model, case["mode"], layout=case["layout"], **groups)
        steps = case.get("steps", 1)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)] if steps > 1 else []
        for step in range(steps):
            expected = _reference_loss(reference, reference_inputs)
            expected.backward()
            loss, split = _sp_loss(model, batch, case["mode"], case["layout"], groups)
            split_items.update(f"{case['id']}: {item}" for item in split)
            loss.backward()
            sp_transformers.all_reduce_gradients(model, **groups)
            name = f"{case['id']} step {step}"
            error = integration._relative_error(loss.detach(), expected.detach())
            if not error <= integration.FP32_LOSS_RTOL:
                failures.append(f"{name}: loss {loss.item():.7f} vs {expected.item():.7f} (rel {error:.2e})")
            # After an AdamW step only the losses are compared (Adam's normalised update
            # turns rounding-level gradient differences into parameter differences).
            for (parameter_name, ours), theirs in zip(model.named_parameters() if step == 0 else [],
                                                      reference.parameters()):  # fmt: skip
                error = integration._relative_error(ours.grad, theirs.grad)
                if not error <= integration.FP32_GRAD_RTOL:
                    failures.append(f"{name}: grad of {parameter_name} relative error {error:.2e}")
            for optimizer in optimizers:
                optimizer.step()
            model.zero_grad()
            reference.zero_grad()
    return failures, split_items


def _case(family, mode, layout, kind, **extra) -> dict:
    extra_id = "-".join(f"{key}={value}" for key, value in extra.items())
    return dict(id="-".join(filter(None, [family, mode, layout, kind, extra_id])), family=family, mode=mode,
                layout=layout, kind=kind, **extra)  # fmt: skip


# World size -> cases: each family, mode and layout somewhere; images straddle a rank
# boundary at every world size above 1, video frames at some.
CASES = {
    1: [_case("qwen2_5_vl", "ring", "contiguous", "dense")],
    2: [_case("qwen3_vl", "ulysses", "contiguous", "dense"), _case("qwen2_5_vl", "ring", "balanced", "packed"),
        _case("qwen2_vl", "ring", "contiguous", "images"), _case("qwen3_vl_moe", "ring", "balanced", "padded"),
        _case("glm4v", "ring", "balanced", "videos"), _case("glm46v", "ulysses", "contiguous", "images"),
        _case("qwen3_5", "ring", "balanced", "dense")],
    3: [_case("qwen2_5_vl", "ring", "contiguous", "padded"), _case("qwen3_vl", "ring", "balanced", "packed"),
        _case("qwen2_vl", "ulysses", "contiguous", "dense"), _case("qwen3_vl_moe", "ulysses", "contiguous", "packed"),
        _case("glm4v_moe", "ulysses", "contiguous", "videos"), _case("qwen3_5", "ulysses", "contiguous", "packed"),
        _case("glm4v", "ring", "contiguous", "padded_images"), _case("cosmos3_omni", "ring", "balanced", "dense")],
    4: [_case("qwen3_vl", "ring", "balanced", "dense"), _case("qwen2_5_vl", "usp", "balanced", "dense", ulysses=2),
        _case("qwen3_vl", "usp", "balanced", "images", ulysses=2),
        _case("qwen2_vl", "usp", "balanced", "packed", ulysses=2),
        _case("qwen3_vl_moe", "usp", "balanced", "dense", ulysses=2),
        _case("qwen2_5_vl", "ulysses", "contiguous", "images", steps=3),
        _case("glm4v", "usp", "balanced", "images", ulysses=2), _case("glm_ocr", "ring", "balanced", "videos"),
        _case("qwen3_5_moe", "usp", "balanced", "padded", ulysses=2)],
}  # fmt: skip


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_vision_language_models_match_one_process(world_size):
    cases = [case for case in CASES[world_size] if _here(case["family"])]
    if not cases:
        pytest.skip(f"transformers {transformers.__version__} has none of these families")
    per_rank = pool_for(world_size).run(run_vision_cases, cases)
    failures = [failure for failures, _ in per_rank for failure in failures]
    assert not failures, "\n".join(failures)
    split_items = sorted(set().union(*(split for _, split in per_rank)))
    assert world_size == 1 or any(": image" in item for item in split_items), "no image straddles a rank boundary"


# ----------------------------------------------------------------------------------
# The Trainer, with a collator of the test's own
# ----------------------------------------------------------------------------------


def _samples(count: int, seed: int) -> list[dict]:
    """Samples of 10 to 30 tokens around an image of 4 to 12 features, every third with
    a video of 2 frames after it."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        grid = [(1, 4, 4), (1, 4, 6), (1, 6, 8)][index % 3]
        segments = [("text", int(torch.randint(1, 8, (1,), generator=generator))), ("image", grid),
                    ("text", int(torch.randint(2, 10, (1,), generator=generator)))]  # fmt: skip
        if index % 3 == 2:
            segments += [("video", (2, 4, 4)), ("text", 3)]
        batch, _ = _batch("qwen2_5_vl", "dense", seed=seed * 100 + index, contents=[segments])
        samples.append({key: value[0] if key in ("input_ids", "labels", "mm_token_type_ids") else value
                        for key, value in batch.items()})  # fmt: skip
    return samples


def collate(features: list[dict]) -> dict:
    """Right padding of the token keys (labels -100 there), the items' pixels and grids
    concatenated in the batch's order. (The Trainer drops the keys its model's forward
    does not take: mm_token_type_ids under transformers 4.)"""
    longest = max(len(feature["input_ids"]) for feature in features)
    batch = {"attention_mask": torch.zeros(len(features), longest, dtype=torch.long)}
    token_keys = [key for key in ("input_ids", "labels", "mm_token_type_ids") if key in features[0]]
    for key in token_keys:
        batch[key] = torch.full((len(features), longest), -100 if key == "labels" else 0, dtype=torch.long)
    for row, feature in enumerate(features):
        length = len(feature["input_ids"])
        batch["attention_mask"][row, :length] = 1
        for key in token_keys:
            batch[key][row, :length] = feature[key]
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        values = [feature[key] for feature in features if key in feature]
        if values:
            batch[key] = torch.cat(values)
    return batch


def run_vision_training(case: dict) -> dict:
    """Three SGD steps and an evaluation of a Qwen2.5-VL model: the plain Trainer (no
    mode) or SequenceParallelTrainer."""
    import test_transformers_trainer as trainer_tests
    from transformers import Trainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    trainer_tests._as_torchrun_started()
    with tempfile.TemporaryDirectory() as output_dir:
        common = dict(model=_model("qwen2_5_vl"), args=trainer_tests._arguments(output_dir, 2, max_steps=3),
                      train_dataset=_samples(6, seed=5), eval_dataset=_samples(2, seed=6),
                      data_collator=collate)  # fmt: skip
        if "mode" in case:
            trainer = SequenceParallelTrainer(mode=case["mode"], layout=case["layout"], **common)
        else:
            trainer = Trainer(**common)
        trainer.train()
        return trainer_tests._result(trainer, trainer.evaluate())


def test_trainer_with_a_vision_language_model():
    import test_transformers_trainer as trainer_tests

    [reference] = pool_for(1).run(run_vision_training, {})
    ours = pool_for(2).run(run_vision_training, {"mode": "ring", "layout": "balanced"})
    problems = trainer_tests._differences(ours[0], reference)
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------
# What cannot be honoured raises
# ----------------------------------------------------------------------------------


@on_every_rank
def run_unsupported_vision_cases() -> dict:
    import torch.distributed as dist

    import seqpar_kernels.integrations.transformers as sp_transformers

    group = {"group": timeout_group()}
    model = _model("qwen2_5_vl")
    sp_transformers.apply(model, "ring", **group)
    batch, _ = _batch("qwen2_5_vl", "dense")

    def shard(changed: dict, drop=(), **options):
        given = {key: value for key, value in {**batch, **changed}.items() if key not in drop}
        return sp_transformers.shard_batch(given, mode="ring", **group, **{"model": model, **options})

    problems = {
        "no model": raises(lambda: shard({}, model=None), "model="),
        "pixels without a grid": raises(lambda: shard({}, drop=("image_grid_thw",)), "come together"),
        "pixels of other images": raises(lambda: shard({"pixel_values": batch["pixel_values"][:-4]}), "patches"),
        "placeholders and grids disagree": raises(
            lambda: shard({"input_ids": batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, 0)}),
            "placeholder tokens",
        ),
    }
    if not TRANSFORMERS_4:
        problems["no mm_token_type_ids"] = raises(lambda: shard({}, drop=("mm_token_type_ids",)), "mm_token_type_ids")
    packed, _ = _batch("qwen2_5_vl", "packed")
    inside_image = packed["position_ids"].clone()
    inside_image[0, 6:] = torch.arange(inside_image.shape[1] - 6)  # a document starts inside the first image
    problems["image across documents"] = raises(
        lambda: sp_transformers.shard_batch(dict(packed, position_ids=inside_image), mode="ring", model=model,
                                            **group), "cross the end")  # fmt: skip
    if dist.get_world_size() > 1:
        other = batch["pixel_values"] + dist.get_rank()
        problems["ranks hold other images"] = raises(lambda: shard({"pixel_values": other}), "disagree")
    local = shard({})
    local.pop("shift_labels")
    problems["pixels without the plan"] = raises(
        lambda: model.model(**{key: value for key, value in local.items() if key != "sequence_shard"}),
        "without shard_batch's plan",
    )
    problems["plan without its pixels"] = raises(
        lambda: model.model(**{key: value for key, value in local.items() if key != "pixel_values_videos"}), "missing"
    )
    if hasattr(transformers, FAMILIES["glm4v"][1]):
        glm = _model("glm4v")
        if TRANSFORMERS_4:
            problems["GLM-4.1V under transformers 4"] = raises(lambda: sp_transformers.apply(glm, "ring", **group),
                                                               "transformers 5")  # fmt: skip
        else:
            sp_transformers.apply(glm, "ring", **group)
            both, _ = _batch("glm4v", "dense")
            problems["GLM-4.1V images and videos together"] = raises(
                lambda: sp_transformers.shard_batch(both, mode="ring", model=glm, **group), "not both")  # fmt: skip
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    llava = LlavaForConditionalGeneration(LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=8, patch_size=4),
        text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2), image_token_index=IMAGE))  # fmt: skip
    problems["another kind of sub-model"] = raises(lambda: sp_transformers.apply(llava, "ring", **group),
                                                   "vision-language models")  # fmt: skip
    return {name: problem for name, problem in problems.items() if problem is not None}


def test_what_cannot_be_honoured_raises():
    for per_rank in pool_for(2).run(run_unsupported_vision_cases):
        assert not per_rank, per_rank
