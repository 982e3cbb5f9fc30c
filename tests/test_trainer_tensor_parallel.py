"""SequenceParallelTrainer with tensor parallelism on its mesh: tensor 2 x sequence 2 on 4
gloo ranks (the tiny Llama's 4 heads and 2 kv heads: 2 and 1 per tensor rank), asked for
by tensor_parallel_size=2 (Ulysses, the mixin averaging the gradients over the sequence
ranks itself) and by accelerate's ParallelismConfig(tp_size=2, cp_size=2) with FSDP2
over the sequence ranks on the tensor-parallel parameters (the ring, balanced), against
the plain Trainer in one process on the same batches: every step's loss and grad_norm,
eval_loss, train_loss and every parameter after 3 SGD steps of 2 micro-batches, fp32
(tolerances: test_transformers_trainer's). And a tensor degree the heads cannot take
raises on every rank, naming the numbers.
"""

from __future__ import annotations

import tempfile

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import pool_for  # noqa: E402
from on_ranks import raises  # noqa: E402
from test_transformers_trainer import (  # noqa: E402
    _arguments,
    _as_torchrun_started,
    _case,
    _collator,
    _dataset,
    _differences,
    _model,
    _reference,
)

pytestmark = pytest.mark.skipif(
    transformers.__version__.startswith("4."),
    reason="tensor parallelism in the Trainer needs transformers 5's Trainer, which takes a model sharded before it",
)

ACCUMULATE = dict(max_steps=3, gradient_accumulation_steps=2)
ULYSSES = _case("ulysses", "contiguous", args=ACCUMULATE)
# The same training from the reference's view (it drops the mode, the layout and fsdp).
RING_FSDP2 = _case("ring", "balanced", args=dict(ACCUMULATE, fsdp=True, fsdp_config={"version": 2}))


def _trainer(case: dict, directory: str, **options):
    """The case's SequenceParallelTrainer on this rank, with `options` (the Trainer's
    tensor_parallel_size, sequence_parallel_size, or parallelism_config for its
    TrainingArguments)."""
    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    config = options.pop("parallelism_config", None)
    args = _arguments(directory, 2, parallelism_config=config, **case["args"])
    return SequenceParallelTrainer(model=_model(), args=args, train_dataset=_dataset(),
                                   eval_dataset=_dataset(6, seed=2), data_collator=_collator(case["collator"]),
                                   mode=case["mode"], layout=case["layout"], **options)  # fmt: skip


def _trained(case: dict, **options) -> dict:
    """The run on this rank: its log, evaluation, the full parameters (rank 0), its data
    index, its mesh's dims, and its q_proj's local and full rows."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    with tempfile.TemporaryDirectory() as directory:
        trainer = _trainer(case, directory, **options)
        trainer.train()
        metrics = trainer.evaluate()
    weights = {name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
               for name, tensor in trainer.model.state_dict().items()}  # fmt: skip
    q_proj = trainer.model.model.layers[0].self_attn.q_proj.weight
    sp = trainer.sequence_parallel
    return {"log": trainer.state.log_history, "eval": metrics, "weights": weights if dist.get_rank() == 0 else None,
            "data_rank": sp.data_rank, "dims": sp.mesh_dims.mesh.mesh_dim_names, "piece": sp.piece,
            "q_rows": (q_proj.to_local().shape[0], q_proj.shape[0])}  # fmt: skip


def run_tensor_parallel_trainers() -> dict:
    """On every rank: the tensor_parallel_size run, the ParallelismConfig + FSDP2 run, and
    what raises."""
    from accelerate.parallelism_config import ParallelismConfig

    _as_torchrun_started()
    results = {
        "tensor_parallel_size": _trained(ULYSSES, tensor_parallel_size=2),
        "parallelism_config": _trained(RING_FSDP2, parallelism_config=ParallelismConfig(tp_size=2, cp_size=2)),
    }
    with tempfile.TemporaryDirectory() as directory:
        # 4 tensor ranks over the 2 kv heads: a rank would hold half a kv head.
        results["refused"] = raises(
            lambda: _trainer(ULYSSES, directory, tensor_parallel_size=4),
            r"tensor parallelism over 4 ranks .* the model has 4 and 2",
        )
    return results


def test_tensor_times_sequence_matches_the_plain_trainer():
    per_rank = pool_for(4).run(run_tensor_parallel_trainers)
    reference = _reference(ULYSSES)
    assert _reference(RING_FSDP2) is reference  # one reference: the same training
    # q_proj's 64 rows (4 heads): 32 on each tensor rank, FSDP2 halving them over the 2 sequence ranks.
    for kind, rows in (("tensor_parallel_size", 32), ("parallelism_config", 16)):
        problems = _differences(per_rank[0][kind], reference)
        assert not problems, (kind, problems)
        # Ranks (piece 0, tp 0), (0, 1), (1, 0), (1, 1): one replica.
        assert per_rank[0][kind]["dims"] == ("dp_replicate", "dp_shard", "sequence", "tp"), kind
        assert [result[kind]["piece"] for result in per_rank] == [0, 0, 1, 1], kind
        assert all(result[kind]["data_rank"] == 0 and result[kind]["q_rows"] == (rows, 64) for result in per_rank), kind
    for rank, result in enumerate(per_rank):
        assert result["refused"] is None, (rank, result["refused"])
