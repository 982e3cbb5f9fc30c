"""ssd_scan and selective_scan (seqpar_kernels/parallel/state_space.py), the state-space
scans of hybrid models' mixers, sequence-parallel: against transformers' own scans
(Bamba's mamba2_chunk_scan, Jamba's mamba_selective_scan) on the whole sequence in one
process (per document for packed ones), forward and every gradient, every layout, world
sizes 1-4 and USP grids; bf16 within rounding; bytes against seqpar_kernels.traffic; bad
inputs on every rank."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import pool_for
from on_ranks import on_every_rank, raises, timeout_group
from recurrent_cases import check_against_reference
from test_usp import usp_groups

from seqpar_kernels import comm_stats
from seqpar_kernels.parallel.state_space import selective_scan, ssd_scan
from seqpar_kernels.traffic import state_passing_bytes

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

# What transformers' references call besides torch, as they run without the optional kernels.
_REFERENCE_GLOBALS = {
    "is_torch_greater_or_equal": lambda version: False,
    "is_mambapy_available": lambda: False,
    "is_torchdynamo_compiling": lambda: False,
    "is_torchdynamo_exporting": lambda: False,
}


@functools.cache
def transformers_function(modeling_file: str, name: str, helpers: tuple[str, ...] = ()):
    """transformers' function `name` (and the module-level helpers it calls) from
    transformers/models/<modeling_file>, as written there, decorators dropped (they pick
    an installed kernel package instead): read from the source, because importing the
    modeling module costs seconds of CPU in every rank."""
    root = Path(importlib.util.find_spec("transformers").submodule_search_locations[0])
    path = root / "models" / modeling_file
    wanted = {name, *helpers}
    functions = [node for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.FunctionDef) and node.name in wanted]  # fmt: skip
    assert {node.name for node in functions} == wanted, f"{path} has {[node.name for node in functions]}"
    for node in functions:
        node.decorator_list = []
    namespace = {"torch": torch, "F": F, "nn": torch.nn, **_REFERENCE_GLOBALS}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


@contextlib.contextmanager
def float_keeps_fp64():
    """transformers' scans upcast with .float(); for the fp64 checks their code runs as
    written with .float() leaving fp64 tensors in fp64 (exact to 1e-15 instead of fp32's
    1e-7)."""
    upcast = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: self if self.dtype == torch.float64 else upcast(self)
    try:
        yield
    finally:
        torch.Tensor.float = upcast


def reference_ssd(x, dt, A, B, C, D, dt_bias, *, chunk_size, dt_softplus, dt_limit):
    """transformers' mamba2_chunk_scan (Bamba's), sequence on dim 1 as ours."""
    scan = transformers_function("bamba/modeling_bamba.py", "mamba2_chunk_scan",
                                 ("pad_tensor_by_size", "reshape_into_chunks", "segment_sum"))  # fmt: skip
    with float_keeps_fp64():
        return scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)


def reference_selective(u, delta, A, B, C, D, z, delta_bias, *, delta_softplus):
    """transformers' mamba_selective_scan (Jamba's; Mamba's is the same), which takes the
    sequence on dim 2: our layout transposed in and out."""
    scan = transformers_function("jamba/modeling_jamba.py", "mamba_selective_scan")

    def flip(t):
        return None if t is None else t.transpose(1, 2)

    with float_keeps_fp64():
        out = scan(flip(u), flip(delta), A, flip(B), flip(C), D=D, z=flip(z), delta_bias=delta_bias,
                   delta_softplus=delta_softplus)  # fmt: skip
    return flip(out)


def in_fp64(reference):
    """The reference on the inputs upcast to fp64, its output back in the inputs' dtype:
    the exact result of inputs rounded to a low precision."""

    def upcast(*inputs):
        dtype = inputs[0].dtype
        inputs = [t.double() if isinstance(t, torch.Tensor) else t for t in inputs]
        return reference(*inputs).to(dtype)

    return upcast


def ssd_case(generator, dtype, total, batch, grouped: bool):
    """(inputs, sequence input indices, options): x, dt, A, B, C, D, dt_bias on `total`
    tokens; grouped: 4 heads reading 2 groups of B and C, D, dt_bias, softplus and a
    dt_limit that clamps; else 2 heads of 1 group, dt used as given (clamped at 0)."""
    heads, groups = (4, 2) if grouped else (2, 1)
    head_dim, state_size = 3, 5

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    x = randn(batch, total, heads, head_dim)
    dt = randn(batch, total, heads) if grouped else torch.rand(batch, total, heads, generator=generator) - 0.1
    A = -torch.exp(randn(heads))
    B, C = randn(batch, total, groups, state_size), randn(batch, total, groups, state_size)
    D, dt_bias = (randn(heads), randn(heads) * 0.5) if grouped else (None, None)
    options = dict(dt_softplus=grouped, dt_limit=(0.0, 1.2) if grouped else (0.0, math.inf))
    inputs = [t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (x, dt, A, B, C, D, dt_bias)]
    return inputs, {0, 1, 3, 4}, options


def selective_case(generator, dtype, total, batch, gated: bool):
    """(inputs, sequence input indices, options): u, delta, A, B, C, D, z, delta_bias on
    `total` tokens, 3 channels of 4 states; gated: D, z, delta_bias and softplus."""
    channels, state_size = 3, 4

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    u = randn(batch, total, channels)
    delta = randn(batch, total, channels) if gated else torch.rand(batch, total, channels, generator=generator)
    A = -torch.exp(randn(channels, state_size))
    B, C = randn(batch, total, state_size), randn(batch, total, state_size)
    D, z, delta_bias = (randn(channels), randn(batch, total, channels), randn(channels)) if gated else (None,) * 3
    inputs = [t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (u, delta, A, B, C, D, z, delta_bias)]
    return inputs, {0, 1, 3, 4} | ({6} if gated else set()), dict(delta_softplus=gated)


def ssd_op(chunk_size, options):
    def op(x, dt, A, B, C, D, dt_bias, **where):
        return ssd_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, **options, **where)

    return op


def selective_op(options):
    def op(u, delta, A, B, C, D, z, delta_bias, **where):
        return selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, **options, **where)

    return op


@on_every_rank
def run_scans(dtype, totals, atol, rtol, case_filter=None):
    """Both scans against transformers' on every layout: the failures."""
    failures = []
    world = dist.get_world_size()
    generator = torch.Generator().manual_seed(11)
    for total, variant in zip(totals(world), (True, False)):
        inputs, sequence, options = ssd_case(generator, dtype, total, 2, grouped=variant)
        # Chunks of 4 (ours per run, theirs over the whole sequence): both cross chunks.
        reference = functools.partial(reference_ssd, chunk_size=4, **options)
        reference = in_fp64(reference) if dtype != torch.float64 else reference
        failures += [f"ssd {failure}" for failure in check_against_reference(
            ssd_op(4, options), reference, inputs, sequence, total, generator=generator, atol=atol, rtol=rtol,
            case_filter=case_filter)]  # fmt: skip
        inputs, sequence, options = selective_case(generator, dtype, total, 2, gated=variant)
        reference = functools.partial(reference_selective, **options)
        reference = in_fp64(reference) if dtype != torch.float64 else reference
        failures += [f"selective {failure}" for failure in check_against_reference(
            selective_op(options), reference, inputs, sequence, total, generator=generator, atol=atol, rtol=rtol,
            case_filter=case_filter)]  # fmt: skip
    return failures


