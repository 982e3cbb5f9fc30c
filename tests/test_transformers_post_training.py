"""TRL's DPOTrainer and GRPOTrainer through SequenceParallelTrainerMixin against TRL's own
trainer in one process.

The sequence-parallel runs: gloo ranks of the rank pool, started as torchrun would start
them. The reference: TRL's trainer in one process on the same data, seed and sampling;
for data-parallel replicas, TRL's trainer on one process per replica with the same global
batch (TRL seeds GRPO's sampling per process: that run samples the replicas' completions).
Compared: every logged value both log (loss, grad_norm, rewards, logps, entropy, KL, ...;
relative 1e-5, grad_norm 1e-4, rewards 1e-6 absolute: they are beta x differences of
summed log-probs, whose rounding does not shrink with them) and the final weights (1e-4
of each tensor's largest value), with SGD so that rounding does not grow into the update.
Under TRL's default bf16: the accuracy rule of tools/reference.py, TRL's fp32 run the
exact answer and its bf16 run the yardstick.

The model: a small random Llama (or a Qwen2 with a sliding-window layer), saved to a
temporary directory (TRL builds GRPO's reference model from its path); the
character-level tokenizer, built in memory, and the random words of examples/dpo_sp.py;
a reward function of the test's own.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")

from conftest import pool_for  # noqa: E402
from on_ranks import raises  # noqa: E402
from test_transformers_trainer import _as_torchrun_started, moe_model  # noqa: E402

from tools import reference as accuracy  # noqa: E402

SEED = 0
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
WEIGHT_RTOL = 1e-4
REWARD_ATOL = 1e-6
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dpo_sp.py"
# Logged values that are not the training's own (times, rates, counters of the run).
NOT_COMPARED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch",
                "total_flos", "learning_rate")  # fmt: skip


def _example():
    """examples/dpo_sp.py as a module (examples/ is not a package: loaded from its file
    once per process): its character-level tokenizer, random words and train()."""
    import importlib.util
    import sys

    name = "_seqpar_example_dpo_sp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_MODELS = tempfile.TemporaryDirectory()


def _model_directory(kind: str) -> str:
    """A small random model saved once, in the test's process (under torch.distributed,
    transformers saves on rank 0 only), which every rank loads."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    common = dict(vocab_size=len(_example().CHARACTERS) + 2, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                  eos_token_id=1, bos_token_id=None, use_cache=False)  # fmt: skip
    if kind == "sliding-window":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1))
    elif kind == "qwen3_moe":
        model = moe_model(kind, common["vocab_size"], pad_token_id=0, eos_token_id=1, bos_token_id=None)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=16))
    path = os.path.join(_MODELS.name, kind)
    if not os.path.isdir(path):
        model.save_pretrained(path)
    return path


def _preference_data(samples: int = 8):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(1)
    rows = [{"prompt": _example().random_words(generator, 4, 20), "chosen": _example().random_words(generator, 2, 14),
             "rejected": _example().random_words(generator, 2, 14)} for _ in range(samples)]  # fmt: skip
    return Dataset.from_list(rows)


def _prompts(samples: int = 8):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(2)
    return Dataset.from_list([{"prompt": _example().random_words(generator, 3, 16)} for _ in range(samples)])


def vowel_reward(completions, **kwargs) -> list[float]:
    """The GRPO test's reward: the share of vowels in each completion."""
    return [sum(char in "aeiou" for char in text) / max(len(text), 1) for text in completions]


