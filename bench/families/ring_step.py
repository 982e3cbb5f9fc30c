"""(GPU) The ring's step alone, both step backends, against SDPA's flash and cuDNN
backends; writes the table step_backend="auto" reads.

Rows (bench column):
  ring-step-fwd   one forward step (attention_step_forward) merging into a running fp32
                  (out, lse), as in the ring, full or causal
  ring-step-bwd   one backward step (attention_backward_preprocess +
                  attention_step_backward)
against SDPA restricted to each backend (sdpa_kernel), the faster of those that run the
case within the accuracy rule (the baseline); TFLOP/s of both (FLOPs: forward 4 B H S^2
D, backward 2.5x that, causal half) and ours as a fraction of the spec-sheet dense bf16
peak. check: ours against the exact fp64 result on the first head, by the tests'
accuracy rule with the trusted baseline's error in the yardstick (bench/runner/verify.py:
accuracy_verdict).

The "aten" step backend (torch's library kernel per block, then the merge kernel:
seqpar_kernels/engine/step_backends.py AtenSteps) is timed in the same run; its TFLOP/s
and accuracy are in each row's detail. After the cases, the backend with the shorter
total time over them (forward + backward) becomes this GPU family's entry of the table
step_backend="auto" reads, unless either failed its accuracy check somewhere: written
into the results JSON ("step_backend", with every case's TFLOP/s of each candidate)
and into this checkout's table (seqpar_kernels/engine/step_backends.json: commit it
with the results). A run elsewhere brings its JSON back; python -m bench.runner.step_table
writes its entry into the checkout's table from there.

Tile sweep (rows ring-step-tiles, not with --quick; with --short the dk/dv candidates of
SHORT_SWEEP_TILES only, about 20 s): for the first forward and backward
case, each candidate tile of each step kernel (SWEEP_TILES: forward, dq, dk/dv) timed
against the shipped one side by side (ours = the candidate, baseline = the shipped
tile; speedup > 1: the candidate is faster), its result checked by the same accuracy
rule. A candidate that does not compile or fit says so in its row.

Rank 0 runs the cases on its GPU while the other ranks wait; on CPU nothing runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.families.shared.baselines import leaves, sdpa
from bench.runner import hardware, step_table
from bench.runner.cases import run_on_one_gpu, timed_row
from bench.runner.context import Context
from bench.runner.family import Family
from bench.runner.plan import Size, Sizes
from bench.runner.rows import Row, short_dtype
from bench.runner.timing import time_side_by_side
from bench.runner.verify import accuracy_verdict, chunked_attention, within_error_rule
from tools.reference import ERROR_FACTOR, max_error


@dataclass(frozen=True)
class StepCase:
    batch: int
    seqlen: int  # q and k/v rows of the one step
    heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    backward: bool

    @property
    def bench(self) -> str:
        return "ring-step-bwd" if self.backward else "ring-step-fwd"

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"{mask} S={self.seqlen} D={self.head_dim} {short_dtype(self.dtype)}"

    @property
    def shape(self) -> str:
        return f"B={self.batch} S_q=S_k={self.seqlen} H={self.heads} D={self.head_dim}"

    @property
    def flops(self) -> float:
        """Matmul FLOPs: forward 2 matmuls (4 B H S^2 D), backward 2.5x (5 matmuls, the
        recomputation of the scores included), as flash-attention counts; causal half."""
        forward = 4 * self.batch * self.heads * self.seqlen**2 * self.head_dim
        return forward * (2.5 if self.backward else 1.0) * (0.5 if self.causal else 1.0)


def step_cases(ctx: Context) -> list[StepCase]:
    """S = 4K, 8K, 16K, D = 128, bf16, 32 heads (--quick: 512 rows, 4 heads)."""
    seqlens, heads = ((512,), 4) if ctx.quick else ((4096, 8192, 16384), 32)
    cases = []
    for backward in (False, True):
        for seqlen in seqlens:
            for causal in (False, True):
                cases.append(StepCase(1, seqlen, heads, 128, torch.bfloat16, causal, backward))
    return cases


SIZES = Sizes(  # GPU only: nothing runs on CPU
    quick=Size("GPU only", 0, gpu_runs="step kernels at S = 512"),
    default=Size("GPU only", 0, gpu_runs="step kernels at S = 4K, 8K, 16K, D = 128, and the tile sweep"),
    full=Size("GPU only", 0, gpu_runs="the default's cases"),
)


def sdpa_backends():
    """{name: SDPBackend} of the SDPA kernels the step kernel is compared with."""
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def sdpa_with(backend, q, k, v, causal):
    """SDPA restricted to one backend: raises (never falls back) when it cannot run."""
    with sdpa_kernel([backend]):
        return sdpa(q, k, v, causal)


def usable_backends(case: StepCase, q, k, v) -> tuple[dict, list[str]]:
    """The SDPA backends that run this case, and why the others cannot (said in the
    row's detail and the log: a missing backend must not pass unnoticed). Raises when
    none runs."""
    usable, missing = {}, []
    for name, backend in sdpa_backends().items():
        try:
            inputs = leaves(q, k, v) if case.backward else (q, k, v)
            out = sdpa_with(backend, *inputs, case.causal)
            if case.backward:  # a backend may run forward only
                torch.autograd.grad(out, inputs, torch.ones_like(out))
        except RuntimeError as error:
            missing.append(f"{name} unavailable: {str(error).strip().splitlines()[0][:160]}")
        else:
            usable[name] = backend
    if not usable:
        raise RuntimeError(f"no SDPA backend among {list(sdpa_backends())} runs {case.shape}: {missing}")
    return usable, missing


def step_candidates(case: StepCase, backends: dict, q, k, v, dout) -> dict:
    """{"ours": fn, <backend name>: fn, ...}, each fn returning what it computes: the
    forward output, or (dq, dk, dv). Ours is one ring step from a fresh running
    (out, lse) = (0, -inf); its backward includes the delta = rowsum(dout * out) pass
    (SDPA's backward computes its own)."""
    # Imported here, where a GPU runs the kernels: the module imports Triton, which a
    # CPU-only install may lack (seqpar_kernels imports it as lazily).
    from seqpar_kernels.kernels import attention_step_launch as kernels

    mode = kernels.MASK_CAUSAL if case.causal else kernels.MASK_FULL
    scale = 1.0 / math.sqrt(case.head_dim)
    fp32 = dict(dtype=torch.float32, device=q.device)
    out = torch.zeros(q.shape, **fp32)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), **fp32)
    kernels.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
    out_low, final_lse = out.to(q.dtype), lse.clone()  # the backward's saved results
    if not case.backward:  # the forward's first (checked) call starts from scratch
        out.zero_()
        lse.fill_(float("-inf"))
    dq, dk, dv = torch.zeros(q.shape, **fp32), torch.zeros(k.shape, **fp32), torch.zeros(v.shape, **fp32)

    # Timed calls do not reset the running results (that would add passes over fp32
    # tensors SDPA does not make): each forward merges the same block again, as a later
    # ring step merges into a running (out, lse) (out stays, lse grows by ln 2); each
    # backward adds to dq, dk, dv. The first call (the check's) starts from scratch.
    def ours_forward():
        kernels.attention_step_forward(q, k, v, out, lse, softmax_scale=scale, mask_mode=mode)
        return [out]

    def ours_backward():
        delta = kernels.attention_backward_preprocess(out_low, dout)
        kernels.attention_step_backward(q, k, v, out_low, dout, final_lse, delta, dq, dk, dv,
                                        softmax_scale=scale, mask_mode=mode)  # fmt: skip
        return [dq, dk, dv]

    # The aten backend's step, with running results of its own.
    from seqpar_kernels.engine.step_backends import STEP_KERNELS
    from seqpar_kernels.engine.steps import StepSpec

    aten = STEP_KERNELS["aten"]
    aten_out, aten_lse = torch.zeros(q.shape, **fp32), torch.full(lse.shape, float("-inf"), **fp32)
    aten_grads = [torch.zeros(t.shape, **fp32) for t in (q, k, v)]

    def aten_forward():
        aten.forward(q, k, v, aten_out, aten_lse, StepSpec(scale), case.causal)
        return [aten_out]

    def aten_backward():
        aten.backward(dout, q, k, v, out_low, final_lse, None, aten_grads[0], lambda: aten_grads[1:],
                      StepSpec(scale), case.causal)  # fmt: skip
        return aten_grads

    candidates = {"ours": ours_backward if case.backward else ours_forward,
                  "aten": aten_backward if case.backward else aten_forward}  # fmt: skip
    for name, backend in backends.items():
        if case.backward:
            inputs = leaves(q, k, v)
            graph = sdpa_with(backend, *inputs, case.causal)  # the backward runs the same backend

            def theirs(graph=graph, inputs=inputs):
                return list(torch.autograd.grad(graph, inputs, dout, retain_graph=True))
        else:

            def theirs(backend=backend):
                return [sdpa_with(backend, q, k, v, case.causal)]

        candidates[name] = theirs
    return candidates


