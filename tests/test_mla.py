"""Multi-head latent attention: v of another head dim (Dv) than q and k (D), as the
training form of DeepSeek-V3's attention has it (D = nope + rope dims, Dv smaller).

The ops (ring contiguous and zigzag, Ulysses, USP, packed documents, windows, chunks,
softcap, sinks) against fp64 attention written out (tools/reference.py), gradients
too, on 2 and 3 gloo ranks (test_attention_variants.run_cases: its rule, cases and
helpers); one realistic head dim (192/128); opcheck of the engine's custom ops; the
ring's and Ulysses' bytes against the formulas with k and v counted apart; the Triton
step kernels on the ring; the entry's checks of v's shape. The MLA families (DeepSeek-V3,
GLM-4.7-Flash, LongCat-Flash; MiMo-V2-Flash's GQA with Dv != D) through apply against
transformers' single-process run (test_transformers_integration.run_parity_cases), and
generate over a sharded cache (test_generation.run_generate).
"""

from __future__ import annotations

import pytest
import torch
from conftest import pool_for
from on_ranks import on_every_rank, rank_and_world, timeout_group
from test_attention_variants import case, run_cases
from triton_interpreter import runs_triton_on

import seqpar_kernels as sp
from seqpar_kernels.engine.step_backends import AUTO
from seqpar_kernels.traffic import (
    PASS_KV,
    PASS_Q,
    decode_attention_bytes,
    prefill_attention_bytes,
    ring_bytes,
    ulysses_bytes,
)

# D = 24 (16 nope + 8 rope), Dv = 16: the tiny MLA shape; one case with Dv > D; by world
# size, so that each runs once.
# fmt: off
MLA_CASES = {
    2: [
        case("mla-ring-zigzag-softcap-sinks", "ring", layout="zigzag", D=24, Dv=16, softcap=1.5, sinks=True, B=2),
        case("mla-ring-wider-v", "ring", D=8, Dv=20, chunk=4, causal=False),
        case("mla-ulysses-docs-window-sinks", "ulysses", D=24, Dv=16, window=(4, -1), sinks=True, documents=(0.5,)),
        case("mla-192-128", "ring", layout="zigzag", D=192, Dv=128, H=2, H_kv=2, per_rank=4),
    ],
    3: [
        case("mla-ring", "ring", D=24, Dv=16),
        case("mla-ring-docs-window", "ring", layout="balanced", D=24, Dv=16, window=(3, -1), documents=(0.3, 0.7)),
        case("mla-ulysses", "ulysses", D=24, Dv=16, H=6, H_kv=3),
        # Fewer heads than ranks: a rank without heads still returns out of v's head dim.
        case("mla-ulysses-fewer-heads", "ulysses", D=24, Dv=16, H=2, H_kv=1, softcap=1.0),
    ],
}
GRID_CASE = case("mla-usp-docs-softcap", "usp", grid=2, layout="balanced", D=24, Dv=16, softcap=1.5, documents=(0.4,))
# fmt: on


