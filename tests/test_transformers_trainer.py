"""SequenceParallelTrainer (seqpar_kernels.integrations.transformers) against the plain
Hugging Face Trainer in one process.

The sequence-parallel runs: gloo ranks of the rank pool, started as torchrun would start
them (the Trainer sets up accelerate on the pool's process group). The reference: the
plain Trainer in one process (the pool of one rank) on the same data with the global
batch (per-device batch x replicas), the same seed and sampling. Compared: every logged
loss (relative 1e-5) and grad_norm (1e-4; clipping at max_grad_norm acts on it),
eval_loss, train_loss, and the final weights (1e-4 of each tensor's largest value).

The model: a small random Llama (2 layers, hidden 64, 4 heads / 2 kv heads, vocab 128),
fp32. The data: sequences of 9 to 40 tokens, right-padded by a small collator (labels
-100 at padding), or packed into one row by DataCollatorWithFlattening.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import pool_for  # noqa: E402
from on_ranks import raises as _raises  # noqa: E402

VOCAB = 128
SEED = 0
LOSS_RTOL = 1e-5
# transformers 4.x logs the loss rounded to 4 decimals: values on either side of a
# rounding boundary log one unit of the last decimal apart.
LOGGED_LOSS_ATOL = 1e-4 if transformers.__version__.startswith("4.") else 0.0
GRAD_NORM_RTOL = 1e-4
WEIGHT_RTOL = 1e-4
SAMPLES = 16


# ----------------------------------------------------------------------------------
# What runs on the ranks
# ----------------------------------------------------------------------------------


def _as_torchrun_started() -> None:
    """The environment torchrun gives a rank, for accelerate (the pool's process group
    is already initialised, which accelerate then uses)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    if world == 1:
        return
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(world), LOCAL_RANK=str(dist.get_rank()),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      OMP_NUM_THREADS="1")  # fmt: skip


MOE_MODELS = ("qwen3_moe", "mixtral", "olmoe")


def moe_model(kind: str, vocab: int, **extra):
    """A small random mixture-of-experts model of a family in MOE_MODELS (4 experts, top
    2) trained with its router load-balancing loss (output_router_logits=True,
    router_aux_loss_coef 0.5)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    experts = {"mixtral": dict(num_local_experts=4), "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32)}
    config = AutoConfig.for_model(kind, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=512, use_cache=False, output_router_logits=True,
                                  router_aux_loss_coef=0.5, num_experts_per_tok=2,
                                  **experts.get(kind, dict(num_experts=4)), **extra)  # fmt: skip
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config)


def _model(kind: str = "llama"):
    """A small random model: Llama, or (kind "sliding-window") Qwen2 whose first layer
    attends within a window of 8 tokens, or (kind "hybrid") LFM2: short convolutions
    between attention layers, or a mixture-of-experts model of MOE_MODELS."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    if kind == "hybrid":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        return Lfm2ForCausalLM(Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                          layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
                                          use_cache=False))  # fmt: skip
    if kind in MOE_MODELS:
        return moe_model(kind, VOCAB)
    if kind == "sliding-window":
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=512, use_sliding_window=True, sliding_window=8,
                                            max_window_layers=1, use_cache=False))  # fmt: skip
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         use_cache=False)  # fmt: skip
    return LlamaForCausalLM(config)


def _dataset(samples: int = SAMPLES, seed: int = 1) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(samples):
        length = int(torch.randint(9, 41, (1,), generator=generator))
        ids = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        data.append({"input_ids": ids, "labels": list(ids)})
    return data


