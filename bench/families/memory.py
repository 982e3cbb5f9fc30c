"""Peak memory per rank of a training step of a small Llama at growing lengths: one rank
against P ranks, with and without the MLP in tiles and activation offload; the bytes per
token each configuration needs, the longest sequence that fits a budget, and what that
makes of Llama-8B.

The step is the one SequenceParallelTrainer runs (seqpar_kernels.integrations.
transformers): shard_batch, the model's forward with activation checkpointing
(transformers' gradient_checkpointing), logits for no token, the loss from the hidden
states (causal_lm_loss: sequence_parallel_cross_entropy, LOSS_CHUNK tokens' logits at a
time, so that the loss adds a constant), backward. fp32, one sequence of T tokens
(random ids, seeded), ring attention in the balanced layout.

Configurations (rows "memory", case "<configuration> T=<tokens>"):
  1 rank                       rank 0 alone, on a group of its own (the baseline of every row)
  1 rank, tiled + offload      ... every MLP in tiles of TILE tokens (tile_mlp), the
                               checkpoints in host memory (offload_activations)
  P ranks                      every rank, T / P tokens each
  P ranks, tiled               ... tile_mlp
  P ranks, tiled + offload     ... and offload_activations
ours_peak_bytes: the largest over the ranks of the most bytes the allocator held during
the step beyond what it held before (the gradients included): on CPU the allocator's
own counters (peak_bytes: seqpar_kernels.testing.peak_cpu_memory), on GPUs
torch.cuda.max_memory_allocated. Offloaded tensors live outside the allocator (pinned
host memory on GPUs, numpy buffers on CPU), so they are not counted. baseline_peak_bytes:
"1 rank" at the same T. ours_s / baseline_s: one step each (not a timing: the time
family is transformers). check: the step's loss against "1 rank"'s (fp32: 1e-5 relative).
The "1 rank" steps keep rank 0's share of the cores (not every core, as the loss and
transformers families give their one process): they measure memory, not time, and
threads would only add the intra-op pools' buffers to the peak they are compared with.

Then, per configuration, a line fitted through its (T, peak) points (least squares):
bytes per token of the sequence (per rank) and the intercept; and the longest sequence
within the budget, (budget - intercept) / slope, where the budget is the device's memory
(on GPUs its total memory, on CPUs the memory available at the start over the ranks)
or SEQPAR_BENCH_MEMORY_BUDGET (bytes, or with a unit: "80GiB"). Beyond the measured
lengths this is a linear extrapolation and says so.

The log-prob path (rows "memory", case "logprobs <P> ranks T=<tokens>"): what TRL's DPO
and GRPO ask of the model's head, each token's log-probability of its label and the
entropy of its distribution, forward and backward, from hidden states of T tokens (the
same model's head, random hidden states, seeded). ours: causal_lm_logprobs on every
rank, T / P tokens each, LOSS_CHUNK tokens' logits at a time; baseline: rank 0 alone,
log_softmax of the materialised (T, vocab) logits. check: the sums of the log-probs and
the entropies over the sequence against the baseline's (fp32: 1e-5 relative).

Llama-8B. The P-rank slopes split into three measured parts per token of a rank: the
MLP's working set ("P ranks" - "P ranks, tiled"), the checkpoints ("tiled" - "tiled +
offload"), the rest. Each part is scaled to Llama-8B in bf16 by what it is made of: the
MLP's by intermediate size x bytes per element, the rest by hidden x bytes (its fp32
hidden-state gradient of the loss at 4 bytes); the checkpoints are layers x hidden x 2
bytes (the formula: the small model's measurement shows only layers - 1 of them at its
peak). Against an 80 GB budget less the model's states (stated with the result), that
gives the tokens per GPU, and x P GPUs for the sequence: extrapolated, not measured.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.families.transformers import ModelSize, TransformersCase
from bench.runner.cases import run_case
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import MEMORY_BENCH, Row
from seqpar_kernels.testing import peak_cpu_memory

BASELINE_NOTE = (
    "memory: peak bytes per rank of a training step of a small Llama (activation checkpointing, the loss a "
    "chunk of tokens at a time) at growing lengths; baseline = one rank, ours = P ranks (ring, balanced), "
    "with and without tiled MLPs and activation offload; bytes per token fitted per configuration; the log-prob "
    "path (causal_lm_logprobs on P ranks against log_softmax of the materialised logits on one)"
)

SEED = 0
LOSS_CHUNK = 64  # tokens of logits at a time in the loss: a constant, whatever T
TILE = 64  # tokens per MLP tile
LOSS_RTOL = 1e-5
MiB = 2**20


# Llama-8B's proportions (MLP 3.5 x hidden, 4 query heads per kv head) at a size whose
# steps take seconds on CPU ranks.
MODEL = ModelSize(vocab=4096, hidden=128, intermediate=448, layers=2, heads=8, kv_heads=2, head_dim=16)
TOKENS = (512, 1024, 2048)
QUICK_MODEL = ModelSize(vocab=512, hidden=64, intermediate=224, layers=2, heads=4, kv_heads=1, head_dim=16)
QUICK_TOKENS = (128, 256)
FULL_MODEL = ModelSize(vocab=32000, hidden=256, intermediate=896, layers=4, heads=8, kv_heads=2, head_dim=32)
FULL_TOKENS = (4096, 8192, 16384, 32768)
# On CPUs --full stops at 8K: the one-rank steps grow with the square of the length there
# (4K and 8K: about 10 minutes on 2 cores; 16K alone would take about 20 more).
FULL_CPU_TOKENS = FULL_TOKENS[:2]
LLAMA_8B = ModelSize(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128)
LLAMA_8B_PARAMETERS = 8.03e9
GPU_BYTES = 80e9


@dataclass(frozen=True)
class Configuration:
    name: str
    all_ranks: bool  # P ranks, else rank 0 alone
    tiled: bool
    offload: bool


def configurations(world_size: int) -> list[Configuration]:
    ranks = f"{world_size} ranks"
    return [
        Configuration("1 rank", False, False, False),
        Configuration("1 rank, tiled + offload", False, True, True),
        Configuration(ranks, True, False, False),
        Configuration(f"{ranks}, tiled", True, True, False),
        Configuration(f"{ranks}, tiled + offload", True, True, True),
    ]


@dataclass(frozen=True)
class MemoryCase(TransformersCase):
    """A model and a length, as the transformers family's: one sequence rather than a packed batch."""

    @property
    def shape(self) -> str:
        return f"{self.model.label}; 1 x {self.tokens} tokens"


