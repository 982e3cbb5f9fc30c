"""Hybrid models' mixers on P ranks, their state passed across ranks, against the same
function on the whole sequence in one process; and the bytes a layer sends against
gathering the sequence and against Ulysses.

Rows (bench column "hybrid"), one per mixer, length and layout, forward + backward, fp32:
  ours       the mixer (seqpar_kernels.causal_conv1d, ssd_scan, selective_scan,
             gated_delta_rule) on every rank, each holding S / P rows of a sequence of
             S tokens in the layout (contiguous, or zigzag: chunks r and 2P-1-r of 2P),
             called with seq_lens;
             the gradients of every input (each rank's weight gradients are its rows'
             share, which a training step's all_reduce_gradients sums once for the
             whole model: not timed)
  baseline   the same function on the whole sequence in one process: rank 0 alone (a
             group of its own), on CPU with every core, while the other ranks wait at
             the next round's barrier (as the transformers family's single process)
A case is a mixer at a length: the one process and every layout are timed side by side
in one time_side_by_side call (interleaved rounds; a sample is the slowest rank's time);
speedup = one process / the layout's. On CPU ranks sharing the cores (4 gloo ranks on 2
here) that is the one process's work over the ranks' total work, not a parallel speedup
(bench/README.md, "Transformers training step").

Bytes per layer (rank 0, one forward + backward; the lengths even):
  bytes_sent_ours     comm_stats around ours; bytes_sent_theory traffic.state_passing_bytes
                      of the layout's runs (a piece is 1 run contiguous, 2 zigzag) and the
                      mixer's summary; volume_at_theory: equal on every rank
  bytes_if_gathered   the layer gathering its inputs instead (the naive sequence-parallel
                      mixer): every sequence input all-gathered (traffic.gather_bytes), and
                      in the backward the inputs' gradients reduce-scattered back to their
                      ranks (as many bytes again)
  bytes_if_ulysses    Ulysses' all-to-alls: every sequence input to whole sequences of a
                      share of the heads (the head groups they read: traffic.kv_heads_read),
                      the output back; the backward the reverse (ulysses_mixer_bytes, which
                      gives traffic.ulysses_bytes for attention's q, k, v)
State passing sends the same bytes at every length; the other two grow with it.

check: ours' output and every input's gradient (the sequence inputs' gathered to rank 0
in sequence order, the weights' summed over the ranks) against the one process's,
"matches" within OUTPUT_RTOL (output) and GRAD_RTOL (gradients) of the largest value
(fp32: the summation order differs at the pieces' boundaries), else "MISMATCH ...".

The mixers (MIXERS, one entry each: its inputs, what Ulysses splits, its summary's bytes,
the call) at CPU sizes in the ratios of the models': Mamba2's SSD of 8 heads of 32 with
state 64 and one group of B, C (Bamba, Nemotron-H: heads of 64, state 128), Mamba's
selective scan of 256 channels with state 16 (Jamba, Mamba: state 16), Gated DeltaNet's
rule of 4 q/k heads serving 8 value heads, all of 32 (Qwen3-Next: 16 serving 32, of 128),
the short convolution of kernel 4 on 512 channels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bench.runner.cases import run_case, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import HYBRID_BENCH, Row
from bench.runner.timing import time_side_by_side
from bench.runner.verify import volume_against_theory
from seqpar_kernels import causal_conv1d, comm_stats, gated_delta_rule, gather_sequence, selective_scan, ssd_scan
from seqpar_kernels.layouts import tensor_split_sizes
from seqpar_kernels.traffic import (
    CallBytes,
    gated_delta_summary_bytes,
    gather_bytes,
    kv_heads_read,
    state_passing_bytes,
)
from tools.reference import ring_piece

BASELINE_NOTE = (
    "hybrid: each mixer (causal_conv1d, ssd_scan, selective_scan, gated_delta_rule) forward + backward, fp32; "
    "ours = the function on every rank's piece (contiguous, zigzag), its state passed across ranks; baseline = "
    "the same function on the whole sequence in one process (rank 0 alone; on CPU with every core); x = one "
    "process / ours (on CPU ranks sharing cores: total work, not a parallel speedup); bytes per layer: "
    "state passing (measured) against gathering the inputs and against Ulysses (formulas)"
)

SINGLE = "one process"
LAYOUTS = ("contiguous", "zigzag")
BATCH = 1
DTYPE = torch.float32
# fp32 against the one process's fp32 (the transformers and video families' tolerances):
# ours sums in another order at the pieces' boundaries, nothing more.
OUTPUT_RTOL = 1e-5
GRAD_RTOL = 1e-4
# Per case: the one process and each layout a call each round, warm after the check; a
# few rounds settle the ratio (the selective scan's calls take seconds at 4K tokens).
REPETITIONS = dict(warmup=1, reps=5, max_reps=15, seconds_per_case=6.0)


def normal(values: torch.Tensor) -> torch.Tensor:
    return values


def negative(values: torch.Tensor) -> torch.Tensor:
    """A decay rate: -exp of normal values (A of the scans)."""
    return -torch.exp(values)


def log_decay(values: torch.Tensor) -> torch.Tensor:
    """A log decay in (-1, 0): the gated delta rule's g (slow decays, as the tests draw)."""
    return -torch.sigmoid(values)


