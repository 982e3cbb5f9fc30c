"""Bytes per rank of a small Llama's training state under FSDP2 x sequence parallelism
against sequence parallelism alone, on one DeviceMesh of data x sequence ranks; the
longest sequence each fits in a budget; and what that makes of Llama-8B.

The mesh: (dp 2, cp P / 2) where P is even and at least 4 (dp 1 otherwise), ring
attention in the balanced layout over cp, each data replica reading its own sequence of
T tokens (random ids, seeded). The step is docs/mesh.md's: shard_batch, the forward
with activation checkpointing and the loss inside it (loss_through_forward,
causal_lm_loss a chunk of LOSS_CHUNK tokens at a time), the backward, the gradient
reduction, Adam (two fp32 states a parameter, and a step counter a tensor). fp32.

Configurations (rows "memory", case "fsdp: <configuration>"), each a fresh model from
the same seed:
  SP alone             every rank holds every parameter, gradient and Adam state;
                       all_reduce_gradients over cp and dp              shards S = 1
  FSDP2 dp x cp        fully_shard over sp.data_parallel_mesh(): every layer, then the
                       model; loss x S for the backward                 S = P
  FSDP2 dp             over sp.data_parallel_mesh(shard_sequence=False), then
                       all_reduce_gradients over cp                     S = dp

Measured after the first optimizer step, on every rank: the bytes of the storages of
the parameters, of their gradients and of Adam's state tensors (a DTensor's local
shard; a storage several tensors view counted once). Formula: N parameters x 4 bytes /
S for the parameters and for the gradients, 2 x that + 4 bytes per parameter tensor
(the step counters) for Adam; every parameter's first dim divides by every S here, so
FSDP2 pads none. check: "matches" where every rank holds exactly the formula's bytes
and every step's loss equals SP alone's (fp32: 1e-5 relative); else "MISMATCH ...".

The step's peak (bench_memory.peak_bytes: the most bytes held during forward, backward
and the gradient reduction beyond what was held before: gradients, activations, FSDP2's
gathered layers), the largest rank's, at each length, fitted as bench_memory does
(bytes per token of the sequence); the longest sequence within the budget
(bench_memory.memory_budget) is (budget - parameters - Adam's states - intercept) /
slope, a linear extrapolation beyond the measured lengths.

Llama-8B: the state bytes per parameter measured for SP alone (fp32 weights, gradients
and Adam: 16, as bf16 weights and gradients with fp32 master weights and Adam) x its
parameters / S at 8 ranks (dp 2 x cp 4): stated, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.families.memory import (
    FULL_MODEL,
    GPU_BYTES,
    LLAMA_8B_PARAMETERS,
    LOSS_CHUNK,
    LOSS_RTOL,
    MODEL,
    QUICK_MODEL,
    QUICK_TOKENS,
    SEED,
    Fit,
    memory_budget,
    peak_bytes,
)
from bench.families.transformers import ModelSize, build_model
from bench.runner.cases import run_case
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import MEMORY_BENCH, Row

BASELINE_NOTE = (
    "fsdp: bytes per rank of parameters, gradients and Adam's states of a small Llama on a (dp, cp) mesh, "
    "measured against N x bytes / shards; FSDP2 over dp x cp and over dp against sequence parallelism alone "
    "(every rank holds everything), each step's loss against SP alone's; the longest sequence within the budget"
)

ADAM_LR = 1e-3
STEP_COUNTER_BYTES = 4  # Adam's step: an fp32 scalar tensor per parameter tensor
# At 512 and 1024 tokens SP alone's peak is its gradient reduction's (the gradients and
# their flat copy, 11.3 MiB at the default size), whatever the length: the lengths start
# where every configuration's peak grows with the activations (18.5 MiB at 2048).
TOKENS = (2048, 4096)
FULL_TOKENS = (4096, 8192)
WARM_UP_TOKENS = 256  # the first step's buffers (gloo's, FSDP2's lazy set-up) do not grow with the length
LLAMA_8B_RANKS, LLAMA_8B_DATA = 8, 2
GiB = 2**30
MiB = 2**20

SIZES = Sizes(
    quick=Size(f"a tiny Llama on dp 2 x cp 2, {' and '.join(map(str, QUICK_TOKENS))} tokens, 3 configurations", 2),
    default=Size(f"Llama of 2 layers, hidden 128, {' and '.join(map(str, TOKENS))} tokens, 3 configurations", 13),
    full=Size(f"Llama of 4 layers, hidden 256, {' and '.join(map(str, FULL_TOKENS))} tokens, 3 configurations", 52),
)


@dataclass(frozen=True)
class Configuration:
    name: str
    wrapper: str  # "none" | "fsdp_data_sequence" | "fsdp_data"


CONFIGURATIONS = (
    Configuration("SP alone", "none"),
    Configuration("FSDP2 dp x cp", "fsdp_data_sequence"),
    Configuration("FSDP2 dp", "fsdp_data"),
)


def sizes(ctx: Context) -> tuple[ModelSize, tuple[int, ...]]:
    if ctx.quick:
        return QUICK_MODEL, QUICK_TOKENS
    return (FULL_MODEL, FULL_TOKENS) if ctx.full else (MODEL, TOKENS)


def mesh_shape(world_size: int) -> tuple[int, int]:
    """(dp, cp): two data replicas where the ranks make at least two sequence ranks each."""
    data = 2 if world_size % 2 == 0 and world_size >= 4 else 1
    return data, world_size // data


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind tensors (a DTensor's local shard; a storage several
    of them view, as FSDP2's gradients view one reduce-scatter output, once)."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for tensor in tensors:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass(frozen=True)
class StateBytes:
    """Bytes a rank holds of each part of the training state."""

    parameters: int
    gradients: int
    optimizer: int

    @staticmethod
    def formula(parameters: int, tensors: int, element_size: int, shards: int) -> StateBytes:
        """N parameters in `tensors` tensors sharded evenly over `shards` ranks: Adam's two
        states a parameter, a step counter a tensor."""
        shard = parameters * element_size // shards
        return StateBytes(shard, shard, 2 * shard + STEP_COUNTER_BYTES * tensors)

    @property
    def held(self) -> int:
        """What stays between steps (the gradients are freed, set to None)."""
        return self.parameters + self.optimizer

    def text(self) -> str:
        return f"{self.parameters} + {self.gradients} + {self.optimizer} B"


class Trainer:
    """One configuration's model, wrapper and optimizer on this rank."""

    def __init__(self, ctx: Context, size: ModelSize, configuration: Configuration, mesh):
        from torch.distributed.fsdp import fully_shard

        import seqpar_kernels.integrations.transformers as sp_transformers

        model = build_model(size, ctx.device)  # seeded: the same weights on every rank and in every configuration
        self.parameters = sum(parameter.numel() for parameter in model.parameters())
        self.tensors = len(list(model.parameters()))
        # Its newer name where transformers has it (the old one warns of its removal).
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        self.dims = dict(mesh=mesh, sequence_dims="cp", data_dims="dp")
        sp = sp_transformers.apply(model, "ring", layout="balanced", **self.dims)
        self.data_rank, self.scale, self.shards = sp.data_rank, 1, 1
        # What all_reduce_gradients sums over: the dims no wrapper sums over (docs/mesh.md's table).
        self.left = self.dims
        if configuration.wrapper != "none":
            shard_mesh = sp.data_parallel_mesh(shard_sequence=configuration.wrapper == "fsdp_data_sequence")
            for layer in model.model.layers:
                fully_shard(layer, mesh=shard_mesh)
            fully_shard(model, mesh=shard_mesh)
            self.scale = self.shards = shard_mesh.size()
            self.left = None if configuration.wrapper == "fsdp_data_sequence" else dict(mesh=mesh, sequence_dims="cp")
        self.model, self.ctx = model, ctx
        self.optimizer = torch.optim.Adam(model.parameters(), lr=ADAM_LR)

    def backward(self, batch: dict) -> float:
        """Forward, backward and the gradient reduction of this replica's batch; the loss."""
        import seqpar_kernels.integrations.transformers as sp_transformers
        from seqpar_kernels.integrations.transformers.loss import loss_through_forward

        model = self.model
        local = sp_transformers.shard_batch(batch, mode="ring", layout="balanced", **self.dims)
        shift_labels = local.pop("shift_labels")
        no_logits = torch.empty(0, dtype=torch.long, device=self.ctx.device)
        loss = loss_through_forward(
            lambda: model(**local, logits_to_keep=no_logits, use_cache=False), model, model.model,
            lambda hidden: sp_transformers.causal_lm_loss(model, hidden, shift_labels, chunk_size=LOSS_CHUNK),
        )  # fmt: skip
        (loss * self.scale).backward()  # a wrapper averages over its ranks what the loss's shares want summed
        if self.left is not None:
            sp_transformers.all_reduce_gradients(model, **self.left)
        return loss.item()

    def state_bytes(self) -> StateBytes:
        parameters = list(self.model.parameters())
        states = [value for state in self.optimizer.state.values() for value in state.values()
                  if isinstance(value, torch.Tensor)]  # fmt: skip
        gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
        return StateBytes(storage_bytes(parameters), storage_bytes(gradients), storage_bytes(states))

    def formula(self) -> StateBytes:
        return StateBytes.formula(self.parameters, self.tensors, 4, self.shards)