SIZES = Sizes(
    quick=Size(f"a tiny Llama, {' and '.join(map(str, QUICK_TOKENS))} tokens", 3),
    default=Size(f"Llama of 2 layers, hidden 128, {', '.join(map(str, TOKENS))} tokens, 5 configurations", 17),
    full=Size(
        f"Llama of 4 layers, hidden 256, {' and '.join(map(str, FULL_CPU_TOKENS))} tokens",
        1020,
        gpu_runs=f"Llama of 4 layers, hidden 256, {', '.join(map(str, FULL_TOKENS))} tokens",
    ),  # fmt: skip
)


def sizes(ctx: Context) -> tuple[ModelSize, tuple[int, ...]]:
    if ctx.quick:
        return QUICK_MODEL, QUICK_TOKENS
    if ctx.full:
        return FULL_MODEL, FULL_TOKENS if ctx.on_gpu else FULL_CPU_TOKENS
    return MODEL, TOKENS


def peak_bytes(ctx: Context, step) -> tuple[object, int]:
    """(step's result, the most bytes this rank's allocator held during step() beyond
    what it held before): the one place the family measures memory."""
    if not ctx.on_gpu:
        return peak_cpu_memory(step)
    ctx.sync()
    before = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    result = step()
    ctx.sync()
    return result, torch.cuda.max_memory_allocated(ctx.device) - before


def parse_bytes(text: str) -> float:
    """ "80GiB", "80 GB", "1.5e9" -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "b": 1}  # fmt: skip
    cleaned = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if cleaned.endswith(unit):
            return float(cleaned[: -len(unit)]) * scale
    return float(cleaned)


def memory_budget(ctx: Context) -> tuple[float, str]:
    """(bytes, where the number comes from) of one rank's budget."""
    configured = os.environ.get("SEQPAR_BENCH_MEMORY_BUDGET")
    if configured:
        return parse_bytes(configured), "SEQPAR_BENCH_MEMORY_BUDGET"
    if ctx.on_gpu:
        return float(torch.cuda.get_device_properties(ctx.device).total_memory), "the GPU's memory"
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    return available / ctx.world_size, "MemAvailable / ranks"