@pytest.mark.parametrize("world_size", [2, 3])
def test_value_head_dim_matches_fp64_attention(world_size):
    failures = [failure for per_rank in pool_for(world_size).run(run_cases, MLA_CASES[world_size], torch.float32)
                for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_usp_value_head_dim_matches_fp64_attention():
    failures = [failure for per_rank in pool_for(4).run(run_cases, [GRID_CASE], torch.float32) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_low_precision_value_head_dim_within_twice_plain_torch_error():
    cases = [case("mla-bf16-ring", "ring", D=24, Dv=16, per_rank=8, window=(6, -1)),
             case("mla-bf16-ulysses", "ulysses", D=24, Dv=16, per_rank=8, softcap=1.0)]  # fmt: skip
    failures = [failure for per_rank in pool_for(2).run(run_cases, cases, torch.bfloat16) for failure in per_rank]
    assert not failures, "\n".join(failures)


@on_every_rank
def run_bytes():
    """{function: (measured, the formula's)} of this rank, k and v of different head
    dims: the ring's and Ulysses' (forward, backward); prefill_attention's by each method
    and decode_attention's."""
    rank, world_size = rank_and_world()
    group = timeout_group()
    batch, per_rank, heads, kv_heads, head_dim, value_dim = 1, 4, 4, 2, 24, 16
    sizes = dict(batch=batch, num_kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim, element_size=4)
    lengths = [per_rank] * world_size
    formulas = {"ring_attention": ring_bytes(lengths, rank, **sizes),
                "ulysses_attention": ulysses_bytes(lengths, rank, num_heads=heads, **sizes)}  # fmt: skip
    results = {}
    for function, formula in formulas.items():
        q = torch.randn(batch, per_rank, heads, head_dim, requires_grad=True)
        k = torch.randn(batch, per_rank, kv_heads, head_dim, requires_grad=True)
        v = torch.randn(batch, per_rank, kv_heads, value_dim, requires_grad=True)
        with sp.comm_stats() as forward:
            out = getattr(sp, function)(q, k, v, group=group, causal=True, seq_lens=lengths)
        with sp.comm_stats() as backward:
            out.sum().backward()
        results[function] = ((forward.bytes_sent, backward.bytes_sent), tuple(formula))
    # Inference: this rank caches 3 + rank rows, holds 2 + rank of a new chunk after them.
    caches, chunks = [3 + r for r in range(world_size)], [2 + r for r in range(world_size)]
    cache_start, chunk_start = sum(caches[:rank]), sum(caches) + sum(chunks[:rank])
    k_cache, v_cache = (
        torch.randn(1, caches[rank], kv_heads, head_dim),
        torch.randn(1, caches[rank], kv_heads, value_dim),
    )
    cache = dict(k_cache=k_cache, v_cache=v_cache, cache_lengths=torch.tensor([caches[rank]]),
                 cache_positions=torch.arange(cache_start, cache_start + caches[rank])[None])  # fmt: skip
    q, k = torch.randn(1, chunks[rank], heads, head_dim), torch.randn(1, chunks[rank], kv_heads, head_dim)
    v = torch.randn(1, chunks[rank], kv_heads, value_dim)
    q_positions = torch.arange(chunk_start, chunk_start + chunks[rank])[None]
    for method in (PASS_KV, PASS_Q):
        with sp.comm_stats() as sent:
            sp.prefill_attention(q, k, v, **cache, q_positions=q_positions, method=method, group=group,
                                 chunk_seq_lens=chunks, cache_seq_lens=caches, check_ranks=False)  # fmt: skip
        formula = prefill_attention_bytes(caches, chunks, rank, method=method, num_heads=heads, **sizes)
        results[f"prefill_attention {method}"] = (sent.bytes_sent, formula)
    with sp.comm_stats() as sent:
        sp.decode_attention(q[:, :1], **cache, q_positions=q_positions[:, :1] * 0 + sum(caches), group=group,
                            check_ranks=False)  # fmt: skip
    formula = decode_attention_bytes([world_size], batch=batch, num_queries=1, num_heads=heads, head_dim=value_dim)
    results["decode_attention"] = (sent.bytes_sent, formula)
    return results


def test_bytes_count_k_and_v_apart():
    for per_rank in pool_for(3).run(run_bytes):
        for function, (measured, formula) in per_rank.items():
            assert measured == formula, function


@on_every_rank
def opcheck_ops():
    """The ring's and the local attention's custom ops with v of another head dim: the
    fake kernels' shapes, autograd, schema (torch.library.opcheck)."""
    rank, world_size = rank_and_world()
    gen = torch.Generator().manual_seed(rank)
    seq_lens = [3 + r for r in range(world_size)]
    q = torch.randn(1, seq_lens[rank], 4, 24, generator=gen, requires_grad=True)
    k = torch.randn(1, seq_lens[rank], 2, 24, generator=gen, requires_grad=True)
    v = torch.randn(1, seq_lens[rank], 2, 16, generator=gen, requires_grad=True)
    ring = torch.ops.seqpar.ring_attention_forward.default
    args = (q, k, v, True, 0.2, False, torch.distributed.group.WORLD.group_name, AUTO, seq_lens)
    torch.library.opcheck(ring, args)
    out, lse = ring(*(t.detach() if torch.is_tensor(t) else t for t in args))
    backward_args = (torch.randn(out.shape, generator=gen), *(t.detach() for t in (q, k, v)), out, lse, *args[3:])
    torch.library.opcheck(torch.ops.seqpar.ring_attention_backward.default, backward_args)
    local = torch.ops.seqpar.local_attention_forward.default
    torch.library.opcheck(local, (q, k, v, True, 0.2), dict(window_left=2))
    return out.shape, local(q, k, v, True, 0.2)[0].shape


def test_ops_pass_opcheck():
    shapes = pool_for(2).run(opcheck_ops)
    assert shapes == [((1, 3 + rank, 4, 16),) * 2 for rank in range(2)]


@runs_triton_on("cpu")
def test_triton_step_kernels_take_value_head_dim():
    # The GPU path's kernels (in the interpreter on the ranks' CPU tensors): v narrower
    # than q and k over the zigzag ring with a window and softcap, and wider.
    cases = [
        case("mla-triton-zigzag-window-softcap", "ring", layout="zigzag", D=24, Dv=16, H=2, H_kv=1, window=(4, -1),
             softcap=1.5, step_kernels="triton"),
        case("mla-triton-wider-v", "ring", D=8, Dv=20, H=2, H_kv=1, causal=False, step_kernels="triton"),
    ]  # fmt: skip
    failures = [failure for per_rank in pool_for(2).run(run_cases, cases, torch.float32) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_the_entry_refuses_value_shapes_it_cannot_take():
    q, k, v = torch.randn(1, 4, 2, 24), torch.randn(1, 4, 2, 24), torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"v head dim must be in \[1, 256\], got 0"):
        sp.ulysses_attention(q, k, v[..., :0])
    with pytest.raises(ValueError, match="k and v must share batch, sequence length and heads"):
        sp.ulysses_attention(q, k, v[:, :3])


# ----------------------------------------------------------------------------------
# The MLA families through apply
# ----------------------------------------------------------------------------------

# Tiny configs: q/k head dim 24 (16 nope + 8 rope), v head dim 12; one dense layer and
# one MoE layer. The latent models expand k and v to every q head (kv heads = heads).
_LATENT = dict(num_hidden_layers=2, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, head_dim=8, first_k_dense_replace=1, n_routed_experts=4,
               num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32)  # fmt: skip
MLA_FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _LATENT),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", _LATENT),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM",  # one layer of two attentions
                      dict(_LATENT, num_hidden_layers=1, num_layers=1, moe_topk=2, expert_ffn_hidden_size=32,
                           ffn_hidden_size=64)),
    # GQA of q/k head dim 24 and v head dim 16, a full layer, then a sliding one with sinks.
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM",
                      dict(num_hidden_layers=2, head_dim=24, v_head_dim=16, num_key_value_heads=1, sliding_window=5,
                           layer_types=["full_attention", "sliding_attention"], n_routed_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32)),
}  # fmt: skip


