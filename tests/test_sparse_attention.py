"""Indexer-sparse attention (seqpar_kernels.parallel.sparse) on gloo ranks against one
process: the indexer's top-k indices identical to the whole sequence's torch.topk (ties
included: few indexer heads make relu's exact zeros tie), the output and the gradients
of q, k, v (Dv != D, GQA) within the accuracy rule against fp64, and the bytes sent
against traffic.sparse_attention_bytes; then DeepSeek-V3.2 and GLM-5 through apply
against transformers' single-process model, and the refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from on_ranks import on_every_rank, raises, rank_and_world, timeout_group

from seqpar_kernels import traffic
from seqpar_kernels.parallel.sparse import indexer_topk, sparse_attention, sparse_placement
from tools.reference import assert_within_rule, contiguous_piece, even_lengths, with_grads, zigzag_piece

B, S, H, H_KV, D, DV, INDEX_HEADS, INDEX_DIM, TOPK = 2, 29, 4, 2, 24, 16, 2, 8, 7
DOCUMENTS = [0, 11, 20, S]


def _inputs(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return dict(q=randn(B, S, H, D), k=randn(B, S, H_KV, D), v=randn(B, S, H_KV, DV), dout=randn(B, S, H, DV),
                index_q=randn(B, S, INDEX_HEADS, INDEX_DIM), index_k=randn(B, S, INDEX_DIM),
                weights=randn(B, S, INDEX_HEADS))  # fmt: skip


def _visible(cu_seqlens) -> torch.Tensor:
    """(S, S) bool: causal, within each document."""
    document = torch.bucketize(torch.arange(S), torch.tensor(cu_seqlens[1:-1]), right=True)
    return torch.ones(S, S, dtype=torch.bool).tril() & (document[:, None] == document[None])


def _reference_topk(inputs, visible) -> torch.Tensor:
    """transformers' DSA indexer on the whole sequence in one process (fp32 scores)."""
    q, k, weights = (inputs[name].float() for name in ("index_q", "index_k", "weights"))
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * INDEX_DIM**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2).masked_fill(~visible, float("-inf"))
    return index_scores.topk(TOPK, dim=-1).indices


def _dense(q, k, v, keep):
    """Attention of (B, S, H, D) q over (B, S, H_kv, D) k, v under a (B, S, S) key mask."""
    k, v = (x.repeat_interleave(H // H_KV, dim=2) for x in (k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, k) * D**-0.5
    probabilities = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhst,bthe->bshe", probabilities, v)


@on_every_rank
def run_sparse_cases(layout: str, documents: bool):
    rank, world = rank_and_world()
    inputs = _inputs()
    cu_seqlens = DOCUMENTS if documents else [0, S]
    visible = _visible(cu_seqlens)
    expected_indices = _reference_topk(inputs, visible)
    keep = torch.zeros(B, S, S, dtype=torch.bool).scatter(-1, expected_indices, True) & visible

    def piece(x):
        return zigzag_piece(x, rank, world) if layout == "zigzag" else contiguous_piece(x, even_lengths(S, world), rank)

    group = timeout_group()
    placement = sparse_placement(piece(torch.arange(S)[None])[0].shape[0], group=group, layout=layout,
                                 cu_seqlens=cu_seqlens if documents else None)  # fmt: skip
    failures = []
    indices = indexer_topk(*(piece(inputs[name]).float() for name in ("index_q", "index_k", "weights")), TOPK,
                           placement=placement)  # fmt: skip
    if not torch.equal(indices, piece(expected_indices)):
        failures.append(f"rank {rank}: indices differ from the whole sequence's top-k")
    leaves = [inputs[name] for name in ("q", "k", "v")]
    exact = with_grads(lambda q, k, v: _dense(q, k, v, keep), leaves, inputs["dout"])
    plain = with_grads(lambda q, k, v: _dense(q, k, v, keep), [x.float() for x in leaves], inputs["dout"].float())
    with traffic.comm_stats() as stats:
        ours = with_grads(lambda q, k, v: sparse_attention(q, k, v, indices, placement=placement),
                          [piece(x.float()) for x in leaves], piece(inputs["dout"].float()))  # fmt: skip
    for name, got, want, yardstick in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[2:]),
                                          (exact[0], *exact[2:]), (plain[0], *plain[2:])):  # fmt: skip
        try:
            assert_within_rule(got, piece(want), piece(yardstick), torch.float32, f"rank {rank} {name}")
        except AssertionError as error:
            failures.append(str(error))
    # Every rank's distinct kept rows, by the rank that holds them: what each asks of each.
    holder = torch.bucketize(placement.slot_of_row, torch.tensor(placement.sizes).cumsum(0), right=True)
    asked = []
    for asking in range(world):
        if layout == "zigzag":
            queries = zigzag_piece(torch.arange(S)[None], asking, world)[0]
        else:
            queries = contiguous_piece(torch.arange(S)[None], even_lengths(S, world), asking)[0]
        needed = keep[:, queries].any(0).any(0)  # (S,): the global rows its queries keep
        asked.append(torch.bincount(holder[needed], minlength=world).tolist())
    expected_bytes = traffic.sparse_attention_bytes(asked, rank, batch=B, kv_heads=H_KV, head_dim=D, value_dim=DV,
                                                    element_size=4).sent(with_backward=True)  # fmt: skip
    if stats.bytes_sent != expected_bytes:
        failures.append(f"rank {rank}: sent {stats.bytes_sent} bytes, the formula says {expected_bytes}")
    return failures