@dataclass(frozen=True)
class Input:
    """One input of a mixer. A sequence input is (batch, S, *shape); under Ulysses each rank
    needs those of its `groups` that its share of the mixer's heads read (kv_heads_read:
    `groups` = heads for a per-head input, 1 for one shared by every head). A weight is
    `shape`, whole on every rank. values: its random values, from normal ones."""

    shape: tuple[int, ...]
    groups: int = 1
    values: Callable[[torch.Tensor], torch.Tensor] = normal

    @property
    def row_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Mixer:
    """A mixer as the bench runs it: one entry of MIXERS, under its function's name."""

    model: str  # whose mixer and its sizes: the rows' shape column
    heads: int  # what Ulysses splits over the ranks: heads, or channels
    sequence: dict[str, Input]  # inputs along the sequence (dim 1), by keyword
    weights: dict[str, Input]  # inputs whole on every rank, by keyword
    output: tuple[int, ...]  # the output's shape per row: (batch, S_local, *output)
    summary_bytes: Callable[[int], int]  # batch -> one run's summary (state_passing_bytes' summary_bytes)
    call: Callable[..., torch.Tensor]  # (inputs by keyword, **where) -> the output


CONV_CHANNELS, CONV_KERNEL = 512, 4
SSD_HEADS, SSD_HEAD_DIM, SSD_GROUPS, SSD_STATE = 8, 32, 1, 64
SELECTIVE_CHANNELS, SELECTIVE_STATE = 256, 16
DELTA_KEY_HEADS, DELTA_VALUE_HEADS, DELTA_KEY_DIM, DELTA_VALUE_DIM = 4, 8, 32, 32