def check_step(case: StepCase, candidates: dict, q, k, v, dout) -> tuple[dict, list[str], list[str]]:
    """Every candidate against the exact result on the first head.

    Returns {"ours": verdict, "aten": verdict} (the Triton and the aten step backend)
    (accuracy_verdict's rule, SDPA error from the first trusted backend), the SDPA
    backends trusted as baselines, and a note for each one that is not: a backend
    outside the accuracy rule with plain torch as the yardstick (within_error_rule) is
    not timed against, so a broken baseline cannot make ours look slow or fast."""
    head = slice(0, 1)
    results = {name: [t[:, :, head] for t in fn()] for name, fn in candidates.items()}
    names = ["dq", "dk", "dv"] if case.backward else ["out"]
    subset = (q[:, :, head], k[:, :, head], v[:, :, head], dout[:, :, head] if case.backward else None)
    scale = 1.0 / math.sqrt(case.head_dim)
    exact, lse_magnitude = chunked_attention(*subset, case.causal, scale, torch.float64)
    plains, _ = chunked_attention(*subset, case.causal, scale, case.dtype)
    if case.backward:
        exact, plains = exact[1:], plains[1:]
    trusted, untrusted = [], []
    for backend in (name for name in candidates if name in sdpa_backends()):
        errors = [
            (name, max_error(theirs, truth), max_error(plain, truth), truth)
            for name, theirs, plain, truth in zip(names, results[backend], plains, exact)
        ]
        wrong = [
            f"{name} err {error:.1e} > {ERROR_FACTOR:g}x plain {plain_error:.1e}"
            for name, error, plain_error, truth in errors
            if not within_error_rule(error, plain_error, truth, lse_magnitude, case.dtype)
        ]
        if wrong:
            untrusted.append(f"{backend} not used as a baseline: {', '.join(wrong)}")
        else:
            trusted.append(backend)
    if not trusted:
        raise RuntimeError(f"no SDPA backend computes {case.shape} within the error rule: {untrusted}")
    accuracy = {
        name: accuracy_verdict(results[name], plains, results[trusted[0]], exact, lse_magnitude, names, case.dtype)
        for name in ("ours", "aten")
    }  # fmt: skip
    return accuracy, trusted, untrusted


