"""Pipeline parallelism around sequence parallelism on one DeviceMesh: a (pp 2, cp 2)
mesh of 4 gloo ranks, a tiny Llama of 3 decoder layers cut into stages of 2 and 1,
trained three SGD steps by GPipe or 1F1B over packed micro-batches whose real tokens
differ, against one process on every micro-batch: the loss of every step and every
parameter after the steps, fp32. Under the slow marker, 8 ranks: pipeline 2 x tensor 2
x sequence 2 and data 2 x pipeline 2 x sequence 2. And what cannot work raises on every
rank: tied embeddings across stages, a reduction over the pipeline dim (gradients and
the loss), a pipeline dim the mesh lacks, FSDP2 around the stage.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from on_ranks import raises  # noqa: E402
from test_mesh import FP32_LOSS_RTOL, FP32_UPDATE_RTOL, LR, STEPS, _mesh, _packed  # noqa: E402
from test_transformers_integration import VOCAB, _config, _model, _relative_error  # noqa: E402

LAYERS = 3
# Each micro-batch: packed documents of 24 tokens, the first `prompt` tokens' labels -100
# (a prompt): 20, 8, 18 and 14 real targets, so that a mean of the micro-batches' means
# weighs their tokens up to 20/8 times differently from the global mean. Every one
# shards to 12 + 12 tokens in the balanced layout too (the stages' buffers have one shape).
MICRO_BATCHES = (([6, 1, 11, 6], 0), ([14, 10], 16), ([8, 8, 8], 4), ([24], 10))
# Data 2: the second replica's micro-batches (other documents; 21, 12, 23 and 6 real targets).
SECOND_REPLICA = (([12, 12], 2), ([4, 20], 12), ([24], 0), ([5, 5, 14], 18))


def _micro_batches(specs, seed):
    batches = []
    for index, (lengths, prompt) in enumerate(specs):
        batch = _packed(lengths, seed=seed + index)
        batch["labels"][:, :prompt] = -100
        batches.append(batch)
    return batches


def _reference_loss(model, batches):
    """The one-process loss of every micro-batch together: the mean over all their real
    targets (each micro-batch's mean weighted by its target count)."""
    counts = [(batch["labels"][0, 1:] != -100).sum() for batch in batches]
    return sum(model(**batch).loss * count for batch, count in zip(batches, counts)) / sum(counts)


def run_pipeline_case(case):
    """Three SGD steps through the pipeline as `case` says, against one process:
    failures (empty when every step's loss and every parameter's update match)."""
    from torch.distributed.tensor import DTensor

    import seqpar_kernels.integrations.transformers as sp_transformers

    mesh = _mesh(*case["mesh"])
    data_dims, tensor_dims = case.get("data_dims", ()), case.get("tensor_dims", ())
    dims = dict(mesh=mesh, sequence_dims="cp", data_dims=data_dims)
    reference = _model(_config(layers=LAYERS, **case.get("heads", {})))
    model = copy.deepcopy(reference)
    initial = {name: parameter.detach().clone() for name, parameter in reference.named_parameters()}
    sp = sp_transformers.apply(model, case["mode"], layout=case["layout"], tensor_dims=tensor_dims, **dims)
    count = case.get("microbatches", 4)
    pipe = sp_transformers.pipeline(model, pipeline_dim="pp", schedule=case["schedule"], microbatches=count)
    replicas = [_micro_batches(MICRO_BATCHES[:count], seed=1), _micro_batches(SECOND_REPLICA[:count], seed=11)]
    replicas = replicas[: sp.data_size]
    everything = [batch for replica in replicas for batch in replica]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (reference, pipe.module)]
    failures = []
    for step in range(STEPS):
        expected = _reference_loss(reference, everything)
        expected.backward()
        loss = pipe.step(replicas[sp.data_rank])
        sp_transformers.all_reduce_gradients(pipe.module, **dims)
        if pipe.is_last:
            error = _relative_error(loss, expected.detach())
            if not error <= FP32_LOSS_RTOL:
                failures.append(f"step {step}: loss {loss.item():.7f} vs {expected.item():.7f} (rel {error:.2e})")
        elif loss is not None:
            failures.append(f"stage {pipe.stage} of {pipe.stages} returned a loss")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    theirs = dict(reference.named_parameters())
    for name, ours in pipe.module.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:  # the stage's layer i is the model's layers[i]
            parts[2] = str(pipe.layers[int(parts[2])])
        name = ".".join(parts)
        ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
        error = _relative_error(ours.detach() - initial[name], theirs[name].detach() - initial[name])
        if not error <= FP32_UPDATE_RTOL:
            failures.append(f"{name}: update after {STEPS} steps, relative error {error:.2e}")
    return failures


