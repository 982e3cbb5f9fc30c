"""On one GPU: the GPU paths no other test file reaches there. Without one, each test's
harness runs as a dry run on CPU (the library kernels' CPU stand-ins, gloo for NCCL,
smaller sizes), so that a change of the code it drives fails here too.

- The "aten" step backend's real library calls (seqpar_kernels/parallel/block_attention.py
  CudaLibraryBlocks: flash-attention 2, cuDNN, the memory-efficient kernel, with and
  without the additive mask of packed documents) over the steps of a ring (a causal
  diagonal block, then full blocks), each block's (out, lse) merged by the CUDA
  attention_merge_, then every block's backward given the final out and lse, against
  fp64 attention over all the keys by the accuracy rule (tools/reference.py). Without a
  GPU, test_step_backends.py runs the same code on CPU stand-ins of those kernels.
- Ring, Ulysses and USP attention over an NCCL process group of one rank (its
  collectives: the ranks' check, Ulysses' all-to-all), forward and backward, against
  fp64 attention by the same rule.
- Inference over a KV cache on the GPU: decode_attention_partial over shards of a cache
  merged by merge_attention_partials (the CUDA attention_merge_), decode_attention and
  prefill_attention (pass-KV and pass-Q) over an NCCL group of one rank, in bf16 and fp16
  at head dims 64 and 128, against fp64 attention over the whole cache by the same rule.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_step_backends import register_library_kernels_on_cpu

import seqpar_kernels as sp
from seqpar_kernels.engine import step_backends
from seqpar_kernels.engine.block_attention import CUDNN, EFFICIENT, FLASH, CudaLibraryBlocks
from seqpar_kernels.engine.steps import StepSpec
from tools import reference

# Each test runs on the GPU and, as a dry run of its harness, on CPU: the library kernels
# replaced by test_step_backends' CPU stand-ins, NCCL by gloo, the sizes smaller.
DEVICES = [pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
           "cpu"]  # fmt: skip


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def _size(device, on_gpu, dry_run):
    return on_gpu if device == "cuda" else dry_run


def _library_steps(device, kernel=None):
    """The aten backend on the CUDA library kernels (`kernel` forced; None: their choice),
    on CPU their stand-ins as an sm_90 GPU would choose them."""
    blocks = CudaLibraryBlocks(kernel=kernel, capability=None if device == "cuda" else 90)
    if device == "cpu":
        register_library_kernels_on_cpu()
    return step_backends.AtenSteps(cpu_blocks=blocks, cuda_blocks=blocks)


NAMES = ("out", "dq", "dk", "dv")


def _randn(generator, *shape, dtype):
    return torch.randn(*shape, generator=generator, dtype=torch.float64, device=generator.device).to(dtype)


def _attention(q, k, v, scale, keep):
    """Plain attention in q's dtype, scores materialised: q (B, S, H, D), k/v (B, T, H_kv,
    D), keep (S, T) bool. The exact answer for fp64 inputs, the yardstick otherwise."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1).nan_to_num(0.0), v)


def _failures(ours, exact, plain, dtype) -> list[str]:
    failures = []
    for name, got, want, yardstick in zip(NAMES, ours, exact, plain):
        err, plain_err = reference.max_error(got, want), reference.max_error(yardstick, want)
        bound = reference.error_bound(dtype, plain_err, reference.magnitude(want))
        if not (torch.isfinite(got).all() and err <= bound):
            failures.append(f"{name}: err {err:.3g} > {bound:.3g} (plain torch in {dtype} {plain_err:.3g})")
    return failures


# (kernel, dtype, q heads, kv heads, head dim): each library kernel at the head dims and
# GQA/MQA mappings the ring hands it (flash-attention reads kv heads as they are, cuDNN and
# the memory-efficient kernel get them repeated), odd block lengths.
LIBRARY_CASES = [
    (FLASH, torch.bfloat16, 4, 2, 128),
    (FLASH, torch.float16, 4, 1, 256),
    (CUDNN, torch.bfloat16, 4, 2, 128),
    (CUDNN, torch.float16, 4, 4, 64),
    (EFFICIENT, torch.bfloat16, 4, 2, 80),
]


@pytest.mark.parametrize("kernel, dtype, heads, kv_heads, head_dim", LIBRARY_CASES,
                         ids=lambda value: str(value).removeprefix("torch."))  # fmt: skip
