"""Video diffusion transformers from diffusers under sequence parallelism: one call of the
transformer of Latte and of Wan (a denoising step's, as a pipeline makes it: full latents
on every rank, inference under no_grad) under each mode of
seqpar_kernels.integrations.diffusers, side by side with diffusers' own context
parallelism where it runs, and with one process.

Models (MODELS: the one place; SIZES says what each size runs): latent frames x height x width x
channels and the model's width from the published configurations, scaled to fit:
  Latte (maxin-cn/Latte-1: 16 frames of 64 x 64 x 4 latents at 512 px, patch 2, 16 heads
        of 72, 28 spatial-temporal pairs, T5 captions of 120 tokens)
  Wan   (Wan2.1-T2V-1.3B: 81 frames at 480 x 832 -> 21 x 60 x 104 x 16 latents, patch
        (1, 2, 2), 12 heads of 128, 30 blocks, 512 text tokens)
"default" keeps the frames, channels and head counts and scales the rest down (a few
seconds per candidate on 4 CPU ranks); "full" is the published shape and depth, on GPUs
(--full on CPUs runs the default's: the published shapes take hours there).
Random weights, the same on every rank; nothing is downloaded.

Candidates, timed side by side in one time_side_by_side call per model (interleaved
rounds; a sample is the slowest rank's time):
  single process      rank 0 alone, the whole transformer (on CPU with every core, as
                      one process would run alone); the other ranks wait
  dsp                 Latte only: frames and spatial positions sharded in turn
  ulysses, ring, usp  the tokens sharded; usp on a 2-D mesh, Ulysses degree 2 where the
                      world size is even (else 1)
  diffusers <method>  diffusers' own context parallelism (enable_parallelism with
                      ContextParallelConfig: ulysses_degree=P, ring_degree=P, or the
                      mesh's U x R), for a model with a _cp_plan, where it runs
Rows (bench "video"): one per mode of ours. The baseline is diffusers' context
parallelism with the same method (DSP's: its Ulysses, the method DSP is measured
against) where it ran, else the single process; the case label says which, and the
detail gives every candidate's time and why diffusers' did not run. bytes_sent_ours is
comm_stats on rank 0 and bytes_sent_theory the formula of docs/diffusers.md (tests/video_bytes.py:
the model's calls, each by seqpar_kernels.traffic), volume_at_theory the two equal on
every rank; the Latte rows' detail gives DSP's bytes over Ulysses'. check: the output
(the same on every rank) against the single process's, within OUTPUT_RTOL of its
largest value (fp32; the bf16 tolerance on GPUs).

On CPU ranks sharing a machine the modes' times are total work spread over the same
cores the single process has to itself (see bench_transformers), not a parallel speedup;
diffusers' context parallelism needs an accelerator (it places rank r on device
r % torch.accelerator.device_count()), so on CPU it is reported not run, with that
reason. On GPUs (NCCL) all candidates run.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.families.transformers import usp_mesh
from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import VIDEO_BENCH, Row, short_dtype
from bench.runner.timing import time_side_by_side
from seqpar_kernels import comm_stats
from tests.video_bytes import expected_bytes

BASELINE_NOTE = (
    "video: one call of a diffusers video transformer (Latte, Wan; inference) with the full latents on every "
    "rank; ours = each mode of seqpar_kernels.integrations.diffusers; baseline = diffusers' own context "
    "parallelism with the same method (DSP: its Ulysses) where it runs, else the single process (rank 0 "
    "alone, on CPU with every core); x = baseline time / ours. On CPU ranks sharing cores the time is total "
    "work, not a parallel speedup"
)

SINGLE = "single process"
OUTPUT_RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
SEED = 0


@dataclass(frozen=True)
class VideoModel:
    """A transformer's size and its latent video: (batch, channels, frames, height, width)."""

    name: str  # "Latte" | "Wan"
    frames: int
    height: int
    width: int
    channels: int
    heads: int
    head_dim: int
    layers: int  # Latte: spatial-temporal pairs; Wan: blocks
    text_tokens: int
    text_dim: int
    batch: int = 1
    source: str = ""  # the published configuration it scales

    @property
    def shape(self) -> str:
        return f"{self.label} ({self.source})"

    @property
    def label(self) -> str:
        return (f"{self.name} B={self.batch} latents {self.frames}x{self.height}x{self.width}x{self.channels}, "
                f"{self.heads} heads x {self.head_dim}, {self.layers} layers, text {self.text_tokens}")  # fmt: skip


