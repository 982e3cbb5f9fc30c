"""Hybrid models whose linear attention is Kimi's delta attention (Kimi Linear, Ling's
BailingHybrid) or MiniMax's lightning attention, under sequence parallelism: tiny random
models through apply + shard_batch + causal_lm_loss + all_reduce_gradients on gloo ranks
against transformers' own single-process run (its torch fallbacks: loss and every
parameter's gradient, fp32), Ulysses, the ring balanced and USP, packed documents against
each document run alone (the state restarts at every document).

Kimi Linear and BailingHybrid each have a delta-attention layer and a full-attention
layer of multi-head latent attention (v of another head size than q and k). The parity
harness is tests/test_transformers_integration.py's (run_parity_cases)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_transformers_integration as integration  # noqa: E402
from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank  # noqa: E402

_MOE = dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)  # fmt: skip
# Their full-attention layers: multi-head latent attention (k and v for every q head), q/k
# of 16 + 8 rotary dims (head_dim: the rotary size), v of 12.
_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=12,
)
# (config class, model class, what the tiny config sets): one delta-attention layer of 4
# heads of 16 with a convolution of kernel 3 (Kimi Linear's with a MoE, BailingHybrid's
# with a dense MLP); MiniMax's lightning layer in blocks of 8 tokens beside a softmax
# attention layer, MoE.
LINEAR_FAMILIES = {
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_head_dim=16,
                         linear_num_heads=4, linear_conv_kernel_dim=3, mlp_layer_types=["sparse", "sparse"], **_MLA,
                         **_MOE)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            short_conv_kernel_size=3, first_k_dense_replace=2, n_group=1, topk_group=1,
                            num_mtp_layers=0, **_MLA, **_MOE)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], block_size=8,
                     num_local_experts=4, num_experts_per_tok=2)),
}  # fmt: skip


def _here() -> list[str]:
    return [family for family, (config_class, _, _) in LINEAR_FAMILIES.items() if hasattr(transformers, config_class)]


def _case(family, mode, layout, batch, **extra):
    return integration._case(mode, layout, batch, family=family, family_spec=LINEAR_FAMILIES[family], **extra)


@on_every_rank
def run_cases(cases):
    return integration.run_parity_cases(cases)


# Per world size: (family, mode, layout, batch, extra): each family on the ring balanced
# or Ulysses, packed documents, 3 ranks' uneven pieces, USP's 2 x 2 grid once.
_CASES = {
    2: [("kimi_linear", "ulysses", "contiguous", "dense", {}), ("minimax", "ulysses", "contiguous", "dense", {}),
        ("bailing_hybrid", "ring", "balanced", "dense", {}),
        ("minimax", "ring", "balanced", "packed", dict(per_document=True))],
    3: [("kimi_linear", "ring", "balanced", "packed", dict(per_document=True))],
    4: [("minimax", "usp", "balanced", "dense", dict(ulysses=2))],
}  # fmt: skip


@pytest.mark.parametrize("world_size", sorted(_CASES), ids=lambda size: f"P{size}")
def test_families_match_the_single_process_model(world_size):
    if not any(case[0] in _here() for case in _CASES[world_size]):
        pytest.skip(f"transformers {transformers.__version__} has none of this world size's families")
    cases = [_case(family, mode, layout, batch, **extra) for family, mode, layout, batch, extra in _CASES[world_size]
             if family in _here()]  # fmt: skip
    failures = [failure for per_rank in pool_for(world_size).run(run_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_lightning_attention_runs_its_own_forward_outside_an_applied_model():
    """apply() replaces MiniMaxLightningAttention's class forward: a model it did not set up
    runs transformers' own, unchanged (the logits bitwise those of before any apply)."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    if "minimax" not in _here():
        pytest.skip(f"transformers {transformers.__version__} has no MiniMax")
    spec = LINEAR_FAMILIES["minimax"]
    ids = torch.randint(0, integration.VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = integration._family_model("minimax", spec=spec)(input_ids=ids).logits
        sp_transformers.apply(integration._family_model("minimax", spec=spec), "ring")
        after = integration._family_model("minimax", spec=spec)(input_ids=ids).logits
    assert type(integration._family_model("minimax", spec=spec).model.layers[0].self_attn).forward.seqpar_original
    torch.testing.assert_close(after, before, rtol=0, atol=0)
