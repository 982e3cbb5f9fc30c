"""The state-space scans' Triton kernels (seqpar_kernels/kernels/state_space_kernels.py):
the selective scan over runs from their initial states, with and without input, and the
SSD scan's pass over its chunks' states, against the torch path they replace on GPUs
(engine/state_space.py), outputs and every gradient; and their compiles for GPUs that
are not here (no register spill in the chunk loop). Without CUDA they run in the Triton
interpreter on CPU tensors (conftest.py)."""

import json

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import compiled_without_interpreter, runs_triton_on

from tools import reference

pytest.importorskip("triton", reason="the Triton kernels need triton (torch CPU wheels do not ship it)")
from seqpar_kernels.engine import state_space  # noqa: E402
from seqpar_kernels.kernels import state_space_kernels as kernels  # noqa: E402
from seqpar_kernels.kernels.attention_step_tiles import MAX_GRID_YZ  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernels carry a state over a run's rows (the SSD pass: over its chunks) in another
# order than the torch path (an associative scan; the backward rebuilds the states from
# the chunks' saved ones): up to a unit of fp32 roundoff more per row, at the tensor's
# magnitude (as a sum or product of n terms errs by up to n units). On a GPU the selective
# scan's exp (ex2.approx of x log2(e)) errs by 2 units plus |x| (< 2 here) where torch's
# errs by half a unit: up to 4 units more per row.
ROW_ROUNDOFFS = 1
EXP_ROUNDOFFS = 4 if DEVICE == "cuda" else 0


def _selective_inputs(batch, length, channels, state_size, runs, generator):
    """u, delta, A, B, C (the compute dtype's, delta discretised) and initial states (runs,
    B, D, N) of a selective scan, on DEVICE."""

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).float().to(DEVICE)

    u = randn(batch, length, channels)
    delta = (0.5 * torch.rand(batch, length, channels, generator=generator)).to(DEVICE)
    A = -torch.exp(randn(channels, state_size, scale=0.5))
    B, C = randn(batch, length, state_size), randn(batch, length, state_size)
    return u, delta, A, B, C, randn(runs, batch, channels, state_size)


def _outputs_and_gradients(scan, inputs, grads):
    """scan(*leaves) -> outputs; the outputs, then the leaves' gradients (None where a leaf
    is None) from grads of the outputs."""
    leaves = [None if x is None else x.clone().requires_grad_() for x in inputs]
    outputs = scan(*leaves)
    torch.autograd.backward(outputs, grads)
    return [output.detach() for output in outputs] + [None if leaf is None else leaf.grad for leaf in leaves]


def _assert_within_rule(names, mine, torch_path, inputs, grads, rows, exp=True):
    """The kernels' outputs and gradients `mine` against torch_path's in fp64, each within
    the accuracy rule (reference.error_bound) with torch_path's in fp32 as yardstick, plus
    the kernels' own rounding over runs of up to `rows` rows (ROW_ROUNDOFFS, and
    EXP_ROUNDOFFS where the kernels compute the decays: exp)."""
    yardstick = _outputs_and_gradients(torch_path, inputs, grads)
    exact = _outputs_and_gradients(torch_path, [x.double() for x in inputs], [g.double() for g in grads])
    per_row = ROW_ROUNDOFFS + (EXP_ROUNDOFFS if exp else 0)
    for name, got, plain, fp64 in zip(names, mine, yardstick, exact, strict=True):
        rounding = per_row * rows * 2.0**-24 * reference.magnitude(fp64)
        reference.assert_within_rule(got, fp64, plain, torch.float32, name, rounding)


# Channels and states not powers of two, channels over several blocks, runs of several
# chunks and a last partial one, an empty run (the interpreter's chunks: 4 tokens, 2
# channels a block at 3 or 4 states; a GPU's: 16 tokens).
SPANS = [
    (2, 5, 3, [(0, 3), (3, 0), (3, 18)], 21),
    (1, 3, 4, [(0, 8), (8, 9)], 17),
]


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("batch, channels, state_size, spans, length", SPANS)
def test_selective_scan_from_states_is_the_torch_path(batch, channels, state_size, spans, length):
    """The kernels' scan with input from each run's initial state against the torch path's
    pieces of it: the scan from zero plus the initial state's share, the final state
    decayed from the initial one plus the final from zero; y, final and every gradient,
    the initial states' too."""
    generator = torch.Generator().manual_seed(0)
    inputs = _selective_inputs(batch, length, channels, state_size, len(spans), generator)
    grads = [torch.randn(batch, length, channels, generator=generator).to(DEVICE),
             torch.randn(len(spans), batch, channels, state_size, generator=generator).to(DEVICE)]  # fmt: skip

    def with_kernels(u, delta, A, B, C, initial):
        return state_space._SelectiveScanKernels.apply(u, delta, A, B, C, initial, tuple(spans))

    def in_torch(u, delta, A, B, C, initial):
        y, finals = state_space.selective_runs_from_zero(u, delta, A, B, C, spans, backend="torch")
        shares = state_space.selective_state_shares(delta, A, C, spans, initial, backend="torch")
        decays = state_space.selective_summaries(delta, A, spans, finals)[..., :state_size]
        return y + shares, decays * initial + finals

    names = ["y", "final", "du", "d delta", "dA", "dB", "dC", "d initial"]
    mine = _outputs_and_gradients(with_kernels, inputs, grads)
    _assert_within_rule(names, mine, in_torch, inputs, grads, rows=max(rows for _, rows in spans))