@dataclass(frozen=True)
class Measured:
    """A configuration's numbers, every rank's."""

    losses: list[float]  # rank 0's loss at each step (the same on every rank)
    peaks: list[int]  # the largest rank's peak at each length
    states: list[StateBytes]  # per rank
    formula: StateBytes  # rank 0's
    shards: int
    parameters: int  # N
    tensors: int

    @property
    def bytes_per_parameter(self) -> float:
        """Rank 0's state bytes a parameter, the step counters left out."""
        state = self.states[0]
        return (state.parameters + state.gradients + state.optimizer - STEP_COUNTER_BYTES * self.tensors) / (
            self.parameters / self.shards
        )


@dataclass(frozen=True)
class FsdpCase:
    configuration: Configuration
    model: ModelSize
    tokens: tuple[int, ...]
    mesh_shape: tuple[int, int]
    # Each step's peak and the fit: not in --quick on CPU, where the profiler that
    # counts the allocator's bytes makes an FSDP2 step about 2 s instead of 0.4 s.
    peaks: bool

    @property
    def label(self) -> str:
        return f"fsdp: {self.configuration.name}"

    @property
    def shape(self) -> str:
        data, sequence = self.mesh_shape
        return f"{self.model.label}; dp {data} x cp {sequence}; 1 x {'/'.join(map(str, self.tokens))} tokens a replica"