def measure_step(case: StepCase, ctx: Context) -> Row:
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    q, k, v, dout = (ctx.random(shape, case.dtype, seed) for seed in (20, 21, 22, 23))
    backends, missing = usable_backends(case, q, k, v)
    for reason in missing:
        ctx.log(f"WARNING {case.bench} {case.label}: {reason}")
    candidates = step_candidates(case, backends, q, k, v, dout)
    accuracy, trusted, untrusted = check_step(case, candidates, q, k, v, dout)
    for note in untrusted:
        ctx.log(f"WARNING {case.bench} {case.label}: {note}")
    candidates = {name: fn for name, fn in candidates.items() if name in ("ours", "aten") or name in trusted}
    timings = time_side_by_side(candidates, ctx, collective=False)
    tflops = {name: case.flops / timing.median_s / 1e12 for name, timing in timings.items()}
    best = max(trusted, key=lambda name: tflops[name])
    BACKEND_TIMES.append((case, timings["ours"].median_s, timings["aten"].median_s,
                          accuracy["ours"].check, accuracy["aten"].check))  # fmt: skip
    STEP_RATES.append({"bench": case.bench, "case": case.label, "shape": case.shape,
                       "tflops": {"triton" if name == "ours" else name: rate for name, rate in tflops.items()},
                       "checks": {"triton": accuracy["ours"].check, "aten": accuracy["aten"].check},
                       "sdpa_baselines": trusted})  # fmt: skip
    timings = {name: timing for name, timing in timings.items() if name != "aten"}
    timings["baseline"] = timings[best]
    peak, peak_source = ctx.peak_flops
    rates = ", ".join(f"{name} {tflops[name]:.3g}" for name in trusted)
    detail = "; ".join([f"TFLOP/s: ours (triton) {tflops['ours']:.3g}, aten step {tflops['aten']:.3g}, {rates}; "
                        f"baseline = {best}", *missing, *untrusted, accuracy["ours"].detail,
                        f"aten step: {accuracy['aten'].check} {accuracy['aten'].detail}"])  # fmt: skip
    accuracy = accuracy["ours"]
    return timed_row(
        ctx, timings,
        bench=case.bench, case=case.label, shape=case.shape, dtype=short_dtype(case.dtype),
        check=accuracy.check, error_vs_plain=accuracy.vs_plain,
        ours_tflops=tflops["ours"], baseline_tflops=tflops[best],
        peak_tflops=peak, peak_tflops_source=peak_source,
        ours_fraction_of_peak_tflops=None if peak is None else tflops["ours"] / peak,
        detail=detail,
    )  # fmt: skip


