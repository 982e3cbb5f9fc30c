"""Video diffusion transformers from diffusers, sequence-parallel: a small random Latte
under DSP, Ulysses, ring and USP, and a small random Wan under Ulysses, ring and USP,
each called exactly as a pipeline calls it (the full latents on every rank) and
returning the full output on every rank, equal to the transformer run whole in one
process; a training step's gradients (each rank's share, summed) equal to its gradients.

    torchrun --nproc-per-node=4 examples/video_dsp.py     # NCCL on GPUs, else gloo on CPU

Prints, per model and mode, the output's and the gradients' largest error (relative to
their largest values) and the bytes each call sent (rank 0's, comm_stats), and exits
non-zero if any error exceeds the tolerance. With a real pipeline the same one line
does it (see docs/diffusers.md):

    pipe = LattePipeline.from_pretrained("maxin-cn/Latte-1", torch_dtype=torch.float16).to(device)
    sp_diffusers.apply(pipe.transformer, "dsp")
    frames = pipe(prompt, generator=torch.Generator(device).manual_seed(0)).frames  # the same on every rank
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

import seqpar_kernels as sp
import seqpar_kernels.integrations.diffusers as sp_diffusers

# max |parallel - one process| <= RTOL x max |one process|, for the output and each
# parameter's gradient (fp32); a gradient that is zero in exact arithmetic (a key
# projection's bias) is held to RTOL of the model's largest gradient instead.
RTOL = 1e-5


def latte():
    """A Latte of 2 spatial-temporal pairs, 8 heads of 16; 8 frames of 16 x 16 x 4
    latents (64 patches a frame), captions of 12 tokens; batch 2 (a prompt and its
    negative, as classifier-free guidance batches them)."""
    from diffusers import LatteTransformer3DModel

    model = LatteTransformer3DModel(
        num_attention_heads=8, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=16,
        patch_size=2, norm_type="ada_norm_single", num_embeds_ada_norm=1000, caption_channels=32,
        cross_attention_dim=128, video_length=8,
    )  # fmt: skip
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 16, 16), timestep=torch.tensor([999, 999]),
                  encoder_hidden_states=torch.randn(2, 12, 32))  # fmt: skip
    return model, inputs, ("dsp", "ulysses", "ring", "usp")


def wan():
    """A Wan of 2 blocks, 4 heads of 16; 5 frames of 8 x 12 x 16 latents (120 tokens),
    text of 16 tokens."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16,
                                  in_channels=16, out_channels=16, text_dim=32, freq_dim=64, ffn_dim=128,
                                  num_layers=2)  # fmt: skip
    inputs = dict(hidden_states=torch.randn(1, 16, 5, 8, 12), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 16, 32))  # fmt: skip
    return model, inputs, ("ulysses", "ring", "usp")


def _randomize(model):
    """Random weights everywhere (diffusers zero-initialises some output layers, which
    would hide errors behind them)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def _error(ours: torch.Tensor, exact: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(exact.abs().max().item(), floor, 1e-30)
    return (ours - exact).abs().max().item() / scale


def usp_mesh(device: torch.device):
    """A 2-D mesh: Ulysses degree 2 where the world size is even (else 1), the ring across."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    ulysses = 2 if world % 2 == 0 else 1
    return init_device_mesh(device.type, (world // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))


def run_check(device: torch.device | str = "cpu", verbose: bool = True) -> dict:
    """Every model and mode on this rank of an initialised process group against the
    model run whole. Returns {"ok": bool, "results": [(model, mode, output error,
    gradient error, bytes forward, bytes backward)]}, the same verdict on every rank."""
    device = torch.device(device)
    mesh = usp_mesh(device)  # collective: every rank, once
    results, ok = [], True
    for build in (latte, wan):
        torch.manual_seed(0)  # the same weights and inputs on every rank
        reference, inputs, modes = build()
        reference = _randomize(reference).to(device)
        inputs = {key: value.to(device) for key, value in inputs.items()}
        expected = reference(**inputs).sample
        dout = torch.randn_like(expected)
        (expected * dout).sum().backward()
        largest = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
        for mode in modes:
            model = copy.deepcopy(reference)
            model.zero_grad(set_to_none=True)
            groups = {"mesh": mesh} if mode == "usp" else {}
            sp_diffusers.apply(model, mode, **groups)  # the one line a pipeline needs
            with sp.comm_stats() as forward:
                out = model(**inputs).sample  # called as the pipeline calls it; the full output
            with sp.comm_stats() as backward:
                (out * dout).sum().backward()  # each rank: its share of every gradient
            sp.all_reduce_gradients(model, **groups)  # the shares summed
            out_error = _error(out.detach(), expected.detach())
            grad_error = max(_error(ours.grad, exact.grad, RTOL * largest)
                             for ours, exact in zip(model.parameters(), reference.parameters())
                             if exact.grad is not None)  # fmt: skip
            worst = torch.tensor([out_error, grad_error], dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            out_error, grad_error = worst.tolist()
            ok &= out_error <= RTOL and grad_error <= RTOL
            results.append((type(reference).__name__, mode, out_error, grad_error, forward.bytes_sent,
                            backward.bytes_sent))  # fmt: skip
    if verbose and dist.get_rank() == 0:
        print_report(results, ok)
    return {"ok": ok, "results": results}


def print_report(results, ok: bool) -> None:
    print(f"{dist.get_world_size()} ranks; errors relative to the single process's largest values "
          f"(tolerance {RTOL:g}); bytes sent by rank 0 per call")  # fmt: skip
    print(f"  {'model':26s} {'mode':8s} {'output':>9s} {'gradients':>10s} {'forward B':>10s} {'backward B':>11s}")
    for name, mode, out_error, grad_error, forward, backward in results:
        print(f"  {name:26s} {mode:8s} {out_error:9.1e} {grad_error:10.1e} {forward:10d} {backward:11d}")
    sent = {mode: forward for name, mode, _, _, forward, _ in results if name.startswith("Latte")}
    if sent.get("ulysses"):
        print(f"  Latte: DSP sends {sent['dsp'] / sent['ulysses']:.2f} x what Ulysses sends per call")
    print("OK" if ok else "FAILED")


def main() -> int:
    """Under torchrun: one rank per GPU over NCCL, else gloo ranks on the CPU."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        summary = run_check(device)
    finally:
        dist.destroy_process_group()
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