@on_every_rank
def run_bad_inputs():
    rank, world = rank_and_world()
    group = timeout_group()
    q = torch.randn(1, 4, H, D)
    k, v = torch.randn(1, 4, H_KV, D), torch.randn(1, 4, H_KV, DV)
    indices = torch.zeros(1, 4 if rank else 3, TOPK, dtype=torch.long)  # rank 0's is short
    return [raises(lambda: sparse_attention(q, k, v, indices, group=group), r"indices \(1, 3, 7\)")]


def test_sparse_attention_matches_one_process():
    from conftest import pool_for

    failures = []
    for world, layout, documents in ((2, "contiguous", False), (3, "zigzag", True)):
        failures += [f"P{world} {layout}: {f}" for row in pool_for(world).run(run_sparse_cases, layout, documents)
                     for f in row]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_bad_input_raises_on_every_rank():
    from conftest import pool_for

    assert pool_for(2).run(run_bad_inputs) == [[None], [None]]


# DeepSeek-V3.2 and GLM-5 (its second layer reusing the first's indices), tiny: MLA with
# Dv != D, 2 indexer heads (ties), top-5 of 37 tokens; settings for the parity runner.
_DSA = dict(num_hidden_layers=2, num_key_value_heads=4, head_dim=8, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, index_n_heads=2, index_head_dim=16,
            index_topk=5, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1,
            topk_group=1, first_k_dense_replace=1)  # fmt: skip
DSA_FAMILIES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", _DSA),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(_DSA, indexer_types=["full", "shared"])),
}


def _model_case(family: str, mode: str, layout: str, batch: str, **extra) -> dict:
    return dict(id=f"{family}-{mode}-{layout}-{batch}", mode=mode, layout=layout, batch=batch, family=family,
                family_spec=DSA_FAMILIES[family], **extra)  # fmt: skip


def _tiny(config_class: str, model_class: str, **settings):
    import transformers

    sizes = dict(vocab_size=96, pad_token_id=0, hidden_size=32, intermediate_size=32, num_attention_heads=2)
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**sizes, **settings}))


@on_every_rank
def run_tensor_parallel_refusal():
    from torch.distributed.device_mesh import init_device_mesh

    import seqpar_kernels.integrations.transformers as sp_transformers

    _, world = rank_and_world()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("cp", "tp"))
    model = _tiny(*DSA_FAMILIES["deepseek_v32"][:2], **dict(_DSA, num_key_value_heads=2))
    return [raises(lambda: sp_transformers.apply(model, "ring", mesh=mesh, sequence_dims="cp", tensor_dims="tp"),
                   r"indexed \(DSA\) attention runs without tensor_dims.*tensor size 2")]  # fmt: skip


def test_what_dsa_layers_cannot_run_raises():
    """In one process: packed position ids without shard_batch's batch, and a KV cache,
    raise in the forward; DeepSeek-V4 and GLM-5-next at apply, naming what is missing."""
    modeling_glm5_next = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

    import seqpar_kernels.integrations.transformers as sp_transformers

    model = _tiny(*DSA_FAMILIES["deepseek_v32"][:2], **dict(_DSA, num_key_value_heads=2))
    sp_transformers.apply(model, "ring")
    ids = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="not every rank's global positions"):
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]), use_cache=False)
    with pytest.raises(ValueError, match="KV cache"):
        model(input_ids=ids, position_ids=torch.arange(9)[None], use_cache=True)

    v4 = _tiny("DeepseekV4Config", "DeepseekV4ForCausalLM", num_hidden_layers=2, num_key_value_heads=1, head_dim=16,
               q_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)  # fmt: skip
    with pytest.raises(ValueError, match="deepseek_v4.*no sequence-parallel compressor"):
        sp_transformers.apply(v4, "ring")
    config = modeling_glm5_next.Glm5NextTextConfig(
        vocab_size=96, pad_token_id=0, hidden_size=32, intermediate_size=32, num_attention_heads=2,
        num_hidden_layers=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=16, v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        index_head_dim=16, index_n_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="glm5_next.*pooled key blocks"):
        sp_transformers.apply(modeling_glm5_next.Glm5NextTextModel(config), "ring")


def test_dsa_models_match_transformers():
    """Loss and every gradient (fp32) of DeepSeek-V3.2 and GLM-5 through apply +
    shard_batch + causal_lm_loss on 2 and 3 ranks, and USP on a 2 x 2 grid, against
    transformers' model in one process (eager); Ulysses, ring and USP, contiguous and
    balanced, dense and packed. USP's grid group from two groups (a (ring, ulysses)
    mesh) and from a mesh's flattened sequence dims (ordered (ulysses, ring): the
    group's rank order is not the piece order, and 38 tokens give the swapped pieces
    different lengths)."""
    from conftest import pool_for

    pytest.importorskip("transformers.models.glm_moe_dsa")
    from test_transformers_integration import run_parity_cases

    cases = {2: [_model_case("deepseek_v32", "ulysses", "contiguous", "dense"),
                 _model_case("glm_moe_dsa", "ring", "balanced", "packed")],
             3: [_model_case("deepseek_v32", "ring", "balanced", "packed"),
                 _model_case("glm_moe_dsa", "ulysses", "contiguous", "dense")],
             4: [_model_case("deepseek_v32", "usp", "balanced", "packed", ulysses=2),
                 _model_case("glm_moe_dsa", "usp", "contiguous", "dense", ulysses=2,
                             sequence_dims=("ulysses", "ring"), seqlen=38)]}  # fmt: skip
    failures = [failure for world, runs in cases.items() for row in pool_for(world).run(run_parity_cases, runs)
                for failure in row]  # fmt: skip
    failures += [failure for row in pool_for(2).run(run_tensor_parallel_refusal) for failure in row if failure]
    assert not failures, "\n".join(failures)