# Candidate tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) of each step kernel, timed
# against the shipped ones for bf16 at head dim 128: wider key tiles and deeper
# pipelines forward, the tutorial's shapes and their neighbours backward.
SWEEP_TILES = {
    "forward": ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)),
    "dq": ((128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3)),
    "dkdv": ((32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)),
}


# The short check's tiles: the bf16 d128 dk/dv tile of Triton 3.8 on sm_90 and the
# narrower ones a Triton release that serializes its wgmma (ptxas) may take instead
# (attention_step_tiles' release-keyed table): about 5 s each, compile included.
SHORT_SWEEP_TILES = {"dkdv": ((16, 128, 8, 2), (32, 32, 4, 2), (32, 64, 8, 2), (64, 64, 4, 2))}


@dataclass(frozen=True)
class TileCase:
    """One candidate tile of one step kernel on one step case."""

    step: StepCase
    kernel: str  # "forward", "dq" or "dkdv"
    tiles: tuple[int, int, int, int]
    dtype: torch.dtype = torch.bfloat16

    @property
    def bench(self) -> str:
        return "ring-step-tiles"

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.tiles} {self.step.label}"

    @property
    def shape(self) -> str:
        return self.step.shape


def tile_cases(ctx: Context) -> list[TileCase]:
    if ctx.quick:
        return []
    forward = next(case for case in step_cases(ctx) if not case.backward)
    backward = next(case for case in step_cases(ctx) if case.backward)
    sweep = SHORT_SWEEP_TILES if ctx.short else SWEEP_TILES
    return [TileCase(backward if kernel != "forward" else forward, kernel, tiles)
            for kernel, candidates in sweep.items() for tiles in candidates]  # fmt: skip


def measure_tiles(case: TileCase, ctx: Context) -> Row:
    from seqpar_kernels.kernels.attention_step_tiles import tile_override

    step = case.step
    shape = (step.batch, step.seqlen, step.heads, step.head_dim)
    q, k, v, dout = (ctx.random(shape, step.dtype, seed) for seed in (20, 21, 22, 23))
    backends, _ = usable_backends(step, q, k, v)
    shipped = step_candidates(step, backends, q, k, v, dout)
    with tile_override(case.kernel, case.tiles):
        candidate = step_candidates(step, backends, q, k, v, dout)
        accuracy, _, _ = check_step(step, candidate, q, k, v, dout)
    ours = candidate["ours"]

    def ours_with_candidate_tiles():
        with tile_override(case.kernel, case.tiles):
            return ours()

    timings = time_side_by_side({"ours": ours_with_candidate_tiles, "baseline": shipped["ours"]}, ctx,
                                collective=False)  # fmt: skip
    tflops = {name: step.flops / timing.median_s / 1e12 for name, timing in timings.items()}
    return timed_row(
        ctx, timings, bench=case.bench, case=case.label, shape=case.shape, dtype=short_dtype(step.dtype),
        check=accuracy["ours"].check, error_vs_plain=accuracy["ours"].vs_plain,
        ours_tflops=tflops["ours"], baseline_tflops=tflops["baseline"],
        detail=f"TFLOP/s: {case.tiles} {tflops['ours']:.3g}, shipped tiles {tflops['baseline']:.3g}; "
               f"{accuracy['ours'].detail}",
    )  # fmt: skip


