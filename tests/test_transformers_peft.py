"""PEFT models (LoRA, DoRA) at every entry point of the transformers integration, against
the same training in one process.

One run on 2 gloo ranks covers every case, and one run of the same function in one
process (the pool of one rank, no sequence parallelism) gives the references:
- a loop of one's own (shard_batch, causal_lm_loss, all_reduce_gradients on the
  PeftModel; 3 SGD steps): apply() on the PeftModel after get_peft_model (LoRA, Ulysses),
  apply() before get_peft_model (DoRA, ring balanced); every logged loss and gradient
  norm, every trainable parameter after the steps, no gradient on a frozen one, and the
  weights merge_and_unload gives after them;
- generate with the trained LoRA model (greedy: the same tokens, scores within
  test_generation's tolerance);
- SequenceParallelTrainer(model=peft_model) against the plain Trainer (3 SGD steps:
  test_transformers_trainer's comparison), and the adapter its save_model writes;
- TRL's DPOTrainer and GRPOTrainer with peft_config through the mixin (the reference:
  the model with its adapter disabled, as TRL computes it) against TRL's trainer;
- prompt tuning refused, naming why.
And in the test's process: the LM head under PEFT (modules_to_save, an adapter on it),
adaption prompts refused.
The model: a small random Llama, fp32.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")
pytest.importorskip("trl")

from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402

VOCAB = 64
LR = 0.5
STEPS = 3
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
WEIGHT_RTOL = 1e-4
# The loop cases: (name, adapter, mode, layout, whether apply() comes first).
LOOP_CASES = (("lora-peft-then-apply", "lora", "ulysses", "contiguous", False),
              ("dora-apply-then-peft", "dora", "ring", "balanced", True))  # fmt: skip


def _base_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=256, use_cache=False))  # fmt: skip


def _lora_config(adapter: str):
    from peft import LoraConfig

    # init_lora_weights=False: B random too, so that every adapter weight has a gradient from the first step.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                      use_dora=adapter == "dora")  # fmt: skip


def _peft_model(adapter: str, mode: str | None, layout: str, apply_first: bool, groups: dict):
    """The PeftModel, apply() before or after get_peft_model (not at all without a mode)."""
    from peft import get_peft_model

    import seqpar_kernels.integrations.transformers as sp_transformers

    model = _base_model()
    if mode is not None and apply_first:
        sp_transformers.apply(model, mode, layout=layout, **groups)
    torch.manual_seed(1)
    model = get_peft_model(model, _lora_config(adapter))
    if mode is not None and not apply_first:
        sp_transformers.apply(model, mode, layout=layout, **groups)
    return model


def _batch() -> dict:
    """Two rows of 37 tokens, the second right-padded by 7."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 37), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_loop(model, mode: str | None, layout: str, groups: dict) -> dict:
    """3 SGD steps on the batch: losses, gradient norms (trainable parameters), the
    frozen parameters that got a gradient, the trainable parameters after."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    batch, losses, norms, frozen_with_grad = _batch(), [], [], set()
    trainable = {name: parameter for name, parameter in model.named_parameters() if parameter.requires_grad}
    for _ in range(STEPS):
        if mode is None:
            loss = model(**batch).loss
            loss.backward()
        else:
            local = sp_transformers.shard_batch(batch, mode=mode, layout=layout, model=model, **groups)
            hidden = model.get_base_model().model(**local).last_hidden_state  # (B, S_local, hidden)
            loss = sp_transformers.causal_lm_loss(model, hidden, local["shift_labels"], **groups)
            loss.backward()
            sp_transformers.all_reduce_gradients(model, **groups)
        frozen_with_grad |= {name for name, p in model.named_parameters() if not p.requires_grad and p.grad is not None}
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainable.values()])).item())
        losses.append(loss.item())
        with torch.no_grad():
            for parameter in trainable.values():
                parameter -= LR * parameter.grad
                parameter.grad = None
    return {"loss": losses, "grad_norm": norms, "frozen_with_grad": sorted(frozen_with_grad),
            "weights": {name: p.detach().clone() for name, p in trainable.items()}}  # fmt: skip


def _generate(model) -> dict:
    """Greedy generate of 5 tokens after two left-padded prompts."""
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    model.eval()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         use_cache=True, return_dict_in_generate=True, output_scores=True)  # fmt: skip
    model.train()
    return {"sequences": out.sequences, "scores": torch.stack(out.scores)}


def _trainer_run(sequence_parallel: bool) -> dict:
    """SequenceParallelTrainer (or the plain Trainer in one process) on a LoRA PeftModel:
    test_transformers_trainer's result (log, eval, trainable weights) and the files and
    tensors of the adapter save_model writes."""
    from peft import get_peft_model
    from safetensors.torch import load_file
    from test_transformers_trainer import _arguments, _dataset, _model, pad_right
    from transformers import Trainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    torch.manual_seed(1)
    model = get_peft_model(_model(), _lora_config("lora"))
    with tempfile.TemporaryDirectory() as directory:
        common = dict(model=model, args=_arguments(directory, 2, max_steps=STEPS), train_dataset=_dataset(),
                      eval_dataset=_dataset(6, seed=2), data_collator=pad_right)  # fmt: skip
        trainer = SequenceParallelTrainer(mode="ring", layout="balanced", **common) if sequence_parallel \
            else Trainer(**common)  # fmt: skip
        trainer.train()
        metrics = trainer.evaluate()
        trainer.save_model(os.path.join(directory, "saved"))
        saved = os.path.join(directory, "saved")
        files = sorted(os.listdir(saved)) if os.path.isdir(saved) else []
        adapter = load_file(os.path.join(saved, "adapter_model.safetensors")) if "adapter_model.safetensors" in files \
            else {}  # fmt: skip
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return {"log": trainer.state.log_history, "eval": metrics, "weights": weights, "files": files, "adapter": adapter}


def _trl_run(kind: str, sequence_parallel: bool, path: str) -> dict:
    """TRL's DPOTrainer or GRPOTrainer (KL to the reference) with peft_config (no
    reference model: TRL disables the adapter), with the mixin or alone: its log and
    trainable weights."""
    from peft import LoraConfig
    from test_transformers_post_training import _example, _preference_data, _prompts, vowel_reward
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainerMixin

    base = DPOTrainer if kind == "dpo" else GRPOTrainer

    class SequenceParallel(SequenceParallelTrainerMixin, base):
        pass

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with tempfile.TemporaryDirectory() as directory:
        common = dict(beta=0.1, output_dir=directory, per_device_train_batch_size=2, max_steps=STEPS, optim="sgd",
                      learning_rate=LR, max_grad_norm=1.0, logging_steps=1, seed=0, report_to="none",
                      save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False)  # fmt: skip
        if kind == "dpo":
            extra = dict(args=DPOConfig(**common), train_dataset=_preference_data())
        else:
            extra = dict(args=GRPOConfig(num_generations=2, max_completion_length=6, temperature=0.9, **common),
                         reward_funcs=vowel_reward, train_dataset=_prompts())  # fmt: skip
        extra.update(model=model, processing_class=_example().character_tokenizer(),
                     peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))  # fmt: skip
        torch.manual_seed(1)  # the adapter's initial weights, drawn inside the trainer
        trainer = SequenceParallel(mode="ring", layout="balanced", **extra) if sequence_parallel else base(**extra)
        trainer.train()
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    return {"log": trainer.state.log_history, "weights": weights, "reference_model": trainer.ref_model is not None}


@on_every_rank
def run_peft_cases(path: str) -> dict:
    """Every case on this rank: sequence-parallel where the world has several ranks, as
    one process otherwise; path: test_transformers_post_training's saved Llama (TRL)."""
    from peft import PromptTuningConfig, get_peft_model
    from test_transformers_trainer import _as_torchrun_started

    import seqpar_kernels.integrations.transformers as sp_transformers

    parallel = torch.distributed.get_world_size() > 1
    groups = {"group": timeout_group()} if parallel else {}
    results = {}
    for name, adapter, mode, layout, apply_first in LOOP_CASES:
        mode = mode if parallel else None
        model = _peft_model(adapter, mode, layout, apply_first, groups)
        results[name] = _train_loop(model, mode, layout, groups)
        if adapter == "lora":
            results[name]["generate"] = _generate(model)
        results[name]["merged"] = {key: value.clone() for key, value in model.merge_and_unload().state_dict().items()}
    if parallel:
        prompt_tuning = get_peft_model(_base_model(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
        results["prompt tuning refused"] = [
            raises(lambda: sp_transformers.apply(prompt_tuning, "ulysses", **groups), "virtual tokens"),
            raises(lambda: sp_transformers.shard_batch(_batch(), mode="ulysses", model=prompt_tuning, **groups),
                   "virtual tokens"),
        ]  # fmt: skip
    _as_torchrun_started()
    results["trainer"] = _trainer_run(parallel)
    for kind in ("dpo", "grpo"):
        results[kind] = _trl_run(kind, parallel, path)
    return results


_results: list = []


def _ours_and_reference() -> tuple[dict, dict, list[dict]]:
    """(rank 0's results on 2 ranks, the one-process results, every rank's), run once."""
    if not _results:
        from test_transformers_post_training import _model_directory

        path = _model_directory("llama")
        ranks = pool_for(2).run(run_peft_cases, path)
        _results.extend([ranks[0], pool_for(1).run(run_peft_cases, path)[0], ranks])
    return _results[0], _results[1], _results[2]


def _weight_errors(ours: dict, reference: dict) -> list[str]:
    if sorted(ours) != sorted(reference):
        return [f"parameters {sorted(set(ours) ^ set(reference))} on one side only"]
    problems = []
    for name, expected in reference.items():
        error = ((ours[name] - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
        if not error <= WEIGHT_RTOL:
            problems.append(f"{name}: relative error {error:.1e}")
    return problems


@pytest.mark.parametrize("case", [case[0] for case in LOOP_CASES])
def test_a_loop_of_ones_own_on_the_peft_model(case):
    """apply() on the PeftModel after get_peft_model, or on the model before it: 3 steps
    as one process takes them, gradients for the adapter only, and the merged weights."""
    ours, reference, _ = _ours_and_reference()
    ours, reference = ours[case], reference[case]
    problems = []
    for key, tolerance in (("loss", LOSS_RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        for step, (mine, expected) in enumerate(zip(ours[key], reference[key])):
            if not abs(mine - expected) <= tolerance * abs(expected):
                problems.append(f"step {step} {key}: {mine:.7f} vs {expected:.7f}")
    if ours["frozen_with_grad"]:
        problems.append(f"frozen parameters with a gradient: {ours['frozen_with_grad'][:3]}")
    problems += _weight_errors(ours["weights"], reference["weights"])
    problems += [f"merged {problem}" for problem in _weight_errors(ours["merged"], reference["merged"])]
    assert not problems, "\n".join(problems)


def test_generate_with_a_lora_model():
    ours, reference, _ = _ours_and_reference()
    ours, reference = ours[LOOP_CASES[0][0]]["generate"], reference[LOOP_CASES[0][0]]["generate"]
    assert torch.equal(ours["sequences"], reference["sequences"]), (ours["sequences"], reference["sequences"])
    # fp32 logits of order 1 after two layers: rounding of the sharded attention's sums.
    assert (ours["scores"] - reference["scores"]).abs().max().item() <= 1e-4


def test_prompt_tuning_raises_naming_why():
    _, _, ranks = _ours_and_reference()
    problems = [problem for result in ranks for problem in result["prompt tuning refused"] if problem]
    assert not problems, problems


def test_trainer_with_a_peft_model():
    """SequenceParallelTrainer(model=peft_model), ring balanced on 2 ranks, against the
    plain Trainer with the same PeftModel; save_model writes the adapter PEFT writes."""
    from test_transformers_trainer import _differences

    ours, reference, _ = _ours_and_reference()
    ours, reference = ours["trainer"], reference["trainer"]
    problems = _differences(ours, reference)
    assert ours["files"] == reference["files"] and "adapter_model.safetensors" in ours["files"], ours["files"]
    problems += [f"saved {problem}" for problem in _weight_errors(ours["adapter"], reference["adapter"])]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_trl_with_peft_config(kind):
    """TRL's DPOTrainer and GRPOTrainer with peft_config through the mixin: no reference
    model (the policy with its adapter disabled), every logged value (rewards, KL, ...)
    and the adapter as TRL's in one process."""
    from test_transformers_post_training import NOT_COMPARED

    ours, reference, _ = _ours_and_reference()
    ours, reference = ours[kind], reference[kind]
    assert not ours["reference_model"]
    problems = []
    steps = [entry for entry in reference["log"] if "loss" in entry]
    assert len(steps) == STEPS and len([entry for entry in ours["log"] if "loss" in entry]) == STEPS
    for expected, mine in zip(reference["log"], ours["log"]):
        for name, value in expected.items():
            if not isinstance(value, float) or name in NOT_COMPARED:
                continue
            tolerance = GRAD_NORM_RTOL if name == "grad_norm" else LOSS_RTOL
            floor = 1e-6 if name.startswith("rewards/") else 1e-7
            if not abs(mine[name] - value) <= tolerance * abs(value) + floor:
                problems.append(f"step {expected.get('step')} {name}: {mine[name]} vs {value}")
    problems += _weight_errors(ours["weights"], reference["weights"])
    assert not problems, "\n".join(problems)


def test_the_lm_head_under_peft():
    """In one process, no ranks: modules_to_save=["lm_head"] gives the fused loss the
    adapter's trained copy of the head (the original with the adapter disabled); an
    adapter layer on the head and an adaption prompt raise, naming why."""
    from peft import AdaptionPromptConfig, LoraConfig, get_peft_model

    from seqpar_kernels.integrations.transformers.causal_lm import head_of

    model = get_peft_model(_base_model(), LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    wrapper = model.get_base_model().lm_head
    assert head_of(model)[0] is wrapper.modules_to_save["default"].weight
    with model.disable_adapter():
        assert head_of(model)[0] is wrapper.original_module.weight
    on_head = get_peft_model(_base_model(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert raises(lambda: head_of(on_head), "adapter layer.*target_modules") is None
    adaption = get_peft_model(_base_model(), AdaptionPromptConfig(adapter_len=2, adapter_layers=1,
                                                                 task_type="CAUSAL_LM"))  # fmt: skip
    assert raises(lambda: head_of(adaption), "AdaptionPromptConfig.*virtual tokens") is None
