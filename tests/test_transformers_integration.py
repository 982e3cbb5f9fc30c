"""Hugging Face transformers models under sequence parallelism
(seqpar_kernels.integrations.transformers): small models from configs (random weights,
nothing downloaded) run through apply + shard_batch + causal_lm_loss +
all_reduce_gradients on gloo ranks must give the single-process model's loss and every
parameter's gradient: a Llama in each mode and layout, GQA, heads not divisible by the
ranks, a packed batch, batch size 2 with right padding, three AdamW steps, bf16; every
family of FAMILIES (sliding windows, per-layer types, softcapping, sinks, chunked
attention, logit transforms of the head) in each mode; and what the attention cannot
honour raises.

The single-process reference is transformers' own: the same model on the full batch
(the families with eager attention, which honours everything they ask for: Gemma 2's
softcapping only runs there; the Llama with its default), labels shifted by its loss
(labels set to -100 where shard_batch ignores a target: padding and the first token of
each packed document).

Run against the installed transformers; test_oldest_supported_transformers reruns this
file under the oldest release the README promises, where the test set-up installed it.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402
from optional_dependency import assert_never_imported  # noqa: E402

VOCAB = 96
FP32_LOSS_RTOL = 1e-5
FP32_GRAD_RTOL = 1e-4


def _config(heads=4, kv_heads=2, head_dim=16, layers=2, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, max_position_embeddings=256, use_cache=False, **extra)  # fmt: skip


def _model(config, dtype=torch.float32, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


# The families checked: (config class, model class, what the tiny config sets). Windows
# and chunks smaller than a rank's piece (37 tokens: pieces of 9-10 at 4 ranks, zigzag
# chunks of 4-5) and spanning several pieces.
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",  # full, then sliding layers
              dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=13, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=4,
                                                      layer_types=["sliding_attention", "full_attention"])),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # scaling by query_pre_attn_scalar, both softcaps, tied head
               dict(num_hidden_layers=2, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_hidden_layers=2, sliding_window=20,
               query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",  # learned sinks, sliding and full layers, MoE
                dict(num_hidden_layers=2, sliding_window=4, num_local_experts=4, num_experts_per_tok=2)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",  # a chunked RoPE layer, a full no-RoPE layer whose
               dict(num_hidden_layers=2, attention_chunk_size=6, num_local_experts=2,  # temperature tuning
                    intermediate_size_mlp=64, no_rope_layers=[1, 0], floor_scale=4)),  # starts at row 3
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(num_hidden_layers=2, sliding_window=11, logit_scale=0.5,
                layer_types=["sliding_attention", "full_attention"])),
}  # fmt: skip


def _family_model(family: str, dtype=torch.float32, seed=0, spec=None):
    """A tiny random model of the family (FAMILIES', or spec: (config class, model class,
    settings)) on eager attention; sinks drawn at a scale that matters (the models
    initialise them near 0), state-space decays slow enough to matter."""
    config_class, model_class, settings = spec or FAMILIES[family]
    sizes = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, max_position_embeddings=256, use_cache=False, **{**sizes, **settings}
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.normal_(0.0, 1.0)
            if name.endswith("A_log"):
                # Hybrid mixers' decays: slow ones, whose gradients are not rounding noise (A up to 16 decays
                # every state within a few tokens and leaves A_log a gradient of order 1e-5).
                parameter.copy_(torch.empty_like(parameter).uniform_(0.05, 0.5).log())
    return model.to(dtype)


def _families_here() -> list[str]:
    return [family for family, (config_class, _, _) in FAMILIES.items() if hasattr(transformers, config_class)]


def _chunks_from_document_start() -> bool:
    """Whether this release counts chunks from each packed document's start (it remaps
    positions to the documents'), as sequence-parallel attention does."""
    return hasattr(transformers.masking_utils, "remap_positions_for_packed_sequence")


