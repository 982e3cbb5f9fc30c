"""Inkling 2 (transformers' inkling2 and inkling2_loop) under sequence parallelism: a
tiny random model through apply + shard_batch + causal_lm_loss + all_reduce_gradients in
Ulysses, ring and USP modes (dense and packed batches) on 2-4 gloo ranks against
transformers' single-process eager run (loss and every parameter's gradient, fp32); what
is not served raises at the call.

The tiny config has a sliding layer, a full layer and a second sliding layer (every
module kind: static and dynamic short convolutions, both biases, block residuals over
two blocks); a window (5) and relative extents (5 and 7) shorter than a rank's piece
(9-19 tokens) so that both the bias and the mask cross ranks; convolutions of kernel 3;
log scaling from position 8 on, so that it reads the global positions."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Inkling2TextConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Inkling 2", allow_module_level=True)

import test_transformers_integration as integration  # noqa: E402
from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402

SEQLEN = 37


# The looped variant: layer 1 (the full one) run in two passes, the second with messages from the first;
# every layer a block (the loop's bounds must fall on blocks).
LOOP = dict(loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8,
            n_layers_per_attn_res_block=1)  # fmt: skip


def _model(looped: bool, seed: int = 0, **overrides):
    """A tiny random Inkling 2 (looped: Inkling 2 Loop) on eager attention, with the
    parameters its init zeroes (dynamic convolutions' static taps, the residuals'
    queries) drawn, so that they matter."""
    prefix = "Inkling2Loop" if looped else "Inkling2"
    settings = dict(
        vocab_size=integration.VOCAB, unpadded_vocab_size=integration.VOCAB, eos_token_id=None, hidden_size=32,
        num_hidden_layers=3, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        swa_num_attention_heads=6, swa_num_key_value_heads=3, swa_head_dim=8, sliding_window_size=5, d_rel=4,
        rel_extent=7, log_scaling_n_floor=8, conv_kernel_size=3, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    config = getattr(transformers, f"{prefix}TextConfig")(**{**settings, **(LOOP if looped else {}), **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("static_weight", "query")):
                parameter.normal_(0.0, 0.5)
    return model


def parity_failures(looped: bool, mode: str, layout: str, groups: dict, kind: str = "dense", **overrides) -> list[str]:
    """The loss and every parameter's gradient (summed over the ranks) of the model in
    `mode` on a batch of `kind` (integration._batch's) against the single-process
    model's (packed: each document alone, as the model's convolutions read across
    documents without seq_idx), the config changed by `overrides`: the failures."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    reference = _model(looped, **overrides)
    model = copy.deepcopy(reference)
    sp_transformers.apply(model, mode, layout=layout, **groups)
    batch, labels, positions = integration._batch(kind, SEQLEN)
    expected = integration._reference_step(reference, batch, labels, positions, per_document=kind == "packed")
    expected.backward()
    loss = integration._sp_step(model, batch, mode, layout, groups)
    loss.backward()
    sp_transformers.all_reduce_gradients(model, **groups)
    failures = []
    error = integration._relative_error(loss.detach(), expected.detach())
    if not error <= integration.FP32_LOSS_RTOL:
        failures.append(f"loss {loss.item():.7f} vs {expected.item():.7f} (rel {error:.2e})")
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        error = integration._relative_error(ours.grad, theirs.grad)
        if not error <= integration.FP32_GRAD_RTOL:
            failures.append(f"grad of {name} relative error {error:.2e}")
    return [f"{mode} {layout} {kind} {overrides}: {failure}" for failure in failures]


@on_every_rank
def run_inkling(looped: bool):
    """The parity failures (strings), then the refusals' problems (None where it raised as expected)."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    groups = {"group": timeout_group()}
    failures = parity_failures(looped, "ulysses", "contiguous", groups)
    model = _model(looped)
    sp_transformers.apply(model, "ulysses", **groups)
    batch = integration._batch("dense", SEQLEN)[0]
    # Without shard_batch's shard: raises at the call, on every rank.
    local = sp_transformers.shard_batch(batch, mode="ulysses", **groups)
    bare = {key: local[key] for key in ("input_ids", "position_ids")}
    refusals = [raises(lambda: model.model(**bare), "sequence_shard")]
    return failures, refusals


@on_every_rank
def run_inkling_modes(looped: bool, cases):
    """The parity failures of each (mode, layout, batch kind, config overrides) case."""
    failures = []
    for mode, layout, kind, *overrides in cases:
        failures += parity_failures(looped, mode, layout, integration._parallelism(mode, 2), kind, **dict(*overrides))
    return failures


# Inkling 2 Loop on 2 ranks (its layers are Inkling 2's), Inkling 2 on 3 (uneven pieces of 12-13 tokens).
@pytest.mark.parametrize("world_size, looped", [(2, True), (3, False)])
def test_inkling2_matches_the_single_process_model(world_size, looped):
    if looped and not hasattr(transformers, "Inkling2LoopTextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Inkling 2 Loop")
    for rank, (failures, refusals) in enumerate(pool_for(world_size).run(run_inkling, looped)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)
        assert refusals == [None], f"rank {rank}: {refusals}"


# The ring (the bias's near band from halos, the rest over the shifted ring) and USP (that
# ring over the 2 x 2 grid): contiguous on 3 ranks, balanced (zigzag) on 2, both on 4;
# packed documents (5, 1, 17 and 14 tokens) in balanced plans on 3 and 4 ranks, and in
# Ulysses mode (a ring over the Ulysses group) on 3; a window (11) and an extent (13)
# longer than USP's pieces of 9-10 tokens, so that the halos span two ranks.
@pytest.mark.parametrize("world_size, looped, cases", [
    (2, True, [("ring", "balanced", "dense")]),
    (3, False, [("ring", "contiguous", "dense"), ("ring", "balanced", "packed"), ("ulysses", "contiguous", "packed")]),
    (4, False, [("usp", "balanced", "dense"), ("usp", "balanced", "packed"),
                ("usp", "contiguous", "dense", dict(sliding_window_size=11, rel_extent=13))]),
], ids=["P2-ring-balanced-loop", "P3-ring", "P4-usp"])  # fmt: skip
def test_inkling2_ring_and_usp_match_the_single_process_model(world_size, looped, cases):
    if looped and not hasattr(transformers, "Inkling2LoopTextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Inkling 2 Loop")
    for rank, failures in enumerate(pool_for(world_size).run(run_inkling_modes, looped, cases)):
        assert not failures, f"rank {rank}: " + "\n".join(failures)
