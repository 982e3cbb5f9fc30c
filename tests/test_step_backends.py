"""The ring's step backends (seqpar_kernels/engine/step_backends.py,
seqpar_kernels/engine/block_attention.py): step_backend="auto" | "triton" | "aten".

Without a GPU the CUDA library kernels of the "aten" backend (cuDNN, flash-attention 2,
the memory-efficient kernel) cannot run, so the code that drives them is checked twice:
- with meta tensors, through torch's own meta kernels of those ops: the argument order,
  the schemas and the shapes that come back (cuDNN's (B, H, S, 1) lse, the
  memory-efficient kernel's lse padded to 32 rows);
- numerically, on gloo ranks, with CPU implementations of the six ops registered for
  this test (plain attention in fp32 whose outputs are rounded to the input dtype, as the
  library kernels return them): the ring driver, the merge and every CudaLibraryBlocks
  line run on CPU tensors as they would on a GPU, against the fp64 reference.
"""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch
from test_ring_attention import CASE_GROUPS, LOW_PRECISION_CASES, _case, failures_of, run_cases
from test_varlen import _case as varlen_case
from test_varlen import run_varlen_cases
from triton_interpreter import runs_triton_on

import seqpar_kernels as sp
from seqpar_kernels.engine import step_backends
from seqpar_kernels.engine.block_attention import CUDNN, EFFICIENT, FLASH, CudaLibraryBlocks, cuda_block_kernel
from seqpar_kernels.engine.steps import StepSpec
from tools import reference

NAMES = ("out", "dq", "dk", "dv")

# ----------------------------------------------------------------------------------
# "auto" and its table
# ----------------------------------------------------------------------------------


def test_every_family_of_the_table_names_a_backend_and_its_basis():
    with open(step_backends.STEP_BACKEND_TABLE) as f:
        families = json.load(f)["families"]
    assert set(families) == {"sm_80", "sm_86", "sm_90", "sm_100", "sm_120"}
    for family, entry in families.items():
        assert entry["backend"] in ("aten", "triton"), family
        assert isinstance(entry["measured"], bool) and entry["basis"], family


@pytest.mark.parametrize(
    "capability, family",
    [(80, "sm_80"), (87, "sm_80"), (86, "sm_86"), (89, "sm_86"), (90, "sm_90"), (100, "sm_100"),
     (103, "sm_100"), (120, "sm_120"), (121, "sm_120")],
)  # fmt: skip
def test_gpu_families(capability, family):
    assert step_backends.gpu_family(capability) == family