def _batch(kind: str, seqlen: int, seed: int = 1):
    """The full batch (the same on every rank) and the reference's labels.

    kind: "dense" (batch 2, no padding), "padded" (batch 2, the second row right-padded),
    "packed" (batch 1, documents of lengths 5, 1, 17, then the rest, positions
    restarting at 0 and labels -100 at each document's first token, as
    DataCollatorWithFlattening makes them)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "packed":
        ids = torch.randint(0, VOCAB, (1, seqlen), generator=generator)
        lengths = [5, 1, 17, seqlen - 23]
        positions = torch.cat([torch.arange(length) for length in lengths])[None]
        labels = ids.clone()
        labels[positions == 0] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": positions}, labels, positions
    ids = torch.randint(0, VOCAB, (2, seqlen), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":
        mask = torch.ones(2, seqlen, dtype=torch.long)
        mask[1, seqlen - 7 :] = 0
        batch["attention_mask"] = mask
        batch["labels"][mask == 0] = -100
    return batch, batch["labels"], None


def _parallelism(mode: str, ulysses_degree: int, sequence_dims=None):
    """The attention's process groups: the world (a gloo group whose collectives time
    out) for ulysses and ring; a 2-D DeviceMesh for usp, or with sequence_dims (the
    (ulysses, ring) dim names) a mesh of those dims in that order, named by
    sequence_dims=."""
    if mode != "usp":
        return {"group": timeout_group()}
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if sequence_dims is not None:
        mesh = init_device_mesh("cpu", (ulysses_degree, world // ulysses_degree), mesh_dim_names=sequence_dims)
        return {"mesh": mesh, "sequence_dims": sequence_dims}
    return {"mesh": init_device_mesh("cpu", (world // ulysses_degree, ulysses_degree),
                                     mesh_dim_names=("ring", "ulysses"))}  # fmt: skip


def _reference_step(model, batch, labels, positions, per_document=False):
    """The single-process model's loss on the full batch; per_document: on each packed
    document alone, the mean over all their targets (for models whose own attention
    does not keep packed documents apart)."""
    if not per_document:
        kwargs = {"attention_mask": batch.get("attention_mask"), "position_ids": positions}
        return model(input_ids=batch["input_ids"], labels=labels, **kwargs).loss
    starts = [*torch.nonzero(positions[0] == 0).flatten().tolist(), positions.shape[1]]
    total = (labels[0, 1:] != -100).sum()
    loss = 0.0
    for start, end in zip(starts[:-1], starts[1:]):
        targets = (labels[0, start + 1 : end] != -100).sum()
        if targets:
            document = model(input_ids=batch["input_ids"][:, start:end], labels=labels[:, start:end]).loss
            loss = loss + document * targets / total
    return loss


def _sp_step(model, batch, mode, layout, groups, with_shard=True):
    import seqpar_kernels.integrations.transformers as sp_transformers

    local = sp_transformers.shard_batch(batch, mode=mode, layout=layout, **groups)
    if not with_shard:  # the tokens and their global positions alone, as a user's own sharding gives them
        local = {key: local[key] for key in ("input_ids", "position_ids", "shift_labels")}
    hidden = model.model(**local).last_hidden_state  # (B, S_local, hidden)
    return sp_transformers.causal_lm_loss(model, hidden, local["shift_labels"], **groups)


def _relative_error(mine: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    """Max error relative to the largest expected value; a missing gradient counts as
    zeros (an expert no token reached), both missing as no error, one missing against a
    non-zero one as infinite."""
    if mine is None or expected is None:
        present = expected if mine is None else mine
        return 0.0 if present is None or not present.any() else float("inf")
    return ((mine.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


@on_every_rank
def run_parity_cases(cases):
    """Per case: the loss and every parameter's gradient (summed over the ranks) against
    the single-process model's; AdamW cases compare the losses of three steps."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    failures = []
    for case in cases:
        mode, layout, dtype = case["mode"], case["layout"], case.get("dtype", torch.float32)
        groups = _parallelism(mode, case.get("ulysses", 2), case.get("sequence_dims"))
        batch, labels, positions = _batch(case["batch"], case.get("seqlen", 37))
        if "family" in case:
            reference = _family_model(case["family"], spec=case.get("family_spec"))
        else:
            reference = _model(_config(**case.get("config", {})), torch.float32)
        model = copy.deepcopy(reference).to(dtype)
        sp_transformers.apply(model, mode, layout=layout, **groups)
        if case.get("checkpointing"):  # the layers run again in the backward, collectives included
            model.gradient_checkpointing_enable()
            model.train()
        if dtype != torch.float32:
            # bf16: each side's error against the fp32 single-process model.
            single_low = copy.deepcopy(reference).to(dtype)
        steps = case.get("steps", 1)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)] if steps > 1 else None
        for step in range(steps):
            expected = _reference_step(reference, batch, labels, positions, case.get("per_document", False))
            expected.backward()
            loss = _sp_step(model, batch, mode, layout, groups, case.get("with_shard", True))
            loss.backward()
            sp_transformers.all_reduce_gradients(model, **groups)
            name = f"{case['id']} step {step}"
            if dtype == torch.float32:
                loss_error = _relative_error(loss.detach(), expected.detach())
                if not loss_error <= FP32_LOSS_RTOL:
                    failures.append(f"{name}: loss {loss.item():.7f} vs {expected.item():.7f} (rel {loss_error:.2e})")
                # After an AdamW step the gradients are compared no more: Adam's normalised
                # update turns rounding-level differences of tiny gradients into parameter
                # differences of order lr; the losses must still match.
                for (param_name, ours), theirs in zip(model.named_parameters() if step == 0 else [],
                                                      reference.parameters()):  # fmt: skip
                    error = _relative_error(ours.grad, theirs.grad)
                    if not error <= FP32_GRAD_RTOL:
                        failures.append(f"{name}: grad of {param_name} relative error {error:.2e}")
            else:
                low = _reference_step(single_low, batch, labels, positions, case.get("per_document", False))
                low.backward()
                for what, ours, single, exact in [("loss", loss.detach(), low.detach(), expected.detach())] + [
                    (param_name, ours.grad, single.grad, exact.grad)
                    for (param_name, ours), single, exact in zip(
                        model.named_parameters(), single_low.parameters(), reference.parameters()
                    )
                ]:
                    ours_error, single_error = _relative_error(ours, exact), _relative_error(single, exact)
                    if not ours_error <= 2 * single_error + 1e-3:
                        failures.append(f"{name}: {dtype} {what} error {ours_error:.2e} > 2 x single-process "
                                        f"{single_error:.2e}")  # fmt: skip
            if optimizers:
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                model.zero_grad()
                reference.zero_grad()
    return failures


