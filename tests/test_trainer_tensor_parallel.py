"""SequenceParallelTrainer with tensor parallelism on its mesh, on 4 gloo ranks (the tiny
Llama's 4 heads and 2 kv heads: 2 and 1 per tensor rank), against the plain Trainer in
one process on the same global batches: every step's loss and grad_norm, eval_loss,
train_loss and every parameter after 3 SGD steps of 2 micro-batches, fp32 (tolerances:
test_transformers_trainer's). The runs:
- tensor 2 x sequence 2 asked by tensor_parallel_size=2 (Ulysses, the mixin averaging
  the gradients over the sequence ranks itself), saving a checkpoint and the final
  model: each file holds the whole model, equal to the trained shards gathered;
- the same from accelerate's ParallelismConfig(tp_size=2, cp_size=2) with FSDP2 over
  the sequence ranks on the tensor-parallel parameters (the ring, balanced), saving too;
- with gradient checkpointing, tiled MLPs and offloaded activations;
- USP (tensor 2 x ring 2 x Ulysses 1) on packed documents;
- 2 data replicas x tensor 2 (sequence_parallel_size=1);
- a LoRA PeftModel (q_proj, v_proj column-wise, down_proj row-wise: the adapter's halves
  sharded with them) under FSDP2, against the plain Trainer on the same PeftModel, and
  the adapter its save_model writes.
And what cannot be honoured raises on every rank, naming why: a tensor degree the heads
cannot take, saving optimizer state, loading the best model at the end, saving on each
node, resuming from a checkpoint, DoRA and LoRA dropout on a column-wise layer.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import pool_for  # noqa: E402
from on_ranks import raises  # noqa: E402
from test_transformers_trainer import (  # noqa: E402
    SEQUENCE_PARALLEL_KEYS,
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
MEMORY = _case("ulysses", "contiguous", tiled_mlp=16, offload_activations=True,
               args=dict(ACCUMULATE, gradient_checkpointing=True))  # fmt: skip
USP = _case("usp", "balanced", "packed", args=ACCUMULATE)
REPLICAS = _case("ulysses", "contiguous", replicas=2, args=ACCUMULATE)
# Saved at the last step (a checkpoint holding the model only) and by save_model after training.
SAVE = dict(save_strategy="steps", save_steps=3, save_only_model=True)


# The adapter weights the LoRA run freezes (as LoRA-FA trains B alone): saved all the same.
FROZEN_ADAPTER = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.default.weight"


def _lora_model(dropout: float = 0.0, dora: bool = False):
    """The tiny Llama with LoRA on q_proj, v_proj (column-wise under tensor parallelism)
    and down_proj (row-wise); B random too, so every adapter weight moves from step 1,
    but FROZEN_ADAPTER, which stays."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        lora_dropout=dropout, use_dora=dora)  # fmt: skip
    torch.manual_seed(1)
    model = get_peft_model(_model(), config)
    model.get_parameter(FROZEN_ADAPTER).requires_grad_(False)
    return model


def _trainer(case: dict, directory: str, model=None, plain: bool = False, **options):
    """The case's SequenceParallelTrainer on this rank (or, plain, the Trainer in one
    process), with `options`: the Trainer's tensor_parallel_size, sequence_parallel_size,
    parallelism_config or TrainingArguments' overrides (args=)."""
    from transformers import Trainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    config = options.pop("parallelism_config", None)
    settings = {**case["args"], **options.pop("args", {})}
    if plain:
        settings = {key: value for key, value in settings.items() if key not in ("fsdp", "fsdp_config")}
    args = _arguments(directory, 2, parallelism_config=config, **settings)
    common = dict(model=_model() if model is None else model, args=args, train_dataset=_dataset(),
                  eval_dataset=_dataset(6, seed=2), data_collator=_collator(case["collator"]))  # fmt: skip
    if plain:
        return Trainer(**common)
    sequence_parallel = {key: case[key] for key in SEQUENCE_PARALLEL_KEYS if key in case}
    return SequenceParallelTrainer(**common, **sequence_parallel, **options)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _saved_files(directory: str) -> dict:
    """The tensors of every safetensors file under directory, by its relative path."""
    from safetensors.torch import load_file

    return {os.path.relpath(os.path.join(root, name), directory): load_file(os.path.join(root, name))
            for root, _, names in os.walk(directory) for name in names if name.endswith(".safetensors")}  # fmt: skip