MIXERS = {
    "causal_conv1d": Mixer(
        model=f"short convolution: {CONV_CHANNELS} channels, kernel {CONV_KERNEL}, bias, SiLU",
        heads=CONV_CHANNELS,
        sequence={"x": Input((CONV_CHANNELS,), CONV_CHANNELS)},
        weights={"weight": Input((CONV_CHANNELS, CONV_KERNEL)), "bias": Input((CONV_CHANNELS,))},
        output=(CONV_CHANNELS,),
        # A run's last kernel - 1 inputs, in x's dtype.
        summary_bytes=lambda batch: batch * (CONV_KERNEL - 1) * CONV_CHANNELS * DTYPE.itemsize,
        call=lambda t, **where: causal_conv1d(t["x"], t["weight"], t["bias"], activation="silu", **where),
    ),
    "ssd_scan": Mixer(
        model=f"Mamba2 SSD: {SSD_HEADS} heads x {SSD_HEAD_DIM}, {SSD_GROUPS} group, state {SSD_STATE}, "
        "chunk 256, D, dt_bias, softplus",
        heads=SSD_HEADS,
        sequence={
            "x": Input((SSD_HEADS, SSD_HEAD_DIM), SSD_HEADS),
            "dt": Input((SSD_HEADS,), SSD_HEADS),
            "B": Input((SSD_GROUPS, SSD_STATE), SSD_GROUPS),
            "C": Input((SSD_GROUPS, SSD_STATE), SSD_GROUPS),
        },
        weights={"A": Input((SSD_HEADS,), values=negative), "D": Input((SSD_HEADS,)), "dt_bias": Input((SSD_HEADS,))},
        output=(SSD_HEADS, SSD_HEAD_DIM),
        # Per head its decay and its (head_dim, state) final state, fp32.
        summary_bytes=lambda batch: batch * SSD_HEADS * (1 + SSD_HEAD_DIM * SSD_STATE) * 4,
        call=lambda t, **where: ssd_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["dt_bias"],
                                         dt_softplus=True, **where),
    ),
    "selective_scan": Mixer(
        model=f"Mamba selective scan: {SELECTIVE_CHANNELS} channels, state {SELECTIVE_STATE}, D, z, "
        "delta_bias, softplus",
        heads=SELECTIVE_CHANNELS,
        sequence={
            "u": Input((SELECTIVE_CHANNELS,), SELECTIVE_CHANNELS),
            "delta": Input((SELECTIVE_CHANNELS,), SELECTIVE_CHANNELS),
            "B": Input((SELECTIVE_STATE,)),  # shared by every channel
            "C": Input((SELECTIVE_STATE,)),
            "z": Input((SELECTIVE_CHANNELS,), SELECTIVE_CHANNELS),
        },
        weights={
            "A": Input((SELECTIVE_CHANNELS, SELECTIVE_STATE), values=negative),
            "D": Input((SELECTIVE_CHANNELS,)),
            "delta_bias": Input((SELECTIVE_CHANNELS,)),
        },
        output=(SELECTIVE_CHANNELS,),
        # Per channel its (state,) decay and final state, fp32.
        summary_bytes=lambda batch: batch * SELECTIVE_CHANNELS * SELECTIVE_STATE * 2 * 4,
        call=lambda t, **where: selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], D=t["D"], z=t["z"],
                                               delta_bias=t["delta_bias"], delta_softplus=True, **where),
    ),
    "gated_delta_rule": Mixer(
        model=f"Gated DeltaNet: {DELTA_KEY_HEADS} q/k heads x {DELTA_KEY_DIM} serving {DELTA_VALUE_HEADS} value "
              f"heads x {DELTA_VALUE_DIM}, q/k L2 norm",
        heads=DELTA_VALUE_HEADS,
        sequence={
            "q": Input((DELTA_KEY_HEADS, DELTA_KEY_DIM), DELTA_KEY_HEADS),
            "k": Input((DELTA_KEY_HEADS, DELTA_KEY_DIM), DELTA_KEY_HEADS),
            "v": Input((DELTA_VALUE_HEADS, DELTA_VALUE_DIM), DELTA_VALUE_HEADS),
            "g": Input((DELTA_VALUE_HEADS,), DELTA_VALUE_HEADS, values=log_decay),
            "beta": Input((DELTA_VALUE_HEADS,), DELTA_VALUE_HEADS, values=torch.sigmoid),
        },
        weights={},
        output=(DELTA_VALUE_HEADS, DELTA_VALUE_DIM),
        summary_bytes=lambda batch: gated_delta_summary_bytes(batch, DELTA_VALUE_HEADS, DELTA_KEY_DIM,
                                                              DELTA_VALUE_DIM),
        call=lambda t, **where: gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm=True,
                                                 **where),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class HybridCase:
    """A mixer at S tokens in all, on every layout of `layouts`."""

    mixer: str  # a key of MIXERS
    tokens: int
    layouts: tuple[str, ...] = LAYOUTS

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE

    @property
    def label(self) -> str:
        return f"{self.mixer} S={self.tokens}"

    @property
    def shape(self) -> str:
        return f"B={BATCH} S={self.tokens}; {MIXERS[self.mixer].model}"