LATTE = "maxin-cn/Latte-1"
WAN = "Wan2.1-T2V-1.3B"
MODELS = {
    "quick": (VideoModel("Latte", 4, 8, 8, 4, 4, 8, 1, 8, 16, source=LATTE),
              VideoModel("Wan", 3, 8, 8, 16, 4, 8, 1, 8, 16, source=WAN)),
    "default": (VideoModel("Latte", 16, 16, 16, 4, 16, 8, 2, 30, 64, source=LATTE),
                VideoModel("Wan", 21, 12, 20, 16, 12, 16, 2, 64, 64, source=WAN)),
    "full": (VideoModel("Latte", 16, 64, 64, 4, 16, 72, 28, 120, 4096, source=LATTE),
             VideoModel("Wan", 21, 60, 104, 16, 12, 128, 30, 512, 4096, source=WAN)),
}  # fmt: skip


def models_at(ctx: Context) -> str:
    """The MODELS entry a run takes: --full takes the published shapes on GPUs only."""
    return "default" if ctx.size == "full" and not ctx.on_gpu else ctx.size


SIZES = Sizes(
    quick=Size("Latte and Wan, tiny shapes", 5),
    default=Size("Latte 16 x 16 x 16 x 4 latents and Wan 21 x 12 x 20 x 16, 2 blocks: DSP, Ulysses, ring, "
                 "USP and diffusers' own against one process", 14),
    full=Size("the default's shapes (the published ones on GPUs)", 14,
              gpu_runs="Latte 16 x 64 x 64 x 4 (28 pairs) and Wan 21 x 60 x 104 x 16 (30 blocks)"),
)  # fmt: skip


def diffusers_unavailable() -> str | None:
    """Why the family cannot run (diffusers missing or too old), or None."""
    try:
        import seqpar_kernels.integrations.diffusers  # noqa: F401
    except ImportError as error:
        cause = f" ({error.__cause__})" if error.__cause__ is not None else ""
        return f"{type(error).__name__}: {error}{cause}"
    return None