def _trained(case: dict, save: bool = False, model=None, trainable_only: bool = False, **options) -> dict:
    """The run on this rank: its log, evaluation, the full parameters (rank 0; only the
    trainable ones for a PeftModel, on every rank), its data index, its mesh's dims, its q_proj's local
    and full rows, and (save) the safetensors files the run wrote (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    with tempfile.TemporaryDirectory() as directory:
        trainer = _trainer(case, directory, model=model, args=SAVE if save else {}, **options)
        trainer.train()
        metrics = trainer.evaluate()
        if save:
            trainer.save_model(os.path.join(directory, "final"))
        files = _saved_files(directory) if save and rank == 0 else None
    named = trainer.model.named_parameters() if trainable_only else trainer.model.state_dict().items()
    # Every rank gathers (collective); rank 0 keeps them.
    weights = {name: _whole(tensor) for name, tensor in named if not trainable_only or tensor.requires_grad}
    q_proj = trainer.model.get_decoder().layers[0].self_attn.q_proj
    q_proj = getattr(q_proj, "base_layer", q_proj).weight
    sp = trainer.sequence_parallel
    keep = rank == 0 or trainable_only  # a PeftModel's adapters: every rank's, compared
    return {"log": trainer.state.log_history, "eval": metrics, "weights": weights if keep else None,
            "data_rank": sp.data_rank, "dims": sp.mesh_dims.mesh.mesh_dim_names, "piece": sp.piece,
            "q_rows": (q_proj.to_local().shape[0] if isinstance(q_proj, DTensor) else None, q_proj.shape[0]),
            "files": files}  # fmt: skip


def run_lora_reference() -> dict:
    """The plain Trainer in one process on the LoRA PeftModel: the reference's result."""
    with tempfile.TemporaryDirectory() as directory:
        trainer = _trainer(RING_FSDP2, directory, model=_lora_model(), plain=True)
        trainer.train()
        metrics = trainer.evaluate()
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return {"log": trainer.state.log_history, "eval": metrics, "weights": weights}


def _refusals(directory: str) -> dict:
    """What raises at construction (or at train()), on every rank: None where it raised as expected."""
    refused = {
        # 4 tensor ranks over the 2 kv heads: a rank would hold half a kv head.
        "heads": (lambda: _trainer(ULYSSES, directory, tensor_parallel_size=4),
                  r"tensor parallelism over 4 ranks .* the model has 4 and 2"),
        "optimizer state": (lambda: _trainer(ULYSSES, directory, tensor_parallel_size=2,
                                             args=dict(save_strategy="steps")),
                            r"saves no optimizer state: pass save_only_model=True"),
        "best model": (lambda: _trainer(ULYSSES, directory, tensor_parallel_size=2,
                                        args=dict(SAVE, eval_strategy="steps", eval_steps=3,
                                                  load_best_model_at_end=True)),
                       r"load_best_model_at_end would load a whole checkpoint into a model sharded by tensor"),
        "each node": (lambda: _trainer(ULYSSES, directory, tensor_parallel_size=2,
                                       args=dict(SAVE, save_on_each_node=True)),
                      r"save_on_each_node: a model sharded by tensor parallelism is gathered whole on the first"),
        "resume": (lambda: _trainer(RING_FSDP2, directory, tensor_parallel_size=2,
                                    args=SAVE).train(resume_from_checkpoint=True),
                   r"resume_from_checkpoint: .* saves its weights only"),
        "dora": (lambda: _trainer(ULYSSES, directory, model=_lora_model(dora=True), tensor_parallel_size=2),
                 r"runs plain LoRA on layers.0.self_attn.q_proj; its adapters \['default'\] are a LoRA variant"),
        "lora dropout": (lambda: _trainer(ULYSSES, directory, model=_lora_model(dropout=0.1), tensor_parallel_size=2),
                         r"shards layers.0.self_attn.q_proj column-wise, and its LoRA adapters \['default'\] drop out"),
    }  # fmt: skip
    return {name: raises(call, match) for name, (call, match) in refused.items()}


