"""Dynamic Sequence Parallelism (DSP, arXiv:2403.10266) on a small video-DiT-like model
(one file, over 500 lines: an example a reader runs and reads whole).

The model is a spatial-temporal transformer on latent videos x of shape
(B, T, S, C): batch, frames, patches per frame, channels. Each layer is a pair of
DiT blocks (adaLN modulation from a conditioning vector, attention, MLP):

    spatial block   attention over S, independently for each frame      (B*T sequences of S)
    temporal block  attention over T, independently for each patch      (B*S sequences of T)

Every other op (layernorm, MLP, modulation) is per token. So a block only needs the
dim it attends over to be whole on each rank; the other sequence dim can be sharded.

DSP shards one sequence dim at a time and switches which when the stage changes:

    (B, T/P, S, C)  spatial block (each rank: whole frames)
        all_to_all_reshard(scatter_dim=S, gather_dim=T)      one all-to-all
    (B, T, S/P, C)  temporal block (each rank: whole patch trajectories)
        all_to_all_reshard(scatter_dim=T, gather_dim=S)      one all-to-all
    (B, T/P, S, C)  next layer ...

Embedded sequence parallelism ("Ulysses" below) instead keeps S sharded throughout:
the temporal block is then local, and the spatial block runs ulysses_attention (an
all-to-all of q, k, v to head sharding and one of the output back).

Per layer and rank, forward, with M the full activation's bytes and even sizes:
    DSP      2 switches       x (P-1)/P x M/P   (the paper: 2M/N)
    Ulysses  q, k, v and out  x (P-1)/P x M/P   (the paper: 4M/N)
and twice that with the backward. This script measures both with comm_stats, checks
both against the single-process model (outputs and parameter gradients), and exits
non-zero if anything disagrees.

Run:
    python examples/dsp_video_dit.py --world-size 4       # spawns 4 gloo ranks on CPU
    torchrun --nproc-per-node=4 examples/dsp_video_dit.py  # NCCL on GPUs when available
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from seqpar_kernels import all_to_all_reshard, comm_stats, ulysses_attention

# Dims of a (B, T, S, C) video activation.
FRAME_DIM, PATCH_DIM = 1, 2
SPATIAL, TEMPORAL = "spatial", "temporal"
# The dim a block attends over; it must be whole on every rank (except under Ulysses).
ATTENDED_DIM = {SPATIAL: PATCH_DIM, TEMPORAL: FRAME_DIM}


@dataclasses.dataclass
class Config:
    batch: int = 2
    frames: int = 8  # T
    patches: int = 16  # S, patches per frame
    in_channels: int = 8  # latent channels of the input video
    channels: int = 64  # C, the model width
    heads: int = 4
    layers: int = 2  # spatial-temporal block pairs
    mlp_ratio: int = 4
    seed: int = 0
    # max |parallel - single process| <= atol + rtol * max |single process|
    atol: float = 1e-5
    rtol: float = 1e-4


# ----------------------------------------------------------------------------------
# parallel plans: where the model's activations live, and how attention runs
# ----------------------------------------------------------------------------------

# attend(q, k, v) -> out; all (N, L, heads, head_dim): N independent sequences of L.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over whole sequences on this rank. q, k, v: (N, L, H, Dh) -> (N, L, H, Dh)."""
    # (N, L, H, Dh) -> (N, H, L, Dh): SDPA's layout (views, no copies).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def piece_range(total: int, world_size: int, rank: int) -> slice:
    """This rank's range of a dim of size `total`, torch.tensor_split style (the first
    total % P ranks get one more), the convention of seqpar_kernels."""
    sizes = piece_sizes(total, world_size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def piece_sizes(total: int, world_size: int) -> list[int]:
    return [len(piece) for piece in torch.arange(total).tensor_split(world_size)]


class SingleProcess:
    """Everything on one process: the reference."""

    def __init__(self, config: Config):
        self.config = config

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full (B, T, S, ...) tensor: all of it."""
        return x

    def local_ranges(self) -> tuple[slice, slice]:
        """(frames, patches) this rank holds in the current layout."""
        return slice(None), slice(None)

    def prepare(self, x: torch.Tensor, stage: str) -> torch.Tensor:
        """x in the layout that a `stage` block needs."""
        return x

    def attention(self, stage: str) -> AttentionFn:
        return local_attention


class DSP(SingleProcess):
    """Dynamic sequence parallelism: frames sharded for spatial blocks, patches sharded
    for temporal blocks, one all_to_all_reshard at each switch. Starts (and each layer
    ends) with frames sharded."""

    def __init__(self, config: Config, group=None):
        super().__init__(config)
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.sharded_dim = FRAME_DIM
        # Every rank's size along each dim: passed to the reshard so that it does not
        # exchange them before every switch.
        self.sizes = {
            FRAME_DIM: piece_sizes(config.frames, self.world_size),
            PATCH_DIM: piece_sizes(config.patches, self.world_size),
        }

    def shard(self, x):
        self.sharded_dim = FRAME_DIM
        return x[:, piece_range(x.shape[FRAME_DIM], self.world_size, self.rank)]

    def local_ranges(self):
        frames = piece_range(self.config.frames, self.world_size, self.rank)
        patches = piece_range(self.config.patches, self.world_size, self.rank)
        return (frames, slice(None)) if self.sharded_dim == FRAME_DIM else (slice(None), patches)

    def prepare(self, x, stage):
        # A block attends over one dim; the other one is the one to shard.
        wanted = FRAME_DIM if ATTENDED_DIM[stage] == PATCH_DIM else PATCH_DIM
        if self.sharded_dim == wanted:
            return x
        # e.g. spatial -> temporal: (B, T_r, S, C) -> (B, T, S_r, C). Every rank sends
        # the patches of its frames to the rank that owns those patches.
        x = all_to_all_reshard(
            x, scatter_dim=wanted, gather_dim=self.sharded_dim, group=self.group,
            gather_sizes=self.sizes[self.sharded_dim],
        )  # fmt: skip
        self.sharded_dim = wanted
        return x


class Ulysses(SingleProcess):
    """Embedded sequence parallelism: patches (S) sharded throughout. Temporal blocks
    need nothing (each rank has whole patch trajectories); spatial blocks run
    ulysses_attention, which exchanges q, k, v and the output around the attention."""

    def __init__(self, config: Config, group=None):
        super().__init__(config)
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.patch_sizes = piece_sizes(config.patches, self.world_size)

    def shard(self, x):
        return x[:, :, piece_range(x.shape[PATCH_DIM], self.world_size, self.rank)]

    def local_ranges(self):
        return slice(None), piece_range(self.config.patches, self.world_size, self.rank)

    def attention(self, stage):
        if stage == TEMPORAL:
            return local_attention
        # Every frame's patch sequence is sharded the same way, so the per-rank lengths
        # are the patch sizes (passed, so that they are not exchanged on every call).
        return lambda q, k, v: ulysses_attention(q, k, v, group=self.group, seq_lens=self.patch_sizes)


# ----------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN: x (B, T', S', C), shift/scale (B, 1, 1, C) broadcast over the tokens."""
    return x * (1 + scale) + shift


class Attention(nn.Module):
    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        """x: (N, L, C), N independent sequences of length L. Returns (N, L, C)."""
        batch, length, channels = x.shape
        # (N, L, 3C) -> (N, L, 3, H, Dh) -> three (N, L, H, Dh) strided views: the
        # kernels read them in place.
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, channels // self.heads).unbind(2)
        out = attend(q, k, v)  # (N, L, H, Dh)
        return self.proj(out.reshape(batch, length, channels))


class Block(nn.Module):
    """A DiT block attending over one sequence dim of a video activation."""

    def __init__(self, stage: str, config: Config):
        super().__init__()
        channels = config.channels
        self.stage = stage
        self.norm1 = nn.LayerNorm(channels, elementwise_affine=False)
        self.attn = Attention(channels, config.heads)
        self.norm2 = nn.LayerNorm(channels, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(channels, config.mlp_ratio * channels),
            nn.GELU(approximate="tanh"),
            nn.Linear(config.mlp_ratio * channels, channels),
        )
        # Shift, scale and gate for the attention and the MLP. (DiT zero-initialises
        # this; random weights here, so that the check exercises every path.)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 6 * channels))

    def forward(self, x: torch.Tensor, cond: torch.Tensor, plan: SingleProcess) -> torch.Tensor:
        """x: (B, T', S', C), this rank's piece (the attended dim whole, except under
        Ulysses); cond: (B, C). Returns the same shape."""
        # (B, 6C) -> (B, 1, 1, 6C) -> six (B, 1, 1, C), broadcast over the local tokens.
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(cond)[:, None, None, :].chunk(6, dim=-1)
        x = x + gate_a * self._attention(modulate(self.norm1(x), shift_a, scale_a), plan)
        x = x + gate_m * self.mlp(modulate(self.norm2(x), shift_m, scale_m))
        return x

    def _attention(self, x: torch.Tensor, plan: SingleProcess) -> torch.Tensor:
        batch, frames, patches, channels = x.shape
        attend = plan.attention(self.stage)
        if self.stage == SPATIAL:
            # (B, T', S', C) -> (B*T', S', C): one sequence per frame (a view).
            out = self.attn(x.reshape(batch * frames, patches, channels), attend)
            return out.view(batch, frames, patches, channels)
        # (B, T', S', C) -> (B, S', T', C) -> (B*S', T', C): one sequence per patch (a copy).
        sequences = x.transpose(1, 2).reshape(batch * patches, frames, channels)
        out = self.attn(sequences, attend)
        # (B*S', T', C) -> (B, S', T', C) -> (B, T', S', C)
        return out.view(batch, patches, frames, channels).transpose(1, 2)


class Layer(nn.Module):
    """A spatial block then a temporal block. Under DSP the output is returned in the
    layout the input came in (frames sharded), so every layer does the same two
    switches."""

    def __init__(self, config: Config):
        super().__init__()
        self.spatial = Block(SPATIAL, config)
        self.temporal = Block(TEMPORAL, config)

    def forward(self, x, cond, plan):
        x = self.spatial(plan.prepare(x, SPATIAL), cond, plan)
        x = self.temporal(plan.prepare(x, TEMPORAL), cond, plan)
        return plan.prepare(x, SPATIAL)


class VideoDiT(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        channels = config.channels
        self.embed = nn.Linear(config.in_channels, channels)
        self.frame_pos = nn.Parameter(torch.randn(config.frames, channels) * 0.02)
        self.patch_pos = nn.Parameter(torch.randn(config.patches, channels) * 0.02)
        self.cond_mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels))
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, config.in_channels)

    def forward(
        self,
        video: torch.Tensor,
        cond: torch.Tensor,
        plan: SingleProcess,
        layer_bytes: list[int] | None = None,
    ) -> torch.Tensor:
        """video: this rank's piece of a (B, T, S, in_channels) latent video, as
        plan.shard gives it; cond: (B, C), the same on every rank.
        Returns this rank's piece of the (B, T, S, in_channels) prediction, in the same
        layout. layer_bytes, if given, receives each layer's bytes sent (comm_stats)."""
        frames, patches = plan.local_ranges()
        # Position embeddings of the tokens this rank holds. Plain slices, so each rank's
        # gradient covers its tokens only and the ranks' gradients add up.
        # (T', C) -> (1, T', 1, C) and (S', C) -> (1, 1, S', C), broadcast over (B, T', S', C).
        x = self.embed(video)  # (B, T', S', in_channels) -> (B, T', S', C)
        x = x + self.frame_pos[frames][None, :, None] + self.patch_pos[patches][None, None]
        cond = self.cond_mlp(cond)
        for layer in self.layers:
            with comm_stats() as sent:
                x = layer(x, cond, plan)
            if layer_bytes is not None:
                layer_bytes.append(sent.bytes_sent)
        return self.head(self.final_norm(x))