# Total tokens per size; the selective scan's backward costs seconds at 4K tokens on CPU
# (its (S, channels, state) intermediates), so the default runs it at 1K.
QUICK_TOKENS = 64
DEFAULT_TOKENS = {"causal_conv1d": (1024, 4096), "ssd_scan": (1024, 4096), "selective_scan": (1024,),
                  "gated_delta_rule": (1024, 4096)}  # fmt: skip
FULL_TOKENS = {mixer: (1024, 4096, 8192) for mixer in MIXERS}
GPU_TOKENS = (8192, 32768)


def cases(ctx: Context) -> list[HybridCase]:
    if ctx.quick:
        return [HybridCase(mixer, QUICK_TOKENS) for mixer in MIXERS]
    if ctx.on_gpu:
        return [HybridCase(mixer, tokens) for mixer in MIXERS for tokens in GPU_TOKENS]
    lengths = FULL_TOKENS if ctx.full else DEFAULT_TOKENS
    return [HybridCase(mixer, tokens) for mixer in MIXERS for tokens in lengths[mixer]]


SIZES = Sizes(
    quick=Size(f"4 mixers at {QUICK_TOKENS} tokens, contiguous and zigzag", 5),
    default=Size(
        "conv, SSD and gated delta rule at 1K and 4K tokens, the selective scan at 1K; contiguous and zigzag, "
        "forward + backward, against one process",
        44,
        gpu_runs="4 mixers at 8K and 32K tokens, contiguous and zigzag",
    ),
    full=Size("4 mixers at 1K, 4K and 8K tokens, contiguous and zigzag", 411, gpu_runs="the default's cases"),
)


def run_counts(layout: str, world_size: int) -> list[int]:
    """Every piece's runs of one sequence: contiguous 1, zigzag 2 (chunks r and 2P-1-r)."""
    return [2 if layout == "zigzag" else 1] * world_size


def gathering_bytes(seq_lens: Sequence[int], rank: int, row_bytes: int) -> CallBytes:
    """Bytes a mixer that gathers its inputs sends from `rank` (row_bytes: one row of
    every sequence input): the all-gather (traffic.gather_bytes), and in the backward
    the gradients of every rank's rows reduce-scattered back to it:
        forward   (P-1) x S_r x row_bytes
        backward  (S - S_r) x row_bytes"""
    return CallBytes(gather_bytes(seq_lens, rank, row_bytes), (sum(seq_lens) - seq_lens[rank]) * row_bytes)


def ulysses_mixer_bytes(seq_lens: Sequence[int], rank: int, *, heads: int, inputs: Sequence[tuple[int, int]],
                        output_bytes_per_head: int) -> CallBytes:  # fmt: skip
    """Bytes a mixer under Ulysses sends from `rank`: each sequence input to whole
    sequences of a share of the heads (rank j runs n_j heads, torch.tensor_split, and
    needs the m_j(g) groups of an input of g groups they read: traffic.kv_heads_read),
    the output back; the backward the reverse.

    inputs: (groups g, bytes of one group's row) per sequence input; the output has
    output_bytes_per_head per row and head. Sums over j != r:
        forward   S_r sum_g m_j(g) x row_g + S_j n_r x out
        backward  S_r n_j x out + S_j sum_g m_r(g) x row_g
    Attention's q (H groups), k and v (H_kv groups) and out give traffic.ulysses_bytes."""
    world_size = len(seq_lens)
    shares = tensor_split_sizes(heads, world_size)
    read = [[len(groups) for groups in kv_heads_read(heads, count, world_size)] for count, _ in inputs]
    sizes = [row for _, row in inputs]
    others = [j for j in range(world_size) if j != rank]
    own = seq_lens[rank]
    forward = sum(own * sum(m[j] * row for m, row in zip(read, sizes)) + seq_lens[j] * shares[rank]
                  * output_bytes_per_head for j in others)  # fmt: skip
    backward = sum(own * shares[j] * output_bytes_per_head + seq_lens[j] * sum(m[rank] * row for m, row in
                   zip(read, sizes)) for j in others)  # fmt: skip
    return CallBytes(forward, backward)


