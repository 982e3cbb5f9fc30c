"""Train a small model from Hugging Face transformers under sequence parallelism, next to
the same model trained in one process.

    torchrun --nproc-per-node=4 examples/train_transformers_sp.py             # every mode
    torchrun --nproc-per-node=4 examples/train_transformers_sp.py --mode ring --steps 5
    torchrun --nproc-per-node=4 examples/train_transformers_sp.py --model gemma2

The model is built from a config (random weights; nothing is downloaded): a Llama, a
Mistral (a sliding window on every layer) or a Gemma 2 (sliding and full layers,
attention and final logit softcapping, a tied head); the loss is the model's own
(causal_lm_loss). Each step's
batch is documents of random lengths packed into one row by transformers'
DataCollatorWithFlattening (position ids restarting at 0, labels -100 at each document's
first token). Every rank also trains the single-process model on the full batch, and
rank 0 prints both losses per step. CPU ranks over gloo without GPUs, one GPU per rank
over NCCL with them. Needs `pip install "seqpar-kernels[transformers]"`.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from transformers import DataCollatorWithFlattening

import seqpar_kernels.integrations.transformers as sp_transformers

MODES = {  # mode -> the layout this example uses for it
    "ulysses": "contiguous",  # Ulysses' work is balanced in any layout
    "ring": "balanced",  # the ring's causal work balanced across ranks
    "usp": "balanced",
}


# model -> (config class, model class, what its config sets beside the common sizes)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 64, "query_pre_attn_scalar": 16,
                                                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
}  # fmt: skip


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["all", *MODES], default="all")
    parser.add_argument("--model", choices=list(MODELS), default="llama")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per packed batch (all ranks together)")
    return parser.parse_args()


def packed_batch(step: int, tokens: int, vocab_size: int, device) -> dict:
    """Documents of random lengths (the same on every rank) packed into one row."""
    generator = torch.Generator().manual_seed(step)
    documents, remaining = [], tokens
    while remaining > 0:
        length = min(remaining, int(torch.randint(1, tokens // 3, (1,), generator=generator)))
        documents.append({"input_ids": torch.randint(0, vocab_size, (length,), generator=generator).tolist()})
        remaining -= length
    batch = DataCollatorWithFlattening(return_tensors="pt")(documents)
    return {key: value.to(device) for key, value in batch.items()}


def mesh_or_group(mode: str, device_type: str) -> dict:
    """USP runs on a 2-D mesh (Ulysses degree 2 where the world size is even), the others
    on the world."""
    if mode != "usp":
        return {}
    world = dist.get_world_size()
    ulysses = 2 if world % 2 == 0 else 1
    return {"mesh": init_device_mesh(device_type, (world // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))}


def main():
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    rank = dist.get_rank()

    config_class, model_class, settings = MODELS[args.model]
    config = getattr(transformers, config_class)(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, use_cache=False, **settings,
    )  # fmt: skip
    torch.manual_seed(0)
    initial = getattr(transformers, model_class)(config).to(device)  # the same weights on every rank
    initial.set_attn_implementation("eager")  # the single-process model: eager honours every softcap

    for mode in MODES if args.mode == "all" else [args.mode]:
        layout, groups = MODES[mode], mesh_or_group(mode, device.type)
        single, model = copy.deepcopy(initial), copy.deepcopy(initial)
        sp_transformers.apply(model, mode, layout=layout, **groups)
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (single, model)]
        if rank == 0:
            print(f"\n{args.model}, {mode} ({layout}) on {dist.get_world_size()} ranks")
            print(f"{'step':>4}  {'single process':>14}  {'sequence parallel':>17}  {'difference':>10}")
        for step in range(args.steps):
            batch = packed_batch(step, args.tokens, config.vocab_size, device)

            # One process, the whole batch: transformers shifts the labels itself.
            single_loss = single(**batch).loss
            single_loss.backward()

            # Sequence parallel: this rank's tokens, labels shifted on the full sequence.
            local = sp_transformers.shard_batch(batch, mode=mode, layout=layout, **groups)
            hidden = model.model(**local).last_hidden_state  # (1, tokens on this rank, hidden)
            # The model's own head and logit transforms; the mean over every rank's real
            # tokens, the same on every rank.
            loss = sp_transformers.causal_lm_loss(model, hidden, local["shift_labels"])
            loss.backward()
            sp_transformers.all_reduce_gradients(model, **groups)  # each rank held its tokens' share

            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            if rank == 0:
                difference = abs(loss.item() - single_loss.item())
                print(f"{step:>4}  {single_loss.item():>14.6f}  {loss.item():>17.6f}  {difference:>10.2e}")
    dist.barrier()  # no rank closes its connections while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