def test_auto_picks_aten_on_cpus_triton_for_fp32_gpus_and_the_table_otherwise(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert step_backends.auto_step_backend(torch.device("cpu"), torch.bfloat16) == "aten"
    assert step_backends.auto_step_backend(cuda, torch.float32) == "triton"
    for capability, family in ((90, "sm_90"), (80, "sm_80")):
        monkeypatch.setattr(step_backends, "_device_capability", lambda index, capability=capability: capability)
        for backend in ("aten", "triton"):
            table = {name: dict(entry) for name, entry in step_backends.step_backend_table().items()}
            table[family]["backend"] = backend
            monkeypatch.setattr(step_backends, "step_backend_table", lambda table=table: table)
            assert step_backends.auto_step_backend(cuda, torch.bfloat16) == backend
    # Other devices are refused once, at the public entry, before any step backend is chosen.
    meta = torch.empty(1, 4, 2, 8, device="meta")
    with pytest.raises(ValueError, match="CPU or CUDA"):
        sp.ring_attention(meta, meta, meta)


def test_library_kernel_choice():
    q = torch.empty(1, 8, 4, 128, dtype=torch.bfloat16, device="meta")
    assert cuda_block_kernel(q, masked=False, capability=90) in (CUDNN, FLASH)  # cuDNN where torch has it
    assert cuda_block_kernel(q, masked=False, capability=80) == FLASH
    assert cuda_block_kernel(q, masked=True, capability=90) == EFFICIENT
    assert cuda_block_kernel(q.float(), masked=False, capability=90) == EFFICIENT
    assert cuda_block_kernel(q[..., :100], masked=False, capability=90) == EFFICIENT  # head dim % 8 != 0
    assert cuda_block_kernel(torch.empty(1, 8, 4, 256, dtype=torch.half, device="meta"), False, 90) == FLASH


# ----------------------------------------------------------------------------------
# The CUDA library kernels' calls, through torch's meta kernels
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", [FLASH, CUDNN, EFFICIENT])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_library_calls_match_torch_schemas_and_shapes(kernel, kv_heads, causal):
    batch, q_len, k_len, heads, head_dim = 2, 40, 40 if causal else 24, 4, 64
    meta = dict(dtype=torch.bfloat16, device="meta")
    # (B, S, H, D) views of head-major storage, as the ring's narrowed blocks can be.
    q = torch.empty(batch, heads, q_len, head_dim, **meta).transpose(1, 2)
    k, v = (torch.empty(batch, k_len, kv_heads, head_dim, **meta) for _ in range(2))
    blocks = CudaLibraryBlocks(kernel=kernel)
    out, lse = blocks.forward(q, k, v, 0.125, causal)
    assert out.shape == q.shape and lse.shape == (batch, heads, q_len) and lse.dtype == torch.float32
    dq, dk, dv = blocks.backward(q, q, k, v, out, lse, 0.125, causal)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    if kernel == EFFICIENT:
        mask = torch.zeros(q_len, k_len, dtype=torch.float32, device="meta")
        out, lse = blocks.forward(q, k, v, 0.125, False, mask)
        assert out.shape == q.shape and lse.shape == (batch, heads, q_len)
        dq, dk, dv = blocks.backward(q, q, k, v, out, lse, 0.125, False, mask)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ----------------------------------------------------------------------------------
# The CUDA library kernels' results, emulated on CPU tensors
# ----------------------------------------------------------------------------------

_emulation = None


def _plain_attention_fp32(q, k, v, scale, causal, bias=None):
    """(B, H, S, D) head-major inputs, kv heads repeated -> fp32 (out, lse (B, H, S)).
    A row that sees no key gets lse -inf and NaN outputs (what a kernel may return)."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ v.float(), lse


def _plain_backward_fp32(dout, q, k, v, out, lse, scale, causal, bias=None):
    """Gradients of one block given the FINAL out and lse, kv heads as given."""
    group = q.shape[1] // k.shape[1]
    k_, v_ = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = q.float() @ k_.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    probabilities = (scores - lse[..., : q.shape[2], None].float()).exp()
    dout, out = dout.float(), out.float()
    dv = probabilities.transpose(-1, -2) @ dout
    dscores = probabilities * (dout @ v_.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq, dk = dscores @ k_ * scale, dscores.transpose(-1, -2) @ q.float() * scale
    fold = lambda g: g.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(q.dtype), fold(dv).to(q.dtype)


def register_library_kernels_on_cpu():
    """CPU kernels for torch's CUDA attention ops the aten backend calls, for this
    process: plain attention computed in fp32, outputs in the input dtype. The cuDNN ones
    check that every tensor comes (B, H, S, D) over dense (B, S, H, D) storage."""
    global _emulation
    if _emulation is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    empty = lambda *shape: torch.empty(shape, dtype=torch.int64)  # noqa: E731

    def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        group = q.shape[1] // k.shape[1]
        out, lse = _plain_attention_fp32(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale, is_causal
        )  # fmt: skip
        return out.to(q.dtype), lse, empty(0), empty(0), q.shape[2], k.shape[2], empty(2), empty(), empty(0)

    def flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                       scale=None):  # fmt: skip
        return _plain_backward_fp32(dout, q, k, v, out, lse, scale, is_causal)

    def dense_as_sdpa_hands_cudnn(**tensors):
        for name, x in tensors.items():
            assert x.transpose(1, 2).is_contiguous() and 0 not in x.stride(), f"cuDNN's {name}: strides {x.stride()}"

    def cudnn(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        assert k.shape[1] == q.shape[1], "cuDNN is handed repeated kv heads"
        dense_as_sdpa_hands_cudnn(q=q, k=k, v=v)
        out, lse = _plain_attention_fp32(q, k, v, scale, is_causal)
        return (out.to(q.dtype), lse.unsqueeze(-1), empty(0), empty(0), q.shape[2], k.shape[2], empty(), empty(),
                empty(0))  # fmt: skip

    def cudnn_backward(dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p,
                       is_causal, *, scale=None):  # fmt: skip
        assert lse.shape[-1] == 1, "cuDNN's lse is (B, H, S, 1)"
        dense_as_sdpa_hands_cudnn(dout=dout, q=q, k=k, v=v, out=out)
        return _plain_backward_fp32(dout, q, k, v, out, lse[..., 0], scale, is_causal)

    def efficient(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        assert k.shape[1] == q.shape[1], "the memory-efficient kernel is handed repeated kv heads"
        assert bias is None or bias.stride(-2) % 16 == 0, "its mask rows 16-element aligned"
        out, lse = _plain_attention_fp32(q, k, v, scale, is_causal, bias)
        padded = torch.full((*lse.shape[:2], -(-q.shape[2] // 32) * 32), float("inf"))
        padded[..., : q.shape[2]] = lse
        return out.to(q.dtype), padded, empty(), empty()

    def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False,
                           *, scale=None):  # fmt: skip
        assert lse.shape[-1] % 32 == 0, "its lse is padded to a multiple of 32 rows"
        return (*_plain_backward_fp32(dout, q, k, v, out, lse, scale, is_causal, bias), torch.empty(0))

    for name, function in (
        ("_scaled_dot_product_flash_attention", flash),
        ("_scaled_dot_product_flash_attention_backward", flash_backward),
        ("_scaled_dot_product_cudnn_attention", cudnn),
        ("_scaled_dot_product_cudnn_attention_backward", cudnn_backward),
        ("_scaled_dot_product_efficient_attention", efficient),
        ("_scaled_dot_product_efficient_attention_backward", efficient_backward),
    ):
        library.impl(name, function, "CPU")
    _emulation = library


def emulated_library_steps(kernel) -> str:
    """Registers step kernels running the aten backend's CUDA block code on CPU tensors
    (`kernel` forced; None: the choice on an sm_90 GPU) and returns their name."""
    register_library_kernels_on_cpu()
    name = f"aten-emulated-{kernel or 'sm_90'}"
    blocks = CudaLibraryBlocks(kernel=kernel, capability=90)
    step_backends.STEP_KERNELS[name] = step_backends.AtenSteps(cpu_blocks=blocks, cuda_blocks=blocks)
    return name


def run_cases_on_emulated_library(kernel, cases, dtype):
    return run_cases(cases, dtype, step_kernels=emulated_library_steps(kernel))


def run_varlen_cases_on_emulated_library(cases):
    for case in cases:
        case["method"] = f"ring with {emulated_library_steps(None)}"
    return run_varlen_cases(cases)


EMULATED_CASES = [
    *CASE_GROUPS["gqa-mqa"][:3],
    _case("zigzag-causal-B2", H=4, H_kv=4, D=64, S=8, causal=True, layout="zigzag", B=2),
    _case("D80-contig-full", H=2, H_kv=1, D=80, S=6, causal=False, layout="contiguous"),
    *CASE_GROUPS["uneven-lengths"][:1],
]


@pytest.mark.parametrize("kernel", [FLASH, CUDNN, EFFICIENT])
def test_library_blocks_match_the_reference_in_fp32(ranks, kernel):
    per_rank = ranks.run(run_cases_on_emulated_library, kernel, EMULATED_CASES, torch.float32)
    failures = failures_of(per_rank, lambda name, yardsticks: reference.FP32_TOLERANCE)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kernel", [FLASH, CUDNN])
def test_library_blocks_rounded_to_bf16_keep_the_accuracy_rule(ranks, kernel):
    # Each block's output and gradients rounded to bf16 before the fp32 merge and sums,
    # as the library kernels return them.
    per_rank = ranks.run(run_cases_on_emulated_library, kernel, LOW_PRECISION_CASES, torch.bfloat16)
    failures = failures_of(
        per_rank,
        lambda name, yardsticks: reference.error_bound(
            torch.bfloat16, yardsticks["plain"][name], yardsticks["magnitude"][name]
        ),
    )
    assert not failures, "\n".join(failures)


def rounded_blocks_errors(blocks, seed, rows=8, heads=4, kv_heads=2, head_dim=64, kernel=CUDNN):
    """{name: (error, plain error, the rule's bound)} of out, dq, dk, dv of full bf16
    attention computed as a ring of `blocks` ranks does it, in one process: each rank's
    `rows` queries against every rank's K/V block through the aten backend on the
    emulated library kernel (each block's output and gradients rounded to bf16), merged
    by attention_merge_, dq and each block's dk/dv summed in fp32 over the block pairs;
    against fp64 attention, plain attention in bf16 the yardstick (reference.error_bound)."""
    steps = step_backends.STEP_KERNELS[emulated_library_steps(kernel)]
    generator = torch.Generator().manual_seed(seed)

    def draw(heads):
        return torch.randn(1, rows * blocks, heads, head_dim, generator=generator, dtype=torch.float64).bfloat16()

    q, k, v, dout = draw(heads), draw(kv_heads), draw(kv_heads), draw(heads)
    spec = StepSpec(head_dim**-0.5)
    qs, ks, vs, douts = (t.chunk(blocks, dim=1) for t in (q, k, v, dout))
    outs = [torch.zeros(piece.shape) for piece in qs]
    lses = [torch.full((1, heads, rows), float("-inf")) for _ in qs]
    for i, j in itertools.product(range(blocks), repeat=2):
        steps.forward(qs[i], ks[j], vs[j], outs[i], lses[i], spec, False)
    dq, dk, dv = ([torch.zeros(piece.shape) for piece in pieces] for pieces in (qs, ks, vs))
    for i, j in itertools.product(range(blocks), repeat=2):
        steps.backward(douts[i], qs[i], ks[j], vs[j], outs[i], lses[i], None, dq[i], lambda j=j: (dk[j], dv[j]),
                       spec, False)  # fmt: skip
    ours = [torch.cat(pieces, dim=1) for pieces in (outs, dq, dk, dv)]
    attention = lambda q, k, v: reference.attention(q, k, v, False, spec.scale)  # noqa: E731
    exact = reference.with_grads(attention, [t.double() for t in (q, k, v)], dout.double())
    plain = reference.with_grads(attention, [q, k, v], dout)
    errors = {}
    for name, got, want, yardstick in zip(NAMES, ours, [exact[0], *exact[2:]], [plain[0], *plain[2:]]):
        plain_error = reference.max_error(yardstick, want)
        bound = reference.error_bound(torch.bfloat16, plain_error, reference.magnitude(want))
        errors[name] = (reference.max_error(got, want), plain_error, bound)
    return errors


def test_library_blocks_rounded_to_bf16_over_eight_ring_steps():
    # The error of bf16 blocks grows with the steps merged: 8 here (docs/tuning.md has
    # 8, 16 and 32: python tests/test_step_backends.py).
    errors = rounded_blocks_errors(8, seed=0)
    failures = [f"{name}: error {error:.3g} > {bound:.3g} (plain {plain:.3g})"
                for name, (error, plain, bound) in errors.items() if not error <= bound]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_packed_documents_through_the_library_blocks(ranks):
    # Coalesced short documents are masked blocks: the memory-efficient kernel with an
    # additive mask; the rest dense blocks of cuDNN (bf16) or the memory-efficient
    # kernel (fp32).
    cases = [
        varlen_case("ring", "mixed", causal=True, layout="balanced"),
        varlen_case("ring", "lengths 1", causal=False, layout="contiguous", seed=1),
        varlen_case("ring", "spanning ranks", causal=True, layout="contiguous", seed=2),
        varlen_case("ring", "mixed", dtype=torch.bfloat16, heads=3, kv_heads=1, head_dim=80),
    ]
    failures = [failure for per_rank in ranks.run(run_varlen_cases_on_emulated_library, cases)
                for failure in per_rank]  # fmt: skip
    assert not failures, "\n".join(failures)


def test_the_benchmark_records_a_measured_family(tmp_path, monkeypatch):
    table = tmp_path / "step_backends.json"
    table.write_text(open(step_backends.STEP_BACKEND_TABLE).read())
    monkeypatch.setattr(step_backends, "STEP_BACKEND_TABLE", str(table))
    step_backends.step_backend_table.cache_clear()
    try:
        step_backends.record_measured_step_backend("sm_90", "triton", "measured on a test GPU", str(table))
        families = step_backends.step_backend_table()
        assert families["sm_90"] == {"backend": "triton", "measured": True, "basis": "measured on a test GPU"}
        assert families["sm_80"]["measured"] is False  # the others untouched
        with pytest.raises(AssertionError):
            step_backends.record_measured_step_backend("sm_90", "auto", "", str(table))
    finally:
        step_backends.step_backend_table.cache_clear()


# ----------------------------------------------------------------------------------
# The Triton backend's first step: the running output starts uninitialised
# ----------------------------------------------------------------------------------


@runs_triton_on("cpu")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_first_step_needs_no_initialised_output(monkeypatch, causal):
    # One process: step 0 is the whole ring. The driver hands the first step an
    # uninitialised output (filled with NaN here, as torch.empty may hold anything).
    from seqpar_kernels.attention_mask import AttentionMask
    from seqpar_kernels.engine.ring_driver import ring_forward
    from seqpar_kernels.engine.step_masks import dense_step_masks
    from seqpar_kernels.engine.steps import StepSpec, first_step_writes_every_row

    triton_steps = step_backends.STEP_KERNELS["triton"]
    masks = dense_step_masks(AttentionMask(causal), [5], False)
    assert first_step_writes_every_row(triton_steps, masks.step(0, 0), 5)
    assert not first_step_writes_every_row(step_backends.STEP_KERNELS["aten"], masks.step(0, 0), 5)
    forward = type(triton_steps).forward
    first_steps = []

    def forward_on_garbage(self, q, k, v, out, lse, spec, causal, first_step=False):
        if first_step:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        first_steps.append(first_step)
        return forward(self, q, k, v, out, lse, spec, causal, first_step=first_step)

    monkeypatch.setattr(type(triton_steps), "forward", forward_on_garbage)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 5, heads, 16, generator=generator) for heads in (4, 2, 2))
    out, lse = ring_forward(q, k, v, StepSpec(0.25), "", triton_steps, masks)
    expected, expected_lse = ring_forward(q, k, v, StepSpec(0.25), "", step_backends.STEP_KERNELS["aten"], masks)
    assert first_steps == [True]
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------------
# A row that saw no key: final lse -inf
# ----------------------------------------------------------------------------------

NO_KEY_BACKENDS = ["aten", "aten softcapped", FLASH, CUDNN, EFFICIENT,
                   pytest.param("triton", marks=runs_triton_on("cpu"))]  # fmt: skip


@pytest.mark.parametrize("backend", NO_KEY_BACKENDS)
def test_a_row_whose_final_lse_is_minus_inf_gets_no_gradient(backend):
    # Row 2 saw no key in any step (final out 0, lse -inf), yet a block's keys reach it
    # (here all of them, or none under a mask of -inf): exp(s - lse) must be 0, not
    # exp(-inf - (-inf)) = NaN or exp(s + inf). Its dq is 0 and dk, dv are what they are
    # without its dout.
    name = {FLASH: None, CUDNN: None, EFFICIENT: None}.get(backend, backend.split()[0])
    steps = step_backends.STEP_KERNELS[name or emulated_library_steps(backend)]
    spec = StepSpec(0.25, 5.0 if "softcapped" in backend else 0.0)
    generator = torch.Generator().manual_seed(8)
    q, dout = (torch.randn(1, 5, 2, 16, generator=generator) for _ in range(2))
    k, v = (torch.randn(1, 6, 1, 16, generator=generator) for _ in range(2))
    out, lse = torch.zeros(q.shape), torch.full((1, 2, 5), float("-inf"))
    steps.forward(q, k, v, out, lse, spec, False)

    def gradients(out, lse, dout, mask=None):
        dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
        delta = steps.prepare_backward(out, dout)
        if mask is None:
            steps.backward(dout, q, k, v, out, lse, delta, dq, lambda: (dk, dv), spec, False)
        else:
            steps.backward_masked(dout, q, k, v, out, lse, delta, dq, lambda: (dk, dv), spec, mask)
        return dq, dk, dv

    without_row = dout.clone()
    without_row[:, 2] = 0
    want = gradients(out, lse, without_row)
    out[:, 2], lse[:, :, 2] = 0.0, float("-inf")
    masks = [None]
    if name != "triton":  # masked blocks: the aten backend's packed documents
        masks.append(torch.zeros(5, 6).index_fill_(0, torch.tensor([2]), float("-inf")))
    for mask in masks:
        got = gradients(out, lse, dout, mask)
        for grad_name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert torch.isfinite(a).all(), f"{backend} mask={mask is not None}: {grad_name} not finite"
            if mask is None:
                torch.testing.assert_close(a, b, atol=reference.FP32_TOLERANCE, rtol=0)
        assert torch.equal(got[0][:, 2], torch.zeros_like(got[0][:, 2])), f"{backend}: the row's dq is not 0"


if __name__ == "__main__":  # the errors of bf16 blocks at the ring steps given: 8,16,32 [seeds: 0,1,2]
    for blocks in map(int, sys.argv[1].split(",")):
        for seed in map(int, (sys.argv[2] if len(sys.argv) > 2 else "0").split(",")):
            cells = [f"{name} {error:.3g} (plain {plain:.3g}, bound {bound:.3g}: {error / bound:.2f})"
                     for name, (error, plain, bound) in rounded_blocks_errors(blocks, seed).items()]  # fmt: skip
            print(f"{blocks} steps, seed {seed}:", "; ".join(cells), flush=True)
