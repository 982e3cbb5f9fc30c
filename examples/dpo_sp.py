"""Train a small Llama with TRL's DPOTrainer under sequence parallelism, and print its
losses and reward margins beside TRL's own DPOTrainer's in one process on the same data.

    torchrun --nproc-per-node=2 examples/dpo_sp.py                 # ring, one group of 2
    torchrun --nproc-per-node=2 examples/dpo_sp.py --mode ulysses

The sequence-parallel trainer is TRL's DPOTrainer with SequenceParallelTrainerMixin
first: each rank runs the policy and the reference model on its piece of every sequence,
and TRL's loss reads the per-token log-probs of the whole sequence (gathered, 4 bytes a
token; the logits are never formed). The model is built from a config (random weights;
nothing is downloaded), the tokenizer is one id per character, made in memory, and the
preference pairs are random words. When the ranks are done, rank 0 runs this script
again in one process (--one-process: TRL's DPOTrainer) and prints both runs' logs per
step. CPU ranks over gloo without GPUs, one GPU per rank over NCCL with them. Needs
`pip install "seqpar-kernels[trl]"` (TRL 1.15 or newer).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch

CHARACTERS = "abcdefghijklmnopqrstuvwxyz "
LAYOUTS = {"ulysses": "contiguous", "ring": "balanced"}  # this example's layout per mode
# What torchrun sets; the one-process run gets an environment without them.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip
LOGGED = ("loss", "rewards/margins", "grad_norm")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=list(LAYOUTS), default="ring")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--one-process", action="store_true", help="TRL's DPOTrainer in this process (JSON out)")
    return parser.parse_args(argv)


def character_tokenizer():
    """One id per character, <pad> and <eos>, made in memory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{char: index + 2 for index, char in enumerate(CHARACTERS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def random_words(generator: torch.Generator, low: int, high: int) -> str:
    """low to high - 1 random characters of CHARACTERS."""
    length = int(torch.randint(low, high, (1,), generator=generator))
    return "".join(CHARACTERS[int(i)] for i in torch.randint(0, len(CHARACTERS), (length,), generator=generator))


def model_and_data():
    """A small random Llama (the reference model: its copy) and 16 preference pairs (seeded: the same everywhere)."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(CHARACTERS) + 2, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    pairs = [{"prompt": random_words(generator, 8, 40), "chosen": random_words(generator, 4, 24),
              "rejected": random_words(generator, 4, 24)} for _ in range(16)]  # fmt: skip
    return model, Dataset.from_list(pairs)


def train(args) -> list[dict]:
    """Train on this rank (TRL's DPOTrainer with the mixin, or with --one-process TRL's
    own); returns the per-step log of LOGGED."""
    from trl import DPOConfig, DPOTrainer

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainerMixin

    class SequenceParallelDPOTrainer(SequenceParallelTrainerMixin, DPOTrainer):
        pass

    model, pairs = model_and_data()
    with tempfile.TemporaryDirectory() as output_dir:
        config = DPOConfig(output_dir=output_dir, beta=0.1, per_device_train_batch_size=2, max_steps=args.steps,
                           learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none", save_strategy="no",
                           disable_tqdm=True, seed=0, use_cpu=not torch.cuda.is_available(),
                           bf16=False)  # fp32 (TRL's default is bf16 autocast): the runs agree to rounding  # fmt: skip
        common = dict(model=model, ref_model=copy.deepcopy(model), args=config, train_dataset=pairs,
                      processing_class=character_tokenizer())  # fmt: skip
        if args.one_process:
            trainer = DPOTrainer(**common)
        else:
            trainer = SequenceParallelDPOTrainer(mode=args.mode, layout=LAYOUTS[args.mode],
                                                 sequence_parallel_size=int(os.environ.get("WORLD_SIZE", "1")),
                                                 **common)  # fmt: skip
        trainer.train()
    return [{"step": entry["step"], **{name: entry[name] for name in LOGGED}}
            for entry in trainer.state.log_history if "grad_norm" in entry]  # fmt: skip


def one_process_log(args) -> list[dict]:
    """This script with --one-process, in a process of its own (no torchrun variables)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    command = [sys.executable, __file__, "--one-process", "--mode", args.mode, "--steps", str(args.steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    args = parse_args()
    if args.one_process:
        print(json.dumps(train(args)))
        return
    ours = train(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    reference = one_process_log(args)
    print(f"\nDPOTrainer + SequenceParallelTrainerMixin, mode={args.mode} layout={LAYOUTS[args.mode]}, "
          f"{os.environ.get('WORLD_SIZE', '1')} ranks, beside TRL's DPOTrainer in one process")  # fmt: skip
    print(f"{'step':>4}  {'name':<15}  {'one process':>12}  {'sequence parallel':>17}  {'difference':>10}")
    for mine, theirs in zip(ours, reference):
        for name in LOGGED:
            print(f"{mine['step']:>4}  {name:<15}  {theirs[name]:>12.6f}  {mine[name]:>17.6f}  "
                  f"{abs(mine[name] - theirs[name]):>10.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