PIPELINE_SEQUENCE = ((2, 2), ("pp", "cp"))
PIPELINE_CASES = [
    dict(mode="ring", layout="balanced", schedule="GPipe", microbatches=2, mesh=PIPELINE_SEQUENCE),
    dict(mode="ulysses", layout="contiguous", schedule="1F1B", microbatches=4, mesh=PIPELINE_SEQUENCE),
]


def _case_id(case) -> str:
    return "-".join([case["mode"], case["layout"], case["schedule"], f"{case['microbatches']}mb",
                     "x".join(case["mesh"][1])])  # fmt: skip


def _run(case):
    ranks = pool_for(math.prod(case["mesh"][0])).run(run_pipeline_case, case)
    failures = [failure for per_rank in ranks for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_micro_batch_means_would_differ():
    """The micro-batches' real tokens differ enough that the LM head's gradient of a mean
    of their means misses the global mean's by far more than the tolerance (their
    losses, near log(vocab) for every token at the start, differ less)."""
    reference = _model(_config(layers=LAYERS))
    batches = _micro_batches(MICRO_BATCHES, seed=1)
    global_mean = _reference_loss(reference, batches)
    (expected,) = torch.autograd.grad(global_mean, reference.lm_head.weight)
    mean_of_means = sum(reference(**batch).loss for batch in batches) / len(batches)
    (head,) = torch.autograd.grad(mean_of_means, reference.lm_head.weight)
    assert _relative_error(head, expected) > 100 * FP32_UPDATE_RTOL


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=_case_id)
def test_pipeline_times_sequence_matches_one_process(case):
    _run(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        # Each tensor rank's 4 of 8 heads (1 of 2 kv heads), split 2 and 2 by Ulysses.
        dict(mode="ulysses", layout="contiguous", schedule="1F1B", microbatches=2, tensor_dims="tp",
             heads=dict(heads=8, kv_heads=2, head_dim=8), mesh=((2, 2, 2), ("pp", "tp", "cp"))),
        # Two replicas, each its own pipeline, their micro-batches' tokens counted together.
        dict(mode="ring", layout="balanced", schedule="GPipe", microbatches=4, data_dims="dp",
             mesh=((2, 2, 2), ("dp", "pp", "cp"))),
    ],
    ids=_case_id,
)  # fmt: skip
def test_pipeline_with_tensor_or_data_parallelism_on_8_ranks(case):
    _run(case)


