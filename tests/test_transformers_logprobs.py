"""causal_lm_logprobs (sequence_parallel_logprobs under the model's own head) against the
single-process model's full logits: log_softmax(logits / temperature)[label] and the
entropy per token, their per-sequence (per-document) sums, and the gradients of a loss
built from both, in every mode and layout, dense, padded and packed batches, on 1 to 4
gloo ranks; a softcapped tied head (Gemma 2) and a scaled one (Cohere 2)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises  # noqa: E402
from test_transformers_integration import (  # noqa: E402
    _batch,
    _config,
    _family_model,
    _model,
    _parallelism,
    _relative_error,
)

FP32_VALUE_RTOL = 1e-5
FP32_GRAD_RTOL = 1e-4


def _reference(model, batch, temperature):
    """(log-probs, entropies) (B, S) of the full batch in one process from the model's own
    logits, 0 where the shifted label is -100; and the shifted labels."""
    labels = batch["labels"]
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
    positions = batch.get("position_ids")
    if positions is not None:  # the last token of a packed document predicts nothing
        starts = torch.nonzero(positions[0] == 0).flatten()
        shifted[0, starts[1:] - 1] = -100
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=positions).logits.float() / temperature  # fmt: skip
    log_softmax = logits.log_softmax(-1)
    valid = shifted != -100
    log_probs = log_softmax.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.where(valid, log_probs, 0.0), torch.where(valid, entropy, 0.0), shifted


def _documents(batch) -> torch.Tensor:
    """Each token's sequence: its row, or its packed document (1, S)."""
    positions = batch.get("position_ids")
    if positions is None:
        rows, length = batch["input_ids"].shape
        return torch.arange(rows).unsqueeze(1).expand(rows, length)
    return (positions == 0).long().cumsum(1) - 1


@on_every_rank
def run_logprob_cases(cases):
    import seqpar_kernels.integrations.transformers as sp_transformers

    failures = []
    for case in cases:
        groups = _parallelism(case["mode"], case.get("ulysses", 2))
        batch, _, _ = _batch(case["batch"], case.get("seqlen", 29))
        reference = _family_model(case["family"]) if "family" in case else _model(_config(), torch.float32)
        model = copy.deepcopy(reference)
        sp_transformers.apply(model, case["mode"], layout=case["layout"], **groups)
        temperature, per_sequence = case.get("temperature", 1.0), case.get("per_sequence", False)

        expected_lp, expected_h, _ = _reference(reference, batch, temperature)
        generator = torch.Generator().manual_seed(3)
        documents = _documents(batch)
        if per_sequence:  # the loss weighs each sequence's sums
            count = int(documents.max()) + 1
            weights = torch.randn(2, count, generator=generator)
            expected = [torch.zeros(count).index_add(0, documents.reshape(-1), value.reshape(-1))
                        for value in (expected_lp, expected_h)]  # fmt: skip
        else:  # the loss weighs each token's values
            weights = torch.randn(2, *expected_lp.shape, generator=generator)
            expected = [expected_lp, expected_h]
        ((weights[0] * expected[0]).sum() + (weights[1] * expected[1]).sum()).backward()

        local = sp_transformers.shard_batch(batch, mode=case["mode"], layout=case["layout"], **groups)
        hidden = model.model(**local).last_hidden_state
        shard = local["sequence_shard"]
        log_probs, entropy = sp_transformers.causal_lm_logprobs(
            model, hidden, local["shift_labels"], temperature=temperature, return_entropy=True,
            per_sequence=per_sequence, sequence_shard=shard, **groups,
        )  # fmt: skip
        if per_sequence:
            mine = [log_probs, entropy]
            local_weights = weights
        else:  # every rank's values in sequence order, to compare with the reference's
            full = shard.varlen.total if shard.varlen is not None else batch["input_ids"].shape[1]
            gather = (lambda x: shard.varlen.gather(x, 1)) if shard.varlen is not None else \
                (lambda x: shard.parallelism.gather(x, 1, full))  # fmt: skip
            take = (lambda x: shard.varlen.split(x, 1)) if shard.varlen is not None else \
                (lambda x: shard.parallelism.take(x, 1))  # fmt: skip
            mine = [gather(log_probs.detach()), gather(entropy.detach())]
            local_weights = torch.stack([take(weights[0]), take(weights[1])])
        ((local_weights[0] * log_probs).sum() + (local_weights[1] * entropy).sum()).backward()
        sp_transformers.all_reduce_gradients(model, **groups)

        for what, ours, theirs in zip(("log-probs", "entropy"), mine, expected):
            error = _relative_error(ours, theirs.detach())
            if not error <= FP32_VALUE_RTOL:
                failures.append(f"{case['id']}: {what} relative error {error:.2e}")
        for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
            error = _relative_error(ours.grad, theirs.grad)
            if not error <= FP32_GRAD_RTOL:
                failures.append(f"{case['id']}: grad of {name} relative error {error:.2e}")
    return failures


def _case(mode, layout, batch, **extra):
    return dict(id="-".join([mode, layout, batch, *(f"{k}={v}" for k, v in extra.items())]), mode=mode,
                layout=layout, batch=batch, **extra)  # fmt: skip


CASES = [
    _case("ulysses", "contiguous", "dense"),
    _case("ring", "balanced", "padded", temperature=0.7),
    _case("ring", "balanced", "packed", per_sequence=True),
    _case("ring", "contiguous", "dense", per_sequence=True),
    _case("ulysses", "contiguous", "packed", family="gemma2", temperature=1.3),
    _case("ring", "balanced", "dense", family="cohere2", per_sequence=True),
]


# Each world size its share of the cases (every case runs at 2 ranks), to keep the time low.
CASES_BY_WORLD = {
    1: [CASES[0], CASES[4]],
    2: CASES,
    3: CASES[1:3] + CASES[5:],
    4: [CASES[2], _case("usp", "balanced", "packed", per_sequence=True),
        _case("usp", "contiguous", "padded", family="gemma2")],
}  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_logprobs_match_the_full_logits(world_size):
    cases = CASES_BY_WORLD[world_size]
    failures = [failure for per_rank in pool_for(world_size).run(run_logprob_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


@on_every_rank
def run_bad_inputs():
    import seqpar_kernels.integrations.transformers as sp_transformers

    model = _model(_config(), torch.float32)
    rank = torch.distributed.get_rank()
    hidden = torch.randn(2, 5, model.config.hidden_size)
    labels = torch.randint(0, 96, (2, 5))
    bad_labels = labels.clone()
    if rank == 1:
        bad_labels[0, 0] = 1000
    return [
        raises(lambda: sp_transformers.causal_lm_logprobs(model, hidden, bad_labels), r"outside \[0, 96\)"),
        raises(lambda: sp_transformers.causal_lm_logprobs(model, hidden, labels, temperature=0.0), "temperature"),
        raises(lambda: sp_transformers.causal_lm_logprobs(model, hidden[0], labels[0], per_sequence=True),
               "per_sequence"),
    ]  # fmt: skip


def test_bad_inputs_raise_on_every_rank():
    problems = [problem for per_rank in pool_for(2).run(run_bad_inputs) for problem in per_rank if problem]
    assert not problems, problems