def full_inputs(ctx: Context, mixer: Mixer, tokens: int) -> dict[str, torch.Tensor]:
    """The whole sequence's inputs by keyword, the same on every rank (seeded)."""
    tensors = {}
    for seed, (name, spec) in enumerate([*mixer.sequence.items(), *mixer.weights.items()]):
        shape = (BATCH, tokens, *spec.shape) if name in mixer.sequence else spec.shape
        tensors[name] = spec.values(ctx.random(shape, DTYPE, 100 + seed))
    return tensors


def leaves(tensors: dict) -> dict:
    return {name: tensor.detach().clone().requires_grad_() for name, tensor in tensors.items()}


def forward_backward(mixer: Mixer, tensors: dict, dout: torch.Tensor, **where) -> Callable[[], list]:
    """The call timed: the mixer's output and every input's gradient, [out, *grads]."""
    inputs = leaves(tensors)
    names = list(inputs)

    def call():
        out = mixer.call(inputs, **where)
        grads = torch.autograd.grad(out, [inputs[name] for name in names], dout)
        return [out.detach(), *grads]

    return call


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| over the largest |want| (0 for empty tensors)."""
    if not want.numel():
        return 0.0
    return (got.double() - want.double()).abs().max().item() / max(want.abs().max().item(), 1e-30)


def check(ctx: Context, mixer: Mixer, layout: str, ours: list, expected: list | None) -> tuple[str, str]:
    """Ours' [out, *grads] (this rank's rows; the weights' gradients its share) against the
    one process's (rank 0): (check, detail) on rank 0, placeholders elsewhere.
    Collective: every rank gathers its rows and sums its weights' gradients."""
    names = ["out", *mixer.sequence, *mixer.weights]
    along_sequence = {"out", *mixer.sequence}
    whole = [gather_sequence(t, 1) if name in along_sequence else ctx.reduce_over_ranks(t, op=dist.ReduceOp.SUM)
             for name, t in zip(names, ours)]  # fmt: skip
    if not ctx.is_root:
        return "", ""
    errors = {}
    for name, got, want in zip(names, whole, expected):
        if name in along_sequence:  # the one process's rows in rank order, as gathered
            want = torch.cat([ring_piece(want, layout, rank, ctx.world_size) for rank in range(ctx.world_size)], 1)
        errors[name] = relative_error(got.to(want.device), want)
    grads = {name: error for name, error in errors.items() if name != "out"}
    worst = max(grads, key=grads.get)
    failed = (["out"] if not errors["out"] <= OUTPUT_RTOL else []) + [
        name for name, error in grads.items() if not error <= GRAD_RTOL
    ]
    verdict = "matches" if not failed else f"MISMATCH {', '.join(failed)}"
    detail = (f"vs one process: out {errors['out']:.1e} of its largest value (tolerance {OUTPUT_RTOL:g}), "
              f"gradients at most {grads[worst]:.1e} (d{worst}, tolerance {GRAD_RTOL:g})")  # fmt: skip
    return verdict, detail


