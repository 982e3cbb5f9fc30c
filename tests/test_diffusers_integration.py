"""diffusers transformers under sequence parallelism (seqpar_kernels.integrations.diffusers):
tiny random models from configs (nothing downloaded), called with the full inputs on every
rank as a pipeline calls them, must return the single-process model's output on every rank,
and the ranks' gradient shares (summed by all_reduce_gradients) must be its gradients: Latte
under DSP, Ulysses, ring and USP, Wan under Ulysses, ring and USP, CogVideoX, HunyuanVideo
(padded prompt), LTX-Video (text mask) and Flux (joint text-image attention), with frame and
token counts no world size divides, and heads no world size divides (3). The bytes sent
(comm_stats) must be the formulas of docs/diffusers.md, and DSP on Latte must send at most half of what
Ulysses sends. LattePipeline and WanPipeline run unchanged and give every rank the whole
pipeline's frames. What the integration cannot run raises a ValueError on every rank.

The single-process reference is the same model without apply(), run whole on each rank.
Run against the installed diffusers; tests/test_oldest_releases.py reruns some of it under
the oldest release the README promises, where the test set-up installed it.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises, timeout_group  # noqa: E402
from optional_dependency import assert_never_imported  # noqa: E402
from video_bytes import expected_bytes  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent

FP32_RTOL = 1e-5  # of the output's largest value; of each parameter's largest gradient
# A floor for gradients that are zero in exact arithmetic (a key projection's bias: softmax
# ignores what it adds to a whole row of scores), relative to the model's largest gradient.
GRADIENT_FLOOR = 1e-5

# ----------------------------------------------------------------------------------
# tiny models: 5 frames, 35 or 25 tokens per frame or video, 3 heads, 7 text tokens
# ----------------------------------------------------------------------------------


def _randomized(model):
    """Random weights everywhere, the tables diffusers initialises to zero included,
    so that every path carries a signal."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def _latte(layers=2, batch=2, frames=5, side=10):
    """Latte: (batch, 4, frames, side, side) latents, patch 2: (side/2)^2 positions per
    frame; 3 heads of 8. shape: what the byte formulas read."""
    torch.manual_seed(0)
    model = diffusers.LatteTransformer3DModel(
        num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=2, num_layers=layers,
        sample_size=side, patch_size=2, norm_type="ada_norm_single", num_embeds_ada_norm=1000,
        caption_channels=16, cross_attention_dim=24, video_length=frames, activation_fn="gelu-approximate",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, side, side, generator=generator),
                  timestep=torch.tensor([10, 500][:batch]), encoder_hidden_states=torch.randn(batch, 7, 16,
                  generator=generator))  # fmt: skip
    shape = dict(batch=batch, frames=frames, positions=(side // 2) ** 2, width=24, heads=3, head_dim=8,
                 layers=layers, out_per_token=2 * 2 * 2)  # fmt: skip
    return _randomized(model), inputs, shape


def _wan(layers=2, per_token_timestep=False):
    """Wan: (2, 4, 5, 2, 14) latents, patch (1, 2, 2): 35 tokens; 3 heads of 12."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers, rope_max_seq_len=32,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    timestep = torch.randint(0, 1000, (2, 35), generator=generator) if per_token_timestep else torch.tensor([10, 500])
    inputs = dict(hidden_states=torch.randn(2, 4, 5, 2, 14, generator=generator), timestep=timestep,
                  encoder_hidden_states=torch.randn(2, 7, 16, generator=generator))  # fmt: skip
    shape = dict(batch=2, tokens=[35], heads=3, head_dim=12, layers=layers, out_per_token=4 * 2 * 2)
    return _randomized(model), inputs, shape


def _cogvideox():
    """CogVideoX with rotary embeddings: 35 video tokens joined by 7 text tokens."""
    torch.manual_seed(0)
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=16, num_layers=1, sample_width=14, sample_height=2, sample_frames=17, patch_size=2,
        max_text_seq_length=7, use_rotary_positional_embeddings=True,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 5, 4, 2, 14, generator=generator), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 7, 16, generator=generator),
                  image_rotary_emb=tuple(torch.randn(35, 8, generator=generator) for _ in range(2)))  # fmt: skip
    shape = dict(batch=2, tokens=[35, 7], heads=3, head_dim=8, layers=1, out_per_token=4 * 2 * 2)
    return _randomized(model), inputs, shape


def _hunyuan_video():
    """HunyuanVideo: 35 video tokens and a prompt of 7 tokens padded to 9 (masked)."""
    torch.manual_seed(0)
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=3, attention_head_dim=12, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(4, 4, 4),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(1, 9, dtype=torch.long)
    mask[:, 7:] = 0
    inputs = dict(hidden_states=torch.randn(1, 4, 5, 2, 14, generator=generator), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 9, 16, generator=generator), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(1, 8, generator=generator),
                  guidance=torch.tensor([3500.0]))  # fmt: skip
    shape = dict(batch=1, tokens=[35, 7], heads=3, head_dim=12, layers=2, out_per_token=4 * 2 * 2)
    return _randomized(model), inputs, shape


def _ltx():
    """LTX-Video: 35 tokens (5 x 1 x 7), cross-attention to 7 text tokens, one row's
    last two masked."""
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=3,
                                                 attention_head_dim=8, cross_attention_dim=24, num_layers=1,
                                                 caption_channels=16)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    inputs = dict(hidden_states=torch.randn(2, 35, 4, generator=generator), timestep=torch.tensor([10, 500]),
                  encoder_hidden_states=torch.randn(2, 7, 16, generator=generator), encoder_attention_mask=mask,
                  num_frames=5, height=1, width=7)  # fmt: skip
    shape = dict(batch=2, tokens=[35], heads=3, head_dim=8, layers=1, out_per_token=4)
    return _randomized(model), inputs, shape


def _flux():
    """Flux: 35 image tokens (5 x 7) and 7 text tokens in one joint attention."""
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                             attention_head_dim=12, num_attention_heads=3, joint_attention_dim=16,
                                             pooled_projection_dim=8, axes_dims_rope=(4, 4, 4))  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    rows, columns = torch.meshgrid(torch.arange(5.0), torch.arange(7.0), indexing="ij")
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], dim=-1).reshape(35, 3)
    inputs = dict(hidden_states=torch.randn(1, 35, 4, generator=generator),
                  encoder_hidden_states=torch.randn(1, 7, 16, generator=generator),
                  pooled_projections=torch.randn(1, 8, generator=generator), timestep=torch.tensor([0.5]),
                  img_ids=image_ids, txt_ids=torch.zeros(7, 3))  # fmt: skip
    shape = dict(batch=1, tokens=[35, 7], heads=3, head_dim=12, layers=2, out_per_token=4)
    return _randomized(model), inputs, shape


MODELS = {"latte": _latte, "wan": _wan, "cogvideox": _cogvideox, "hunyuan_video": _hunyuan_video, "ltx": _ltx,
          "flux": _flux}  # fmt: skip

# ----------------------------------------------------------------------------------
# the parity cases, run on every rank
# ----------------------------------------------------------------------------------


def _groups(mode, ulysses):
    """apply()'s group arguments: the world (a gloo group whose collectives time out),
    or a 2-D DeviceMesh for usp."""
    if mode != "usp":
        return {"group": timeout_group()}
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    return {"mesh": init_device_mesh("cpu", (world // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))}


def _scaled_error(ours: torch.Tensor, exact: torch.Tensor, floor: float = 0.0) -> float:
    """max |ours - exact| over max |exact| (or floor, where larger)."""
    scale = max(exact.double().abs().max().item(), floor)
    return (ours.double() - exact.double()).abs().max().item() / max(scale, 1e-30)


def _run(model, inputs, case):
    """The output of one call, and a fixed output gradient."""
    if case.get("checkpointing"):
        model.enable_gradient_checkpointing()
    model.train(case.get("train", False))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.get("autocast", False)):
        out = model(**inputs, return_dict=False)[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    return out, dout


def _ranks_ready() -> None:
    """A barrier on the default group (no short timeout) after building a model: the
    first model of a class imports its diffusers module, which on a busy machine can
    keep a rank longer than the timeout group waits in the next collective."""
    torch.distributed.barrier()


@on_every_rank
def run_parity_cases(cases):
    """Per case: the output and every parameter's gradient against the single-process
    model's, the bytes against the formulas. Returns (failures, bytes sent per case id).

    Precision: fp32 within FP32_RTOL; dtype=bf16 (weights and inputs in bf16, as a
    pipeline runs) the output within twice the single-process bf16 model's error
    against fp32 (the gradients are left out: each rank's share rounded to bf16 before
    they are summed is the convention's rounding, not the model's); autocast=True (fp32
    weights, bf16 compute, as training runs) output and gradients by the same rule."""
    import seqpar_kernels as sp
    import seqpar_kernels.integrations.diffusers as sp_diffusers

    rank, pieces = torch.distributed.get_rank(), torch.distributed.get_world_size()
    failures, sent = [], {}
    for case in cases:
        name, mode, dtype = case["id"], case["mode"], case.get("dtype", torch.float32)
        ulysses = case.get("ulysses", 1)
        reference, inputs, shape = MODELS[case["model"]](**case.get("config", {}))
        inputs.update(case.get("inputs", {}))
        _ranks_ready()
        model = copy.deepcopy(reference).to(dtype)
        groups = _groups(mode, ulysses)
        sp_diffusers.apply(model, mode, **groups)
        low_inputs = {key: value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
                      for key, value in inputs.items()}  # fmt: skip
        expected, dout = _run(reference, inputs, dict(case, autocast=False))
        (expected * dout).sum().backward()
        with sp.comm_stats() as forward:
            out, _ = _run(model, low_inputs, case)
        with sp.comm_stats() as backward:
            (out * dout.to(out.dtype)).sum().backward()
        sp.all_reduce_gradients(model, **groups)
        pairs = [("output", out.detach(), expected.detach(), 0.0)]
        largest = max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
        pairs += [(f"grad of {param_name}", ours.grad if ours.grad is not None else torch.zeros_like(ours),
                   exact.grad, GRADIENT_FLOOR * largest)
                  for (param_name, ours), exact in zip(model.named_parameters(), reference.parameters())
                  if exact.grad is not None]  # fmt: skip
        low_precision = dtype != torch.float32 or case.get("autocast", False)
        if dtype != torch.float32:
            pairs = pairs[:1]
        if not low_precision:
            for what, ours, exact, floor in pairs:
                error = _scaled_error(ours, exact, floor)
                if not error <= FP32_RTOL:
                    failures.append(f"{name} rank {rank}: {what} error {error:.2e} > {FP32_RTOL}")
        else:  # within twice the single-process model's error in the same dtype, both against fp32
            single = copy.deepcopy(reference).to(dtype)
            single.zero_grad()
            single_out, _ = _run(single, low_inputs, case)
            (single_out * dout.to(single_out.dtype)).sum().backward()
            singles = [single_out.detach()] + [p.grad for p in single.parameters() if p.grad is not None]
            for (what, ours, exact, floor), alone in zip(pairs, singles):
                ours_error, single_error = _scaled_error(ours, exact, floor), _scaled_error(alone, exact, floor)
                if not ours_error <= 2 * single_error + 1e-3:
                    failures.append(f"{name} rank {rank}: {what} error {ours_error:.2e} > 2 x single-process "
                                    f"{single_error:.2e}")  # fmt: skip
        element = torch.finfo(out.dtype).bits // 8
        for direction, measured in (("forward", forward.bytes_sent), ("backward", backward.bytes_sent)):
            formula = expected_bytes(mode, shape, rank, pieces, element, ulysses, direction == "forward")
            if direction == "backward" and case.get("checkpointing") and mode != "dsp":
                # The recomputation runs the attention again (DSP's reshards follow the
                # blocks' forwards, which a checkpoint's recomputation stops before).
                formula += expected_bytes(mode, shape, rank, pieces, element, ulysses, forward=True, gather=False)
            if case.get("check_bytes", True) and measured != formula:
                failures.append(f"{name} rank {rank}: {direction} sent {measured} bytes, the formula {formula}")
        sent[name] = forward.bytes_sent
    return failures, sent


def _case(model, mode, **extra):
    extra_id = "-".join(f"{key}={value}" for key, value in extra.items() if key not in ("config", "inputs"))
    return dict(id="-".join(filter(None, [model, mode, extra_id])), model=model, mode=mode, **extra)


def _run_cases(world_size, cases):
    results = pool_for(world_size).run(run_parity_cases, cases)
    failures = [failure for per_rank, _ in results for failure in per_rank]
    assert not failures, "\n".join(failures)
    return [sent for _, sent in results]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_latte_and_wan_match_one_process(world_size):
    # 5 frames of 25 positions (Latte), 35 tokens (Wan), 3 heads: uneven on 2, 3 and 4 ranks.
    cases = [_case("latte", "dsp"), _case("latte", "ulysses"), _case("wan", "ulysses"), _case("wan", "ring")]
    sent = _run_cases(world_size, cases)
    # The call's bytes, all ranks together: two reshards per spatial-temporal pair against
    # Ulysses' four exchanges per spatial attention (and the same gather of the output).
    dsp, ulysses = (sum(per_rank[name] for per_rank in sent) for name in ("latte-dsp", "latte-ulysses"))
    assert dsp <= ulysses / 2, sent


def test_usp_grids():
    cases = [_case("wan", "usp", ulysses=2), _case("latte", "usp", ulysses=2), _case("wan", "usp", ulysses=1),
             _case("flux", "usp", ulysses=4)]  # fmt: skip
    _run_cases(4, cases)


def test_more_transformers_and_options():
    cases = [
        _case("cogvideox", "ulysses"),
        _case("hunyuan_video", "ulysses"),  # the padded prompt is cut to its 7 tokens
        _case("ltx", "ring"),
        _case("flux", "ulysses"),
        _case("wan", "ulysses", config=dict(per_token_timestep=True)),  # Wan 2.2 TI2V
        _case("latte", "dsp", inputs=dict(enable_temporal_attentions=False), check_bytes=False),
        _case("latte", "dsp", train=True, checkpointing=True),
        _case("wan", "ring", train=True, checkpointing=True),
        _case("latte", "dsp", dtype=torch.bfloat16),
        _case("wan", "ulysses", dtype=torch.bfloat16),
        _case("latte", "dsp", autocast=True, check_bytes=False),
        _case("wan", "ulysses", autocast=True, check_bytes=False),
    ]
    _run_cases(3, cases)


# ----------------------------------------------------------------------------------
# Pipelines run unchanged
# ----------------------------------------------------------------------------------


def _latte_pipeline():
    """LattePipeline around _latte's transformer, a tiny VAE (scale 2), no text encoder
    (prompt embeddings given): 5 frames of 40 x 40 pixels, 100 patches a frame."""
    transformer, _, _ = _latte(layers=1)
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2)  # fmt: skip
    pipe = diffusers.LattePipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                   scheduler=diffusers.DDIMScheduler())  # fmt: skip
    embeds = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(2))
    return pipe, dict(prompt_embeds=embeds, negative_prompt=None, negative_prompt_embeds=torch.zeros_like(embeds),
                      video_length=5, height=40, width=40, mask_feature=False)  # fmt: skip


def _wan_pipeline():
    """WanPipeline with a Wan of 16 latent channels, a tiny Wan VAE, no text encoder: 9
    frames of 48 x 48 pixels, 3 x 3 x 3 = 27 tokens."""
    torch.manual_seed(0)
    transformer = _randomized(diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32))  # fmt: skip
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                     temperal_downsample=[False, True, True])  # fmt: skip
    pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))  # fmt: skip
    embeds = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(2))
    return pipe, dict(prompt_embeds=embeds, negative_prompt_embeds=torch.zeros_like(embeds), num_frames=9, height=48,
                      width=48)  # fmt: skip


@on_every_rank
def run_pipelines(cases):
    """Each pipeline whole, then with apply(pipe.transformer, mode): the frames (two
    denoising steps, classifier-free guidance, the VAE's decoding) against the whole
    pipeline's, and the same on every rank (their sums gathered)."""
    import seqpar_kernels.integrations.diffusers as sp_diffusers

    failures = []
    for name, mode in cases:
        pipe, arguments = {"latte": _latte_pipeline, "wan": _wan_pipeline}[name]()
        pipe.set_progress_bar_config(disable=True)
        _ranks_ready()

        def frames():
            return pipe(**arguments, num_inference_steps=2, generator=torch.Generator().manual_seed(1),
                        output_type="pt").frames  # fmt: skip

        expected = frames()
        sp_diffusers.apply(pipe.transformer, mode, group=timeout_group())
        ours = frames()
        error = _scaled_error(ours, expected)
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(sums, ours.double().sum().reshape(1), group=timeout_group())
        if not error <= FP32_RTOL or len({value.item() for value in sums}) != 1:
            failures.append(f"{name} {mode}: frames error {error:.1e}, sums per rank {[v.item() for v in sums]}")
    return failures


def test_pipelines_run_unchanged():
    for failures in pool_for(3).run(run_pipelines, [("latte", "dsp"), ("wan", "ulysses")]):
        assert not failures, failures


# ----------------------------------------------------------------------------------
# What cannot run raises, on every rank
# ----------------------------------------------------------------------------------


class _ProcessorWithoutSDPA:
    """Wan's self-attention without rotary embeddings, by matmul and softmax."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = (projection(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
                   for projection in (attn.to_q, attn.to_k, attn.to_v))  # fmt: skip
        weights = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(dim=-1)
        return attn.to_out[0]((weights @ v).transpose(1, 2).flatten(2))


@on_every_rank
def run_unsupported_cases():
    import seqpar_kernels.integrations.diffusers as sp_diffusers

    group = {"group": timeout_group()}
    rank = torch.distributed.get_rank()
    problems = {}
    latte, latte_inputs, _ = _latte(layers=1)
    wan, wan_inputs, _ = _wan(layers=1)
    hunyuan, hunyuan_inputs, _ = _hunyuan_video()
    problems["bad mode"] = raises(lambda: sp_diffusers.apply(latte, "megatron", **group), "mode must be")
    problems["dsp without alternating blocks"] = raises(lambda: sp_diffusers.apply(wan, "dsp", **group),
                                                         "alternate spatial and temporal")  # fmt: skip
    torch.manual_seed(0)
    dit = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                          sample_size=8, patch_size=2)  # fmt: skip
    _ranks_ready()
    problems["no plan"] = raises(lambda: sp_diffusers.apply(dit, "ulysses", **group), "no sequence-parallel plan")
    problems["usp on a group"] = raises(lambda: sp_diffusers.apply(wan, "usp", **group), "mesh")
    # Inputs that differ by rank raise on every rank, before any piece is cut.
    sp_diffusers.apply(wan, "ulysses", **group)
    problems["applied twice"] = raises(lambda: sp_diffusers.apply(wan, "ring", **group), "already")
    different = dict(wan_inputs, encoder_hidden_states=wan_inputs["encoder_hidden_states"][:, : 7 - rank])
    problems["inputs differ by rank"] = raises(lambda: wan(**different), "different inputs")
    # An attention that does not call torch's SDPA (another backend, a processor of one's
    # own) would bypass the sharded attention.
    native = wan.blocks[0].attn1.processor
    wan.blocks[0].attn1.set_processor(_ProcessorWithoutSDPA())
    problems["not the native backend"] = raises(lambda: wan(**wan_inputs), "native")
    wan.blocks[0].attn1.set_processor(native)
    sp_diffusers.remove(wan)
    wan(**wan_inputs)  # runs whole again
    # DSP gives every rank whole frames: fewer frames than ranks raise.
    sp_diffusers.apply(latte, "dsp", **group)
    if torch.distributed.get_world_size() > 1:
        one_frame = dict(latte_inputs, hidden_states=latte_inputs["hidden_states"][:, :, :1])
        problems["fewer frames than ranks"] = raises(lambda: latte(**one_frame), "at least as many frames")
    # A prompt batch whose padded lengths differ leaves a mask the attention cannot take.
    sp_diffusers.apply(hunyuan, "ulysses", **group)
    two_prompts = {key: torch.cat([value, value]) if isinstance(value, torch.Tensor) else value
                   for key, value in hunyuan_inputs.items()}  # fmt: skip
    two_prompts["encoder_attention_mask"][1, 5:] = 0
    problems["prompts of different lengths"] = raises(lambda: hunyuan(**two_prompts), "different lengths")
    return {name: problem for name, problem in problems.items() if problem is not None}


def test_what_cannot_run_raises():
    for per_rank in pool_for(3).run(run_unsupported_cases):
        assert not per_rank, per_rank


EXAMPLE = REPOSITORY / "examples" / "video_dsp.py"


def run_example():
    """examples/video_dsp.py's check on this rank (the example loaded as a module once
    per worker: examples/ is not a package)."""
    import importlib.util

    name = "_seqpar_example_video_dsp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name].run_check(verbose=False)


def test_example_matches_one_process():
    for summary in pool_for(3).run(run_example):
        assert summary["ok"], summary["results"]
        assert [(name, mode) for name, mode, *_ in summary["results"]] == [
            ("LatteTransformer3DModel", mode) for mode in ("dsp", "ulysses", "ring", "usp")
        ] + [("WanTransformer3DModel", mode) for mode in ("ulysses", "ring", "usp")]


def test_core_package_never_imports_diffusers():
    assert_never_imported("diffusers")