def _family_case(mode, layout, batch, family, **extra):
    from test_transformers_integration import _case

    return _case(mode, layout, batch, family=family, family_spec=MLA_FAMILIES[family], **extra)


def _run_families(world_size, cases):
    transformers = pytest.importorskip("transformers")
    from test_transformers_integration import run_parity_cases

    here = [one for one in cases if hasattr(transformers, one["family_spec"][0])]
    failures = [failure for per_rank in pool_for(world_size).run(run_parity_cases, here) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_mla_families_match_the_single_process_model_under_ulysses():
    _run_families(2, [_family_case("ulysses", "contiguous", "packed", "deepseek_v3"),
                      _family_case("ulysses", "contiguous", "dense", "mimo_v2_flash")])  # fmt: skip


def test_mla_families_match_the_single_process_model_under_ring_and_usp():
    _run_families(4, [_family_case("ring", "balanced", "packed", "glm4_moe_lite"),
                      _family_case("ring", "contiguous", "dense", "longcat_flash"),
                      _family_case("usp", "balanced", "dense", "deepseek_v3", ulysses=2)])  # fmt: skip


def test_generate_over_a_sharded_cache_matches_one_process():
    # DeepSeek-V3 caches the latents: the decode steps read them expanded by the layer,
    # a next turn expands the gathered shard; MiMo-V2-Flash caches k and v of two head dims.
    pytest.importorskip("transformers", minversion="5")
    from test_generation import _case, run_generate

    cases = [
        _case("ring", layout="balanced", family="deepseek_v3", family_spec=MLA_FAMILIES["deepseek_v3"], next_turn=True),
        _case("ulysses", family="mimo_v2_flash", family_spec=MLA_FAMILIES["mimo_v2_flash"], next_turn=True),
    ]
    failures = [failure for per_rank in pool_for(2).run(run_generate, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)