class Stepper:
    """The model and the step of one configuration on this rank."""

    def __init__(self, ctx: Context, size: ModelSize, configuration: Configuration, group):
        from transformers import LlamaConfig, LlamaForCausalLM

        import seqpar_kernels.integrations.transformers as sp_transformers

        config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                             num_hidden_layers=size.layers, num_attention_heads=size.heads,
                             num_key_value_heads=size.kv_heads, head_dim=size.head_dim, use_cache=False,
                             max_position_embeddings=max(FULL_TOKENS))  # fmt: skip
        torch.manual_seed(SEED)  # the same weights on every rank and in every configuration
        self.model = LlamaForCausalLM(config).to(ctx.device)
        # Its newer name where transformers has it (the old one warns of its removal).
        checkpointing = getattr(self.model, "activation_checkpointing_enable", None)
        (checkpointing or self.model.gradient_checkpointing_enable)()
        self.model.train()
        self.group, self.configuration, self.ctx = group, configuration, ctx
        sp_transformers.apply(self.model, "ring", layout="balanced", group=group)
        if configuration.tiled:
            sp_transformers.tile_mlp(self.model, TILE)

    def step(self, batch: dict) -> float:
        import seqpar_kernels.integrations.transformers as sp_transformers
        from seqpar_kernels.integrations.transformers.causal_lm import causal_lm_loss
        from seqpar_kernels.integrations.transformers.loss import loss_through_forward

        model = self.model
        model.zero_grad(set_to_none=True)
        local = sp_transformers.shard_batch(batch, mode="ring", layout="balanced", group=self.group)
        shift_labels = local.pop("shift_labels")
        no_logits = torch.empty(0, dtype=torch.long, device=self.ctx.device)
        # Offload what is the size of a checkpoint (tokens x hidden) or larger: at this
        # model's size the default threshold (1 MiB, for real models) would take nothing.
        checkpoint = local["input_ids"].numel() * model.config.hidden_size * 4
        offload = (sp_transformers.offload_activations(min_bytes=checkpoint // 2) if self.configuration.offload
                   else contextlib.nullcontext())  # fmt: skip
        with offload:
            loss = loss_through_forward(
                lambda: model(**local, logits_to_keep=no_logits, use_cache=False), model, model.model,
                lambda hidden: causal_lm_loss(model, hidden, shift_labels, group=self.group, chunk_size=LOSS_CHUNK),
            )  # fmt: skip
        loss.backward()
        return loss.item()


def measure(case: MemoryCase, ctx: Context, steppers: list[tuple[Configuration, Stepper | None]]) -> list[Row]:
    """Every configuration's step at case.tokens: one row each, "1 rank" the baseline."""
    generator = torch.Generator().manual_seed(SEED + case.tokens)
    batch = {"input_ids": torch.randint(0, case.model.vocab, (1, case.tokens), generator=generator).to(ctx.device)}
    results = []
    for configuration, stepper in steppers:
        loss, peak, seconds = 0.0, 0, 0.0
        if stepper is not None:
            stepper.step(batch)  # once before measuring: buffers made on first use
            start = time.perf_counter()
            loss, peak = peak_bytes(ctx, lambda: stepper.step(batch))
            seconds = time.perf_counter() - start
        ctx.barrier()  # the other ranks wait while rank 0 runs a one-rank configuration
        values = torch.zeros(ctx.world_size, 3, dtype=torch.float64)
        values[ctx.rank] = torch.tensor([peak, seconds, loss], dtype=torch.float64)
        per_rank = ctx.reduce_over_ranks(values, op=dist.ReduceOp.SUM)
        ran = per_rank if configuration.all_ranks else per_rank[:1]
        results.append((configuration, int(ran[:, 0].max()), float(ran[:, 1].max()), float(ran[0, 2]),
                        ran[:, 0].tolist()))  # fmt: skip
    _, base_peak, base_seconds, base_loss, _ = results[0]
    rows = []
    for configuration, peak, seconds, loss, peaks in results:
        error = abs(loss - base_loss) / abs(base_loss)
        detail = (f"peak per rank [{', '.join(f'{value / MiB:.2f}' for value in peaks)}] MiB; loss {loss:.7f} vs "
                  f"1 rank's {base_loss:.7f} (relative {error:.1e}); one step each, {seconds:.2f} s vs "
                  f"{base_seconds:.2f} s")  # fmt: skip
        rows.append(Row(bench=MEMORY_BENCH, case=f"{configuration.name} {case.label}", shape=case.shape,
                        dtype="fp32", world_size=ctx.world_size, backend=ctx.backend, device=ctx.device_name,
                        ours_s=seconds, baseline_s=base_seconds,
                        speedup=base_seconds / seconds if seconds > 0 else float("nan"),
                        ours_faster_share=float("nan"), noise=float("nan"), reps=1,
                        check="matches" if error <= LOSS_RTOL else "MISMATCH loss", ours_peak_bytes=peak,
                        baseline_peak_bytes=base_peak, detail=detail))  # fmt: skip
    return rows


def head_of_model(size: ModelSize, device):
    """A Llama of one layer with size's head (seeded): what the log-prob rows project with."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=1, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
                         head_dim=size.head_dim, use_cache=False)  # fmt: skip
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config).to(device)


def measure_logprobs(case: MemoryCase, ctx: Context, model, world) -> Row:
    """causal_lm_logprobs on every rank (T / P tokens each) against log_softmax of the
    whole sequence's logits on rank 0: peak bytes per rank of forward and backward."""
    from seqpar_kernels.integrations.transformers import causal_lm_logprobs

    generator = torch.Generator().manual_seed(SEED + case.tokens)
    hidden = torch.randn(1, case.tokens, case.model.hidden, generator=generator).to(ctx.device)
    labels = torch.randint(0, case.model.vocab, (1, case.tokens), generator=generator).to(ctx.device)

    def ours() -> torch.Tensor:
        """This rank's piece (contiguous: the head is the same in every layout)."""
        piece = case.tokens // ctx.world_size
        local = hidden[:, ctx.rank * piece : (ctx.rank + 1) * piece].clone().requires_grad_()
        log_probs, entropy = causal_lm_logprobs(model, local, labels[:, ctx.rank * piece : (ctx.rank + 1) * piece],
                                                group=world, return_entropy=True, chunk_size=LOSS_CHUNK)  # fmt: skip
        (log_probs.sum() + entropy.sum()).backward()
        return torch.stack([log_probs.sum(), entropy.sum()]).detach().double()

    def materialised() -> torch.Tensor:
        whole = hidden.clone().requires_grad_()
        log_softmax = torch.log_softmax(model.lm_head(whole).float(), dim=-1)  # (1, T, vocab)
        log_probs = log_softmax.gather(-1, labels[..., None])[..., 0]
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        (log_probs.sum() + entropy.sum()).backward()
        return torch.stack([log_probs.sum(), entropy.sum()]).detach().double()

    ours()  # once before measuring: buffers made on first use
    start = time.perf_counter()
    sums, peak = peak_bytes(ctx, ours)
    seconds = time.perf_counter() - start
    per_rank = torch.zeros(ctx.world_size, 3, dtype=torch.float64)
    per_rank[ctx.rank] = torch.tensor([peak, *sums.tolist()], dtype=torch.float64)
    base = torch.zeros(4, dtype=torch.float64)
    if ctx.is_root:
        materialised()
        start = time.perf_counter()
        base_sums, base_peak = peak_bytes(ctx, materialised)
        base[:] = torch.tensor([base_peak, time.perf_counter() - start, *base_sums.tolist()])
    ctx.barrier()
    per_rank = ctx.reduce_over_ranks(per_rank, op=dist.ReduceOp.SUM)
    base = ctx.reduce_over_ranks(base, op=dist.ReduceOp.SUM)
    totals = per_rank[:, 1:].sum(0)
    error = float(((totals - base[2:]).abs() / base[2:].abs()).max())
    peak, base_peak = int(per_rank[:, 0].max()), int(base[0])
    detail = (f"peak per rank [{', '.join(f'{value / MiB:.2f}' for value in per_rank[:, 0].tolist())}] MiB, "
              f"materialised logits on one rank {base_peak / MiB:.2f} MiB ({case.tokens} x {case.model.vocab} fp32 "
              f"logits: {case.tokens * case.model.vocab * 4 / MiB:.1f} MiB); sums of log-probs and entropies "
              f"relative {error:.1e}")  # fmt: skip
    return Row(bench=MEMORY_BENCH, case=f"logprobs {ctx.world_size} ranks {case.label}", shape=case.shape,
               dtype="fp32", world_size=ctx.world_size, backend=ctx.backend, device=ctx.device_name, ours_s=seconds,
               baseline_s=float(base[1]), speedup=float(base[1]) / seconds if seconds > 0 else float("nan"),
               ours_faster_share=float("nan"), noise=float("nan"), reps=1,
               check="matches" if error <= LOSS_RTOL else "MISMATCH log-probs", ours_peak_bytes=peak,
               baseline_peak_bytes=base_peak, detail=detail)  # fmt: skip


@dataclass(frozen=True)
class Fit:
    """peak = intercept + slope x tokens, least squares over the measured lengths."""

    slope: float  # bytes per token of the sequence, on one rank
    intercept: float
    longest_measured: int

    @staticmethod
    def of(points: list[tuple[int, int]]) -> Fit:
        n = len(points)
        mean_t = sum(t for t, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        slope = sum((t - mean_t) * (p - mean_p) for t, p in points) / spread if spread else 0.0
        return Fit(slope, mean_p - slope * mean_t, max(t for t, _ in points))

    def longest_within(self, budget: float) -> int:
        return int((budget - self.intercept) / self.slope) if self.slope > 0 else 0


def llama_8b_lines(fits: dict[str, Fit], size: ModelSize, world_size: int) -> list[str]:
    """Llama-8B (bf16) tokens per GPU from the measured P-rank slopes, split into their
    parts and scaled (see the module docstring): extrapolated."""
    ranks = f"{world_size} ranks"
    plain, tiled, offloaded = (fits.get(name) for name in (ranks, f"{ranks}, tiled", f"{ranks}, tiled + offload"))
    if not (plain and tiled and offloaded) or world_size < 1:
        return []
    per_local = world_size  # the slopes are per token of the sequence; a rank holds 1/P of them
    mlp = (plain.slope - tiled.slope) * per_local
    checkpoints = (tiled.slope - offloaded.slope) * per_local
    rest = offloaded.slope * per_local
    measured_bytes = 4  # fp32
    target = LLAMA_8B
    loss_gradient = 4 * size.hidden  # the loss keeps an fp32 hidden-state gradient
    scaled = {
        "MLP working set": mlp * target.intermediate / size.intermediate * 2 / measured_bytes,
        # The formula, not the measurement: at the peak one layer's own checkpoint is in
        # its recompute, so the small model's (layers - 1) of layers would undercount.
        "checkpoints": target.layers * target.hidden * 2,
        "rest": (rest - loss_gradient) * target.hidden / size.hidden * 2 / measured_bytes + 4 * target.hidden,
    }
    lines = [
        f"memory: measured per token of a rank ({size.label}, fp32): MLP working set {mlp:.0f} B, checkpoints "
        f"{checkpoints:.0f} B ((layers - 1) x hidden x 4 = {(size.layers - 1) * size.hidden * 4} B, "
        f"layers x hidden x 4 = {size.layers * size.hidden * 4} B), rest {rest:.0f} B",
        "memory: Llama-8B in bf16, scaled from those (extrapolated): " + ", ".join(
            f"{name} {value / 1024:.1f} KiB" for name, value in scaled.items()) + " per token of a GPU",
    ]  # fmt: skip
    # Model states per GPU (stated, not measured): one GPU offloads parameters, gradients
    # and AdamW's states to the host and holds one layer's bf16 weights and the head's;
    # 8 GPUs shard 16 bytes per parameter (bf16 weights and gradients, fp32 AdamW) over 8.
    head = target.vocab * target.hidden
    states = {1: (2 * head * 2 + 4 * head + 2 * LLAMA_8B_PARAMETERS / target.layers),
              8: (16 * LLAMA_8B_PARAMETERS / 8 + 4 * head)}  # fmt: skip
    for gpus, state_bytes in states.items():
        for name, parts in (("plain", ("MLP working set", "checkpoints", "rest")), ("tiled + offload", ("rest",))):
            per_token = sum(scaled[part] for part in parts)
            tokens = int((GPU_BYTES - state_bytes) / per_token) * gpus
            host = "" if name == "plain" else (f"; the offloaded checkpoints take "
                                               f"{scaled['checkpoints'] * tokens / gpus / 1e9:.0f} GB of host memory "
                                               "per GPU")  # fmt: skip
            lines.append(f"memory: Llama-8B on {gpus} x 80 GB GPU{'s' if gpus > 1 else ''}, {name}: about "
                         f"{tokens / 1e6:.2f}M tokens ({per_token / 1024:.1f} KiB per token of a GPU, "
                         f"{state_bytes / 1e9:.1f} GB of model states per GPU{host}) - extrapolated")  # fmt: skip
    return lines


def fit_row(ctx: Context, configuration: Configuration, fit: Fit, budget: float, source: str, shape: str) -> Row:
    """The fitted line of one configuration, as a row (case "<configuration> fit")."""
    longest = fit.longest_within(budget)
    beyond = ", a linear extrapolation beyond the measured lengths" if longest > fit.longest_measured else ""
    detail = (f"{fit.slope:.0f} bytes per token of the sequence on a rank, intercept {fit.intercept / MiB:.1f} MiB; "
              f"longest sequence within {budget / 2**30:.1f} GiB ({source}): {longest} tokens{beyond} (measured up "
              f"to {fit.longest_measured})")  # fmt: skip
    nan = float("nan")
    return Row(bench=MEMORY_BENCH, case=f"{configuration.name} fit", shape=shape, dtype="fp32",
               world_size=ctx.world_size, backend=ctx.backend, device=ctx.device_name, ours_s=nan, baseline_s=nan,
               speedup=nan, ours_faster_share=nan, noise=nan, reps=0, check="fit", detail=detail)  # fmt: skip


def run(ctx: Context) -> list[Row]:
    try:
        import transformers  # noqa: F401

        import seqpar_kernels.integrations.transformers  # noqa: F401
    except ImportError as error:
        ctx.log(f"memory: skipped ({error})")
        return []
    ctx.log(BASELINE_NOTE)
    size, tokens = sizes(ctx)
    # Every rank makes every one-rank group (new_group is collective); rank 0 uses its own.
    alone = [dist.new_group([rank]) for rank in range(ctx.world_size)] if ctx.world_size > 1 else [None]
    world = dist.group.WORLD if ctx.world_size > 1 else None
    steppers = []
    for configuration in configurations(ctx.world_size):
        here = configuration.all_ranks or ctx.is_root
        group = world if configuration.all_ranks else alone[ctx.rank]
        steppers.append((configuration, Stepper(ctx, size, configuration, group) if here else None))
    rows = []
    for count in tokens:
        rows += run_case(ctx, MEMORY_BENCH, measure, MemoryCase(size, count), steppers)
    budget, source = memory_budget(ctx)
    fits = {}
    for configuration, _ in steppers:
        points = [(int(row.case.rsplit("T=", 1)[1]), row.ours_peak_bytes) for row in rows
                  if row.case.startswith(configuration.name + " T=") and row.ours_peak_bytes is not None]  # fmt: skip
        if len(points) < 2:
            continue
        fits[configuration.name] = Fit.of(points)
        row = fit_row(ctx, configuration, fits[configuration.name], budget, source, size.label)
        ctx.log(f"{row.bench:<16} {row.case:<32} {row.detail}")
        if ctx.record_row is not None:
            ctx.record_row(row)
        rows.append(row)
    if not ctx.quick:  # the quick lengths are too short for the slopes to mean anything
        for line in llama_8b_lines(fits, size, ctx.world_size):
            ctx.log(line)
    head = head_of_model(size, ctx.device)
    for count in tokens:
        rows += run_case(ctx, MEMORY_BENCH, measure_logprobs, MemoryCase(size, count), head, world)
    return rows


FAMILY = Family(
    name="memory",
    order=140,
    measures="the peak memory per rank of a training step at growing lengths against one rank",
    run=run,
    sizes=SIZES,
    timed_share=0.00,  # it times its own single steps, outside the timed rounds
    work={"float": 0.7, "host": 0.3},
    metadata=lambda: {"memory_baseline": BASELINE_NOTE},
)
