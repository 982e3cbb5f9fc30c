import os
import torch
import torch.distributed as dist
import seqpar_kernels as sp

# examples/varlen.py: torchrun --nproc-per-node=4 examples/varlen.py (gloo on CPU)
on_gpu = torch.cuda.is_available()                       # one GPU per rank, NCCL; else gloo
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
if on_gpu:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
rank = dist.get_rank()

# Six documents packed into one sequence of 300 tokens: lengths 1, 120, 7, 2, 150, 20.
cu_seqlens = [0, 1, 121, 128, 130, 280, 300]
plan = sp.varlen_plan(cu_seqlens, layout="balanced", device=device)  # the same on every rank
torch.manual_seed(0)
q_full = torch.randn(1, 300, 8, 64, device=device)                   # (1, tokens, heads, head dim)
kv_full = torch.randn(1, 300, 2, 64, device=device)                  # GQA: 2 kv heads
q, k, v = (plan.split(t, dim=1) for t in (q_full, kv_full, kv_full))  # this rank's tokens
positions = plan.position_ids                                        # (1, tokens here): for rotary
q.requires_grad_()

out_ring = sp.ring_attention(q, k, v, causal=True, varlen=plan)      # attention inside each document
out_ulysses = sp.ulysses_attention(q, k, v, causal=True, varlen=plan)
out_ring.sum().backward()

full = plan.gather(out_ring, dim=1)                                  # (1, 300, 8, 64) on every rank
expected = torch.cat([
    torch.nn.functional.scaled_dot_product_attention(
        q_full[:, s:e].transpose(1, 2), kv_full[:, s:e].transpose(1, 2), kv_full[:, s:e].transpose(1, 2),
        is_causal=True, enable_gqa=True).transpose(1, 2)
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])], dim=1)
print(f"rank {rank}: {plan.seq_lens[rank]} tokens (positions {positions[0, :4].tolist()}...), "
      f"work imbalance {plan.work_imbalance:.3f}, max error {(full - expected).abs().max().item():.1e}, "
      f"ring vs Ulysses {(out_ring - out_ulysses).abs().max().item():.1e}")
dist.barrier()                # no rank closes its connections while a peer still uses them
dist.destroy_process_group()