def measure_configuration(case: FsdpCase, ctx: Context, mesh) -> Measured:
    """A step at each length (forward, backward, reduction; its peak, but in --quick),
    Adam's step after it; the state bytes after the first."""
    trainer = Trainer(ctx, case.model, case.configuration, mesh)

    def batch(tokens: int) -> dict:
        generator = torch.Generator().manual_seed(SEED + tokens + 1000 * trainer.data_rank)
        ids = torch.randint(0, case.model.vocab, (1, tokens), generator=generator)
        return {"input_ids": ids.to(ctx.device)}

    if case.peaks:
        trainer.backward(batch(WARM_UP_TOKENS))  # once before measuring: buffers made on first use
        trainer.optimizer.zero_grad(set_to_none=True)
    losses, peaks, state = [], [], None
    for tokens in case.tokens:
        step = lambda tokens=tokens: trainer.backward(batch(tokens))  # noqa: E731
        loss, peak = peak_bytes(ctx, step) if case.peaks else (step(), 0)
        trainer.optimizer.step()
        if state is None:
            state = trainer.state_bytes()
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        peaks.append(peak)
    count = len(case.tokens)
    values = torch.zeros(ctx.world_size, 3 + 2 * count, dtype=torch.float64)
    values[ctx.rank] = torch.tensor([state.parameters, state.gradients, state.optimizer, *peaks, *losses],
                                    dtype=torch.float64)  # fmt: skip
    per_rank = ctx.reduce_over_ranks(values, op=dist.ReduceOp.SUM)
    states = [StateBytes(*(int(value) for value in row[:3].tolist())) for row in per_rank]
    return Measured([float(value) for value in per_rank[0, 3 + count :]],
                    [int(value) for value in per_rank[:, 3 : 3 + count].max(0).values], states, trainer.formula(),
                    trainer.shards, trainer.parameters, trainer.tensors)  # fmt: skip


def measure(case: FsdpCase, ctx: Context, mesh, budget: float, source: str, measured: dict[str, Measured]) -> Row:
    """The configuration's row, its losses against SP alone's (the first configuration,
    measured before it); measured[name] keeps its numbers."""
    measured[case.configuration.name] = measure_configuration(case, ctx, mesh)
    baseline = measured.get(CONFIGURATIONS[0].name)
    if baseline is None:
        raise RuntimeError(f"{CONFIGURATIONS[0].name} did not run: no loss to compare {case.configuration.name}'s with")
    return configuration_row(case, ctx, measured[case.configuration.name], baseline, budget, source)