def run_tensor_parallel_trainers() -> dict:
    """On every rank: each run of the module docstring, and what raises."""
    from accelerate.parallelism_config import ParallelismConfig

    _as_torchrun_started()
    results = {
        "tensor_parallel_size": _trained(ULYSSES, save=True, tensor_parallel_size=2),
        "parallelism_config": _trained(RING_FSDP2, save=True,
                                       parallelism_config=ParallelismConfig(tp_size=2, cp_size=2)),
        "memory": _trained(MEMORY, tensor_parallel_size=2),
        "usp": _trained(USP, tensor_parallel_size=2),
        "replicas": _trained(REPLICAS, tensor_parallel_size=2, sequence_parallel_size=1),
        "lora": _trained(RING_FSDP2, save=True, model=_lora_model(), trainable_only=True, tensor_parallel_size=2),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        results["refused"] = _refusals(directory)
    return results


def _saved_problems(result: dict) -> list[str]:
    """The whole model in the checkpoint and in save_model's files, equal to the trained
    weights gathered from their shards."""
    files = result["files"]
    expected = {f"checkpoint-3{os.sep}model.safetensors", f"final{os.sep}model.safetensors"}
    if set(files) != expected:
        return [f"safetensors files {sorted(files)}, expected {sorted(expected)}"]
    return [f"{path}: {name}" for path, tensors in files.items() for name, weight in result["weights"].items()
            if name not in tensors or not torch.equal(tensors[name], weight)]  # fmt: skip


@functools.cache
def _runs() -> list[dict]:
    """Every rank's results of run_tensor_parallel_trainers (one pool run for both tests)."""
    return pool_for(4).run(run_tensor_parallel_trainers)


def test_tensor_parallelism_in_the_trainer_matches_the_plain_trainer():
    per_rank = _runs()
    reference = _reference(ULYSSES)
    # One reference: the same training (the mode, the layout, fsdp and the memory options change nothing).
    assert _reference(RING_FSDP2) is reference
    # q_proj's 64 rows (4 heads): 32 on each tensor rank, FSDP2 halving them over the 2 sequence ranks.
    runs = {"tensor_parallel_size": (ULYSSES, 32), "parallelism_config": (RING_FSDP2, 16), "memory": (MEMORY, 32),
            "usp": (USP, 32), "replicas": (REPLICAS, 32)}  # fmt: skip
    for kind, (case, rows) in runs.items():
        problems = _differences(per_rank[0][kind], _reference(case))
        assert not problems, (kind, problems)
        assert all(result[kind]["q_rows"] == (rows, 64) for result in per_rank), kind
    for kind in ("tensor_parallel_size", "parallelism_config", "memory"):
        # Ranks (piece 0, tp 0), (0, 1), (1, 0), (1, 1): one replica.
        assert per_rank[0][kind]["dims"] == ("dp_replicate", "dp_shard", "sequence", "tp"), kind
        assert [result[kind]["piece"] for result in per_rank] == [0, 0, 1, 1], kind
        assert all(result[kind]["data_rank"] == 0 for result in per_rank), kind
    assert per_rank[0]["usp"]["dims"] == ("dp_replicate", "dp_shard", "ring", "ulysses", "tp")
    # Replicas: ranks (replica 0, tp 0), (0, 1), (1, 0), (1, 1).
    assert [result["replicas"]["data_rank"] for result in per_rank] == [0, 0, 1, 1]
    for kind in ("tensor_parallel_size", "parallelism_config"):
        problems = _saved_problems(per_rank[0][kind])
        assert not problems, (kind, problems)
    for rank, result in enumerate(per_rank):
        assert not any(result["refused"].values()), (rank, result["refused"])


def test_lora_with_tensor_parallelism_matches_the_plain_trainer():
    per_rank = _runs()
    [reference] = pool_for(1).run(run_lora_reference)
    ours = per_rank[0]["lora"]
    problems = _differences(ours, reference)
    assert not problems, problems
    assert sorted(ours["weights"]) == sorted(reference["weights"]) and len(ours["weights"]) == 11
    # The halves each tensor rank holds whole (lora_A of q/v, lora_B of down_proj) stayed the same on every rank.
    for rank, result in enumerate(per_rank[1:], start=1):
        theirs = result["lora"]["weights"]
        differing = [name for name, weight in theirs.items() if not torch.equal(weight, ours["weights"][name])]
        assert not differing, (rank, differing)
    # save_model wrote the adapter alone: its 12 tensors, whole, as trained (the frozen one as it began).
    adapter = ours["files"][f"final{os.sep}adapter_model.safetensors"]
    assert len(adapter) == 12, sorted(adapter)
    initial = _lora_model().get_parameter(FROZEN_ADAPTER).detach()
    for name, tensor in adapter.items():
        name = name.replace(".weight", ".default.weight")
        assert torch.equal(tensor, initial if name == FROZEN_ADAPTER else ours["weights"][name]), name