@runs_triton_on(DEVICE)
def test_selective_scan_of_runs_by_the_kernels_is_the_torch_path():
    """What engine/state_space.py runs on CUDA: the runs from zero, then the shares of the
    states entering some of them (rows between runs, and runs without a share: zeros),
    through backend="triton" against backend="torch"; y, the final states, the shares and
    every gradient."""
    generator = torch.Generator().manual_seed(1)
    batch, length, channels, state_size = 1, 20, 3, 5
    runs, continuing = [(0, 4), (4, 11), (15, 5)], [(4, 11), (17, 2)]
    u, delta, A, B, C, states = _selective_inputs(batch, length, channels, state_size, len(continuing), generator)
    grads = [torch.randn(batch, length, channels, generator=generator).to(DEVICE),
             torch.randn(len(runs), batch, channels, state_size, generator=generator).to(DEVICE),
             torch.randn(batch, length, channels, generator=generator).to(DEVICE)]  # fmt: skip

    def scans(backend):
        def scan(u, delta, A, B, C, states):
            y, finals = state_space.selective_runs_from_zero(u, delta, A, B, C, runs, backend=backend)
            return y, finals, state_space.selective_state_shares(delta, A, C, continuing, states, backend=backend)

        return scan

    inputs = (u, delta, A, B, C, states)
    mine = _outputs_and_gradients(scans("triton"), inputs, grads)
    names = ["y", "finals", "shares", "du", "d delta", "dA", "dB", "dC", "d states"]
    _assert_within_rule(names, mine, scans("torch"), inputs, grads, rows=max(rows for _, rows in runs))
    rows_without_share = torch.ones(length, dtype=torch.bool)
    rows_without_share[4:15] = rows_without_share[17:19] = False
    assert mine[2][:, rows_without_share].eq(0).all() and mine[2][:, ~rows_without_share].ne(0).all()


@runs_triton_on(DEVICE)
def test_chunk_state_pass_from_a_state_is_the_torch_product():
    """The kernels' pass over the SSD chunks' states from an initial state against the
    torch path's product with the initial state as a chunk before the first (of decay 1):
    the entering states, the final state and the gradients of the chunks' states, of the
    log-decays and of the initial state; a state of 3 x 20 elements over two blocks of the
    interpreter's."""
    generator = torch.Generator().manual_seed(2)
    batch, chunks, heads, head_dim, state_size = 2, 5, 3, 3, 20

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float().to(DEVICE)

    inputs = (randn(batch, chunks, heads, head_dim, state_size),
              -torch.rand(batch, heads, chunks, generator=generator).to(DEVICE),
              randn(batch, heads, head_dim, state_size))  # fmt: skip
    grads = [randn(batch, chunks, heads, head_dim, state_size), randn(batch, heads, head_dim, state_size)]

    def with_kernels(chunk_states, log_decays, initial):
        return state_space._ChunkStatePass.apply(chunk_states, torch.exp(log_decays), initial)

    def in_torch(chunk_states, log_decays, initial):
        entering, final = state_space.states_entering_chunks(
            torch.cat([initial[:, None], chunk_states], dim=1), F.pad(log_decays, (1, 0)), backend="torch"
        )
        return entering[:, 1:], final

    names = ["entering", "final", "d chunk states", "d log decays", "d initial"]
    mine = _outputs_and_gradients(with_kernels, inputs, grads)
    _assert_within_rule(names, mine, in_torch, inputs, grads, rows=chunks, exp=False)  # decays: torch's exp