def _bytes(num_bytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def measure(case: HybridCase, ctx: Context, alone) -> list[Row]:
    mixer = MIXERS[case.mixer]
    world_size, rank = ctx.world_size, ctx.rank
    tensors = full_inputs(ctx, mixer, case.tokens)
    along_sequence = set(mixer.sequence)

    dout = ctx.random((BATCH, case.tokens, *mixer.output), DTYPE, 99)
    single_call = forward_backward(mixer, tensors, dout, group=alone, seq_lens=[case.tokens])

    def single():
        if ctx.is_root:
            with ctx.every_core():
                return single_call()
        return None

    ours, seq_lens = {}, {}
    for layout in case.layouts:
        local = {name: ring_piece(t, layout, rank, world_size) if name in along_sequence else t
                 for name, t in tensors.items()}  # fmt: skip
        local_dout = ring_piece(dout, layout, rank, world_size)
        seq_lens[layout] = [ring_piece(dout, layout, piece, world_size).shape[1] for piece in range(world_size)]
        ours[layout] = forward_backward(mixer, local, local_dout, layout=layout, seq_lens=seq_lens[layout])

    expected = single() if ctx.is_root else None
    verdicts, volumes = {}, {}
    for layout in case.layouts:  # one call each: its bytes, then its results checked
        with comm_stats() as sent:
            results = ours[layout]()
        theory = state_passing_bytes(run_counts(layout, world_size), rank, summary_bytes=mixer.summary_bytes(BATCH))
        volumes[layout] = volume_against_theory(ctx, sent.bytes_sent, theory.sent(True))
        verdicts[layout] = check(ctx, mixer, layout, results, expected)

    # What the other two ways would send per layer from this rank's piece.
    row_bytes = BATCH * sum(spec.row_elements for spec in mixer.sequence.values()) * DTYPE.itemsize
    inputs = [(spec.groups, BATCH * spec.row_elements // spec.groups * DTYPE.itemsize)
              for spec in mixer.sequence.values()]  # fmt: skip
    output_bytes_per_head = BATCH * math.prod(mixer.output) // mixer.heads * DTYPE.itemsize
    gathered = {layout: gathering_bytes(lengths, rank, row_bytes).sent(True) for layout, lengths in seq_lens.items()}
    ulysses = {layout: ulysses_mixer_bytes(lengths, rank, heads=mixer.heads, inputs=inputs,
                                           output_bytes_per_head=output_bytes_per_head).sent(True)
               for layout, lengths in seq_lens.items()}  # fmt: skip

    timing_ctx = ctx if ctx.quick else dataclasses.replace(ctx, **REPETITIONS)
    timings = time_side_by_side({SINGLE: single, **ours}, timing_ctx)

    threads = "one GPU" if ctx.on_gpu else "every core"
    rows = []
    for layout in case.layouts:
        volume = volumes[layout]
        verdict, accuracy = verdicts[layout]
        # Even pieces of S_l rows: gathering sends 2 (P-1) S_l rows, state passing the same
        # bytes at every S_l, so it sends less above this S_l.
        break_even = volume.theory / (2 * (world_size - 1) * row_bytes) if world_size > 1 else math.inf
        sent = max(volume.measured, 1)
        gather_sent, ulysses_sent = gathered[layout], ulysses[layout]
        detail = "; ".join([
            f"fp32 forward + backward; one process: rank 0 alone ({threads}), the whole sequence",
            f"bytes per layer (rank 0): state passing {_bytes(volume.measured)}, gathering the inputs "
            f"{_bytes(gather_sent)} ({gather_sent / sent:.1f}x), Ulysses {_bytes(ulysses_sent)} "
            f"({ulysses_sent / sent:.1f}x); gathering sends less below {break_even:.0f} tokens per rank",
            accuracy,
        ])  # fmt: skip
        rows.append(timed_row(
            ctx, {"ours": timings[layout], "baseline": timings[SINGLE]},
            bench=HYBRID_BENCH, case=f"{case.mixer} {layout} S={case.tokens}", shape=case.shape, dtype="fp32",
            check=verdict, layout=layout, bytes_sent_ours=volume.measured, bytes_sent_theory=volume.theory,
            volume_at_theory=volume.at_theory, bytes_if_gathered=gather_sent, bytes_if_ulysses=ulysses_sent,
            detail=detail,
        ))  # fmt: skip
    return rows


def run(ctx: Context) -> list[Row]:
    ctx.log(BASELINE_NOTE)
    ctx.log_every_core("hybrid")
    # The one process's group: rank 0 alone (new_group is collective: every rank makes it).
    alone = dist.new_group([0]) if ctx.world_size > 1 else None
    rows = []
    for case in cases(ctx):
        rows += run_case(ctx, HYBRID_BENCH, measure, case, alone)
    return rows


FAMILY = Family(
    name="hybrid",
    order=100,
    measures="hybrid models' mixers, their state passed across ranks, against one process",
    run=run,
    sizes=SIZES,
    timed_share=0.87,
    work={"float": 0.64, "host": 0.36},
    fewest_share=0.46,  # 1 warm-up + 5 to 15 timed rounds a case: measured 18 s of rounds at the fewest, 28 s at x0.73
    metadata=lambda: {"hybrid_baseline": BASELINE_NOTE},
)
