"""Train a small Llama with the Hugging Face Trainer under sequence parallelism, and
print its losses beside the plain Trainer's in one process on the same data.

    torchrun --nproc-per-node=3 examples/train_trainer_sp.py                 # ring, one group of 3
    torchrun --nproc-per-node=4 examples/train_trainer_sp.py --mode usp --replicas 2
    torchrun --nproc-per-node=2 examples/train_trainer_sp.py --tiled-mlp --offload-activations

SequenceParallelTrainer takes the Trainer's arguments plus the mode, the layout and the
ranks per sequence-parallel group (the rest of the world are data-parallel replicas,
each reading its own batches). The model is built from a config (random weights;
nothing is downloaded); the data: documents of random lengths packed into one row per
batch by transformers' DataCollatorWithFlattening. When the ranks are done, rank 0 runs
this script again in one process (--one-process: the plain Trainer, the global batch =
per-device batch x replicas) and prints both runs' losses and gradient norms per step.
CPU ranks over gloo without GPUs, one GPU per rank over NCCL with them. Needs
`pip install "seqpar-kernels[transformers]"`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

LAYOUTS = {"ulysses": "contiguous", "ring": "balanced", "usp": "balanced"}  # this example's layout per mode
# What torchrun sets; the one-process run gets an environment without them.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=list(LAYOUTS), default="ring")
    parser.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (world / group size)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="documents per batch of a replica")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--tiled-mlp", action="store_true", help="MLPs a tile of tokens at a time")
    parser.add_argument("--offload-activations", action="store_true", help="checkpoints in host memory")
    parser.add_argument("--one-process", action="store_true", help="the plain Trainer in this process (JSON out)")
    return parser.parse_args(argv)


def model_and_data():
    """A small random Llama and 64 documents of 8 to 95 tokens (seeded: the same everywhere)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    documents = []
    for _ in range(64):
        length = int(torch.randint(8, 96, (1,), generator=generator))
        documents.append({"input_ids": torch.randint(0, config.vocab_size, (length,), generator=generator).tolist()})
    return model, documents


def train(args) -> list[dict]:
    """Train on this rank (a SequenceParallelTrainer, or with --one-process the plain
    Trainer on the global batch); returns the per-step log: loss and grad_norm."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from seqpar_kernels.integrations.transformers import SequenceParallelTrainer

    model, documents = model_and_data()
    batch = args.batch * (args.replicas if args.one_process else 1)
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch, max_steps=args.steps,
                                     gradient_accumulation_steps=args.accumulation, learning_rate=1e-3,
                                     logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
                                     seed=0, use_cpu=not torch.cuda.is_available())  # fmt: skip
        common = dict(model=model, args=training, train_dataset=documents,
                      data_collator=DataCollatorWithFlattening(return_tensors="pt"))  # fmt: skip
        if args.one_process:
            trainer = Trainer(**common)
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            trainer = SequenceParallelTrainer(mode=args.mode, layout=LAYOUTS[args.mode],
                                              sequence_parallel_size=world // args.replicas,
                                              tiled_mlp=args.tiled_mlp, offload_activations=args.offload_activations,
                                              **common)  # fmt: skip
        trainer.train()
    return [{"step": entry["step"], "loss": entry["loss"], "grad_norm": entry["grad_norm"]}
            for entry in trainer.state.log_history if "grad_norm" in entry]  # fmt: skip


def one_process_log(args) -> list[dict]:
    """This script with --one-process, in a process of its own (no torchrun variables)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    command = [
        sys.executable,
        __file__,
        "--one-process",
        "--mode",
        args.mode,
        "--replicas",
        str(args.replicas),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--accumulation",
        str(args.accumulation),
    ]
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
    world = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"\nSequenceParallelTrainer, mode={args.mode} layout={LAYOUTS[args.mode]}: {world} ranks = "
          f"{args.replicas} replica(s) x {world // args.replicas} ranks per sequence")  # fmt: skip
    print(f"{'step':>4}  {'one process':>12}  {'sequence parallel':>17}  {'difference':>10}  {'grad_norm':>9}  "
          f"{'one process':>11}")  # fmt: skip
    for mine, theirs in zip(ours, reference):
        print(
            f"{mine['step']:>4}  {theirs['loss']:>12.6f}  {mine['loss']:>17.6f}  "
            f"{abs(mine['loss'] - theirs['loss']):>10.2e}  {mine['grad_norm']:>9.6f}  {theirs['grad_norm']:>11.6f}"
        )


if __name__ == "__main__":
    main()
