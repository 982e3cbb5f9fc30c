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

# The same families at other sizes (odd head counts where the config takes them, one group,
# other states, chunks, kernels; Falcon-H1 at 4 Mamba2 heads of 16 in one group), run on 3
# and 4 ranks.
_OTHER_MAMBA2 = dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, mamba_n_heads=3, mamba_d_head=16,
                     mamba_n_groups=1, mamba_d_state=5, mamba_chunk_size=3, mamba_d_conv=4, mamba_expand=1)  # fmt: skip
_OTHER_GATED_DELTA = dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8,
                          linear_value_head_dim=12, linear_conv_kernel_dim=4, num_attention_heads=3,
                          num_key_value_heads=1)  # fmt: skip
OTHER_SIZES = {
    "qwen3_next": dict(HYBRID_FAMILIES["qwen3_next"][2], **_OTHER_GATED_DELTA),
    "qwen3_5": dict(HYBRID_FAMILIES["qwen3_5"][2], **_OTHER_GATED_DELTA),
    "lfm2": dict(HYBRID_FAMILIES["lfm2"][2], conv_L_cache=4, hidden_size=48, num_attention_heads=3,
                 num_key_value_heads=1),
    "bamba": dict(HYBRID_FAMILIES["bamba"][2], **_OTHER_MAMBA2),
    "falcon_h1": dict(HYBRID_FAMILIES["falcon_h1"][2], mamba_n_groups=1),
    "granitemoehybrid": dict(HYBRID_FAMILIES["granitemoehybrid"][2], **_OTHER_MAMBA2),
    "nemotron_h": dict(HYBRID_FAMILIES["nemotron_h"][2], num_attention_heads=3, num_key_value_heads=1,
                       mamba_num_heads=3, n_groups=1, ssm_state_size=5, chunk_size=3, conv_kernel=4),
    "jamba": dict(HYBRID_FAMILIES["jamba"][2], hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                  mamba_d_state=5, mamba_d_conv=4),
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


# Per world size: Ulysses and the ring, one of them on pieces of 3 or 4 tokens (a
# single Mamba2 chunk each), the other on 37 tokens of another batch kind.
_OTHER_SIZE_CASES = {
    3: [("ulysses", "contiguous", "dense", dict(seqlen=9)),
        ("ring", "balanced", "packed", dict(per_document=True))],
    4: [("ring", "contiguous", "dense", dict(seqlen=15)), ("ulysses", "contiguous", "padded", {})],
}  # fmt: skip


@pytest.mark.parametrize("world_size", [3, 4])
def test_three_and_four_ranks(world_size):
    """Every family at other sizes on 3 and 4 ranks (uneven pieces, pieces of one Mamba2
    chunk); at 3, at the usual sizes too, on uneven pieces of 29 tokens."""
    cases = [
        integration._case(mode, layout, batch, family=family, sizes="other", **extra,
                          family_spec=(*HYBRID_FAMILIES[family][:2], OTHER_SIZES[family]))
        for family in _here() for mode, layout, batch, extra in _OTHER_SIZE_CASES[world_size]
    ]  # fmt: skip
    if world_size == 3:
        cases += [integration._case("ring", "contiguous", "dense", family=family, family_spec=HYBRID_FAMILIES[family],
                                    seqlen=29) for family in _here()]  # fmt: skip
    failures = [failure for per_rank in pool_for(world_size).run(run_hybrid_cases, cases) for failure in per_rank]
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
    apply(), naming the module (RecurrentGemma's RG-LRU scan where this release has it)."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    if not hasattr(transformers, "RecurrentGemmaConfig"):
        pytest.skip("no RecurrentGemma in this transformers release")
    config = transformers.RecurrentGemmaConfig(
        vocab_size=integration.VOCAB, hidden_size=64, intermediate_size=64, lru_width=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    model = transformers.RecurrentGemmaForCausalLM(config)
    problem = raises(lambda: sp_transformers.apply(model, "ring"), "RecurrentGemmaRglru.*does not run")
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


def test_a_mixer_that_bypasses_the_dispatchers_raises():
    """A mixer whose sequence mixing does not reach a dispatcher (transformers' own
    functions back in place: what kernels' kernelize does to a wrapper) raises, naming
    it, instead of mixing this rank's tokens only; with the dispatchers back it runs."""
    import importlib

    import seqpar_kernels.integrations.transformers as sp_transformers

    for family in _here():
        model = integration._family_model(family, spec=HYBRID_FAMILIES[family])
        sp_transformers.apply(model, "ring")
        modeling = importlib.import_module(type(model).__module__)
        dispatchers = {name: value for name, value in vars(modeling).items() if hasattr(value, "seqpar_original")}
        assert dispatchers, f"{family}: no dispatcher in {modeling.__name__}"
        ids = torch.randint(0, integration.VOCAB, (1, 9))
        try:
            for name, dispatcher in dispatchers.items():
                setattr(modeling, name, dispatcher.seqpar_original)
            problem = raises(lambda: model(input_ids=ids), "ran without calling a function the package dispatches")
        finally:
            for name, dispatcher in dispatchers.items():
                setattr(modeling, name, dispatcher)
        assert problem is None, f"{family}: {problem}"
        assert torch.isfinite(model(input_ids=ids).logits).all(), family


# The mixing functions a dispatcher stands for, each called as transformers' mixers call it:
# (modeling module holding it, the reference's inputs (the whole sequence), the sequence's
# dim in them, keyword arguments). Odd head counts and sizes; the gated delta rule with
# as many q/k heads as value heads (the mixers repeat them before the call).
def _mixing_calls(total: int, batch: int, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    heads, head_dim, groups, state, channels = 3, 5, 1, 4, 7
    conv = ("lfm2", [randn(batch, channels, total), randn(channels, 3), randn(channels)], 2)
    ssd = ("bamba", [randn(batch, total, heads, head_dim), randn(batch, total, heads), -torch.rand(heads) - 0.1,
                     randn(batch, total, groups, state), randn(batch, total, groups, state)], 1)  # fmt: skip
    selective = ("jamba", [randn(batch, channels, total), randn(batch, channels, total), -torch.rand(channels, state),
                           randn(batch, state, total), randn(batch, state, total)], 2)  # fmt: skip
    gated = ("qwen3_next", [randn(batch, total, heads, head_dim), randn(batch, total, heads, head_dim),
                            randn(batch, total, heads, 6), -torch.rand(batch, total, heads),
                            torch.rand(batch, total, heads)], 1)  # fmt: skip
    return {
        ("causal_conv1d_fn", "silu"): (*conv, dict(activation="silu")),
        ("causal_conv1d_fn", None): (*conv, {}),
        ("mamba2_chunk_scan", None): (*ssd, dict(chunk_size=4, D=torch.rand(heads), dt_bias=torch.rand(heads),
                                                 dt_softplus=True)),
        ("mamba_selective_scan", None): (*selective, dict(D=torch.rand(channels), z=randn(batch, channels, total),
                                                          delta_bias=torch.rand(channels), delta_softplus=True)),
        ("torch_chunk_gated_delta_rule", None): (*gated, dict(use_qk_l2norm_in_kernel=True)),
    }  # fmt: skip


@on_every_rank
def run_mixer_layouts():
    """Each dispatcher's output on this rank's rows against its transformers function's on
    the same rows in one process: contiguous wherever that one is (what a mixer's own
    .view() of it needs), else contiguous or strided alike; for contiguous pieces (uneven,
    of one Mamba2 chunk, empty), zigzag pieces and packed documents."""
    import importlib

    import seqpar_kernels as sp
    from seqpar_kernels.integrations.transformers.mixers import HANDLED_FUNCTIONS
    from seqpar_kernels.parallel.parallelism import SequenceParallelism
    from seqpar_kernels.parallel.training import SequenceShard

    groups = {"group": timeout_group()}
    generator = torch.Generator().manual_seed(0)
    shardings = []
    for layout, total in (("contiguous", 13), ("balanced", 14), ("contiguous", 2)):  # 2 tokens: an empty piece
        parallelism = SequenceParallelism.resolve("test", "ring", layout, **groups)
        shard = SequenceShard(parallelism, parallelism.piece_lengths(total), None, False)
        shardings.append((f"dense {layout} {total}", shard, total, 2))
    for layout in ("contiguous", "balanced"):
        parallelism = SequenceParallelism.resolve("test", "ring", layout, **groups)
        plan = sp.varlen_plan([0, 1, 9, 16], layout=layout, **groups)
        shardings.append((f"packed {layout}", SequenceShard(parallelism, plan.seq_lens, plan, False), 16, 1))
    failures = []
    for sharding, shard, total, batch in shardings:
        for (name, variant), (family, inputs, dim, kwargs) in _mixing_calls(total, batch, generator).items():
            function = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
            original = getattr(function, "seqpar_original", function)
            local = [shard.take(x, dim) if x.dim() > dim and x.shape[dim] == total else x for x in inputs]
            local_kwargs = {key: shard.take(value, dim) if key == "z" else value for key, value in kwargs.items()}
            ours = HANDLED_FUNCTIONS[name]((shard.parallelism, shard, None), *local, **local_kwargs)
            ours = ours[0] if isinstance(ours, tuple) else ours
            if ours.shape[dim] == 0:  # no rows here: the reference has none to run
                contiguous = True
            else:
                theirs = original(*local, **local_kwargs)
                theirs = theirs[0] if isinstance(theirs, tuple) else theirs
                contiguous = theirs.is_contiguous()
            if not ours.is_contiguous() and (contiguous or ours.stride() != theirs.stride()):
                failures.append(f"{sharding} {name} {variant}: {tuple(ours.shape)} strides {ours.stride()}, where "
                                f"transformers' is {'contiguous' if contiguous else theirs.stride()}")  # fmt: skip
    return failures


def test_mixer_outputs_are_laid_out_as_transformers_functions():
    if not all(
        hasattr(transformers, HYBRID_FAMILIES[family][0]) for family in ("lfm2", "bamba", "jamba", "qwen3_next")
    ):
        pytest.skip(f"transformers {transformers.__version__} lacks one of LFM2, Bamba, Jamba, Qwen3-Next")
    failures = [failure for per_rank in pool_for(3).run(run_mixer_layouts) for failure in per_rank]
    assert not failures, "\n".join(failures)
