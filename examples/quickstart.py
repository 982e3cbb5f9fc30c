import os
import torch
import torch.distributed as dist
import seqpar_kernels as sp

# examples/quickstart.py: torchrun --nproc-per-node=4 examples/quickstart.py (gloo on CPU)
if torch.cuda.is_available():                                 # one GPU per rank, NCCL
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
torch.manual_seed(0)

# Enter the sharded world: this rank's piece of the sequence (torch.tensor_split sizes).
x = torch.randn(2, 512, 1024, device=device)               # (batch, seqlen, hidden)
x_local = sp.split_sequence(x, dim=1)                         # (2, 512/P, 1024)

# Ulysses attention, GQA: 16 q heads, 4 kv heads, head dim 64.
q = x_local.view(2, -1, 16, 64)
k = v = torch.randn(2, q.shape[1], 4, 64, device=device)
with sp.comm_stats() as stats:
    out = sp.ulysses_attention(q, k, v, causal=True)         # (2, seqlen_local, 16, 64)
print(f"rank {dist.get_rank()} sent {stats.bytes_sent} bytes")

# DSP: a video activation sharded along time becomes sharded along space.
video = torch.randn(1, 16 // dist.get_world_size(), 256, 512, device=device)   # (B, T/P, S, C)
spatial_sharded = sp.all_to_all_reshard(video, scatter_dim=2, gather_dim=1)      # (B, T, S/P, C)

# Leave the sharded world.
full_out = sp.gather_sequence(out, dim=1)                     # (2, 512, 16, 64)
dist.barrier()                # no rank closes its connections while a peer still uses them
dist.destroy_process_group()
