import os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import seqpar_kernels as sp

# examples/usp.py: torchrun --nproc-per-node=4 examples/usp.py (a 2 x 2 grid; gloo on CPU)
on_gpu = torch.cuda.is_available()                       # one GPU per rank, NCCL; else gloo
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
if on_gpu:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
rank, world_size = dist.get_rank(), dist.get_world_size()
ulysses_degree = 2 if world_size % 2 == 0 else 1       # e.g. the GPUs of a node; the ring spans the rest

# The grid: Ulysses groups of consecutive ranks, ring groups striding across them.
ulysses_group, ring_group = sp.make_usp_groups(ulysses_degree)
# The same grid as a DeviceMesh: dims named "ring" and "ulysses".
mesh = init_device_mesh(device.type, (world_size // ulysses_degree, ulysses_degree),
                        mesh_dim_names=("ring", "ulysses"))

# 7 q heads, 1 kv head (MQA), a sequence no degree divides, causal: zigzag balances the ring.
torch.manual_seed(0)
q_full = torch.randn(1, 257, 7, 64, device=device)
kv_full = torch.randn(1, 257, 1, 64, device=device)
q, k, v = (sp.usp_split(t, dim=1, mesh=mesh, layout="zigzag") for t in (q_full, kv_full, kv_full))
q.requires_grad_()
with sp.comm_stats() as stats:
    out, lse = sp.usp_attention(q, k, v, mesh=mesh, causal=True, layout="zigzag", return_lse=True)
    out.sum().backward()
# The groups name the same grid as the mesh.
out_groups = sp.usp_attention(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
                              causal=True, layout="zigzag")
full = sp.usp_gather(out, dim=1, mesh=mesh, layout="zigzag")                # (1, 257, 7, 64)
expected = torch.nn.functional.scaled_dot_product_attention(
    q_full.transpose(1, 2), kv_full.transpose(1, 2), kv_full.transpose(1, 2), is_causal=True, enable_gqa=True
).transpose(1, 2)
print(f"rank {rank}: piece {tuple(q.shape)}, lse {tuple(lse.shape)}, sent {stats.bytes_sent} bytes, "
      f"max error {(full - expected).abs().max().item():.1e}, groups == mesh: {torch.equal(out, out_groups)}")
dist.barrier()                # no rank closes its connections while a peer still uses them
dist.destroy_process_group()