def pad_right(features: list[dict]) -> dict:
    """Right padding to the longest sequence; labels -100 at padding."""
    longest = max(len(feature["input_ids"]) for feature in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, feature in enumerate(features):
        n = len(feature["input_ids"])
        ids[row, :n] = torch.tensor(feature["input_ids"])
        labels[row, :n] = torch.tensor(feature["labels"])
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _collator(kind: str):
    if kind == "packed":
        from transformers import DataCollatorWithFlattening

        return DataCollatorWithFlattening(return_tensors="pt")
    return pad_right


def _arguments(output_dir: str, batch: int, **extra):
    from transformers import TrainingArguments

    settings = dict(output_dir=output_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                    optim="sgd", learning_rate=0.5, max_grad_norm=1.0, logging_steps=1, seed=SEED, report_to="none",
                    save_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_drop_last=False)  # fmt: skip
    settings.update(extra)
    return TrainingArguments(**settings)


# The case keys that only the sequence-parallel run takes.
SEQUENCE_PARALLEL_KEYS = ("mode", "layout", "ulysses_degree", "tiled_mlp", "offload_activations")


def _trainer(case: dict, output_dir: str, trainer_class=None, **overrides):
    """The case's trainer on this rank: SequenceParallelTrainer (or trainer_class)
    where the case has a mode, else the plain Trainer with the global batch."""
    import torch.distributed as dist
    from transformers import Trainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    replicas = case.get("replicas", 1)
    options = {key: case[key] for key in SEQUENCE_PARALLEL_KEYS if key in case}
    batch = case.get("batch", 2) * (1 if options else replicas)
    args = _arguments(output_dir, batch, **{**case.get("args", {}), **overrides})
    common = dict(
        model=_model(case.get("model", "llama")),
        args=args,
        train_dataset=_dataset(case.get("samples", SAMPLES)),
        eval_dataset=_dataset(case.get("eval_samples", 6), seed=2),
        data_collator=_collator(case.get("collator", "padded")),
    )
    if not options:
        return (trainer_class or Trainer)(**common)
    world = dist.get_world_size()
    return (trainer_class or SequenceParallelTrainer)(sequence_parallel_size=world // replicas, **options, **common)


def _result(trainer, metrics) -> dict:
    import torch.distributed as dist

    weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    return {"log": trainer.state.log_history, "eval": metrics, "weights": weights if dist.get_rank() == 0 else None,
            "wrapped": type(trainer.model_wrapped).__name__}  # fmt: skip


def run_training(case: dict, trainer_class=None) -> dict:
    """One training run and evaluation on this rank: the log history, the evaluation's
    metrics and (rank 0) the final weights."""
    _as_torchrun_started()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = _trainer(case, output_dir, trainer_class)
        trainer.train()
        return _result(trainer, trainer.evaluate())


# ----------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------


def _relative(mine: float, expected: float) -> float:
    return abs(mine - expected) / max(abs(expected), 1e-30)


def _differences(ours: dict, reference: dict, weight_rtol: float = WEIGHT_RTOL) -> list[str]:
    problems = []
    steps = [entry for entry in reference["log"] if "loss" in entry and "grad_norm" in entry]
    our_steps = [entry for entry in ours["log"] if "loss" in entry and "grad_norm" in entry]
    if len(steps) != len(our_steps) or not steps:
        return [f"{len(our_steps)} logged steps, the reference {len(steps)}"]
    for expected, mine in zip(steps, our_steps):
        for key, tolerance, absolute in (("loss", LOSS_RTOL, LOGGED_LOSS_ATOL), ("grad_norm", GRAD_NORM_RTOL, 0.0)):
            if not abs(mine[key] - expected[key]) <= tolerance * abs(expected[key]) + absolute:
                problems.append(f"step {expected['step']} {key}: {mine[key]:.7f} vs {expected[key]:.7f}")
    for key in ("eval_loss",):
        if not _relative(ours["eval"][key], reference["eval"][key]) <= LOSS_RTOL:
            problems.append(f"{key}: {ours['eval'][key]:.7f} vs {reference['eval'][key]:.7f}")
    train_loss = [entry["train_loss"] for entry in ours["log"] if "train_loss" in entry]
    expected_train_loss = [entry["train_loss"] for entry in reference["log"] if "train_loss" in entry]
    if not _relative(train_loss[0], expected_train_loss[0]) <= LOSS_RTOL:
        problems.append(f"train_loss: {train_loss[0]:.7f} vs {expected_train_loss[0]:.7f}")
    for name, expected in reference["weights"].items():
        error = ((ours["weights"][name] - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
        if not error <= weight_rtol:
            problems.append(f"weight {name}: relative error {error:.1e}")
    return problems


_references: dict[tuple, dict] = {}


def _reference(case: dict, run=None) -> dict:
    """The plain Trainer in one process on the global batch (cached per setting)."""
    plain = {key: value for key, value in case.items() if key not in SEQUENCE_PARALLEL_KEYS}
    # One process has no sharding to do: the same training without FSDP; and uncompiled (what
    # compiling must not change).
    plain["args"] = {key: value for key, value in case.get("args", {}).items()
                     if key not in ("fsdp", "fsdp_config", "torch_compile", "torch_compile_backend")}  # fmt: skip
    key = repr((sorted(plain.items()), getattr(run, "__name__", None)))
    if key not in _references:
        [_references[key]] = pool_for(1).run(run or run_training, plain)
    return _references[key]


def _check(world_size: int, case: dict, run=None, reference_run=None) -> None:
    results = pool_for(world_size).run(run or run_training, case)
    reference = _reference(case, reference_run)
    problems = _differences(results[0], reference)
    # Every rank logs the same losses (the Trainer averages them over the world).
    for rank, result in enumerate(results[1:], start=1):
        if [e.get("loss") for e in result["log"]] != [e.get("loss") for e in results[0]["log"]]:
            problems.append(f"rank {rank} logged other losses than rank 0")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------


def _case(mode, layout, collator="padded", **extra):
    return dict(mode=mode, layout=layout, collator=collator, **extra)


STEPS3 = dict(max_steps=3)
ACCUMULATE = dict(max_steps=3, gradient_accumulation_steps=2)


@pytest.mark.parametrize(
    "world_size,case",
    [
        (2, _case("ring", "balanced", args=ACCUMULATE)),
        (3, _case("ulysses", "contiguous", "packed", args=STEPS3)),
        (3, _case("ring", "contiguous", "packed", tiled_mlp=16, args=ACCUMULATE)),
        (4, _case("usp", "balanced", args=STEPS3)),
        (4, _case("usp", "contiguous", "packed", ulysses_degree=4, args=STEPS3)),
    ],
    ids=["P2-ring-balanced-accumulate", "P3-ulysses-packed", "P3-ring-packed-accumulate-tiled", "P4-usp-balanced",
         "P4-usp-contiguous-packed"],
)  # fmt: skip
def test_each_mode_matches_the_plain_trainer(world_size, case):
    _check(world_size, case)


@pytest.mark.parametrize(
    "case",
    [
        _case("ring", "contiguous", "packed", replicas=2, args=ACCUMULATE),
        # 15 samples in global batches of 4: the last batch tops up replica 1 (ignored);
        # 5 evaluation samples, the same.
        _case("ulysses", "contiguous", replicas=2, samples=15, eval_samples=5,
              args=dict(num_train_epochs=1, gradient_accumulation_steps=2)),
    ],
    ids=["packed-accumulate", "uneven-last-batch"],
)  # fmt: skip
def test_two_replicas_of_a_two_rank_group(case):
    _check(4, case)


def test_checkpointing_tiled_mlp_and_offload():
    """The Trainer's gradient checkpointing (its layers' collectives run again in the
    backward), every MLP in tiles of 16 tokens, activations offloaded."""
    _check(2, _case("ring", "balanced", "packed", tiled_mlp=16, offload_activations=True,
                    args=dict(max_steps=3, gradient_checkpointing=True)))  # fmt: skip


# ----------------------------------------------------------------------------------
# Checkpoints: save, then resume
# ----------------------------------------------------------------------------------


def run_resumed(case: dict) -> dict:
    """Train 4 steps saving at step 2, then a new trainer resumes from that checkpoint
    (weights, AdamW's state, the scheduler, every rank's RNG, the sampler's position)
    and trains to step 4: its log and weights."""
    _as_torchrun_started()
    directory = case["directory"]
    _trainer(case, directory, save_strategy="steps", save_steps=2).train()
    resumed = _trainer(case, directory, save_strategy="no")
    resumed.train(resume_from_checkpoint=os.path.join(directory, "checkpoint-2"))
    return _result(resumed, resumed.evaluate())


def test_checkpoint_resume(tmp_path):
    """Two replicas of a 2-rank group, AdamW (the Trainer's default optimizer, whose state
    the checkpoint carries) and random sampling: the resumed run logs steps 3 and 4 as
    the uninterrupted one-process run does. Weights are compared loosely: AdamW's
    normalised update turns rounding-level differences of tiny gradients into weight
    differences of order the learning rate."""
    if transformers.__version__.startswith("4."):
        pytest.skip(
            "transformers 4.x's Trainer cannot resume on CPU ranks: it saves the optimizer's state from "
            "tensors on 'cpu:0', which torch.load refuses (the plain DDP Trainer alike)"
        )
    case = _case("ring", "balanced", "packed", replicas=2, directory=str(tmp_path / "run"),
                 args=dict(max_steps=4, optim="adamw_torch", learning_rate=1e-3))  # fmt: skip
    results = pool_for(4).run(run_resumed, case)
    reference = _reference(dict(case, directory=str(tmp_path / "reference")), run_resumed)
    problems = _differences(results[0], reference, weight_rtol=0.05)
    # The log of steps 1 and 2 comes back from the checkpoint; 3 and 4 are the resumed run's.
    steps = [entry["step"] for entry in results[0]["log"] if "loss" in entry]
    assert steps == [1, 2, 3, 4], steps
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------
# The mixin on another Trainer subclass
# ----------------------------------------------------------------------------------


def _trainer_subclasses():
    from transformers import Trainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainerMixin

    class SequentialTrainer(Trainer):
        """A Trainer subclass of its own: sequential sampling, and a log entry per step."""

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def log(self, logs, *args, **kwargs):
            super().log({**logs, "subclass": 1.0}, *args, **kwargs)

    class SequenceParallelSequentialTrainer(SequenceParallelTrainerMixin, SequentialTrainer):
        pass

    return SequentialTrainer, SequenceParallelSequentialTrainer


def run_subclass(case: dict) -> dict:
    plain, sequence_parallel = _trainer_subclasses()
    return run_training(case, sequence_parallel if case.get("mode") else plain)


def test_mixin_with_a_trainer_subclass():
    _check(2, _case("ulysses", "contiguous", "packed", args=ACCUMULATE), run_subclass, run_subclass)
    [result] = pool_for(1).run(run_subclass, _case("ring", "contiguous", args=STEPS3))
    assert all(entry.get("subclass") == 1.0 for entry in result["log"])


# ----------------------------------------------------------------------------------
# FSDP
# ----------------------------------------------------------------------------------


def run_under_fsdp(version: int, tied: bool) -> float:
    """The Trainer's loss path (the loss computed inside the forward, scaled by the world
    size for the gradients' average) on a model sharded by torch's FSDP (1: the
    FullyShardedDataParallel wrapper, 2: fully_shard): the largest relative error of the
    gathered gradients against the one-process model's."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import seqpar_kernels.integrations.transformers as sp_transformers
    from seqpar_kernels.integrations.transformers.causal_lm import causal_lm_loss
    from seqpar_kernels.integrations.transformers.loss import loss_through_forward

    model = _model()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    reference = copy.deepcopy(model)
    batch = pad_right(_dataset(2))
    reference(**batch).loss.backward()
    sp_transformers.apply(model, "ring", layout="balanced")
    local = sp_transformers.shard_batch(batch, mode="ring", layout="balanced")
    shift_labels = local.pop("shift_labels")
    if version == 2:
        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    else:
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                           use_orig_params=True, device_id=torch.device("cpu"))  # fmt: skip
    no_logits = torch.empty(0, dtype=torch.long)
    share = loss_through_forward(lambda: wrapped(**local, logits_to_keep=no_logits, use_cache=False), model,
                                 model.model, lambda hidden: causal_lm_loss(model, hidden, shift_labels))  # fmt: skip
    (share * dist.get_world_size()).backward()
    if version == 2:
        grads = [parameter.grad.full_tensor() for parameter in model.parameters()]
    else:
        with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
            grads = [parameter.grad.clone() for parameter in model.parameters()]
    return max(((grad - expected.grad).abs().max() / expected.grad.abs().max()).item()
               for grad, expected in zip(grads, reference.parameters()))  # fmt: skip


@pytest.mark.parametrize("version", [1, 2])
def test_loss_under_fsdp(version):
    """accelerate runs the Trainer's FSDP on accelerators only (on CPU ranks it falls back
    to DDP), so FSDP is tested here without the Trainer: the loss inside the forward of
    a sharded model (untied and tied LM head) gives the one-process gradients."""
    for tied in (False, True):
        errors = pool_for(2).run(run_under_fsdp, version, tied)
        assert max(errors) <= 1e-5, (tied, errors)


# ----------------------------------------------------------------------------------
# Models with sliding-window layers
# ----------------------------------------------------------------------------------


def test_sliding_window_model_matches_the_plain_trainer():
    _check(2, _case("ring", "balanced", "packed", model="sliding-window", args=ACCUMULATE))


def test_hybrid_model_matches_the_plain_trainer():
    """A model whose convolution layers pass their state across the ranks (LFM2), where
    this transformers release runs its mixers through the functions the package replaces.
    Padded batches: transformers' own convolution runs across packed documents, which
    the sequence-parallel one restarts (tests/test_transformers_hybrid.py checks packed
    batches against each document run alone)."""
    if not hasattr(transformers, "Lfm2Config") or transformers.__version__.startswith("4."):
        pytest.skip(f"transformers {transformers.__version__}: no LFM2 with the mixers' functions")
    _check(3, _case("ring", "balanced", "padded", model="hybrid", args=ACCUMULATE))


# ----------------------------------------------------------------------------------
# What cannot work raises
# ----------------------------------------------------------------------------------


def run_unsupported() -> dict:
    import torch.distributed as dist

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    _as_torchrun_started()
    problems = {}
    case = _case("ring", "balanced")
    with tempfile.TemporaryDirectory() as directory:
        problems["label smoothing"] = _raises(
            lambda: _trainer(case, directory, label_smoothing_factor=0.1), "label_smoothing_factor"
        )
        problems["compute_metrics"] = _raises(
            lambda: SequenceParallelTrainer(
                model=_model(), args=_arguments(directory, 2), compute_metrics=lambda prediction: {}
            ),
            "compute_metrics",
        )
        problems["size"] = _raises(
            lambda: SequenceParallelTrainer(model=_model(), args=_arguments(directory, 2), sequence_parallel_size=2),
            "must divide",
        )
        problems["mode"] = _raises(lambda: _trainer(dict(case, mode="zigzag"), directory), "mode must be")
        torch.manual_seed(SEED)
        biased = _model()
        biased.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
        problems["head with a bias"] = _raises(
            lambda: SequenceParallelTrainer(model=biased, args=_arguments(directory, 2)), "bias"
        )
        # Ranks of a group that read different batches (a collator with randomness of its own).
        rank = dist.get_rank()

        def differs_by_rank(features):
            batch = pad_right(features)
            batch["input_ids"][0, 0] = rank
            return batch

        # An IterableDataset: accelerate dispatches its batches from rank 0 by default.
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter(_dataset(4))

        streamed = _trainer(dict(case, args=dict(max_steps=1)), directory)
        streamed.train_dataset = Stream()
        problems["dispatched batches"] = _raises(streamed.train, "dispatch_batches")
        trainer = _trainer(case, directory)
        trainer.data_collator = differs_by_rank
        problems["different batches"] = _raises(trainer.train, "read different batches")
        problems["predict"] = _raises(lambda: trainer.predict(_dataset(2)), "predict")
    return {name: problem for name, problem in problems.items() if problem is not None}


def test_what_cannot_work_raises():
    for per_rank in pool_for(3).run(run_unsupported):
        assert not per_rank, per_rank


# ----------------------------------------------------------------------------------
# The example
# ----------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_trainer_sp.py"


def run_example(argv: list[str]) -> list[dict]:
    """examples/train_trainer_sp.py's train() on this rank (examples/ is not a package:
    loaded from its file once per worker)."""
    import importlib.util
    import sys

    _as_torchrun_started()
    name = "_seqpar_example_train_trainer_sp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    example = sys.modules[name]
    return example.train(example.parse_args(argv))


def test_example_matches_the_one_process_trainer():
    """The example's run on 3 ranks (torchrun starts it so) logs the one-process losses."""
    argv = ["--steps", "2"]
    ours = pool_for(3).run(run_example, argv)[0]
    [reference] = pool_for(1).run(run_example, argv + ["--one-process"])
    assert [entry["step"] for entry in ours] == [1, 2]
    for mine, theirs in zip(ours, reference):
        assert abs(mine["loss"] - theirs["loss"]) <= LOSS_RTOL * abs(theirs["loss"]) + LOGGED_LOSS_ATOL, (mine, theirs)
        assert _relative(mine["grad_norm"], theirs["grad_norm"]) <= GRAD_NORM_RTOL, (mine, theirs)


def test_torch_compile_matches_the_plain_trainer():
    """TrainingArguments(torch_compile=True): the Trainer compiles the model (dynamo with
    the eager backend here: tracing is what the package's path meets; the compiled
    graphs' own code is torch's), and the sequence-parallel run still matches the plain
    Trainer's, uncompiled (what compiling must not change; its run is cheaper than a
    compiled one's)."""
    _check(2, _case("ring", "balanced", args=dict(STEPS3, torch_compile=True, torch_compile_backend="eager")))