def build(size: VideoModel, device: torch.device, dtype: torch.dtype):
    """The transformer (random weights, the same on every rank), its inputs, and the
    shape the byte formulas read."""
    import diffusers

    torch.manual_seed(SEED)
    if size.name == "Latte":
        model = diffusers.LatteTransformer3DModel(
            num_attention_heads=size.heads, attention_head_dim=size.head_dim, in_channels=size.channels,
            out_channels=2 * size.channels, num_layers=size.layers, sample_size=size.height, patch_size=2,
            norm_type="ada_norm_single", num_embeds_ada_norm=1000, caption_channels=size.text_dim,
            cross_attention_dim=size.heads * size.head_dim, video_length=size.frames,
        )  # fmt: skip
        shape = dict(batch=size.batch, frames=size.frames, positions=size.height * size.width // 4,
                     width=size.heads * size.head_dim, heads=size.heads, head_dim=size.head_dim,
                     layers=size.layers, out_per_token=4 * 2 * size.channels)  # fmt: skip
    else:
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=size.heads, attention_head_dim=size.head_dim,
            in_channels=size.channels, out_channels=size.channels, text_dim=size.text_dim, freq_dim=256,
            ffn_dim=4 * size.heads * size.head_dim, num_layers=size.layers,
        )  # fmt: skip
        shape = dict(batch=size.batch, tokens=[size.frames * size.height * size.width // 4], heads=size.heads,
                     head_dim=size.head_dim, layers=size.layers, out_per_token=4 * size.channels)  # fmt: skip
    # Built in fp32; cast only to another dtype (diffusers advises against any .to(dtype)).
    model = (model.to(device=device) if dtype == torch.float32 else model.to(device=device, dtype=dtype)).eval()
    generator = torch.Generator(device=device).manual_seed(SEED + 1)
    inputs = dict(
        hidden_states=torch.randn(size.batch, size.channels, size.frames, size.height, size.width,
                                  generator=generator, device=device).to(dtype),
        timestep=torch.full((size.batch,), 500, device=device),
        encoder_hidden_states=torch.randn(size.batch, size.text_tokens, size.text_dim, generator=generator,
                                          device=device).to(dtype),
    )  # fmt: skip
    return model, inputs, shape


def grid(ctx: Context, method: str, mesh) -> tuple[int, int]:
    """(Ulysses degree, ring degree) of a method on this run's ranks."""
    if method == "usp":
        ring, ulysses = mesh.shape
        return ulysses, ring
    return (ctx.world_size, 1) if method in ("ulysses", "dsp") else (1, ctx.world_size)


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def diffusers_candidates(ctx: Context, model, inputs, shape, mesh, expected) -> tuple[dict, dict[str, str]]:
    """diffusers' own context parallelism of each method, on copies of the model:
    ({method: call}, {method: why it did not run, or its output's error against the
    single process's}). enable_parallelism is collective
    (a mesh of its own), so every rank tries every method; a method runs only where it
    succeeded on every rank, including one call. Where the ranks do not divide the
    tokens or the heads, its "anything" variants (ulysses_anything, ring_anything)."""
    import diffusers

    calls, reasons = {}, {}
    reason = None
    ContextParallelConfig = getattr(diffusers, "ContextParallelConfig", None)  # noqa: N806 - diffusers' class
    if ContextParallelConfig is None:
        reason = f"diffusers {diffusers.__version__} has no context parallelism (it came in 0.36)"
    elif getattr(model, "_cp_plan", None) is None:
        reason = f"{type(model).__name__} has no _cp_plan: diffusers' context parallelism does not cover it"
    elif not (torch.accelerator.is_available() and torch.accelerator.device_count() > 0):
        reason = ("diffusers' enable_parallelism needs an accelerator (it places rank r on device "
                  "r % torch.accelerator.device_count()); this machine has none")  # fmt: skip
    if reason is not None:
        return {}, {method: f"not run: {reason}" for method in ("ulysses", "ring", "usp")}
    for method in ("ulysses", "ring", "usp"):
        ulysses, ring = grid(ctx, method, mesh)
        tokens = shape["tokens"][0] if "tokens" in shape else shape["positions"]
        uneven = tokens % ctx.world_size != 0 or shape["heads"] % ulysses != 0
        anything = {"ulysses_anything": uneven} if ring == 1 else {"ring_anything": uneven} if ulysses == 1 else {}
        copied = copy.deepcopy(model)
        error = ""
        try:
            config = ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring, **anything)
            copied.enable_parallelism(config=config)
            out = forward(copied, inputs)
            mismatch = (out.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
        except Exception as failure:  # noqa: BLE001 - reported as not run, with the reason
            error = f"{type(failure).__name__}: {' '.join(str(failure).split())[:300]}"
        failed = ctx.reduce_over_ranks(torch.tensor([int(bool(error))]), op=dist.ReduceOp.MAX).item()
        if failed:
            reasons[method] = f"not run: {error or 'failed on another rank'}"
        else:
            calls[f"diffusers {method}"] = lambda copied=copied: forward(copied, inputs)
            reasons[method] = f"output error {mismatch:.1e} of its largest value vs the single process"
    return calls, reasons


def measure(size: VideoModel, ctx: Context, mesh) -> list[Row]:
    import seqpar_kernels.integrations.diffusers as sp_diffusers

    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    model, inputs, shape = build(size, ctx.device, dtype)
    expected = forward(model, inputs)  # every rank: the reference of the check
    scale = expected.float().abs().max().item()

    def single():
        if ctx.is_root:
            with ctx.every_core():
                return forward(model, inputs)
        return None

    modes = ("dsp", "ulysses", "ring", "usp") if size.name == "Latte" else ("ulysses", "ring", "usp")
    ours, checks, volumes = {}, {}, {}
    for mode in modes:
        parallel = copy.deepcopy(model)
        sp_diffusers.apply(parallel, mode, **({"mesh": mesh} if mode == "usp" else {}))
        ours[mode] = lambda parallel=parallel: forward(parallel, inputs)
        with comm_stats() as sent:
            out = ours[mode]()
        error = (out.float() - expected.float()).abs().max().item() / max(scale, 1e-30)
        error = ctx.reduce_over_ranks(torch.tensor([error], dtype=torch.float64)).item()
        checks[mode] = ("matches" if error <= OUTPUT_RTOL[dtype] else f"MISMATCH max err {error:.1e}", error)
        ulysses, _ = grid(ctx, mode, mesh)
        theory = expected_bytes(mode, shape, ctx.rank, ctx.world_size, torch.finfo(dtype).bits // 8, ulysses)
        at_theory = ctx.reduce_over_ranks(torch.tensor([int(sent.bytes_sent == theory)]), op=dist.ReduceOp.MIN)
        volumes[mode] = (sent.bytes_sent, theory, bool(at_theory.item()))
    theirs, notes_on_theirs = diffusers_candidates(ctx, model, inputs, shape, mesh, expected)

    timings = time_side_by_side({SINGLE: single, **ours, **theirs}, ctx)
    times = "; ".join(f"{name} {timing.median_s * 1e3:.1f} ms" for name, timing in timings.items())
    if len(set(notes_on_theirs.values())) == 1:  # one reason for all three
        theirs_note = f"diffusers' context parallelism {next(iter(notes_on_theirs.values()))}"
    else:
        theirs_note = "; ".join(f"diffusers {method} {note}" for method, note in notes_on_theirs.items())
    rows = []
    for mode in modes:
        baseline = f"diffusers {'ulysses' if mode == 'dsp' else mode}"
        baseline = baseline if baseline in timings else SINGLE
        check, error = checks[mode]
        measured, theory, at_theory = volumes[mode]
        ulysses, ring = grid(ctx, mode, mesh)
        notes = [f"{short_dtype(dtype)} inference; output error {error:.1e} of its largest value vs the single "
                 f"process", f"times: {times}", theirs_note]  # fmt: skip
        if size.name == "Latte" and volumes["ulysses"][0]:
            notes.append(f"DSP sends {volumes['dsp'][0] / volumes['ulysses'][0]:.2f} x Ulysses' bytes (rank 0)")
        rows.append(timed_row(
            ctx, {"ours": timings[mode], "baseline": timings[baseline]},
            bench=VIDEO_BENCH, case=f"{size.name} {mode} vs {baseline}", shape=size.shape,
            dtype=short_dtype(dtype), check=check, bytes_sent_ours=measured, bytes_sent_theory=theory,
            volume_at_theory=at_theory, ulysses_degree=ulysses, ring_degree=ring,
            detail="; ".join(note for note in notes if note),
        ))  # fmt: skip
    return rows


def run(ctx: Context) -> list[Row]:
    reason = diffusers_unavailable()
    if reason is not None:
        ctx.log(f"video: skipped ({reason})")
        return []
    ctx.log(BASELINE_NOTE)
    ctx.log_every_core("video")
    mesh = usp_mesh(ctx)  # collective: every rank, once
    timing_ctx = ctx if ctx.quick else dataclasses.replace(ctx, warmup=1, reps=3, max_reps=7, seconds_per_case=10.0)
    rows = []
    for size in MODELS[models_at(ctx)]:
        rows += run_case(timing_ctx, VIDEO_BENCH, measure, size, mesh)
    return rows


FAMILY = Family(
    name="video",
    order=130,
    measures="diffusers video transformers (Latte, Wan) under each mode of the diffusers integration",
    run=run,
    sizes=SIZES,
    timed_share=0.63,
    work={"float": 0.49, "exchange": 0.01, "host": 0.5},
    fewest_share=1.0,  # its 1 warm-up + 3 timed rounds a case are the fewest already
    metadata=lambda: {"video_baseline": BASELINE_NOTE, "video_skipped": diffusers_unavailable()},
)