@runs_triton_on(DEVICE)
def test_ssd_scan_with_the_kernels_is_the_torch_path():
    """What engine/state_space.py runs on CUDA: one run of the SSD scan from zero in chunks
    of 8 (4 full and a partial one), 4 heads reading 2 groups, through backend="triton"
    against backend="torch": y, the final state and every gradient."""
    generator = torch.Generator().manual_seed(3)
    batch, length, heads, groups, head_dim, state_size = 2, 37, 4, 2, 3, 5

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float().to(DEVICE)

    dt = (0.5 * torch.rand(batch, length, heads, generator=generator)).to(DEVICE)
    B, C = randn(batch, length, groups, state_size), randn(batch, length, groups, state_size)
    inputs = (randn(batch, length, heads, head_dim), dt, -torch.exp(randn(heads)), B, C)
    grads = [randn(batch, length, heads, head_dim), randn(batch, heads, head_dim, state_size)]

    def scans(backend):
        return lambda x, dt, A, B, C: state_space.ssd_from_zero(x, dt, A, B, C, 8, backend=backend)

    mine = _outputs_and_gradients(scans("triton"), inputs, grads)
    names = ["y", "final", "dx", "d dt", "dA", "dB", "dC"]
    _assert_within_rule(names, mine, scans("torch"), inputs, grads, rows=-(-length // 8), exp=False)  # the chunks


def _compiled_for_gpus() -> list[dict]:
    """Every kernel compiled for sm_90 (H100/H200) and sm_80 (A100): the SSD chunks' pass,
    and the selective scan's at Mamba's 16 states (every variant on sm_90) and at 256
    states, the most its Triton path takes: what the compiled kernels take."""
    from tools.ahead_of_time import compile_for_gpu

    # The compile reads the pointers' dtypes (meta tensors stand for them) and the sizes.
    tensor, table = torch.empty(0, device="meta"), torch.empty(0, dtype=torch.int32, device="meta")
    pointers = {kernels.selective_scan_fwd_kernel: 9, kernels.selective_scan_bwd_kernel: 14}
    cases = [(90, 16, has_input) for has_input in (True, False)] + [(90, 256, True), (80, 16, True)]
    rows = []
    for capability in (90, 80):  # the SSD chunks' pass at 64 x 128 states (Mamba2's), 8 heads, 33 chunks
        sizes = (8, 33, 64 * 128)
        for kernel, count in [(kernels.chunk_state_pass_fwd_kernel, 5), (kernels.chunk_state_pass_bwd_kernel, 7)]:
            launch = kernels.chunk_pass_launch_of(kernel, sizes[-1])
            resources = compile_for_gpu(launch, (*[tensor] * count, *sizes), capability)
            rows.append(dict(kernel=kernel.__name__, capability=capability, registers=resources.registers,
                             spills_in_loops=resources.spills_in_loops, loops=resources.loops))  # fmt: skip
    for capability, state_size, has_input in cases:
        channels = 8192  # Jamba's channels; B, L and the chunks: sizes not 1 nor multiples of 16
        sizes = (3, 4099, channels, state_size, 257)
        for kernel, count in pointers.items():
            launch = kernels.launch_of(kernel, channels, state_size, has_input)
            resources = compile_for_gpu(launch, (*[tensor] * count, table, *sizes), capability)
            rows.append(dict(kernel=kernel.__name__, capability=capability, state_size=state_size,
                             has_input=has_input, registers=resources.registers,
                             spills_in_loops=resources.spills_in_loops, loops=resources.loops))  # fmt: skip
    return rows


def test_grids_past_cuda_limits_raise_naming_the_axis():
    # CUDA caps grid axes 1 and 2 at 65535: batch (selective scan) and batch x heads (the
    # SSD pass) beyond it raise before any launch, with the numbers.
    batch = MAX_GRID_YZ + 1
    delta = torch.zeros(batch, 1, 1, device=DEVICE)
    A, C, initial = (
        torch.zeros(1, 1, device=DEVICE),
        torch.zeros(batch, 1, 1, device=DEVICE),
        torch.zeros(1, batch, 1, 1, device=DEVICE),
    )
    with pytest.raises(ValueError, match=rf"grid axis 1 \(batch\) is {batch}, more than the 65535"):
        kernels.selective_scan_forward(None, delta, A, None, C, initial, [(0, 1)], save_states=False)
    states = torch.zeros(1, 1, batch, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match=rf"grid axis 1 \(batch x heads\) is {batch}"):
        kernels.chunk_state_pass_forward(states, torch.zeros(1, batch, 1, device=DEVICE), states[:, 0])


@pytest.mark.gpu_long  # on a GPU the kernels run: the short GPU check leaves the compiles out
def test_the_kernels_compile_for_gpus_without_spills_in_their_loop():
    """A spilling kernel is only slower, which no test on this machine would see: the
    compiles for an H100 and an A100 (no GPU needed), in a process of their own (the
    interpreter is on here)."""
    rows = compiled_without_interpreter(__file__)
    assert len(rows) == 12 and all(row["loops"] >= 1 for row in rows), rows
    assert not [row for row in rows if row["spills_in_loops"]], rows


if __name__ == "__main__":  # the compiles of the test above, without the interpreter
    print(json.dumps(_compiled_for_gpus()))
