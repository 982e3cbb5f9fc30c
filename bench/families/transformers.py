"""A training step of a Hugging Face transformers model: one process against sequence
parallelism as a training script uses it (seqpar_kernels.integrations.transformers,
examples/train_transformers_sp.py).

The model: a small Llama built from a LlamaConfig (random weights, the same on every
rank; nothing is downloaded), fp32: hidden 256, 4 layers, 8 query heads / 2 kv heads of
dimension 32, MLP 688, vocabulary 32000. The batch: documents of random lengths (1 to a
third of the tokens, seeded) packed into one row by transformers'
DataCollatorWithFlattening (position ids restarting at 0, labels -100 at each document's
first token), 1024 and 2048 tokens in all (--full: 1024 and 4096; --quick: a tiny model,
64 tokens).

Candidates, timed side by side in one time_side_by_side call per case (interleaved
rounds, a sample is the slowest rank's time):
  single process   rank 0 alone, the whole batch, transformers' own attention ("sdpa")
                   and loss: model.zero_grad(); model(**batch).loss.backward(). The
                   other ranks wait at the next round's barrier. On CPU rank 0 runs it
                   with every core of the machine (torch.set_num_threads for the call),
                   as one process training alone would.
  ulysses          every rank: sp_transformers.apply(model, "ulysses") (contiguous)
  ring             ... "ring", layout="balanced"
  usp              ... "usp", layout="balanced", on a 2-D DeviceMesh with Ulysses
                   degree 2 where the world size is even (else 1), as the example
and a mode's step is the five lines of docs/transformers.md on this rank's share:
  model.zero_grad(); local = shard_batch(batch, mode=, layout=, ...)
  hidden = model.model(**local).last_hidden_state
  loss = sequence_parallel_cross_entropy(hidden, model.lm_head.weight, local["shift_labels"], ...)
  loss.backward(); all_reduce_gradients(model, ...)
The optimizer step is excluded from every candidate: it is the same elementwise update
of every parameter in both (the model is replicated on every rank), independent of the
tokens and of the mode, and leaving it out keeps the weights fixed, so that every round
computes the same loss. Building the batch (the collator) is excluded too; shard_batch,
which a sequence-parallel step adds, is included.

Rows (bench column "transformers"): one per mode; ours_s the mode's median step,
baseline_s the single process's, speedup = single process / mode; ours_peak_bytes the
largest over the ranks of the most bytes the CPU allocator held during one step beyond
what it held before (seqpar_kernels.testing.peak_cpu_memory; on GPU the CUDA allocator's
max_memory_allocated), gradients included, every rank's in detail; baseline_peak_bytes
the single process's; ulysses_degree / ring_degree the mode's grid (U x R).

check: before timing, one step of every candidate from the same weights: the mode's loss
(the same on every rank) against the single process's, "matches" within LOSS_RTOL
relative (fp32), and every parameter's gradient after all_reduce_gradients against the
single process's within GRAD_RTOL of its largest value (the integration tests'
tolerances); else "MISMATCH ...".

What the time means. On CPU ranks sharing a machine (4 gloo ranks on 2 cores here) the
ranks run on the same cores the single process has to itself, so a mode's time is the
total work of all ranks (its share of the model, the exchanges, gloo's copies) spread
over those cores, not the time of P devices working at once: the ratio is the single
process's work / the sequence-parallel step's total work, not a parallel speedup. It
also holds two differences of what is computed, both in ours' favour: transformers' sdpa
path on CPU attends over the whole packed row under a mask (document boundaries cost it
the full S x S work), where the varlen plan attends within documents only; and
transformers' loss materialises the (tokens x vocab) logits, where ours computes them a
chunk at a time (bench_loss). On GPUs (NCCL, one GPU per rank: python -m bench --only
transformers, or torchrun) the same command measures the real thing: one GPU training
on the whole batch against P GPUs each training on its share.

Without transformers (the core package does not need it) the family logs that it is
skipped and why, and records no row.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import TRANSFORMERS_BENCH, Row
from bench.runner.timing import time_side_by_side
from seqpar_kernels.testing import peak_cpu_memory

BASELINE_NOTE = (
    "transformers: a training step (zero_grad, forward, loss, backward; optimizer excluded) of a small "
    "Llama (fp32) on a packed batch; baseline = single process (rank 0 alone, the whole batch, "
    "transformers' sdpa attention and loss; on CPU with every core), ours = each mode of "
    "seqpar_kernels.integrations.transformers on every rank (shard_batch, sequence_parallel_cross_entropy, "
    "all_reduce_gradients included); x = single-process time / mode's. On CPU ranks sharing cores the "
    "time is total work, not a parallel speedup"
)

SINGLE = "single process"
MODES = {  # mode -> layout (the example's)
    "ulysses": "contiguous",
    "ring": "balanced",
    "usp": "balanced",
}
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
SEED = 0
# Per case: a step takes about a second (1024 tokens) to ten (4096; the single process's
# masked attention over the whole row); every candidate has run twice before timing
# (the check, the memory), so one warm-up round. The default fills half the time with
# rounds (5 at least either way).
REPETITIONS = dict(warmup=1, reps=5, max_reps=15, seconds_per_case=60.0)
DEFAULT_REPETITIONS = dict(REPETITIONS, seconds_per_case=30.0)
MiB = 2**20


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def label(self) -> str:
        return (f"Llama hidden {self.hidden}, {self.layers} layers, heads {self.heads}/{self.kv_heads} kv x "
                f"{self.head_dim}, MLP {self.intermediate}, vocab {self.vocab}")  # fmt: skip


FULL_MODEL = ModelSize(vocab=32000, hidden=256, intermediate=688, layers=4, heads=8, kv_heads=2, head_dim=32)
QUICK_MODEL = ModelSize(vocab=512, hidden=64, intermediate=128, layers=2, heads=8, kv_heads=2, head_dim=8)
# --full: 1024 and 4096 tokens; the default stops at 2048 (the single process's masked
# attention grows with the square of the tokens: 8 s a step at 4096 on 2 cores).
FULL_TOKENS = (1024, 4096)
DEFAULT_TOKENS = (1024, 2048)
QUICK_TOKENS = (64,)


@dataclass(frozen=True)
class TransformersCase:
    model: ModelSize
    tokens: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def label(self) -> str:
        return f"T={self.tokens}"

    @property
    def shape(self) -> str:
        return f"{self.model.label}; packed batch 1 x {self.tokens}"


def transformers_unavailable() -> str | None:
    """Why the family cannot run (transformers missing or too old), or None."""
    try:
        import seqpar_kernels.integrations.transformers  # noqa: F401
    except ImportError as error:
        cause = f" ({error.__cause__})" if error.__cause__ is not None else ""
        return f"{type(error).__name__}: {error}{cause}"
    return None


def cases(ctx: Context) -> list[TransformersCase]:
    if ctx.quick:
        return [TransformersCase(QUICK_MODEL, tokens) for tokens in QUICK_TOKENS]
    return [TransformersCase(FULL_MODEL, tokens) for tokens in (FULL_TOKENS if ctx.full else DEFAULT_TOKENS)]


SIZES = Sizes(
    quick=Size("a tiny Llama, 64 tokens", 3),
    default=Size(
        f"Llama of 19.2M parameters, {' and '.join(map(str, DEFAULT_TOKENS))} packed tokens, "
        "3 modes against one process",
        115,
    ),
    full=Size(f"the same model, {' and '.join(map(str, FULL_TOKENS))} packed tokens", 242),
)


def packed_batch(tokens: int, vocab: int, seed: int) -> tuple[dict, list[int]]:
    """Documents of random lengths (1 to tokens // 3, seeded: the same on every rank)
    packed into one row by DataCollatorWithFlattening; and their lengths."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(seed)
    documents, lengths, remaining = [], [], tokens
    while remaining > 0:
        length = min(remaining, int(torch.randint(1, max(tokens // 3, 2), (1,), generator=generator)))
        documents.append({"input_ids": torch.randint(0, vocab, (length,), generator=generator).tolist()})
        lengths.append(length)
        remaining -= length
    return DataCollatorWithFlattening(return_tensors="pt")(documents), lengths


def build_model(size: ModelSize, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.kv_heads, head_dim=size.head_dim, use_cache=False,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(SEED)  # the same weights on every rank
    return LlamaForCausalLM(config).to(device)


def usp_mesh(ctx: Context):
    """The example's 2-D mesh: Ulysses degree 2 where the world size is even, else 1."""
    from torch.distributed.device_mesh import init_device_mesh

    ulysses = 2 if ctx.world_size % 2 == 0 else 1
    return init_device_mesh(ctx.device.type, (ctx.world_size // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))


@dataclass
class Candidate:
    """One candidate's model and step on this rank (step None: nothing to do here)."""

    name: str
    model: object | None
    step: object | None  # () -> the loss, detached
    ulysses_degree: int = 1
    ring_degree: int = 1
    layout: str = ""

    def run(self):
        return None if self.step is None else self.step()


def single_candidate(ctx: Context, model, batch: dict) -> Candidate:
    if not ctx.is_root:
        return Candidate(SINGLE, None, None)

    def step():
        with ctx.every_core():
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss  # transformers shifts the labels itself
            loss.backward()
        return loss.detach()

    return Candidate(SINGLE, model, step)


def mode_candidate(ctx: Context, mode: str, model, batch: dict, mesh) -> Candidate:
    import seqpar_kernels.integrations.transformers as sp_transformers

    layout = MODES[mode]
    groups = {"mesh": mesh} if mode == "usp" else {}
    sp_transformers.apply(model, mode, layout=layout, **groups)
    if mode == "usp":
        ring, ulysses = mesh.shape
    else:
        ring, ulysses = (1, ctx.world_size) if mode == "ulysses" else (ctx.world_size, 1)

    def step():
        model.zero_grad(set_to_none=True)
        local = sp_transformers.shard_batch(batch, mode=mode, layout=layout, **groups)
        hidden = model.model(**local).last_hidden_state  # (1, tokens on this rank, hidden)
        loss = sp_transformers.sequence_parallel_cross_entropy(
            hidden, model.lm_head.weight, local["shift_labels"], **groups
        )  # the mean over every rank's real tokens
        loss.backward()
        sp_transformers.all_reduce_gradients(model, **groups)  # each rank held its tokens' share
        return loss.detach()

    return Candidate(mode, model, step, ulysses, ring, layout)


def gradients(model) -> list[torch.Tensor | None]:
    return [parameter.grad for parameter in model.parameters()]


def gradient_error(mine: list, expected: list) -> float:
    """The largest |mine - expected| of a parameter over its largest |expected|, over
    all parameters (a missing gradient counts as zeros)."""
    worst = 0.0
    for ours, theirs in zip(mine, expected):
        if theirs is None and ours is None:
            continue
        theirs = torch.zeros_like(ours) if theirs is None else theirs
        ours = torch.zeros_like(theirs) if ours is None else ours
        scale = max(theirs.abs().max().item(), 1e-30)
        worst = max(worst, (ours.double() - theirs.double()).abs().max().item() / scale)
    return worst


def every_rank(ctx: Context, value: float) -> list[float]:
    """value of every rank, in rank order (a small all-reduce of a vector)."""
    values = torch.zeros(ctx.world_size, dtype=torch.float64)
    values[ctx.rank] = value
    return ctx.reduce_over_ranks(values, op=dist.ReduceOp.SUM).tolist()


def check_modes(ctx: Context, single: Candidate, modes: list[Candidate]) -> dict[str, tuple[str, str]]:
    """One step of every candidate from the same weights: {mode: (check, detail)} on
    rank 0 (the other ranks' are placeholders: rank 0 writes the rows)."""
    expected_loss = single.run()
    expected_grads = gradients(single.model) if ctx.is_root else None
    verdicts = {}
    for candidate in modes:
        loss = candidate.run().item()
        if not ctx.is_root:
            verdicts[candidate.name] = ("", "")
            continue
        loss_error = abs(loss - expected_loss.item()) / abs(expected_loss.item())
        grad_error = gradient_error(gradients(candidate.model), expected_grads)
        checks = (("loss", loss_error, LOSS_RTOL), ("gradients", grad_error, GRAD_RTOL))
        failed = [name for name, error, tolerance in checks if not error <= tolerance]
        check = "matches" if not failed else f"MISMATCH {', '.join(failed)}"
        detail = (f"loss {loss:.7f} vs single process {expected_loss.item():.7f}: relative error {loss_error:.1e} "
                  f"(tolerance {LOSS_RTOL:g}); gradients after all_reduce_gradients: {grad_error:.1e} of the "
                  f"largest value (tolerance {GRAD_RTOL:g})")  # fmt: skip
        verdicts[candidate.name] = (check, detail)
        candidate.model.zero_grad(set_to_none=True)
    if ctx.is_root:
        single.model.zero_grad(set_to_none=True)
    return verdicts


def peak_memory(ctx: Context, candidate: Candidate) -> int:
    """This rank's peak during one step from released gradients, beyond what it held
    before (0 where it has no step): the CPU allocator's (peak_cpu_memory), on GPU the
    CUDA caching allocator's (max_memory_allocated)."""
    if candidate.step is None:
        return 0
    candidate.model.zero_grad(set_to_none=True)
    if ctx.on_gpu:
        ctx.sync()
        before = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        candidate.run()
        ctx.sync()
        peak = torch.cuda.max_memory_allocated(ctx.device) - before
    else:
        _, peak = peak_cpu_memory(candidate.run)
    candidate.model.zero_grad(set_to_none=True)
    return peak


def measure(case: TransformersCase, ctx: Context, mesh) -> list[Row]:
    batch, lengths = packed_batch(case.tokens, case.model.vocab, SEED + case.tokens)
    batch = {key: value.to(ctx.device) for key, value in batch.items()}
    initial = build_model(case.model, ctx.device)
    single = single_candidate(ctx, initial, batch)
    modes = [mode_candidate(ctx, mode, copy.deepcopy(initial), batch, mesh) for mode in MODES]
    if not ctx.is_root:
        del initial  # only rank 0 runs the single process

    verdicts = check_modes(ctx, single, modes)
    single_peak = peak_memory(ctx, single)
    peaks = {candidate.name: every_rank(ctx, peak_memory(ctx, candidate)) for candidate in modes}

    timing_ctx = ctx if ctx.quick else dataclasses.replace(ctx, **(REPETITIONS if ctx.full else DEFAULT_REPETITIONS))
    timings = time_side_by_side({candidate.name: candidate.run for candidate in [single, *modes]}, timing_ctx)

    threads = "every core" if not ctx.on_gpu else "one GPU"
    documents = (f"{len(lengths)} documents of {min(lengths)} to {max(lengths)} tokens "
                 f"(DataCollatorWithFlattening)")  # fmt: skip
    rows = []
    for candidate in modes:
        check, verdict = verdicts[candidate.name]
        per_rank = ", ".join(f"{peak / MiB:.0f}" for peak in peaks[candidate.name])
        detail = "; ".join([
            f"fp32 training step, optimizer excluded; {documents}",
            f"single process: rank 0 alone ({threads}), sdpa + transformers' loss; peak {single_peak / MiB:.0f} MiB",
            f"peak per rank [{per_rank}] MiB",
            verdict,
        ])  # fmt: skip
        rows.append(timed_row(
            ctx, {"ours": timings[candidate.name], "baseline": timings[SINGLE]},
            bench=TRANSFORMERS_BENCH, case=f"{candidate.name} ({candidate.layout}) {case.label}",
            shape=case.shape, dtype="fp32", check=check, layout=candidate.layout,
            ulysses_degree=candidate.ulysses_degree, ring_degree=candidate.ring_degree,
            ours_peak_bytes=int(max(peaks[candidate.name])), baseline_peak_bytes=single_peak or None,
            detail=detail,
        ))  # fmt: skip
    return rows


def run(ctx: Context) -> list[Row]:
    reason = transformers_unavailable()
    if reason is not None:
        ctx.log(f"transformers: skipped ({reason})")
        return []
    ctx.log(BASELINE_NOTE)
    ctx.log_every_core("transformers")
    mesh = usp_mesh(ctx)  # collective: every rank, once
    rows = []
    for case in cases(ctx):
        rows += run_case(ctx, TRANSFORMERS_BENCH, measure, case, mesh)
    return rows


FAMILY = Family(
    name="transformers",
    order=120,
    measures="a small Llama's training step under each mode of the transformers integration against one process",
    run=run,
    sizes=SIZES,
    timed_share=0.72,
    work={"float": 0.78, "exchange": 0.01, "host": 0.21},
    fewest_share=0.67,  # 1 warm-up + 5 timed rounds a case: the fewest keep 4 of 6
    metadata=lambda: {"transformers_baseline": BASELINE_NOTE, "transformers_skipped": transformers_unavailable()},
    preload=("seqpar_kernels.integrations.transformers", "transformers.models.llama.modeling_llama"),
)