def configuration_row(case: FsdpCase, ctx: Context, measured: Measured, baseline: Measured, budget: float,
                      source: str) -> Row:  # fmt: skip
    """The configuration's row: its state bytes against the formula, its losses against
    SP alone's, its peaks and the longest sequence within the budget."""
    exact = all(state == measured.formula for state in measured.states)
    errors = [abs(loss - base) / abs(base) for loss, base in zip(measured.losses, baseline.losses)]
    check = "matches"
    if not exact:
        check = "MISMATCH state bytes"
    elif not max(errors) <= LOSS_RTOL:
        check = "MISMATCH loss"
    formula = measured.formula
    same = all(state == measured.states[0] for state in measured.states)
    held = (f"{measured.states[0].text()} on every rank" if same else
            "; ".join(f"rank {rank} {state.text()}" for rank, state in enumerate(measured.states)))  # fmt: skip
    detail = (f"params + grads + Adam per rank over {measured.shards} shards: formula {formula.text()} "
              f"({formula.parameters + formula.gradients + formula.optimizer} B), measured {held}; losses "
              f"{', '.join(f'{loss:.7f}' for loss in measured.losses)} vs SP alone's (relative {max(errors):.1e})"
              + longest_text(case, measured, budget, source))  # fmt: skip
    nan = float("nan")
    return Row(bench=MEMORY_BENCH, case=case.label, shape=case.shape, dtype="fp32", world_size=ctx.world_size,
               backend=ctx.backend, device=ctx.device_name, ours_s=nan, baseline_s=nan, speedup=nan,
               ours_faster_share=nan, noise=nan, reps=len(case.tokens), check=check, detail=detail)  # fmt: skip


def longest_text(case: FsdpCase, measured: Measured, budget: float, source: str) -> str:
    """The detail's part on the peaks: their fit (bench_memory.Fit) and the longest
    sequence within the budget once the parameters and Adam's states are held."""
    if not case.peaks:
        return "; peaks not measured in --quick"
    fit = Fit.of(list(zip(case.tokens, measured.peaks)))
    longest = fit.longest_within(budget - measured.formula.held)
    beyond = ", extrapolated" if longest > fit.longest_measured else ""
    return (
        f"; step peaks {', '.join(f'{peak / MiB:.2f}' for peak in measured.peaks)} MiB at T="
        f"{'/'.join(map(str, case.tokens))}: {fit.slope:.0f} bytes per token, intercept {fit.intercept / MiB:.2f} "
        f"MiB; longest sequence within {budget / GiB:.1f} GiB ({source}) less {measured.formula.held / MiB:.2f} "
        f"MiB of parameters and Adam's states: {longest} tokens, {longest // case.mesh_shape[1]} a rank{beyond}"
    )


def llama_8b_lines(bytes_per_parameter: float) -> list[str]:
    """Llama-8B's state bytes per rank on LLAMA_8B_RANKS GPUs in each configuration: stated."""
    sequence = LLAMA_8B_RANKS // LLAMA_8B_DATA
    shards = {"SP alone": 1, "FSDP2 dp x cp": LLAMA_8B_RANKS, "FSDP2 dp": LLAMA_8B_DATA}
    lines = []
    for name, count in shards.items():
        state = bytes_per_parameter * LLAMA_8B_PARAMETERS / count
        left = (f"leaves {(GPU_BYTES - state) / 1e9:.1f} GB of an 80 GB GPU" if state < GPU_BYTES
                else "more than an 80 GB GPU holds")  # fmt: skip
        lines.append(f"fsdp: Llama-8B on {LLAMA_8B_RANKS} GPUs (dp {LLAMA_8B_DATA} x cp {sequence}), {name}: "
                     f"{state / 1e9:.1f} GB of parameters, gradients and Adam's states per GPU "
                     f"({bytes_per_parameter:.0f} B a parameter / {count}): {left} - stated, not measured")  # fmt: skip
    return lines


def run(ctx: Context) -> list[Row]:
    try:
        import transformers  # noqa: F401

        import seqpar_kernels.integrations.transformers  # noqa: F401
    except ImportError as error:
        ctx.log(f"fsdp: skipped ({error})")
        return []
    if ctx.world_size < 2:
        ctx.log("fsdp: skipped (one rank: nothing to shard)")
        return []
    from torch.distributed.device_mesh import init_device_mesh

    ctx.log(BASELINE_NOTE)
    if ctx.record_metadata is not None:
        ctx.record_metadata({"fsdp_baseline": BASELINE_NOTE})
    size, tokens = sizes(ctx)
    shape = mesh_shape(ctx.world_size)
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=("dp", "cp"))
    budget, source = memory_budget(ctx)
    measured: dict[str, Measured] = {}
    rows = []
    for configuration in CONFIGURATIONS:
        case = FsdpCase(configuration, size, tokens, shape, peaks=not ctx.quick)
        rows += run_case(ctx, MEMORY_BENCH, measure, case, mesh, budget, source, measured)
    alone = measured.get(CONFIGURATIONS[0].name)
    if alone is not None:
        for line in llama_8b_lines(alone.bytes_per_parameter):
            ctx.log(line)
    return rows


FAMILY = Family(
    name="fsdp",
    order=150,
    measures="what a rank holds of parameters, gradients and Adam's states under FSDP with sequence parallelism",
    run=run,
    sizes=SIZES,
    timed_share=0.00,
    work={"float": 0.75, "exchange": 0.01, "host": 0.24},
)
