"""The gated delta rule's Triton kernels (seqpar_kernels/kernels/gated_delta_kernels.py):
the chunks' sequential pass and its backward against the torch loops they replace, the
chunked rule with them against the rule without them (outputs and every gradient), and
their compiles for GPUs that are not here (no register spill in the chunk loop).
Without CUDA they run in the Triton interpreter on CPU tensors (conftest.py)."""

import contextlib
import json

import pytest
import torch
from triton_interpreter import compiled_without_interpreter, runs_triton_on

from tools import reference

pytest.importorskip("triton", reason="the Triton kernels need triton (torch CPU wheels do not ship it)")
from seqpar_kernels.engine import gated_delta  # noqa: E402
from seqpar_kernels.kernels import gated_delta_kernels as kernels  # noqa: E402
from seqpar_kernels.kernels.attention_step_tiles import MAX_GRID_YZ  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_in_the_kernels_precision():
    """The products of plain PyTorch, the yardstick of the accuracy rule, in the kernels'
    precision: fp32 in the interpreter, TF32 on a GPU (the kernels' module docstring)."""
    return reference.tf32_products() if DEVICE == "cuda" else contextlib.nullcontext()


def _assert_within_rule(names, mine, yardstick, exact):
    """The kernels' values against the torch code's in fp64, each within the accuracy rule
    (reference.error_bound) with the torch code's in the kernels' precision as yardstick:
    the states grow to hundreds, so the rounding allowed scales with them."""
    for name, got, plain, fp64 in zip(names, mine, yardstick, exact, strict=True):
        reference.assert_within_rule(got, fp64, plain, torch.float32, name)


def _randn(*shape, generator, scale=1.0):
    return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).float().to(DEVICE)


def _pass_inputs(batch, heads, chunk_offsets, chunk, key_dim, value_dim, generator):
    """w, u, k_decayed, decay, initial of a pass over runs of chunk_offsets."""
    chunks = chunk_offsets[-1]
    w, k_decayed = (_randn(batch, heads, chunks, chunk, key_dim, generator=generator, scale=0.3) for _ in range(2))
    u = _randn(batch, heads, chunks, chunk, value_dim, generator=generator)
    decay = torch.rand(batch, heads, chunks, generator=generator).to(DEVICE)
    initial = _randn(len(chunk_offsets) - 1, batch, heads, key_dim, value_dim, generator=generator)
    return w, u, k_decayed, decay, initial


# dk below tl.dot's 16 and not a power of two; dv over several column blocks; a run of no chunk.
SHAPES = [
    (2, 3, [0, 2, 2, 5], 16, 5, 7),
    (1, 2, [0, 3], 16, 48, 70),
    (1, 1, [0, 1, 4], 32, 128, 20),
]


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("batch, heads, chunk_offsets, chunk, key_dim, value_dim", SHAPES)
def test_pass_and_its_backward_are_the_torch_loops(batch, heads, chunk_offsets, chunk, key_dim, value_dim):
    generator = torch.Generator().manual_seed(0)
    w, u, k_decayed, decay, initial = _pass_inputs(batch, heads, chunk_offsets, chunk, key_dim, value_dim, generator)
    inputs = w, u, k_decayed, decay, initial
    with _torch_in_the_kernels_precision():
        yardstick = gated_delta._states_forward_loop(*inputs, chunk_offsets)
    exact = gated_delta._states_forward_loop(*(x.double() for x in inputs), chunk_offsets)
    got = kernels.chunk_states_forward(*inputs, chunk_offsets)
    _assert_within_rule(["states", "new values", "final"], got, yardstick, exact)
    grads = [_randn(*x.shape, generator=generator) for x in exact]
    inputs = w, k_decayed, decay, *grads
    with _torch_in_the_kernels_precision():
        yardstick = gated_delta._states_backward_loop(*inputs, chunk_offsets)
    exact = gated_delta._states_backward_loop(*(x.double() for x in inputs), chunk_offsets)
    got = kernels.chunk_states_backward(*inputs, chunk_offsets)
    _assert_within_rule(["d after", "d values", "d initial"], got, yardstick, exact)