def test_aten_steps_on_the_library_kernels(device, kernel, dtype, heads, kv_heads, head_dim):
    # A ring step by step on one GPU: this rank's 333 queries over a causal diagonal block
    # of 333 keys, then full blocks of 700 and 260 keys of earlier ranks (a tenth on CPU).
    generator = torch.Generator(device=device).manual_seed(31)
    q_len, full_lens = _size(device, (333, (700, 260)), (33, (70, 26)))
    q, dout = (_randn(generator, 1, q_len, heads, head_dim, dtype=dtype) for _ in range(2))
    blocks = [
        (
            _randn(generator, 1, length, kv_heads, head_dim, dtype=dtype),
            _randn(generator, 1, length, kv_heads, head_dim, dtype=dtype),
        )
        for length in (q_len, *full_lens)
    ]
    scale = head_dim**-0.5
    steps = _library_steps(device, kernel)
    out = torch.zeros(1, q_len, heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((1, heads, q_len), float("-inf"), dtype=torch.float32, device=device)
    for index, (k, v) in enumerate(blocks):
        steps.forward(q, k, v, out, lse, StepSpec(scale), index == 0)
    final = out.to(dtype)  # what the ring returns and its backward is given
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    grads_kv = [[torch.zeros(k.shape, dtype=torch.float32, device=device) for _ in range(2)] for k, _ in blocks]
    for index, ((k, v), grad_kv) in enumerate(zip(blocks, grads_kv)):
        steps.backward(
            dout, q, k, v, final, lse, None, dq, lambda grad_kv=grad_kv: grad_kv, StepSpec(scale), index == 0
        )
    ours = [final, dq, torch.cat([dk for dk, _ in grads_kv], 1), torch.cat([dv for _, dv in grads_kv], 1)]

    k_all, v_all = (torch.cat([block[i] for block in blocks], 1) for i in (0, 1))
    keep = torch.ones(q_len, k_all.shape[1], dtype=torch.bool, device=device)
    keep[:, :q_len] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    exact = reference.with_grads(lambda *t: _attention(*t, scale, keep), [t.double() for t in (q, k_all, v_all)],
                                 dout.double())  # fmt: skip
    plain = reference.with_grads(lambda *t: _attention(*t, scale, keep), [q, k_all, v_all], dout)
    failures = _failures(ours, [exact[0], *exact[2:]], [plain[0], *plain[2:]], dtype)
    assert not failures, "\n".join(failures)


def test_aten_masked_steps_on_the_memory_efficient_kernel(device):
    # Packed documents (attention inside each, not causal): blocks under an additive mask
    # (the memory-efficient kernel), each with rows that see none of its keys (their lse
    # set to -inf before the merge leaves them untouched).
    generator = torch.Generator(device=device).manual_seed(32)
    dtype, heads, kv_heads, head_dim, q_len, k_len = torch.bfloat16, 4, 2, 64, 150, 190
    q, dout = (_randn(generator, 1, q_len, heads, head_dim, dtype=dtype) for _ in range(2))
    blocks = [(_randn(generator, 1, k_len, kv_heads, head_dim, dtype=dtype),
               _randn(generator, 1, k_len, kv_heads, head_dim, dtype=dtype)) for _ in range(2)]  # fmt: skip
    # Documents [0, 100), [100, 250), [250, 400) by position; the queries at 190-339, the
    # keys of block 0 at 0-189 (queries 250-339 see none), of block 1 at 340-529 (queries
    # 190-249 see none).
    document = lambda positions: torch.bucketize(positions, torch.tensor([100, 250]), right=True)  # noqa: E731
    q_doc = document(torch.arange(190, 340))
    keeps = [(q_doc[:, None] == document(torch.arange(first, first + k_len))[None, :]).to(device)
             for first in (0, 340)]  # fmt: skip
    scale = head_dim**-0.5
    steps = _library_steps(device)  # EFFICIENT: masked blocks
    out = torch.zeros(1, q_len, heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.full((1, heads, q_len), float("-inf"), dtype=torch.float32, device=device)
    masks = [torch.zeros(keep.shape, device=device).masked_fill(~keep, float("-inf")) for keep in keeps]
    for (k, v), keep, mask in zip(blocks, keeps, masks):
        steps.forward_masked(q, k, v, out, lse, StepSpec(scale), mask, ~keep.any(1))
    final = out.to(dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    grads_kv = [[torch.zeros(k.shape, dtype=torch.float32, device=device) for _ in range(2)] for k, _ in blocks]
    for (k, v), grad_kv, mask in zip(blocks, grads_kv, masks):
        steps.backward_masked(
            dout, q, k, v, final, lse, None, dq, lambda grad_kv=grad_kv: grad_kv, StepSpec(scale), mask
        )
    ours = [final, dq, torch.cat([dk for dk, _ in grads_kv], 1), torch.cat([dv for _, dv in grads_kv], 1)]

    keep = torch.cat(keeps, 1)
    assert keep.any(1).all() and not keeps[0].any(1).all() and not keeps[1].any(1).all()
    k_all, v_all = (torch.cat([block[i] for block in blocks], 1) for i in (0, 1))
    exact = reference.with_grads(lambda *t: _attention(*t, scale, keep), [t.double() for t in (q, k_all, v_all)],
                                 dout.double())  # fmt: skip
    plain = reference.with_grads(lambda *t: _attention(*t, scale, keep), [q, k_all, v_all], dout)
    failures = _failures(ours, [exact[0], *exact[2:]], [plain[0], *plain[2:]], dtype)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------
# NCCL, one rank
# ----------------------------------------------------------------------------------


@pytest.fixture
def nccl_world(device, tmp_path):
    """The world: an NCCL process group of one rank on cuda:0 (file:// rendezvous), on
    CPU a gloo one; destroyed after the test."""
    if device == "cuda" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    options = {}
    if device == "cuda":
        options["device_id"] = torch.device("cuda", 0)
        torch.cuda.set_device(options["device_id"])
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{tmp_path}/rendezvous",
                            rank=0, world_size=1, **options)  # fmt: skip
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_ulysses_and_usp_over_nccl_with_one_rank(device, nccl_world, causal):
    generator = torch.Generator(device=device).manual_seed(33)
    # fp32 in the dry run: aten's CPU kernels in bf16 are not what it checks (SDPA's CPU
    # backward under Ulysses erred beyond the rule in bf16 at 100 causal rows, d128: dv 0.106 > 0.098).
    dtype = _size(device, torch.bfloat16, torch.float32)
    seqlen, heads, kv_heads, head_dim = _size(device, (1000, 8, 2, 128), (48, 4, 2, 32))
    q, dout = (_randn(generator, 2, seqlen, heads, head_dim, dtype=dtype) for _ in range(2))
    k, v = (_randn(generator, 2, seqlen, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    scale = head_dim**-0.5
    keep = torch.ones(seqlen, seqlen, dtype=torch.bool, device=device)
    if causal:
        keep = keep.tril()
    exact = reference.with_grads(lambda *t: _attention(*t, scale, keep), [t.double() for t in (q, k, v)],
                                 dout.double())  # fmt: skip
    plain = reference.with_grads(lambda *t: _attention(*t, scale, keep), [q, k, v], dout)
    ulysses_group, ring_group = sp.make_usp_groups(1, group=nccl_world)
    assert dist.get_backend(nccl_world) == ("nccl" if device == "cuda" else "gloo")
    assert dist.get_world_size(ring_group) == 1
    functions = {
        "ring (auto)": lambda *t: sp.ring_attention(*t, group=nccl_world, causal=causal),
        "ring (triton)": lambda *t: sp.ring_attention(*t, group=nccl_world, causal=causal, step_backend="triton"),
        "ring (aten, zigzag)": lambda *t: sp.ring_attention(*t, group=nccl_world, causal=causal, layout="zigzag",
                                                            step_backend="aten"),
        "ulysses": lambda *t: sp.ulysses_attention(*t, group=nccl_world, causal=causal),
        "usp": lambda *t: sp.usp_attention(*t, ulysses_group=ulysses_group, ring_group=ring_group, causal=causal),
    }  # fmt: skip
    if device == "cpu":
        del functions["ring (triton)"]  # the interpreter: slow, and tested elsewhere
    failures = []
    for name, function in functions.items():
        ours = reference.with_grads(function, [q, k, v], dout)
        failures += [f"{name} {failure}" for failure in _failures([ours[0], *ours[2:]], [exact[0], *exact[2:]],
                                                                  [plain[0], *plain[2:]], dtype)]  # fmt: skip
    assert not failures, "\n".join(failures)


def _inference_problem(generator, dtype, head_dim, cached, chunk, heads=8, kv_heads=2):
    """Each sequence's cached keys and values at positions 0..cached[b]-1 and a chunk of
    `chunk` new tokens after them: (B, T, H or H_kv, D) tensors in dtype on the GPU, T the
    longest cache plus the chunk (rows past a sequence's end are never seen)."""
    batch, longest = len(cached), max(cached) + chunk
    q = _randn(generator, batch, longest, heads, head_dim, dtype=dtype)
    k, v = (_randn(generator, batch, longest, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    return q, k, v, torch.tensor(cached, device=generator.device)


def _exact_and_plain(q, k, v, q_positions, k_positions, k_valid, variant):
    """fp64 attention of q over every valid key (the yardstick: the same in q's dtype)."""
    keep = reference.visible_at(q_positions, k_positions, causal=True, window_size=variant.get("window", (-1, -1)))
    keep = (keep & k_valid[:, None, :])[:, None]  # (B, 1, Tq, T)
    options = dict(softcap=variant.get("softcap", 0.0), sinks=variant.get("sinks"))
    exact = reference.masked_attention(q.double(), k.double(), v.double(), keep, **options)[0]
    plain = reference.masked_attention(q, k, v, keep, **options)[0]
    return exact, plain


INFERENCE_VARIANTS = [
    dict(),
    dict(window=(100, 0), softcap=30.0),
    dict(sinks=True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inference_over_a_sharded_cache_on_the_gpu(device, nccl_world, dtype, head_dim):
    if device == "cpu" and (dtype, head_dim) != (torch.bfloat16, 64):
        pytest.skip("the dry run of the harness: one case")
    generator = torch.Generator(device=device).manual_seed(head_dim)
    cached, chunk = _size(device, ((700, 1, 333), 48), ((70, 1, 33), 8))
    q_all, k, v, cached = _inference_problem(generator, dtype, head_dim, cached, chunk)
    batch, longest = k.shape[:2]
    chunk = longest - int(cached.max())
    positions = torch.arange(longest, device=device).expand(batch, longest)
    failures = []
    for index, drawn in enumerate(INFERENCE_VARIANTS):
        variant = dict(drawn)
        if variant.get("sinks"):
            variant["sinks"] = torch.randn(q_all.shape[2], generator=generator, device=device, dtype=torch.float32)
        else:
            variant.pop("sinks", None)
        options = dict(window_size=variant.get("window", (-1, -1)), softcap=variant.get("softcap", 0.0))
        # Decode: each sequence's query at its last cached position, the cache dealt to 3
        # shards by position (one of them empty for the 1-token sequence).
        q = torch.stack([q_all[b, int(cached[b]) - 1] for b in range(batch)])[:, None]  # (B, 1, H, D)
        q_positions = cached[:, None] - 1
        valid = positions < cached[:, None]
        exact, plain = _exact_and_plain(q, k, v, q_positions, positions, valid, variant)
        owner = torch.randint(3, (batch, longest), generator=generator, device=device)
        outs, lses = [], []
        for shard in range(3):
            mine = valid & (owner == shard)
            lengths = mine.sum(1)
            order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)  # this shard's rows first
            take = lambda t: torch.gather(t, 1, order[..., None, None].expand(-1, -1, *t.shape[2:]))  # noqa: E731
            with torch.no_grad():
                out, lse = sp.decode_attention_partial(q, take(k), take(v), q_positions=q_positions,
                                                       cache_positions=torch.gather(positions, 1, order),
                                                       cache_lengths=lengths, **options)  # fmt: skip
            outs.append(out)
            lses.append(lse)
        merged = sp.merge_attention_partials(outs, lses, sinks=variant.get("sinks"))[0].to(dtype)
        with torch.no_grad():
            whole = sp.decode_attention(q, k, v, q_positions=q_positions, cache_positions=positions,
                                        cache_lengths=cached, group=nccl_world, sinks=variant.get("sinks"),
                                        **options)  # fmt: skip
        for name, got in (("decode partials merged", merged), ("decode_attention", whole)):
            failures += [f"variant {index} {name} {f}" for f in _failures([got], [exact], [plain], dtype)]
        # A chunk of new tokens after each sequence's cache (a next turn): pass-KV and pass-Q.
        q_positions = cached[:, None] + torch.arange(chunk, device=device)
        rows = q_positions[..., None, None]
        new_q = torch.gather(q_all, 1, rows.expand(-1, -1, *q_all.shape[2:]))
        new_k, new_v = (torch.gather(t, 1, rows.expand(-1, -1, *t.shape[2:])) for t in (k, v))
        keys_seen = valid | ((positions >= cached[:, None]) & (positions < cached[:, None] + chunk))
        exact, plain = _exact_and_plain(new_q, k, v, q_positions, positions, keys_seen, variant)
        for method in ("pass-kv", "pass-q"):
            with torch.no_grad():
                got = sp.prefill_attention(new_q, new_k, new_v, k, v, q_positions=q_positions,
                                           cache_positions=positions, cache_lengths=cached, method=method,
                                           group=nccl_world, sinks=variant.get("sinks"), **options)  # fmt: skip
            failures += [f"variant {index} prefill {method} {f}" for f in _failures([got], [exact], [plain], dtype)]
    assert not failures, "\n".join(failures)