def _case(mode, layout, batch, **extra):
    extra_id = "-".join(f"{key}={value}" for key, value in extra.items() if key not in ("config", "family_spec"))
    config_id = "-".join(f"{key}{value}" for key, value in extra.get("config", {}).items())
    return dict(id="-".join(filter(None, [mode, layout, batch, config_id, extra_id])), mode=mode, layout=layout,
                batch=batch, **extra)  # fmt: skip


ONE_GROUP_CASES = [
    _case("ulysses", "contiguous", "dense"),
    _case("ulysses", "contiguous", "packed", config=dict(heads=3, kv_heads=1)),  # heads not divisible by 2, 4
    _case("ulysses", "contiguous", "padded", config=dict(heads=6, kv_heads=2, head_dim=8)),
    _case("ring", "contiguous", "dense"),
    _case("ring", "balanced", "padded"),
    _case("ring", "contiguous", "packed"),
    _case("ring", "balanced", "packed", config=dict(heads=4, kv_heads=1)),  # MQA
    # Without shard_batch's sequence_shard: global positions checked once per forward.
    _case("ring", "balanced", "dense", with_shard=False),
    _case("ulysses", "contiguous", "dense", with_shard=False),
]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_one_group_modes_match_the_single_process_model(world_size):
    failures = [failure for per_rank in pool_for(world_size).run(run_parity_cases, ONE_GROUP_CASES)
                for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("ulysses", [2, 1, 4])
def test_usp_matches_the_single_process_model(ulysses):
    cases = [
        _case("usp", "contiguous", "dense", ulysses=ulysses),
        _case("usp", "balanced", "packed", ulysses=ulysses, config=dict(heads=6, kv_heads=2, head_dim=8)),
        _case("usp", "balanced", "padded", ulysses=ulysses),
        _case("usp", "balanced", "dense", ulysses=ulysses, with_shard=False),
    ]
    failures = [failure for per_rank in pool_for(4).run(run_parity_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# The families: windows, per-layer types, softcaps, sinks, chunks, logit transforms
# ----------------------------------------------------------------------------------

# Families whose cases include packed documents (windows, chunks, caps and sinks within
# documents); the others run whole sequences. gpt-oss builds its masks without the
# position ids, so its own eager attention lets packed documents see each other (its
# flash-attention path does not): its packed reference is each document run alone.
PACKED_FAMILIES = ("mistral", "gemma2", "gpt_oss", "llama4", "cohere2")
PER_DOCUMENT_REFERENCE = ("gpt_oss",)


def _family_cases(mode: str) -> list[dict]:
    """Every family here in `mode`, layouts and batches alternating over the families."""
    cases = []
    for index, family in enumerate(_families_here()):
        packed = family in PACKED_FAMILIES and (family != "llama4" or _chunks_from_document_start())
        if mode == "ulysses":
            layout = "contiguous"
        elif mode == "ring":
            layout = "balanced" if index % 2 == 0 else "contiguous"
        else:
            layout, packed = ("balanced" if index % 2 else "contiguous"), packed and index % 2 == 0
        per_document = {"per_document": True} if packed and family in PER_DOCUMENT_REFERENCE else {}
        cases.append(_case(mode, layout, "packed" if packed else "dense", family=family, **per_document))
    return cases


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_one_process(family):
    """The family in this process alone (no torch.distributed): the loss of apply +
    shard_batch + causal_lm_loss is the model's own. Skipped for a family this release
    does not have."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    config_class = FAMILIES[family][0]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    reference = _family_model(family)
    model = copy.deepcopy(reference)
    sp_transformers.apply(model, "ring", layout="balanced")
    batch, labels, positions = _batch("dense", 23)
    with torch.no_grad():
        expected = _reference_step(reference, batch, labels, positions)
        loss = _sp_step(model, batch, "ring", "balanced", {})
    assert _relative_error(loss, expected) <= FP32_LOSS_RTOL, (loss.item(), expected.item())


def test_every_family_matches_under_ulysses():
    failures = [failure for per_rank in pool_for(2).run(run_parity_cases, _family_cases("ulysses"))
                for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_every_family_matches_under_ring_and_usp():
    cases = _family_cases("ring") + _family_cases("usp")
    failures = [failure for per_rank in pool_for(4).run(run_parity_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_three_adamw_steps_match():
    cases = [
        _case("ring", "balanced", "packed", steps=3),
        _case("usp", "balanced", "packed", steps=2, ulysses=2, checkpointing=True),
        _case("ulysses", "contiguous", "dense", steps=3),
        _case("usp", "balanced", "dense", steps=3, ulysses=2),
        # Softcaps, a window and a tied head; sinks learned across the Ulysses heads and the ring.
        _case("ring", "balanced", "packed", steps=3, family="gemma2"),
        _case("usp", "balanced", "dense", steps=3, ulysses=2, family="gpt_oss"),
    ]
    cases = [case for case in cases if "family" not in case or case["family"] in _families_here()]
    failures = [failure for per_rank in pool_for(4).run(run_parity_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_bf16_within_twice_the_single_process_error():
    cases = [
        _case("ring", "balanced", "packed", dtype=torch.bfloat16),
        _case("ulysses", "contiguous", "padded", dtype=torch.bfloat16),
        _case("usp", "contiguous", "dense", dtype=torch.bfloat16, ulysses=2),
    ]
    failures = [failure for per_rank in pool_for(4).run(run_parity_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# What cannot be honoured raises
# ----------------------------------------------------------------------------------


@on_every_rank
def run_unsupported_cases():
    import seqpar_kernels.integrations.transformers as sp_transformers

    group = {"group": timeout_group()}
    config = _config()
    batch, _, _ = _batch("padded", 20)
    problems = {}

    def model_with(mode="ring", layout="contiguous", **config_changes):
        model = _model(_config(**config_changes))
        sp_transformers.apply(model, mode, layout=layout, **group)
        return model

    local = sp_transformers.shard_batch(batch, mode="ring", **group)
    model = model_with()
    # A padding mask handed to the model directly, not folded by shard_batch.
    padded_mask = torch.ones_like(local["input_ids"])
    padded_mask[:, 0] = 0
    problems["padding mask"] = raises(
        lambda: model.model(input_ids=local["input_ids"], attention_mask=padded_mask), "pads some tokens"
    )
    # Left padding cannot be folded into the labels.
    left = dict(batch, attention_mask=batch["attention_mask"].flip(-1))
    problems["left padding"] = raises(lambda: sp_transformers.shard_batch(left, mode="ring", **group), "left padding")
    # Packed documents without shard_batch's plan.
    packed, _, positions = _batch("packed", 37)
    local_positions = sp_transformers.shard_batch(packed, mode="ring", **group)["position_ids"]
    problems["packed without a plan"] = raises(
        lambda: model.model(input_ids=torch.zeros_like(local_positions), position_ids=local_positions),
        "global positions",
    )
    # Positions counted from 0 on every rank (a model given only its tokens).
    if torch.distributed.get_world_size() > 1:
        problems["local positions"] = raises(lambda: model.model(input_ids=local["input_ids"]), "global positions")
    # Attention weights asked for: the model would return no attentions at all.
    problems["output_attentions"] = raises(lambda: model.model(**local, output_attentions=True), "output_attentions")
    # Dropout while training.
    dropout_model = model_with(attention_dropout=0.1).train()
    problems["dropout"] = raises(lambda: dropout_model.model(**local), "dropout")
    # A mask transformers composes with a model-specific overlay (as Gemma 3's image
    # blocks, an or_masks): the registered mask function raises.
    from transformers import masking_utils

    implementation = sp_transformers.IMPLEMENTATIONS["ring"]
    make_mask = masking_utils.AttentionMaskInterface._global_mapping[implementation]
    overlay = masking_utils.or_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv == 0)
    problems["overlay"] = raises(lambda: make_mask(mask_function=overlay), "cannot honour")
    # Called as a model calls the attention: a window its mask does not carry, a mask
    # tensor, sinks the module has but does not pass, a KV cache.
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    kv = torch.randn(1, 2, 5, 16)
    attend = transformers.AttentionInterface._global_mapping[implementation]
    causal = make_mask(mask_function=masking_utils.causal_mask_function)
    problems["window without its mask"] = raises(lambda: attend(attention, q, kv, kv, causal, sliding_window=8),
                                                  "sliding_window=8")  # fmt: skip
    problems["mask tensor"] = raises(lambda: attend(attention, q, kv, kv, torch.zeros(1, 1, 5, 5)), "mask tensor")
    attention.sinks = torch.nn.Parameter(torch.zeros(4))
    problems["sinks not passed"] = raises(lambda: attend(attention, q, kv, kv, causal), "sinks")
    del attention.sinks
    problems["kv cache"] = raises(lambda: attend(attention, q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16),
                                                  causal), "KV cache")  # fmt: skip
    # Chunked attention over packed documents, where this release counts the chunks from
    # the packed row's start.
    if "llama4" in _families_here() and not _chunks_from_document_start():
        llama4 = _family_model("llama4")
        sp_transformers.apply(llama4, "ring", **group)
        packed_local = sp_transformers.shard_batch(_batch("packed", 37)[0], mode="ring", **group)
        problems["chunks of a packed row"] = raises(lambda: llama4.model(**packed_local), "chunk")
    # A batch sharded for another layout than the model's.
    balanced = sp_transformers.shard_batch(batch, mode="ring", layout="balanced", **group)
    problems["layout mismatch"] = raises(lambda: model.model(**balanced), "sharded for")
    # Ulysses has no balanced layout; packing needs batch size 1.
    problems["ulysses balanced"] = raises(lambda: sp_transformers.apply(_model(config), "ulysses", layout="balanced",
                                                                         **group), "contiguous")  # fmt: skip
    two_rows = {"input_ids": torch.zeros(2, 12, dtype=torch.long),
                "position_ids": torch.cat([torch.arange(6), torch.arange(6)]).expand(2, 12)}  # fmt: skip
    problems["packed batch of two"] = raises(lambda: sp_transformers.shard_batch(two_rows, mode="ring", **group),
                                              "batch size 1")  # fmt: skip
    problems["unknown key"] = raises(
        lambda: sp_transformers.shard_batch(dict(batch, pixel_values=torch.zeros(1)), mode="ring", **group),
        "pixel_values",
    )
    problems["step backend"] = raises(
        lambda: sp_transformers.apply(_model(config), "ring", step_backend="cudnn", **group), "step_backend"
    )
    # A step backend is the model's choice alone: a batch sharded without it runs.
    aten_model = _model(config)
    settings = sp_transformers.apply(aten_model, "ring", step_backend="aten", **group)
    # The attention functions dispatch through the model's SequenceParallelism.
    dispatch = sys.modules["seqpar_kernels.parallel.parallelism"]
    backends, ring_attention = [], dispatch.ring_attention
    dispatch.ring_attention = lambda *args, **kwargs: (
        backends.append(kwargs["step_backend"]) or ring_attention(*args, **kwargs)
    )
    try:
        aten_model.model(**local)
    finally:
        dispatch.ring_attention = ring_attention
    if settings.step_backend != "aten" or backends != ["aten"] * config.num_hidden_layers:
        problems["step backend passed on"] = f"apply recorded {settings}, the attention got {backends}"
    # An implementation set by hand, without apply's groups.
    by_hand = _model(config)
    by_hand.set_attn_implementation(implementation)
    problems["set by hand"] = raises(lambda: by_hand.model(**local), "apply")
    return {name: problem for name, problem in problems.items() if problem is not None}


def test_what_cannot_be_honoured_raises():
    for per_rank in pool_for(2).run(run_unsupported_cases):
        assert not per_rank, per_rank


def test_register_never_overwrites_another_function():
    from transformers import AttentionInterface

    import seqpar_kernels.integrations.transformers as sp_transformers

    sp_transformers.register()
    sp_transformers.register()  # idempotent
    name = sp_transformers.IMPLEMENTATIONS["ulysses"]
    ours = AttentionInterface._global_mapping[name]
    try:
        AttentionInterface.register(name, lambda *args, **kwargs: None)
        with pytest.raises(ValueError, match="does not overwrite"):
            sp_transformers.register()
    finally:
        AttentionInterface.register(name, ours)
    assert set(sp_transformers.IMPLEMENTATIONS.values()) <= set(AttentionInterface._global_mapping)
    assert "sdpa" in AttentionInterface._global_mapping  # nothing of transformers' own replaced


def sliding_window_overlay(sliding_window):
    """A mask function under the name of transformers' sliding window overlay, with
    another convention (a window of sliding_window + 1 keys)."""

    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx >= q_idx - sliding_window

    return inner_mask


def test_masks_are_read_as_transformers_builds_them():
    """The registered mask function reads each of masking_utils' patterns as the
    LayerMask that allows exactly what transformers' function allows; the packing
    transformers reads off a rank's position ids is left to the varlen plan; a function
    whose convention changed under the same name raises."""
    from transformers import masking_utils as mu

    import seqpar_kernels.integrations.transformers as sp_transformers
    from seqpar_kernels.integrations.transformers import LayerMask

    sp_transformers.register()
    make_mask = mu.AttentionMaskInterface._global_mapping[sp_transformers.IMPLEMENTATIONS["ulysses"]]
    no_padding = torch.zeros(1, dtype=torch.long)
    packing = mu.packed_sequence_mask_function(torch.zeros(1, 40, dtype=torch.long))
    cases = {
        "causal": (mu.causal_mask_function, LayerMask(causal=True)),
        "window of 1": (mu.sliding_window_causal_mask_function(1), LayerMask(True, (0, -1))),
        "window of 5": (mu.sliding_window_causal_mask_function(5), LayerMask(True, (4, -1))),
        "chunks of 3": (mu.chunked_causal_mask_function(3, no_padding), LayerMask(True, chunk_size=3)),
        "packed window": (mu.and_masks(mu.sliding_window_causal_mask_function(7), packing), LayerMask(True, (6, -1))),
    }
    if hasattr(mu, "sliding_window_bidirectional_mask_function"):
        cases["bidirectional window of 2"] = (
            mu.sliding_window_bidirectional_mask_function(2),
            LayerMask(False, (2, 2)),
        )
    if hasattr(mu, "remap_positions_for_packed_sequence"):
        remapped = mu.remap_positions_for_packed_sequence(mu.chunked_causal_mask_function(4, no_padding),
                                                          torch.zeros(1, 40, dtype=torch.long))  # fmt: skip
        cases["packed chunks"] = (mu.and_masks(remapped, packing), LayerMask(True, chunk_size=4))
    positions = torch.arange(40)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    for name, (function, expected) in cases.items():
        pattern = make_mask(mask_function=function)
        assert pattern == expected, (name, pattern)
        if "packed" not in name:  # the same keys as transformers' function allows
            allowed = function(zero, zero, positions[None, None, :, None], positions[None, None, None, :])
            assert torch.equal(
                allowed.expand(1, 1, 40, 40), pattern.allows(positions[:, None], positions[None, :])[None, None]
            )
    with pytest.raises(ValueError, match="changed its convention"):
        make_mask(mask_function=mu.and_masks(sliding_window_overlay(5), mu.causal_mask_function))
    with pytest.raises(ValueError, match="sliding_window must be an int >= 1"):
        make_mask(mask_function=mu.sliding_window_causal_mask_function(0))


# Models whose heads transform their logits, beside FAMILIES: (config class, model class, settings).
HEAD_MODELS = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(num_hidden_layers=1, logits_scaling=4.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_hidden_layers=1, logit_scale=0.25)),
}


def test_causal_lm_loss_reads_each_head_as_its_forward_computes_it():
    """head_of(model) gives the logits of the model's own forward (tied heads, final
    softcaps, logit scales), for every family and two more heads; heads it cannot
    express raise."""
    from seqpar_kernels.integrations.transformers.causal_lm import causal_lm_loss, head_of

    tables = {**FAMILIES, **HEAD_MODELS}
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    checked = []
    for name, (config_class, model_class, settings) in tables.items():
        if not hasattr(transformers, config_class):
            continue
        if name in FAMILIES:
            model = _family_model(name)
        else:
            torch.manual_seed(0)
            config = getattr(transformers, config_class)(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                                         num_attention_heads=4, num_key_value_heads=2,
                                                         use_cache=False, **settings)  # fmt: skip
            model = getattr(transformers, model_class)(config)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
            hidden = model.model(input_ids=ids).last_hidden_state
            weight, softcap, scale = head_of(model)
            mine = scale * hidden @ weight.t()
            mine = softcap * torch.tanh(mine / softcap) if softcap else mine
        assert _relative_error(mine, logits) <= 1e-5, name
        checked.append(name)
    assert {"gemma2", "cohere2", "granite"} <= set(checked)
    llama = _model(_config(layers=1))
    llama.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    with pytest.raises(ValueError, match="bias"):
        causal_lm_loss(llama, torch.zeros(1, 3, 64), torch.zeros(1, 3, dtype=torch.long))
    scaled = _model(_config(layers=1))
    scaled.config.logits_scaling = 2.0  # a scale this model type's forward is not known to apply
    with pytest.raises(ValueError, match="logits_scaling"):
        causal_lm_loss(scaled, torch.zeros(1, 3, 64), torch.zeros(1, 3, dtype=torch.long))


def test_apply_refuses_layers_that_mix_the_sequence_outside_the_attention():
    import seqpar_kernels.integrations.transformers as sp_transformers

    model = _model(_config())
    model.config.layer_types = ["full_attention", "linear_attention"]  # as hybrid models declare them
    with pytest.raises(ValueError, match="linear_attention"):
        sp_transformers.apply(model, "ring")


def test_core_package_never_imports_transformers():
    assert_never_imported("transformers")
