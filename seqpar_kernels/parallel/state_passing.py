"""State passed across ranks: what the recurrent layers of hybrid models (linear attention,
state-space scans, short convolutions) need from the pieces of the sequence before
their own.

Every rank holds pieces of the global sequence (any layout the attention takes:
contiguous, zigzag, USP pieces, packed documents), each one or more runs of consecutive
positions inside one document. A run's recurrence is affine in the state entering it,

    state_after = transition(run) . state_before + state_after_from_zero(run)

so each rank summarises each of its runs by (transition, final state from a zero state),
a fixed-size value whatever the run's length; the ranks gather every run's summary
(SequenceRuns.gather: one all-to-all over the group, or over USP's two groups in turn),
each composes, for each of its runs, the summaries of the runs before it in its document
(SequenceRuns.incoming), and corrects its output with the state that enters. A
convolution of kernel K passes the last K - 1 inputs of each run instead.

    runs = SequenceRuns.of(describe, x, ...)          every piece's runs, checked on every rank
    runs.mine                                          this rank's runs, in local row order
    runs.gather(per_run)                               (mine, ...) -> (every run, ...), piece order
    runs.incoming(gathered, step, zero)                the state entering each of this rank's runs
    runs.final_states(gathered, step, zero)            every document's state after its last run
    laid_out(out, dtype, channels_first=False)         an op's output as its transformers function lays it out

gather is differentiable: its backward sums, for each run, the gradients every rank's
composition gave its summary (the reverse all-to-all), so the recurrences' gradients are
exact through autograd. Bytes: (P - 1) x this rank's summaries forward (each rank sends
its own to every other), the same backward; independent of the sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from seqpar_kernels.comm.grid import Grid, resolve_ranks
from seqpar_kernels.groups import GroupInfo, all_gather_ints
from seqpar_kernels.layouts import (
    Run,
    dense_slot_segments,
    document_runs,
    offsets,
    slice_segments,
    usp_rows,
    zigzag_piece_lengths,
)
from seqpar_kernels.parallel.checks import CheckedOnEveryRank, check_local_sizes, checked_on_grid, device_of
from seqpar_kernels.parallel.reshard import all_to_all_reshard
from seqpar_kernels.parallel.varlen import VarlenPlan

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SequenceRuns:
    """Every piece's runs of the global sequence (a run: consecutive positions of one
    document held by one piece; layouts.Run: local_start, start, length, document).

    pieces      every piece's runs, in piece order (i * U + j under USP), each piece's in
                its local row order (which is global order)
    piece       this rank's piece
    ranks       the call's group (GroupInfo) or USP grid
    bounds      the document bounds (cu_seqlens; one document for a dense sequence)
    requires_grad  whether the call's inputs require grad, agreed on every rank: then
                every rank's summaries join the backward's collective, a rank holding no
                rows too"""

    pieces: tuple[tuple[Run, ...], ...]
    piece: int
    ranks: GroupInfo | Grid
    bounds: tuple[int, ...]
    requires_grad: bool = False

    @classmethod
    def of(
        cls, describe: str, x: torch.Tensor, *, group=None, mesh=None, ulysses_group=None, ring_group=None,
        layout: str = "contiguous", seq_lens=None, varlen: VarlenPlan | None = None, agreed=(), local_checks=None,
        inputs=(),
    ) -> SequenceRuns:  # fmt: skip
        """The runs of a call whose this-rank tokens are x (batch, seqlen_local, ...), on
        every rank alike: one small all-gather (per group) of every rank's length and of
        the metadata every rank must agree on (`agreed`), so that a bad input on any rank
        raises on every rank. local_checks() runs this rank's own checks (raising
        ValueError) inside it; inputs: the tensors whose gradients the call computes
        (whether any requires grad is agreed too). seq_lens: every piece's length (skips the gather, as the
        attention functions' seq_lens); varlen: a VarlenPlan (the plan's layout)."""
        ranks = resolve_ranks(describe, group=group, mesh=mesh, ulysses_group=ulysses_group, ring_group=ring_group)
        requires_grad = torch.is_grad_enabled() and any(
            isinstance(tensor, torch.Tensor) and tensor.requires_grad for tensor in (x, *inputs)
        )
        grid = isinstance(ranks, Grid)
        pieces_info = ranks.pieces if grid else ranks

        def checks():
            if not isinstance(x, torch.Tensor) or x.dim() < 2:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{describe}: inputs must be (batch, seqlen_local, ...), got {shape}")
            if local_checks is not None:
                local_checks()
            lengths = None
            if varlen is not None:
                if not isinstance(varlen, VarlenPlan) or varlen.on_mesh != grid:
                    raise ValueError(f"{describe}: varlen must be a VarlenPlan made on the call's "
                                     f"{'mesh' if grid else 'group'} (varlen_plan)")  # fmt: skip
                if layout != "contiguous":
                    raise ValueError(f"{describe}: with varlen the plan sets the layout; pass no layout")
                if x.shape[0] != 1 or x.shape[1] != varlen.seq_lens[pieces_info.rank]:
                    expected = varlen.seq_lens[pieces_info.rank]
                    raise ValueError(
                        f"{describe}: packed documents take batch 1 and this rank's {expected} tokens of the plan, "
                        f"got {tuple(x.shape)}"
                    )
                lengths = list(varlen.seq_lens)
            elif layout not in LAYOUTS:
                raise ValueError(f"{describe}: layout must be one of {LAYOUTS}, got {layout!r}")
            elif seq_lens is not None:
                lengths = check_local_sizes(seq_lens, pieces_info, x.shape[1], "seq_lens", x.shape, 1)
            return x.shape[1], (tuple(agreed), layout, lengths, x.shape[0], requires_grad), lengths

        exchange = seq_lens is None and varlen is None
        if grid:
            lengths, row_lens, _ = checked_on_grid(describe, ranks, device_of(x), exchange, checks)
            if lengths is None:  # every slot's Ulysses lengths, in piece order
                lengths = [length for row in all_gather_ints(row_lens, ranks.ring.name, x.device) for length in row]
        else:
            with CheckedOnEveryRank(describe, ranks, device_of(x), exchange=exchange) as gather:
                local_size, metadata, lengths = checks()
                gather.share(local_size, metadata)
            lengths = gather.sizes if lengths is None else lengths
        if varlen is not None:
            bounds, segments = varlen.layout.cu_seqlens, varlen.layout.pieces
        else:
            bounds = (0, sum(lengths))
            ulysses_size = ranks.ulysses.world_size if grid else 1
            segments = _dense_segments(lengths, ulysses_size, layout == "zigzag", describe, x.shape)
        pieces = tuple(document_runs(piece_segments, bounds) for piece_segments in segments)
        return cls(pieces, pieces_info.rank, ranks, bounds, requires_grad)

    @property
    def mine(self) -> tuple[Run, ...]:
        return self.pieces[self.piece]

    def run_counts(self) -> list[int]:
        return [len(piece) for piece in self.pieces]

    def gather(self, per_run: torch.Tensor) -> torch.Tensor:
        """(len(mine), ...) -> (every piece's runs, ...), in piece order, on every rank
        (the other dims the same on every rank). Differentiable: the backward sums every
        rank's gradient of each run's rows onto the run's own rank."""
        counts = self.run_counts()
        if self.requires_grad and not per_run.requires_grad:  # no rows here: nothing to differentiate, but a part
            per_run = per_run.detach().requires_grad_()
        if isinstance(self.ranks, Grid):
            rows = self.ranks.rows(counts)
            slot = _gather_summed(per_run, self.ranks.ulysses_group, rows[self.ranks.ring.rank])
            return _gather_summed(slot, self.ranks.ring_group, [sum(row) for row in rows])
        if self.ranks.world_size == 1:
            return per_run
        return _gather_summed(per_run, self.ranks.process_group(), counts)

    def final_states(self, gathered: torch.Tensor, step: Callable, zero: torch.Tensor) -> torch.Tensor:
        """Every document's state after its last run, on every rank: (documents x batch,
        ...), zero's (batch, ...) per document in document order (a dense sequence: one
        document of the call's batch; packed documents: batch 1), step and gathered as
        incoming's. What a cache keeps for the tokens after the sequence (generation)."""
        offsets = [0]
        for runs in self.pieces:
            offsets.append(offsets[-1] + len(runs))
        order = sorted((run.start, piece, index) for piece, runs in enumerate(self.pieces)
                       for index, run in enumerate(runs))  # fmt: skip
        states: dict[int, torch.Tensor] = {}
        for _, piece, index in order:
            run = self.pieces[piece][index]
            states[run.document] = step(states.get(run.document, zero), gathered[offsets[piece] + index], run)
        documents = len(self.bounds) - 1
        return torch.stack([states.get(document, zero) for document in range(documents)]).flatten(0, 1)

    @staticmethod
    def joined(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """out, in the autograd graph of gathered on every rank: gather's backward is a
        collective, which a rank whose output reads no other run's summary (its runs
        each start a document, or it holds none) must join too. Exactly out forward;
        gathered's gradient from it is 0."""
        return _Joined.apply(out, gathered)

    def incoming(self, gathered: torch.Tensor, step: Callable, zero) -> list:
        """The state entering each of this rank's runs (in its local order): the runs
        before it in its document, in global order, composed from `zero` (a document's
        start) by step(state, gathered[index], run) -> state. gathered: gather's result."""
        offsets = [0]
        for runs in self.pieces:
            offsets.append(offsets[-1] + len(runs))
        last = max((run.start for run in self.mine), default=-1)
        order = sorted((run.start, piece, index) for piece, runs in enumerate(self.pieces)
                       for index, run in enumerate(runs) if run.start <= last)  # fmt: skip
        states: dict[int, object] = {}
        entering: dict[int, object] = {}
        for _, piece, index in order:
            run = self.pieces[piece][index]
            state = states.get(run.document, zero)
            if piece == self.piece:
                entering[index] = state
            states[run.document] = step(state, gathered[offsets[piece] + index], run)
        return [entering[index] for index in range(len(self.mine))]


def laid_out(out: torch.Tensor, dtype: torch.dtype, channels_first: bool = False) -> torch.Tensor:
    """A mixer's output (batch, seqlen_local, ...) in dtype, laid out in memory as the
    transformers function the op stands for returns it, whatever the runs, pieces or
    kernels made it: contiguous (mamba2_chunk_scan, torch_chunk_gated_delta_rule), or
    channels first, out.transpose(1, 2) contiguous (causal_conv1d_fn and
    mamba_selective_scan return (batch, channels, seqlen)); the models .view() them.
    One copy at most, none where out is laid out so already; with the cast when dtype
    differs."""
    if channels_first:
        return laid_out(out.transpose(1, 2), dtype).transpose(1, 2)
    # Tensor.to keeps a tensor of its dtype as it is, whatever memory_format asks.
    return out.contiguous() if out.dtype == dtype else out.to(dtype, memory_format=torch.contiguous_format)


class _Joined(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, gathered):
        ctx.gathered_shape, ctx.gathered_dtype = gathered.shape, gathered.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.gathered_shape, dtype=ctx.gathered_dtype)


def _dense_segments(lengths: Sequence[int], ulysses_size: int, zigzag: bool, describe: str, shape):
    """Every piece's global ranges of one dense sequence held by pieces of `lengths` rows
    (piece i * U + j: Ulysses index j of ring slot i; a group is slots of one piece): the
    slots in the contiguous or zigzag layout of their totals, each cut in its pieces'
    lengths. Raises ValueError (alike on every rank) where the slots' totals are not
    the zigzag layout's."""
    rows = usp_rows(lengths, ulysses_size)
    slot_lens = [sum(row) for row in rows]
    if zigzag:
        expected = zigzag_piece_lengths(sum(slot_lens), len(slot_lens))
        if slot_lens != expected:
            raise ValueError(
                f"{describe}: local lengths {list(lengths)} do not hold the zigzag layout of a sequence of "
                f"{sum(slot_lens)} rows (ring slots of {expected} rows, as zigzag_split and usp_split cut them); "
                f"this rank's input is {tuple(shape)}"
            )
    slots = dense_slot_segments(slot_lens, zigzag)
    return [slice_segments(slot, start, length) for slot, row in zip(slots, rows)
            for start, length in zip(offsets(row), row)]  # fmt: skip


def _gather_summed(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Every rank's x, concatenated along dim 0 in rank order (x holds sizes[rank] rows),
    by one all-to-all of x repeated for every rank: its autograd (the reverse all-to-all,
    then the sum over the repeats) adds every rank's gradient of these rows."""
    world_size = len(sizes)
    repeated = x.unsqueeze(0).expand(world_size, *x.shape)
    return all_to_all_reshard(repeated, 0, 1, group, gather_sizes=sizes).squeeze(0)