def uneven_and_empty(world: int) -> tuple[int, ...]:
    """An uneven length with every option on, then fewer tokens than ranks (empty pieces)
    with none."""
    return (4 * world + 3, max(world - 1, 2))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6], ids=lambda size: f"P{size}")
def test_matches_transformers_scans_in_fp64(world_size):
    results = pool_for(world_size).run(run_scans, torch.float64, uneven_and_empty, 1e-10, 0.0)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {failures[:6]}"


def one_length(world: int) -> tuple[int, ...]:
    return (4 * world + 3,)


def zigzag_and_balanced_documents(case: str) -> bool:
    return case in ("group zigzag", "documents group balanced")


def test_bf16_within_rounding():
    # bf16 inputs, fp32 inside; the reference: the exact (fp64) scan of the same bf16 values,
    # rounded to bf16. Each side rounds a result once: 1 bf16 unit (2^-7 relative) apart at
    # most, plus fp32's error in sums of terms up to ~10 (atol). The A, D and bias gradients are
    # each rank's share rounded to bf16, then summed in bf16: a few units of the shares (atol).
    results = pool_for(3).run(run_scans, torch.bfloat16, one_length, 0.05, 2**-7, zigzag_and_balanced_documents)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {failures[:6]}"


@on_every_rank
def run_bytes(grid: bool):
    """(scan, measured, formula) forward and backward bytes of each scan on pieces of 3 rows."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = usp_groups("mesh", 2) if grid else {"group": timeout_group()}
    generator = torch.Generator().manual_seed(rank)
    ssd_inputs, _, ssd_options = ssd_case(generator, torch.float32, 3, 2, grouped=True)
    selective_inputs, _, selective_options = selective_case(generator, torch.float32, 3, 2, gated=True)
    scans = [
        # batch x heads x (1 + head_dim x state_size) fp32
        ("ssd", ssd_op(4, ssd_options), ssd_inputs, 2 * 4 * (1 + 3 * 5) * 4),
        # batch x channels x state_size x 2 fp32
        ("selective", selective_op(selective_options), selective_inputs, 2 * 3 * 4 * 2 * 4),
    ]
    results = []
    for name, op, inputs, summary_bytes in scans:
        leaves = [t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
        with comm_stats() as forward:
            out = op(*leaves, seq_lens=[3] * world, **ranks)
        with comm_stats() as backward:
            out.sum().backward()
        expected = state_passing_bytes([1] * world, rank, summary_bytes=summary_bytes, ulysses_size=2 if grid else 1)
        results.append((name, (forward.bytes_sent, backward.bytes_sent), tuple(expected)))
    return results


@pytest.mark.parametrize("world_size, grid", [(3, False), (4, True)], ids=["P3 group", "P4 grid"])
def test_bytes_are_the_runs_summaries(world_size, grid):
    for rank, results in enumerate(pool_for(world_size).run(run_bytes, grid)):
        for name, measured, expected in results:
            assert measured == expected, f"rank {rank} {name}: sent {measured}, the formula says {expected}"


@on_every_rank
def run_bad_inputs():
    problems = {}
    rank = dist.get_rank()
    group = {"group": timeout_group()}
    x, dt, A = torch.randn(1, 4, 4, 3), torch.rand(1, 4, 4), -torch.rand(4)
    B = C = torch.randn(1, 4, 2, 5)

    def ssd(**changes):
        args = dict(x=x, dt=dt, A=A, B=B, C=C)
        args.update({name: value for name, value in changes.items() if name in args})
        options = {name: value for name, value in changes.items() if name not in args}
        return lambda: ssd_scan(args["x"], args["dt"], args["A"], args["B"], args["C"], **options, **group)

    # Rank 0 raises its own error, the others name it.
    groups_3 = torch.randn(1, 4, 3, 5) if rank == 0 else B
    problems["ssd groups not dividing heads on rank 0"] = raises(
        ssd(B=groups_3, C=groups_3), "G dividing 4 heads" if rank == 0 else r"bad input on rank\(s\) \[0\]"
    )
    problems["ssd x not 4-D"] = raises(ssd(x=x[..., 0]), "x must be a 4-D")
    problems["ssd C unlike B"] = raises(ssd(C=C[:, :, :1]), "C must be")
    problems["ssd D"] = raises(ssd(D=torch.ones(3)), "D must be")
    problems["ssd dt_limit"] = raises(ssd(dt_limit=(1.0, 0.0)), "dt_limit")
    problems["ssd chunk_size"] = raises(ssd(chunk_size=0), "chunk_size")
    problems["ssd softplus differs by rank"] = raises(ssd(dt_softplus=rank == 0), "disagree")
    problems["ssd layout"] = raises(ssd(layout="balanced"), "layout")

    u, delta, A2, B2 = torch.randn(1, 4, 3), torch.rand(1, 4, 3), -torch.rand(3, 2), torch.randn(1, 4, 2)
    state_differs = -torch.rand(3, 3 if rank == 0 else 2)
    problems["selective state size differs by rank"] = raises(
        lambda: selective_scan(u, delta, state_differs, torch.randn(1, 4, state_differs.shape[1]),
                               torch.randn(1, 4, state_differs.shape[1]), **group), "disagree")  # fmt: skip
    problems["selective A"] = raises(lambda: selective_scan(u, delta, -torch.rand(4, 2), B2, B2, **group), "A must be")
    problems["selective z"] = raises(lambda: selective_scan(u, delta, A2, B2, B2, z=u[:, :, :2], **group), "z must be")
    problems["selective delta on rank 0"] = raises(
        lambda: selective_scan(u, delta if rank else delta[:, :3], A2, B2, B2, **group),
        "delta must be" if rank == 0 else r"bad input on rank\(s\) \[0\]",
    )
    if dist.get_world_size() > 1:
        uneven = torch.randn(1, 4 + rank, 3)
        problems["not the zigzag layout"] = raises(
            lambda: selective_scan(uneven, uneven, A2, uneven[..., :2], uneven[..., :2], layout="zigzag", **group),
            "zigzag")  # fmt: skip
    return {name: problem for name, problem in problems.items() if problem}


def test_bad_inputs_raise_on_every_rank():
    for rank, problems in enumerate(pool_for(3).run(run_bad_inputs)):
        assert not problems, f"rank {rank}: {problems}"