# ----------------------------------------------------------------------------------
# the check
# ----------------------------------------------------------------------------------


def _max_error(got: torch.Tensor, expected: torch.Tensor, config: Config) -> float:
    """Error in units of the allowed tolerance (<= 1 passes)."""
    if expected.numel() == 0:
        return 0.0
    allowed = config.atol + config.rtol * expected.abs().max().item()
    return (got - expected).abs().max().item() / allowed


def _all_reduce(value: float, op, group, device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.item()


def run_parallel(model, plan, video, cond, dout, group):
    """Forward and backward of `model` under `plan` on this rank's piece. Returns
    (local output, parameter grads summed over ranks, bytes per layer forward, bytes
    backward)."""
    model.zero_grad(set_to_none=True)
    layer_bytes: list[int] = []
    out = model(plan.shard(video), cond, plan, layer_bytes)
    with comm_stats() as backward:
        (out * plan.shard(dout)).sum().backward()
    # Each rank's gradients cover the tokens it processed; every token of every block
    # was processed by exactly one rank, so the full gradient is the sum.
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return out.detach(), grads, layer_bytes, backward.bytes_sent


def run_check(config: Config, group=None, device: torch.device | str = "cpu", verbose: bool = True) -> dict:
    """Runs the single-process model, DSP and Ulysses on this rank of an initialised
    process group, and compares. Returns a summary: ok and the per-plan max errors (in
    units of the tolerance) agree on every rank; bytes_per_layer and backward_bytes are
    this rank's, measured with comm_stats; theory_per_layer assumes even pieces."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device(device)
    torch.manual_seed(config.seed)  # the same weights and inputs on every rank
    model = VideoDiT(config).to(device)
    generator = torch.Generator().manual_seed(config.seed + 1)
    shape = (config.batch, config.frames, config.patches)
    video = torch.randn(*shape, config.in_channels, generator=generator).to(device)
    cond = torch.randn(config.batch, config.channels, generator=generator).to(device)
    dout = torch.randn(*shape, config.in_channels, generator=generator).to(device)

    # The reference: the whole model on one process (each rank computes it).
    reference = SingleProcess(config)
    model.zero_grad(set_to_none=True)
    expected_out = model(video, cond, reference)
    (expected_out * dout).sum().backward()
    expected_grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    expected_out = expected_out.detach()

    plans = {"DSP": DSP(config, group), "Ulysses": Ulysses(config, group)}
    if world_size > config.heads and rank == 0 and verbose:
        # Ulysses splits the heads across ranks: the ranks beyond the head count get none
        # and idle during attention (they still take part in the exchanges).
        idle = world_size - config.heads
        print(
            f"Ulysses: {config.heads} heads on {world_size} ranks, {idle} "
            f"rank{'s' if idle > 1 else ''} idle during attention"
        )

    summary = {"ok": True, "world_size": world_size, "plans": {}}
    activation_bytes = config.batch * config.frames * config.patches * config.channels * 4
    even = config.frames % world_size == 0 and config.patches % world_size == 0
    even_heads = config.heads % world_size == 0
    for name, plan in plans.items():
        out, grads, layer_bytes, backward_bytes = run_parallel(model, plan, video, cond, dout, group)
        out_error = _max_error(out, plan.shard(expected_out), config)
        grad_errors = {key: _max_error(grads[key], expected_grads[key], config) for key in grads}
        worst_param = max(grad_errors, key=grad_errors.get)
        # Every rank's verdict, so that all ranks agree on the outcome.
        out_error = _all_reduce(out_error, dist.ReduceOp.MAX, group, device)
        grad_error = _all_reduce(grad_errors[worst_param], dist.ReduceOp.MAX, group, device)
        # Bytes: rank 0's, and the largest over ranks (uneven pieces send different amounts).
        per_layer_max = _all_reduce(max(layer_bytes), dist.ReduceOp.MAX, group, device)
        switches = 2 if name == "DSP" else 4  # tensors of activation size sent per layer
        theory = switches * (world_size - 1) * activation_bytes // world_size**2
        # The backward sends what the forward sent, in reverse.
        at_theory = backward_bytes == theory * config.layers
        at_theory &= all(sent == theory for sent in layer_bytes)
        exact_expected = even and (name == "DSP" or even_heads)
        all_match = _all_reduce(float(at_theory), dist.ReduceOp.MIN, group, device) == 1.0
        passed = out_error <= 1 and grad_error <= 1 and (all_match or not exact_expected)
        summary["ok"] &= passed
        summary["plans"][name] = dict(
            out_error=out_error, grad_error=grad_error, worst_param=worst_param,
            bytes_per_layer=layer_bytes, bytes_per_layer_max=int(per_layer_max),
            backward_bytes=backward_bytes, theory_per_layer=theory, volume_at_theory=all_match,
        )  # fmt: skip

    if rank == 0 and verbose:
        print_report(config, summary, activation_bytes)
    return summary


def print_report(config: Config, summary: dict, activation_bytes: int) -> None:
    world_size = summary["world_size"]
    print(
        f"video DiT: B={config.batch} T={config.frames} S={config.patches} C={config.channels} "
        f"heads={config.heads} layers={config.layers} on {world_size} ranks; activation M = "
        f"{activation_bytes} bytes (fp32)"
    )
    print("match vs single process (error / tolerance, <= 1 passes):")
    for name, result in summary["plans"].items():
        print(
            f"  {name:8s} output {result['out_error']:.3f}   parameter grads {result['grad_error']:.3f} "
            f"(worst: {result['worst_param']})"
        )
    print("bytes sent per layer by rank 0, measured with comm_stats (max over ranks):")
    header = f"  {'':8s} {'forward':>20s} {'backward':>10s} {'theory fwd (even)':>18s}  paper"
    print(header)
    paper = {"DSP": "2M/N", "Ulysses": "4M/N"}
    for name, result in summary["plans"].items():
        per_layer = result["bytes_per_layer"]
        forward = f"{per_layer[0]} ({result['bytes_per_layer_max']})"
        backward = result["backward_bytes"] // config.layers
        theory = result["theory_per_layer"]
        print(f"  {name:8s} {forward:>20s} {backward:>10d} {theory:>18d}  {paper[name]}")
    if {"DSP", "Ulysses"} <= summary["plans"].keys():
        dsp = summary["plans"]["DSP"]["bytes_per_layer"][0]
        ulysses = summary["plans"]["Ulysses"]["bytes_per_layer"][0]
        if ulysses:
            print(f"  DSP / Ulysses = {dsp / ulysses:.2f}")
    print("OK" if summary["ok"] else "FAILED")


# ----------------------------------------------------------------------------------
# launching
# ----------------------------------------------------------------------------------


def _spawned_rank(rank: int, world_size: int, init_file: str, config: Config, threads: int) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        summary = run_check(config)
    finally:
        dist.destroy_process_group()
    if not summary["ok"]:
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="gloo ranks to spawn (ignored under torchrun)")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=type(field.default), default=field.default)
    args = parser.parse_args(argv)
    config = Config(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Config)})

    if "RANK" in os.environ:  # under torchrun
        from seqpar_kernels.extension import build_info

        use_cuda = torch.cuda.is_available() and build_info()["cuda"]
        dist.init_process_group("nccl" if use_cuda else "gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        try:
            summary = run_check(config, device=device)
        finally:
            dist.destroy_process_group()
        return 0 if summary["ok"] else 1

    # Spawn gloo ranks on this machine; they share its cores.
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(
                _spawned_rank,
                args=(args.world_size, os.path.join(tmp, "init"), config, threads),
                nprocs=args.world_size,
                join=True,
            )
        except mp.ProcessExitedException as error:
            print(f"a rank failed: {error}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