# (case, triton seconds, aten seconds, triton check, aten check) of every case measured.
BACKEND_TIMES: list = []
# Every case measured: its TFLOP/s by candidate (triton, aten, the SDPA backends that
# ran it) and both step backends' checks, for the results JSON.
STEP_RATES: list = []


def choose_step_backend(times) -> tuple[str | None, str]:
    """(the faster step backend over `times` (BACKEND_TIMES' rows) by total time, or None
    when a check failed or nothing was measured; a summary of the comparison)."""
    if not times:
        return None, "no case measured"
    failed = [f"{backend} {case.bench} {case.label}" for case, _, _, *checks in times
              for backend, check in zip(("triton", "aten"), checks) if check != "matches"]  # fmt: skip
    triton_total, aten_total = sum(t[1] for t in times), sum(t[2] for t in times)
    summary = (
        f"triton {triton_total * 1e3:.3g} ms, aten {aten_total * 1e3:.3g} ms over {len(times)} cases "
        f"(ring-step-fwd/bwd)"
    )
    if failed:
        return None, f"{summary}; not recorded, accuracy check failed: {', '.join(failed)}"
    return ("triton" if triton_total < aten_total else "aten"), summary


def record_step_backend(ctx: Context, family: str) -> None:
    """This family's measured entry (choose_step_backend over BACKEND_TIMES) into the
    results JSON, with every case's rates, and into this checkout's table. Nothing is
    recorded unless every case was measured (a case that raised counts against)."""
    backend, summary = choose_step_backend(BACKEND_TIMES)
    unmeasured = len(step_cases(ctx)) - len(BACKEND_TIMES)
    if unmeasured and backend is not None:
        backend, summary = None, f"{summary}; not recorded: {unmeasured} cases raised"
    ctx.log(f"step backends on {ctx.device_name} ({family}): {summary}")
    entry = None
    if backend is not None:
        basis = (f"measured on {ctx.device_name}, torch {torch.__version__}, triton {hardware.triton_version()}, "
                 f"commit {hardware.git_commit()}: {summary}")  # fmt: skip
        entry = {"backend": backend, "measured": True, "basis": basis}
    if ctx.record_metadata is not None:
        ctx.record_metadata({step_table.RESULTS_KEY: {"family": family, "entry": entry, "summary": summary,
                                                      "cases": list(STEP_RATES)}})  # fmt: skip
    if entry is None:
        return
    if step_table.SOURCE_TABLE.exists():
        step_table.write_entry(family, entry)
        ctx.log(f'step_backend="auto" on {family}: {backend}, written to {step_table.SOURCE_TABLE}')
    else:
        ctx.log(f"step_backend=\"auto\" on {family}: {backend} (no source table at {step_table.SOURCE_TABLE}: "
                "python -m bench.runner.step_table RESULTS in a checkout writes it there)")  # fmt: skip


def run(ctx: Context) -> list[Row]:
    BACKEND_TIMES.clear()
    STEP_RATES.clear()
    rows = run_on_one_gpu(ctx, "ring-step-fwd/bwd", None, measure_step, step_cases)
    rows += run_on_one_gpu(ctx, "ring-step-tiles", None, measure_tiles, tile_cases)
    if ctx.is_root and ctx.on_gpu and not ctx.quick:
        from seqpar_kernels.engine.step_backends import gpu_family

        major, minor = torch.cuda.get_device_capability(ctx.device)
        record_step_backend(ctx, gpu_family(10 * major + minor))
    return rows


FAMILY = Family(
    name="ring-step",
    order=50,
    measures="(GPU) the ring's step alone: both step backends against SDPA's; writes the step backend table",
    run=run,
    sizes=SIZES,
)
