"""Hybrid transformers models (attention beside short convolutions, linear attention or
state-space mixers) under sequence parallelism: small random models of each family
through apply + shard_batch + causal_lm_loss + all_reduce_gradients on gloo ranks against
transformers' own single-process run (loss and every parameter's gradient), in every
mode; a packed batch against each document run alone; what cannot run raises.

The parity harness is tests/test_transformers_integration.py's (run_parity_cases); each
case carries its family's spec (config class, model class, settings)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_transformers_integration as integration  # noqa: E402
from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402

# (config class, model class, what the tiny config sets); layers of every kind, mixers
# between attention layers.
# Mamba2 mixers: 4 heads of 16 in 2 groups, a state of 8, chunks of 4 tokens (several per
# rank's piece), a convolution of kernel 3.
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, mamba_d_conv=3,
               mamba_expand=1)  # fmt: skip
# Gated DeltaNet: 2 q/k heads serving 4 value heads of 16, a convolution of kernel 3.
_GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=3)  # fmt: skip
HYBRID_FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",  # Gated DeltaNet (2 q/k heads, 4 value heads), MoE
                   # (top 2 of 4 experts: with top 1 the router's normalised weight is 1 and its gradient noise)
                   dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **_GATED_DELTA,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",  # Gated DeltaNet and gated attention, text
                dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], **_GATED_DELTA)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",  # short convolutions of kernel 3 (windows of 2 rows back)
             dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)),
    "bamba": ("BambaConfig", "BambaForCausalLM",  # Mamba2 layers around an attention layer
              dict(num_hidden_layers=3, attn_layer_indices=[1], **_MAMBA2)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",  # attention and Mamba2 side by side in every layer
                  dict(num_hidden_layers=2, mamba_d_ssm=64, **_MAMBA2)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",  # Mamba2 and attention layers, MoE
                         dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=2,
                              num_experts_per_tok=1, **_MAMBA2)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",  # its own Mamba2 mixer, by pattern
                   dict(num_hidden_layers=3, hybrid_override_pattern="M*M", mamba_num_heads=4, mamba_head_dim=16,
                        n_groups=2, ssm_state_size=8, chunk_size=4, conv_kernel=3)),
    "jamba": ("JambaConfig", "JambaForCausalLM",  # Mamba (a diagonal decay) and attention layers, MoE
              dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2,
                   mamba_d_state=8, mamba_d_conv=3, mamba_expand=1)),
}  # fmt: skip


def _here() -> list[str]:
    return [family for family, (config_class, _, _) in HYBRID_FAMILIES.items() if hasattr(transformers, config_class)]


def _cases(family: str) -> list[dict]:
    spec = HYBRID_FAMILIES[family]

    def case(*args, **extra):
        return integration._case(*args, family=family, family_spec=spec, **extra)

    return [
        case("ulysses", "contiguous", "dense"),
        case("ring", "balanced", "packed", per_document=True),
        case("ring", "contiguous", "padded"),
        case("usp", "balanced", "dense", ulysses=2),
        case("usp", "contiguous", "packed", ulysses=2, per_document=True),
    ]


@on_every_rank
def run_hybrid_cases(cases):
    return integration.run_parity_cases(cases)


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_family_matches_the_single_process_model(family):
    if family not in _here():
        pytest.skip(f"transformers {transformers.__version__} has no {HYBRID_FAMILIES[family][0]}")
    cases = _cases(family)
    failures = [failure for per_rank in pool_for(4).run(run_hybrid_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_three_ranks_uneven_pieces():
    cases = [
        integration._case("ring", "contiguous", "dense", family=family, family_spec=HYBRID_FAMILIES[family], seqlen=29)
        for family in _here()
    ]
    failures = [failure for per_rank in pool_for(3).run(run_hybrid_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_three_adamw_steps_match():
    """Gated DeltaNet and Mamba2 layers trained for three steps: the losses stay the
    single-process model's (after the first step Adam's update is compared through them)."""
    cases = [
        integration._case("ring", "balanced", "packed", family=family, family_spec=HYBRID_FAMILIES[family], steps=3,
                          per_document=True)
        for family in ("qwen3_next", "bamba") if family in _here()
    ]  # fmt: skip
    failures = [failure for per_rank in pool_for(2).run(run_hybrid_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_unknown_mixers_raise_naming_them():
    """A model whose layers mix the sequence in a way the package does not run raises at
    apply(), naming the module (Kimi Linear's delta attention where this release has it)."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    if not hasattr(transformers, "KimiLinearConfig"):
        pytest.skip("no Kimi Linear in this transformers release")
    config = transformers.KimiLinearConfig(
        vocab_size=integration.VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    model = transformers.KimiLinearForCausalLM(config)
    problem = raises(lambda: sp_transformers.apply(model, "ring"), "KimiLinearDeltaAttention|does not run")
    assert problem is None, problem


@on_every_rank
def run_cache_raises(family):
    import seqpar_kernels.integrations.transformers as sp_transformers

    model = integration._family_model(family, spec=HYBRID_FAMILIES[family])
    groups = {"group": timeout_group()}
    sp_transformers.apply(model, "ring", **groups)
    batch, _, _ = integration._batch("dense", 11)
    local = sp_transformers.shard_batch(batch, mode="ring", **groups)
    local.pop("shift_labels")
    return raises(lambda: model.model(**local, use_cache=True), "cache|use_cache")


def test_a_cache_raises():
    for family in _here():
        for rank, problem in enumerate(pool_for(2).run(run_cache_raises, family)):
            assert problem is None, f"{family} rank {rank}: {problem}"


def test_mixers_run_their_original_outside_an_applied_model():
    """The dispatchers replace functions of transformers' modeling modules: a model that
    apply() did not set up still runs them, unchanged."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    for family in _here():
        spec = HYBRID_FAMILIES[family]
        applied, plain = integration._family_model(family, spec=spec), integration._family_model(family, spec=spec)
        sp_transformers.apply(applied, "ring")
        ids = torch.randint(0, integration.VOCAB, (1, 9))
        with torch.no_grad():
            first = plain(input_ids=ids).logits
            again = integration._family_model(family, spec=spec)(input_ids=ids).logits
        torch.testing.assert_close(first, again, rtol=0, atol=0)