def run_refusals():
    """What a (pp 2, cp 2) mesh's pipeline cannot do, each call on every rank: None where
    it raised the expected ValueError, else what happened."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    mesh = _mesh(*PIPELINE_SEQUENCE)
    dims = dict(mesh=mesh, sequence_dims="cp")

    def set_up(**config):
        model = _model(_config(layers=LAYERS, **config))
        sp_transformers.apply(model, "ring", layout="balanced", **dims)
        return model

    def fully_sharded(model):  # FSDP2 over the sequence ranks, layer by layer, as torchtitan wraps
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["cp"])
        return model

    def fully_sharded_pipeline(model):
        from torch.distributed.fsdp import fully_shard

        stage = sp_transformers.pipeline(model, pipeline_dim="pp", schedule="GPipe", microbatches=2)
        fully_shard(fully_sharded(stage.module), mesh=mesh["cp"])
        return stage

    pipe = sp_transformers.pipeline(set_up(), pipeline_dim="pp", schedule="GPipe", microbatches=2)
    hidden, labels = torch.randn(1, 12, 64), torch.randint(0, VOCAB, (1, 12))
    stage = r"held by one pipeline stage of mesh dim 'pp' \(2 stages"
    calls = {
        "tied embeddings": (
            lambda: sp_transformers.pipeline(set_up(tie_word_embeddings=True), pipeline_dim="pp", microbatches=2),
            r"ties its LM head to its input embeddings .* stages 0 and 1 of 'pp'",
        ),
        "a pipeline dim the mesh lacks": (
            lambda: sp_transformers.pipeline(set_up(), pipeline_dim="stage", microbatches=2),
            r"no dim pipeline_dim='stage' \(mesh \(2, 2\) with dims \('pp', 'cp'\)\)",
        ),
        "the sequence dim as the pipeline's": (
            lambda: sp_transformers.pipeline(set_up(), pipeline_dim="cp", microbatches=2),
            r"pipeline_dim='cp' is apply\(\)'s sequence_dims=\('cp',\)",
        ),
        "a model apply() did not set up on a mesh": (
            lambda: sp_transformers.pipeline(_model(_config(layers=LAYERS)), pipeline_dim="pp", microbatches=2),
            r"LlamaForCausalLM was not set up by apply\(model, mode, mesh=\.\.\., sequence_dims=\.\.\.\)",
        ),
        "1F1B with fewer micro-batches than stages": (
            lambda: sp_transformers.pipeline(set_up(), pipeline_dim="pp", schedule="1F1B", microbatches=1),
            r"microbatches=1 must be at least 1 \(1F1B: at least the 2 stages of 'pp'\)",
        ),
        "a wrong count of micro-batches": (
            lambda: pipe.step(_micro_batches(MICRO_BATCHES[:3], seed=0)),
            r"takes a list of microbatches=2 batches, got 3",
        ),
        "gradients over the pipeline dim": (
            lambda: sp_transformers.all_reduce_gradients(pipe.module, data_dims="pp", **dims),
            stage + r".*data_dims='pp'",
        ),
        "gradients over the world": (lambda: sp_transformers.all_reduce_gradients(pipe.module), stage),
        "the loss over the pipeline dim": (
            lambda: sp_transformers.causal_lm_loss(pipe.module, hidden, labels, data_dims="pp", **dims),
            stage + r".*data_dims='pp'",
        ),
        "FSDP2 before pipeline()": (
            lambda: sp_transformers.pipeline(fully_sharded(set_up()), pipeline_dim="pp", microbatches=2),
            r"FSDP2 \(fully_shard\) wraps \['model.layers.0', 'model.layers.1', 'model.layers.2'\] of the pipeline",
        ),
        "FSDP2 after pipeline()": (  # every rank's message from the first failing one: its stage's layer
            lambda: fully_sharded_pipeline(set_up()).step(_micro_batches(MICRO_BATCHES[:2], seed=0)),
            r"FSDP2 \(fully_shard\) wraps \['the model itself', 'model.layers.0'",
        ),
        "micro-batches of other local shapes": (
            lambda: pipe.step(_micro_batches([([24], 0), ([3, 21], 0)], seed=0)),
            r"local input_ids of shapes \[\(1, 12\), \(1, 1[13]\)\]",
        ),
    }
    return {what: raises(call, match) for what, (call, match) in calls.items()}


def test_refusals_raise_on_every_rank():
    for per_rank in pool_for(4).run(run_refusals):
        assert all(result is None for result in per_rank.values()), per_rank
