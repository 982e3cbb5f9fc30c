"""Hugging Face transformers models under sequence parallelism
(seqpar_kernels.integrations.transformers): a small Llama from a config (random weights,
nothing downloaded) run through apply + shard_batch + sequence_parallel_cross_entropy +
all_reduce_gradients on gloo ranks must give the single-process model's loss and every
parameter's gradient: each mode and layout, GQA, heads not divisible by the ranks, a
packed batch, batch size 2 with right padding, three AdamW steps, bf16; and what the
attention cannot honour raises.

The single-process reference is transformers' own: the same model with its default
attention on the full batch, labels shifted by its loss (labels set to -100 where
shard_batch ignores a target: padding and the first token of each packed document).

Run against the installed transformers; test_oldest_supported_transformers reruns this
file under the oldest release the README promises, where the test set-up installed it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402
from optional_dependency import assert_never_imported, oldest_marker, run_under_oldest_release  # noqa: E402

OLDEST_SUPPORTED = "4.56.2"

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


def _parallelism(mode: str, ulysses_degree: int):
    """The attention's process groups: the world (a gloo group whose collectives time
    out) for ulysses and ring; a 2-D DeviceMesh for usp."""
    if mode != "usp":
        return {"group": timeout_group()}
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    return {"mesh": init_device_mesh("cpu", (world // ulysses_degree, ulysses_degree),
                                     mesh_dim_names=("ring", "ulysses"))}  # fmt: skip


def _reference_step(model, batch, labels, positions):
    kwargs = {"attention_mask": batch.get("attention_mask"), "position_ids": positions}
    return model(input_ids=batch["input_ids"], labels=labels, **kwargs).loss


def _sp_step(model, batch, mode, layout, groups, with_shard=True):
    import seqpar_kernels.integrations.transformers as sp_transformers

    local = sp_transformers.shard_batch(batch, mode=mode, layout=layout, **groups)
    if not with_shard:  # the tokens and their global positions alone, as a user's own sharding gives them
        local = {key: local[key] for key in ("input_ids", "position_ids", "shift_labels")}
    hidden = model.model(**local).last_hidden_state  # (B, S_local, hidden)
    return sp_transformers.sequence_parallel_cross_entropy(hidden, model.lm_head.weight, local["shift_labels"],
                                                           **groups)  # fmt: skip


def _relative_error(mine: torch.Tensor, expected: torch.Tensor) -> float:
    return ((mine.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


@on_every_rank
def run_parity_cases(cases):
    """Per case: the loss and every parameter's gradient (summed over the ranks) against
    the single-process model's; AdamW cases compare the losses of three steps."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    failures = []
    for case in cases:
        mode, layout, dtype = case["mode"], case["layout"], case.get("dtype", torch.float32)
        groups = _parallelism(mode, case.get("ulysses", 2))
        config = _config(**case.get("config", {}))
        batch, labels, positions = _batch(case["batch"], case.get("seqlen", 37))
        reference = _model(config, torch.float32)
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
            expected = _reference_step(reference, batch, labels, positions)
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
                low = _reference_step(single_low, batch, labels, positions)
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
    extra_id = "-".join(f"{key}={value}" for key, value in extra.items() if key != "config")
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


def test_three_adamw_steps_match():
    cases = [
        _case("ring", "balanced", "packed", steps=3),
        _case("usp", "balanced", "packed", steps=2, ulysses=2, checkpointing=True),
        _case("ulysses", "contiguous", "dense", steps=3),
        _case("usp", "balanced", "dense", steps=3, ulysses=2),
    ]
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
    from transformers import MistralConfig, MistralForCausalLM

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
    # Dropout while training.
    dropout_model = model_with(attention_dropout=0.1).train()
    problems["dropout"] = raises(lambda: dropout_model.model(**local), "dropout")
    # A sliding window.
    torch.manual_seed(0)
    mistral = MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               sliding_window=8, use_cache=False))  # fmt: skip
    sp_transformers.apply(mistral, "ring", **group)
    problems["sliding window"] = raises(lambda: mistral.model(**local), "sliding")
    # Softcapping (called as a model passes it).
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 16)
    kv = torch.randn(1, 2, 5, 16)
    implementation = sp_transformers.IMPLEMENTATIONS["ring"]
    attend = transformers.AttentionInterface._global_mapping[implementation]
    problems["softcap"] = raises(lambda: attend(attention, q, kv, kv, None, softcap=30.0), "softcap")
    problems["kv cache"] = raises(lambda: attend(attention, q, torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16),
                                                  None), "KV cache")  # fmt: skip
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
    attention_module = sp_transformers.attention
    backends, ring_attention = [], attention_module.ring_attention
    attention_module.ring_attention = lambda *args, **kwargs: (
        backends.append(kwargs["step_backend"]) or ring_attention(*args, **kwargs)
    )
    try:
        aten_model.model(**local)
    finally:
        attention_module.ring_attention = ring_attention
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


def test_core_package_never_imports_transformers():
    assert_never_imported("transformers")


@pytest.mark.skipif(os.environ.get(oldest_marker("transformers")) == "1", reason="already the oldest release")
def test_oldest_supported_transformers():
    """This file's parity and error tests, and some of the Trainer's, under the oldest
    supported release, installed by scripts/setup.sh into build/ (skipped where the
    set-up could not reach PyPI). The Trainer's run in the same session: they share its
    rank pools."""
    selection = (
        "one_group and P2 or usp and 2 or unsupported or register or adamw or "
        "test_transformers_trainer and (P2-ring or replicas and packed or mixin)"
    )
    trainer_tests = str(Path(__file__).with_name("test_transformers_trainer.py"))
    run_under_oldest_release("transformers", OLDEST_SUPPORTED, [__file__, trainer_tests], selection)
