"""Mixture-of-experts models trained with their router load-balancing loss
(output_router_logits=True, router_aux_loss_coef 0.5) under sequence parallelism, against
one process: SequenceParallelTrainer against the plain Trainer (every logged loss and
grad_norm, eval_loss, the weights after 3 SGD steps; tests/test_transformers_trainer.py's
comparison and tolerances), and a training loop of one's own (causal_lm_loss +
router_aux_loss) against the model's own loss.

The router loss is a product of two means over the tokens: a rank's own value is not
its share, so these fail by about the loss's size (0.5 x ~2) where it is dropped or
computed per rank. The models: tests/test_transformers_trainer.py's moe_model (Qwen3-MoE,
Mixtral, OLMoE; 4 experts, top 2), fp32. The Trainer's cases run in one call of the
4-rank pool (ring balanced and USP on one group of 4; 2 replicas of a Ulysses pair with
gradient accumulation and a last batch the data does not fill; padded and packed
batches), their references in one call of the 1-rank pool.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import pool_for  # noqa: E402
from test_transformers_trainer import (  # noqa: E402
    LOSS_RTOL,
    SEQUENCE_PARALLEL_KEYS,
    VOCAB,
    WEIGHT_RTOL,
    _as_torchrun_started,
    _case,
    _dataset,
    _differences,
    moe_model,
    pad_right,
    run_training,
)

STEPS3 = dict(max_steps=3)
CASES = {
    "mixtral-ring-balanced-padded": _case("ring", "balanced", model="mixtral", args=STEPS3),
    "olmoe-usp-balanced-packed": _case("usp", "balanced", "packed", model="olmoe", args=STEPS3),
    # 23 samples in global micro-batches of 4: the last one tops up both replicas' (ignored),
    # 5 evaluation samples, the same.
    "qwen3_moe-2-replicas-ulysses-accumulate-uneven": _case(
        "ulysses", "contiguous", model="qwen3_moe", replicas=2, samples=23, eval_samples=5,
        args=dict(num_train_epochs=1, gradient_accumulation_steps=2)),
}  # fmt: skip
LEARNING_RATE = 0.5


def run_trainings(cases: list[dict]) -> list[dict]:
    return [run_training(case) for case in cases]


def run_own_loop(kind: str) -> list[str]:
    """3 SGD steps of a loop of one's own (apply, shard_batch, causal_lm_loss +
    router_aux_loss, all_reduce_gradients; ring, balanced, over the world) on a
    right-padded batch, against the same steps of the model's own loss on the full
    batch in this process: what differs, by step."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    model = moe_model(kind, VOCAB)
    reference = copy.deepcopy(model)
    sp_transformers.apply(model, "ring", layout="balanced")
    batch = pad_right(_dataset(3))
    problems = []
    for step in range(3):
        expected = reference(**batch).loss
        expected.backward()
        local = sp_transformers.shard_batch(batch, mode="ring", layout="balanced")
        shift_labels = local.pop("shift_labels")
        outputs = model.model(**local, output_router_logits=True)
        loss = sp_transformers.causal_lm_loss(model, outputs.last_hidden_state, shift_labels)
        loss = loss + sp_transformers.router_aux_loss(model, outputs, attention_mask=batch["attention_mask"],
                                                      sequence_shard=local["sequence_shard"])  # fmt: skip
        loss.backward()
        sp_transformers.all_reduce_gradients(model)
        if not abs(loss.item() - expected.item()) <= LOSS_RTOL * abs(expected.item()):
            problems.append(f"step {step} loss {loss.item():.7f} vs {expected.item():.7f}")
        with torch.no_grad():
            for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
                error = ((mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max().clamp_min(1e-30)).item()
                if not error <= WEIGHT_RTOL:
                    problems.append(f"step {step} gradient of {name}: relative error {error:.1e}")
                for parameter in (mine, theirs):
                    parameter -= LEARNING_RATE * parameter.grad
                    parameter.grad = None
    return problems


def run_moe(cases: list[dict]) -> dict:
    _as_torchrun_started()
    return {"trainings": run_trainings(cases), "own loop": run_own_loop("mixtral")}


def test_router_loss_matches_one_process():
    cases = list(CASES.values())
    results = pool_for(4).run(run_moe, cases)
    plain = [{key: value for key, value in case.items() if key not in SEQUENCE_PARALLEL_KEYS} for case in cases]
    [references] = pool_for(1).run(run_trainings, plain)
    problems = [f"own loop, rank {rank}: {problem}" for rank, result in enumerate(results)
                for problem in result["own loop"]]  # fmt: skip
    for index, (name, reference) in enumerate(zip(CASES, references)):
        problems += [f"{name}: {problem}" for problem in _differences(results[0]["trainings"][index], reference)]
        logged = [[entry.get("loss") for entry in result["trainings"][index]["log"]] for result in results]
        problems += [f"{name}: rank {rank} logged other losses" for rank in range(1, 4) if logged[rank] != logged[0]]
    assert not problems, "\n".join(problems)


def test_a_router_loss_it_cannot_compute_raises():
    """Doge (product-key routing, a load-balancing formula of its own) with
    output_router_logits=True: apply() (and so the Trainer) raises naming the option,
    and router_aux_loss on it too; without the option it applies."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import seqpar_kernels.integrations.transformers as sp_transformers

    config = AutoConfig.for_model("doge", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, is_moe=True, num_experts=4,
                                  num_experts_per_tok=2, output_router_logits=True)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="output_router_logits"):
        sp_transformers.apply(model, "ring")
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        sp_transformers.router_aux_loss(model, (torch.zeros(4, 4),))
    config.output_router_logits = False
    sp_transformers.apply(AutoModelForCausalLM.from_config(config), "ring")
