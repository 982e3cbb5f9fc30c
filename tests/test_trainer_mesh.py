"""SequenceParallelTrainer building one DeviceMesh from its arguments: data 2 x sequence 2
on 4 gloo ranks with FSDP2 (the mixin's own fully_shard over data x sequence), asked for
by TrainingArguments(fsdp=True) and by accelerate's ParallelismConfig(dp_shard_size=2,
cp_size=2), and HSDP from ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
against the plain Trainer in one process on the global batch: every step's loss and
grad_norm, eval_loss, train_loss and every parameter after 3 (HSDP: 2) SGD steps of 2
micro-batches each, fp32 (tolerances: test_transformers_trainer's). The padded batches
of sequences of 9 to 40 tokens give the replicas different numbers of real tokens.
And the combinations the Trainer cannot honour raise on every rank, naming the numbers.
"""

from __future__ import annotations

import tempfile

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import pool_for  # noqa: E402
from on_ranks import raises  # noqa: E402
from test_transformers_trainer import (  # noqa: E402
    LOSS_RTOL,
    _as_torchrun_started,
    _case,
    _differences,
    _reference,
    _trainer,
)

pytestmark = pytest.mark.skipif(
    transformers.__version__.startswith("4."),
    reason="FSDP2 over the mesh needs transformers 5's Trainer, which takes a model sharded before it",
)

FSDP2 = dict(fsdp=True, fsdp_config={"version": 2})
# Gradient accumulation: the Trainer defers FSDP2's reduce-scatter to the last micro-batch.
CASE = _case("ring", "balanced", replicas=2, args=dict(max_steps=3, gradient_accumulation_steps=2, **FSDP2))

HSDP_CASE = _case("ring", "balanced", replicas=4, args=dict(max_steps=2, gradient_accumulation_steps=2))


def _parallelism_config(**sizes):
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig(**sizes)


def _trained(case: dict, evaluate: bool = True, **overrides) -> dict:
    """The case's run on this rank: its log, evaluation, the full parameters (rank 0;
    gathered from FSDP2's shards on every rank), its data index, data and sequence sizes, and
    the meshes its parameters are sharded over."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    with tempfile.TemporaryDirectory() as directory:
        trainer = _trainer(case, directory, **overrides)
        trainer.train()
        metrics = trainer.evaluate() if evaluate else None
    weights = {name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
               for name, tensor in trainer.model.state_dict().items()}  # fmt: skip
    # The meshes the parameters are sharded over: FSDP2's (4,), HSDP's would be (2, 2).
    meshes = {tuple(p.device_mesh.shape) if isinstance(p, DTensor) else None for p in trainer.model.parameters()}
    sp = trainer.sequence_parallel
    return {"log": trainer.state.log_history, "eval": metrics, "weights": weights if dist.get_rank() == 0 else None,
            "data_rank": sp.data_rank, "meshes": meshes, "sizes": (sp.data_size, sp.pieces)}  # fmt: skip


def run_mesh_trainers() -> dict:
    """On every rank: the FSDP2 run, the ParallelismConfig run, an HSDP run, and what raises."""
    _as_torchrun_started()
    results = {"fsdp": _trained(CASE)}
    # The same mesh from ParallelismConfig: one step (its run is the fsdp run's).
    mapped = dict(CASE, args=dict(max_steps=1, gradient_accumulation_steps=2))
    results["parallelism_config"] = _trained(
        mapped, evaluate=False, parallelism_config=_parallelism_config(dp_shard_size=2, cp_size=2)
    )
    # HSDP: 2 whole copies (dp_replicate), each sharded over 2 ranks (dp_shard), 4 replicas.
    results["hsdp"] = _trained(
        HSDP_CASE, parallelism_config=_parallelism_config(dp_replicate_size=2, dp_shard_size=2, cp_size=1)
    )
    refused = {
        "product": (dict(dp_shard_size=4, cp_size=2), r"dp_replicate_size=1 x dp_shard_size=4 x cp_size=2 = 8 ranks, "
                    r"the world has 4"),
        "deepspeed sequence": (dict(dp_shard_size=2, sp_size=2), r"sp_size=2 asks for DeepSpeed's sequence"),
        "sequence twice": (dict(dp_shard_size=1, cp_size=4), r"sequence_parallel_size=2 and ParallelismConfig "
                           r"cp_size=4"),
    }  # fmt: skip
    problems = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, (sizes, match) in refused.items():
            config = _parallelism_config(**sizes)
            problems[name] = raises(lambda: _trainer(mapped, directory, parallelism_config=config), match)
    results["refused"] = {name: problem for name, problem in problems.items() if problem is not None}
    return results


def _step(result: dict, step: int) -> dict:
    return next(entry for entry in result["log"] if entry.get("step") == step and "grad_norm" in entry)


def test_fsdp2_over_data_and_sequence_matches_the_plain_trainer():
    per_rank = pool_for(4).run(run_mesh_trainers)
    problems = _differences(per_rank[0]["fsdp"], _reference(CASE))
    assert not problems, problems
    for kind in ("fsdp", "parallelism_config"):
        # Ranks 0, 1 read replica 0's batches, 2, 3 replica 1's; every rank holds shards over all 4.
        assert [result[kind]["data_rank"] for result in per_rank] == [0, 0, 1, 1], kind
        assert all(result[kind]["meshes"] == {(4,)} and result[kind]["sizes"] == (2, 2) for result in per_rank), kind
        losses = [[entry.get("loss") for entry in result[kind]["log"]] for result in per_rank]
        assert all(row == losses[0] for row in losses), (kind, losses)
    fsdp, mapped = per_rank[0]["fsdp"], per_rank[0]["parallelism_config"]
    for key in ("loss", "grad_norm"):
        expected = _step(fsdp, 1)[key]
        assert abs(_step(mapped, 1)[key] - expected) <= LOSS_RTOL * abs(expected), key
    problems = _differences(per_rank[0]["hsdp"], _reference(HSDP_CASE))
    assert not problems, ("hsdp", problems)
    assert [result["hsdp"]["data_rank"] for result in per_rank] == [0, 1, 2, 3]
    assert all(result["hsdp"]["meshes"] == {(2, 2)} for result in per_rank)
    for rank, result in enumerate(per_rank):
        assert not result["refused"], (rank, result["refused"])


def run_mesh_reuse() -> tuple[bool, bool]:
    """Whether a second Trainer mesh of the same degrees is the first, and one of others not."""
    from seqpar_kernels.integrations.transformers.trainer_mesh import DATA_DIMS, trainer_device_mesh

    names = (*DATA_DIMS, "sequence")
    first = trainer_device_mesh("cpu", (1, 2, 2), names)
    return trainer_device_mesh("cpu", (1, 2, 2), names) is first, trainer_device_mesh("cpu", (2, 1, 2), names) is first


def test_trainers_of_the_same_degrees_share_one_mesh():
    # Each new mesh's gloo groups would keep idle threads for the rest of the process.
    assert pool_for(4).run(run_mesh_reuse) == [(True, False)] * 4