def _trainer(case: dict, directory: str):
    """The case's trainer on this rank: TRL's own, or with the mixin where the case has a mode."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainerMixin

    path = case["path"]
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    common = dict(output_dir=os.path.join(directory, "out"), per_device_train_batch_size=case.get("batch", 2),
                  max_steps=case.get("steps", 2), optim="sgd", learning_rate=0.5, max_grad_norm=1.0, logging_steps=1,
                  seed=SEED, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                  **{"bf16": False, **case.get("args", {})})  # fmt: skip
    options = {"mode": case["mode"], "layout": case.get("layout", "contiguous"),
               "sequence_parallel_size": case.get("size", dist.get_world_size()),
               **({"ulysses_degree": case["ulysses_degree"]} if "ulysses_degree" in case else {})
               } if "mode" in case else None  # fmt: skip
    if case["trainer"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        base, args = DPOTrainer, DPOConfig(beta=0.1, **common)
        extra = dict(ref_model=AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager"),
                     train_dataset=_preference_data())  # fmt: skip
    else:
        from trl import GRPOConfig, GRPOTrainer

        base = GRPOTrainer
        args = GRPOConfig(beta=0.1, num_generations=2, max_completion_length=6, temperature=0.9, **common)
        extra = dict(reward_funcs=vowel_reward, train_dataset=_prompts())
    tokenizer = _example().character_tokenizer()
    if options is None:
        return base(model=model, args=args, processing_class=tokenizer, **extra)

    class SequenceParallel(SequenceParallelTrainerMixin, base):
        pass

    return SequenceParallel(model=model, args=args, processing_class=tokenizer, **extra, **options)


def run_post_training(case: dict) -> dict:
    _as_torchrun_started()
    with tempfile.TemporaryDirectory() as directory:
        trainer = _trainer(case, directory)
        trainer.train()
        weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
        return {"log": trainer.state.log_history, "weights": weights}


_references: dict[str, dict] = {}


def _reference(replicas: int, case: dict) -> dict:
    """TRL's own trainer on the case (its sequence parallelism left out) on one process
    per replica, run once per session."""
    plain = {key: value for key, value in case.items() if key not in ("mode", "layout", "size", "ulysses_degree")}
    key = repr((replicas, sorted(plain.items())))
    if key not in _references:
        _references[key] = pool_for(replicas).run(run_post_training, plain)[0]
    return _references[key]


def _ranks_disagree(results: list[dict]) -> list[str]:
    losses = [[entry.get("loss") for entry in result["log"]] for result in results]
    return [f"rank {rank} logged other losses than rank 0" for rank in range(1, len(results))
            if losses[rank] != losses[0]]  # fmt: skip


def _check(world_size: int, case: dict) -> None:
    """The case on world_size ranks (groups of case["size"], default all) against TRL's
    own trainer on one process per replica: TRL samples GRPO's completions with a seed
    per process, so that is the run whose completions the replicas' match."""
    case = dict(case, path=_model_directory(case.get("model", "llama")))
    results = pool_for(world_size).run(run_post_training, case)
    reference, problems = _reference(world_size // case.get("size", world_size), case), []
    if len(reference["log"]) != len(results[0]["log"]):
        problems.append(f"{len(results[0]['log'])} log entries, the reference {len(reference['log'])}")
    for expected, mine in zip(reference["log"], results[0]["log"]):
        for name, value in expected.items():
            if name in NOT_COMPARED or not isinstance(value, (int, float)):
                continue
            tolerance = GRAD_NORM_RTOL if name == "grad_norm" else LOSS_RTOL
            floor = REWARD_ATOL if name.startswith("rewards/") else 1e-7
            if name not in mine or not abs(mine[name] - value) <= tolerance * abs(value) + floor:
                problems.append(f"step {expected.get('step')} {name}: {mine.get(name)} vs {value}")
    for name, expected in reference["weights"].items():
        error = ((results[0]["weights"][name] - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
        if not error <= WEIGHT_RTOL:
            problems.append(f"weight {name}: relative error {error:.1e}")
    problems += _ranks_disagree(results)
    assert not problems, "\n".join(problems)


def _check_within_bf16_noise(world_size: int, case: dict) -> None:
    """The case under TRL's default precision (bf16=True: the model's forward and
    generate under a bf16 autocast, with use_cpu too) on world_size ranks against TRL's
    own trainer in one process, by the accuracy rule (tools/reference.py): every logged
    value and weight within twice the error of TRL's bf16 run plus a unit of bf16
    roundoff, both against TRL's run of the case in fp32 (the exact answer). The three
    runs sample the same completions (the rewards, compared so, say it)."""
    case = dict(case, path=_model_directory(case.get("model", "llama")), args={**case.get("args", {}), "bf16": True})
    results = pool_for(world_size).run(run_post_training, case)
    low, exact = _reference(1, case), _reference(1, dict(case, args={**case["args"], "bf16": False}))
    problems = []
    if not len(exact["log"]) == len(low["log"]) == len(results[0]["log"]):
        problems.append(f"{len(results[0]['log'])} log entries, TRL's {len(low['log'])} and {len(exact['log'])}")
    for want, plain, mine in zip(exact["log"], low["log"], results[0]["log"]):
        for name, value in want.items():
            if name in NOT_COMPARED or not isinstance(value, (int, float)):
                continue
            bound = accuracy.error_bound(torch.bfloat16, abs(plain[name] - value), abs(value))
            if name not in mine or not abs(mine[name] - value) <= bound:
                problems.append(f"step {want.get('step')} {name}: {mine.get(name)}, TRL's {plain[name]}, fp32 {value}")
    for name, want in exact["weights"].items():
        error, yardstick = (accuracy.max_error(run["weights"][name], want) for run in (results[0], low))
        bound = accuracy.error_bound(torch.bfloat16, yardstick, accuracy.magnitude(want))
        if not error <= bound:
            problems.append(f"weight {name}: error {error:.2e} > {bound:.2e}")
    problems += _ranks_disagree(results)
    assert not problems, "\n".join(problems)


def test_dpo_matches_trl_in_one_process():
    """DPO with its reference model: ring, balanced layout, gradient accumulation, a model
    with a sliding-window layer."""
    _check(2, dict(trainer="dpo", mode="ring", layout="balanced", model="sliding-window",
                   args=dict(gradient_accumulation_steps=2)))  # fmt: skip


def test_dpo_with_a_moe_router_loss_matches_trl_in_one_process():
    """DPO of a Qwen3-MoE model with its router load-balancing loss (TRL's
    router_aux_loss_coef, the config's 0.5: TRL logs aux_loss), Ulysses on 2 ranks."""
    _check(2, dict(trainer="dpo", mode="ulysses", model="qwen3_moe"))


def test_grpo_matches_trl_in_one_process():
    """GRPO: completions from model.generate (the same on both ranks), KL to the reference
    model, Ulysses, gradient accumulation."""
    _check(2, dict(trainer="grpo", mode="ulysses", args=dict(gradient_accumulation_steps=2)))


def test_grpo_matches_trl_in_one_process_under_usp():
    """GRPO on 4 ranks as one USP group (a ring of 2 Ulysses pairs, balanced): its
    generate over the KV cache sharded on that grid, the policy's and the reference
    model's fused heads."""
    _check(4, dict(trainer="grpo", mode="usp", layout="balanced", ulysses_degree=2))


def test_grpo_replicas_match_trl_data_parallel():
    """GRPO on 4 ranks as 2 replicas of a Ulysses group of 2, against TRL's own trainer on
    2 processes (data-parallel, the same global batch): the replicas' generation, rewards
    gathered across replicas, advantages of this replica's slice, DDP over the world."""
    _check(4, dict(trainer="grpo", mode="ulysses", size=2, args=dict(gradient_accumulation_steps=2)))


def test_grpo_under_trls_default_bf16_within_bf16_noise():
    """GRPO as TRL configures it by default (bf16=True, also with use_cpu=True): ring,
    balanced, 2 ranks; generate over the sharded cache under the bf16 autocast."""
    _check_within_bf16_noise(2, dict(trainer="grpo", mode="ring", layout="balanced"))


def unsupported_option_raises(case: dict) -> str | None:
    _as_torchrun_started()
    with tempfile.TemporaryDirectory() as directory:
        return raises(lambda: _trainer(case, directory), "does not support precompute_ref_log_probs")


def test_an_option_it_cannot_honour_raises_on_every_rank():
    case = dict(trainer="dpo", mode="ring", path=_model_directory("llama"), args=dict(precompute_ref_log_probs=True))
    assert pool_for(2).run(unsupported_option_raises, case) == [None, None]


def test_reference_runs_in_the_policys_autocast():
    """Under TRL's default bf16 autocast the reference model runs as the policy does: the
    first step's rewards (policy against its own copy) are 0, as in TRL's one process."""
    case = dict(trainer="dpo", mode="ring", steps=1, path=_model_directory("llama"), args=dict(bf16=True))
    log = pool_for(2).run(run_post_training, case)[0]["log"]
    assert log[0]["rewards/chosen"] == 0 and log[0]["rewards/margins"] == 0, log[0]


def run_example(argv: list[str]) -> list[dict]:
    _as_torchrun_started()
    example = _example()
    return example.train(example.parse_args(argv))


def test_example_matches_trl_in_one_process():
    """examples/dpo_sp.py's run on 2 ranks (torchrun starts it so) logs what TRL's one
    process logs."""
    argv = ["--steps", "2"]
    ours = pool_for(2).run(run_example, argv)[0]
    [reference] = pool_for(1).run(run_example, argv + ["--one-process"])
    assert [entry["step"] for entry in ours] == [1, 2]
    for mine, theirs in zip(ours, reference):
        for name, value in theirs.items():
            assert abs(mine[name] - value) <= LOSS_RTOL * abs(value) + REWARD_ATOL, (name, mine, theirs)


def test_grpo_with_a_moe_router_loss_matches_trl_in_one_process():
    """GRPO of a Qwen3-MoE model with its router load-balancing loss (TRL adds it per
    chunk of completions), Ulysses on 2 ranks."""
    _check(2, dict(trainer="grpo", mode="ulysses", model="qwen3_moe"))
