"""What the tests of the sequence-parallel mixers share (tests/test_recurrent_*.py): the
ways a sequence is sharded, and one check of an op against its one-process reference.

where_cases(total)    (name, the op's keyword arguments, take, document bounds) for every
                      layout the attention takes on this world: a group (contiguous and
                      zigzag), USP grids (on 4 and 6 ranks), packed documents (contiguous
                      and balanced plans, on the group and on a grid)
check_against_reference(op, reference, inputs, sharded, replicated, ...)
                      forward, and every gradient (the replicated inputs' summed over the
                      ranks), of op on this rank's rows against the reference on the whole
                      sequence (run per document): the failures' names
Run inside the rank pool's ranks (tests/rank_pool.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from on_ranks import timeout_group
from test_usp import usp_groups

import seqpar_kernels as sp
from seqpar_kernels.parallel.parallelism import SequenceParallelism


def document_bounds(total: int) -> list[int]:
    """Packed documents of every kind: one token, short, long, and a long last one."""
    cuts = [0, 1, 9, 12, max(13, total // 2), max(14, total // 2 + 1), total]
    bounds = sorted({cut for cut in cuts if 0 <= cut <= total})
    return bounds if bounds[-1] == total else [*bounds, total]


def where_cases(total: int):
    """(name, op keyword arguments, take(full, dim) -> this rank's rows, document bounds or
    None) for a sequence of `total` tokens, every layout this world runs."""
    world = dist.get_world_size()
    group = {"group": timeout_group()}
    cases = []
    for layout in ("contiguous", "zigzag"):
        parallelism = SequenceParallelism.resolve("test", "ring", "balanced" if layout == "zigzag" else "contiguous",
                                                  **group)  # fmt: skip
        cases.append((f"group {layout}", dict(layout=layout, **group), parallelism.take, None))
    grids = [usp_groups("mesh", 2)] if world % 2 == 0 and world > 2 else []
    for groups in grids:
        for layout in ("contiguous", "zigzag"):
            parallelism = SequenceParallelism.resolve("test", "usp", "balanced" if layout == "zigzag" else "contiguous",
                                                      **groups)  # fmt: skip
            cases.append((f"grid {layout}", dict(layout=layout, **groups), parallelism.take, None))
    bounds = document_bounds(total)
    for name, groups in [("group", group), *(("grid", groups) for groups in grids)]:
        for layout in ("contiguous", "balanced"):
            plan = sp.varlen_plan(bounds, layout=layout, **groups)
            cases.append((f"documents {name} {layout}", dict(varlen=plan, **groups), plan.split, bounds))
    return cases


def per_document(reference, inputs, sequence_inputs, bounds, dim: int = 1):
    """reference(*inputs) run on each document of `bounds` alone, the outputs joined
    (the inputs at the indices sequence_inputs, which hold the sequence along dim, cut)."""
    if bounds is None:
        return reference(*inputs)
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        cut = [x.narrow(dim, start, end - start) if index in sequence_inputs else x for index, x in enumerate(inputs)]
        pieces.append(reference(*cut))
    return torch.cat(pieces, dim)


def check_against_reference(op, reference, full_inputs, sequence_inputs, total, *, generator, atol, rtol=0.0,
                            case_filter=None) -> list[str]:  # fmt: skip
    """op(*inputs, **where) on this rank's rows against reference(*full inputs) per
    document, for every where case: the output rows, the gradients of the sequence inputs
    (this rank's rows) and of the others (summed over the ranks). full_inputs: the
    inputs on the whole sequence, the same on every rank; sequence_inputs: the indices of
    those with the sequence along dim 1 (the others are replicated: weights)."""
    failures = []
    for name, where, take, bounds in where_cases(total):
        if case_filter is not None and not case_filter(name):
            continue
        inputs = full_inputs
        if bounds is not None:  # packed documents: one row
            inputs = [x[:1] if index in sequence_inputs else x for index, x in enumerate(full_inputs)]
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                  for x in inputs]  # fmt: skip
        expected = per_document(reference, leaves, sequence_inputs, bounds)
        dout = torch.randn(expected.shape, generator=generator, dtype=expected.dtype)
        expected.backward(dout)
        local = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        local = [take(x, 1).detach().clone() if index in sequence_inputs else x for index, x in enumerate(local)]
        local = [x.requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in local]
        out = op(*local, **where)
        checks = {"forward": _close(out, take(expected.detach(), 1), atol, rtol)}
        out.backward(take(dout, 1))
        for index, (mine, theirs) in enumerate(zip(local, leaves)):
            if not isinstance(mine, torch.Tensor) or not mine.requires_grad:
                continue
            if index in sequence_inputs:
                checks[f"grad {index}"] = _close(mine.grad, take(theirs.grad, 1), atol, rtol)
            else:
                # A rank without rows gives the weights no gradient: zeros (as all_reduce_gradients).
                summed = torch.zeros_like(mine) if mine.grad is None else mine.grad.clone()
                for group in _reduce_groups(where):
                    dist.all_reduce(summed, group=group)
                checks[f"grad {index} (summed)"] = _close(summed, theirs.grad, atol, rtol)
        failures += [f"{name} N={total}: {check} {detail}" for check, detail in checks.items() if detail]
    return failures


def _reduce_groups(where: dict):
    if "group" in where:
        return [where["group"]]
    mesh = where["mesh"]
    return [mesh.get_group("ulysses"), mesh.get_group("ring")]


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str:
    """'' when close, else the largest difference."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    error = (got.double() - want.double()).abs()
    limit = atol + rtol * want.double().abs()
    return "" if bool((error <= limit).all()) else f"max error {error.max().item():.3g}"