@runs_triton_on(DEVICE)
@pytest.mark.parametrize("use_qk_l2norm", [True, False], ids=["l2norm", "no l2norm"])
def test_chunked_rule_with_the_kernels_is_the_rule_without(use_qk_l2norm):
    """Outputs, final state and every gradient (the initial state's too), two chunks of 16
    and a partial third, grouped heads."""
    generator = torch.Generator().manual_seed(1)
    batch, length, key_heads, value_heads, key_dim, value_dim = 2, 40, 1, 2, 8, 12
    inputs = [
        _randn(batch, length, key_heads, key_dim, generator=generator),
        _randn(batch, length, key_heads, key_dim, generator=generator),
        _randn(batch, length, value_heads, value_dim, generator=generator),
        -torch.rand(batch, length, value_heads, generator=generator).to(DEVICE),
        torch.rand(batch, length, value_heads, generator=generator).to(DEVICE),
        _randn(batch, value_heads, key_dim, value_dim, generator=generator),
    ]
    if not use_qk_l2norm:  # unit keys keep the steps contractions
        inputs[1] = torch.nn.functional.normalize(inputs[1], dim=-1)
    dout = _randn(batch, length, value_heads, value_dim, generator=generator)
    dfinal = _randn(batch, value_heads, key_dim, value_dim, generator=generator)

    def outputs_and_gradients(backend, dtype=torch.float32):
        leaves = [x.to(dtype, copy=True).requires_grad_() for x in inputs]
        out, final = gated_delta.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], chunk_size=16,
                                                        use_qk_l2norm=use_qk_l2norm, backend=backend)  # fmt: skip
        torch.autograd.backward([out, final], [dout.to(dtype), dfinal.to(dtype)])
        return [out.detach(), final.detach(), *(leaf.grad for leaf in leaves)]

    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "d initial state"]
    with _torch_in_the_kernels_precision():
        yardstick = outputs_and_gradients("torch")
    exact = outputs_and_gradients("torch", torch.float64)
    _assert_within_rule(names, outputs_and_gradients("triton"), yardstick, exact)


def _compiled_for_gpus() -> list[dict]:
    """Both kernels compiled for sm_90 (H100/H200) as a launch at dk 128 (Qwen3-Next's)
    and 256 would compile them: what the compiled kernels take."""
    from tools.ahead_of_time import compile_for_gpu

    # The compile reads the pointers' dtypes (meta tensors stand for them) and the sizes.
    tensor, offsets = torch.empty(0, device="meta"), torch.empty(0, dtype=torch.int32, device="meta")
    rows = []
    for key_dim, value_dim in [(128, 256), (256, 256)]:  # dv + dk: the value's and the transition's columns
        sizes = (32, 8, key_dim, value_dim)  # B * H, chunks
        for kernel, pointers in [(kernels.chunk_states_fwd_kernel, 8), (kernels.chunk_states_bwd_kernel, 9)]:
            launch = kernels.launch_of(kernel, key_dim, value_dim, gated_delta.CHUNK_SIZE)
            resources = compile_for_gpu(launch, (*[tensor] * pointers, offsets, *sizes), 90)
            rows.append(dict(kernel=kernel.__name__, key_dim=key_dim, registers=resources.registers,
                             spills_in_loops=resources.spills_in_loops, loops=resources.loops))  # fmt: skip
    return rows


def test_batch_times_heads_past_the_cuda_grid_limit_raises():
    # B x H indexes grid axis 1, which CUDA caps at 65535: it raises before any launch.
    heads = MAX_GRID_YZ // 2 + 1
    w, u, k_decayed, decay, initial = _pass_inputs(2, heads, [0, 1], 16, 1, 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"grid axis 1 \(batch x heads\) is {2 * heads}, more than the 65535"):
        kernels.chunk_states_forward(w, u, k_decayed, decay, initial, [0, 1])


def test_the_kernels_compile_for_gpus_without_spills_in_their_loop():
    """A spilling kernel is only slower, which no test on this machine would see: the
    compile for an H100 (no GPU needed), in a process of its own (the interpreter is on here)."""
    rows = compiled_without_interpreter(__file__)
    assert len(rows) == 4 and all(row["loops"] >= 1 for row in rows), rows
    assert not [row for row in rows if row["spills_in_loops"]], rows


if __name__ == "__main__":  # the compile of the test above, without the interpreter
    print(json.dumps(_compiled_for_gpus()))
