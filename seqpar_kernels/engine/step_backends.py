"""Step backends: what computes one ring step, behind one written interface (StepBackend).

A step folds one K/V block into this rank's running fp32 (out, lse) in place (forward),
or adds one block's share of the gradients (backward). The backends:

    "aten"              torch's own attention kernel for the block's (out, lse), then the
                        attention_merge_ kernel; the kernel's backward given the final
                        out and lse (engine/block_attention.py): on CPUs aten's flash
                        kernel in fp32, on GPUs cuDNN (sm_90 and newer) or flash-attention
                        2, the memory-efficient kernel for what they do not take.
    "aten-repeated-kv"  the same with kv heads repeated for the local kernel: the CPU path
                        of torch releases whose CPU flash kernel cannot read GQA
                        (CPU_FLASH_READS_GQA), selectable on any release.
    "triton"            the fused Triton step kernels (seqpar_kernels/kernels/): the merge
                        inside the kernel, no rounding of a block to the input dtype,
                        packed documents in one launch per step with per-row key
                        intervals; on CPU tensors they run in the Triton interpreter
                        (TRITON_INTERPRET=1), which tests use to check the GPU path's
                        schedule without a GPU.

Adding a backend is one class that implements StepBackend and one entry of
STEP_KERNELS (and of STEP_BACKENDS to make it a public choice).

"auto" (AUTO, the default of ring_attention and usp_attention): "aten" on CPUs; on GPUs
"triton" for fp32 and, for fp16/bf16, the backend of the GPU's family in
step_backends.json: the published figures until a GPU benchmark of that family has
measured both (python -m bench --only ring-step writes the entry in the source tree).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Callable, Protocol

import torch

from seqpar_kernels.engine.block_attention import CPU_FLASH_READS_GQA, CpuFlashBlocks, CudaLibraryBlocks, MathBlocks
from seqpar_kernels.ops.attention_merge import attention_merge_

# Layouts of every method: q, out, dout, dq (B, S, H, D); k, v and the block's dk, dv
# (B, S_k, H_kv, D); lse, delta (B, H, S) fp32; out, lse and dq fp32 running state.
# grad_kv() returns the block's (dk, dv) fp32 accumulators, asked for only once the
# step has computed what it can without them (they may still be arriving).
GradKV = Callable[[], "tuple[torch.Tensor, torch.Tensor]"]


class StepBackend(Protocol):
    """What the ring driver (engine/ring_driver.py) asks of a step backend.

    Capabilities:
        takes_intervals               forward_intervals / backward_intervals run a step of
                                      packed documents in one launch with per-row key
                                      intervals (engine/step_masks.py StepMask.intervals);
                                      without it the driver calls forward / forward_masked
                                      per block of the step.
        first_step_writes_every_row   with first_step=True a launch writes every row of
                                      (out, lse) it covers, reading neither: the driver
                                      then starts the running state uninitialised.

    spec (every method): the call's StepSpec (engine/steps.py): the softmax scale (> 0)
    and the soft cap of the scores (0: none)."""

    takes_intervals: bool
    first_step_writes_every_row: bool

    def prepare_backward(self, out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor | None:
        """What every backward step reads besides out and dout (delta), once per call."""

    def forward(self, q, k, v, out, lse, spec, causal: bool, first_step=False) -> None:
        """Folds all of q against all of k, v (causal: the diagonal block) into (out, lse)."""

    def forward_masked(self, q, k, v, out, lse, spec, mask, empty_rows) -> None:
        """forward under an fp32 additive (q rows, k rows) mask; empty_rows (q rows,)
        bool marks the rows whose mask is all -inf."""

    def forward_intervals(self, q, k, v, out, lse, spec, intervals, first_step=False) -> None:
        """forward where query row i attends key rows [row_start[i], row_end[i])."""

    def backward(self, dout, q, k, v, out, lse, delta, dq, grad_kv: GradKV, spec, causal) -> None:
        """Adds the block's gradients to dq and to grad_kv()'s (dk, dv)."""

    def backward_masked(self, dout, q, k, v, out, lse, delta, dq, grad_kv: GradKV, spec, mask) -> None:
        """backward under forward_masked's mask."""

    def backward_intervals(self, dout, q, k, v, out, lse, delta, dq, grad_kv: GradKV, spec, intervals) -> None:
        """backward of forward_intervals."""


class AtenSteps:
    """torch's own attention kernel per block (engine/block_attention.py: aten's CPU
    flash kernels on CPUs, cuDNN/flash/memory-efficient on GPUs), each block's (out, lse)
    merged by attention_merge_; the kernels' backward given the final out and lse.
    cpu_blocks, cuda_blocks: the block kernels by device. Softcapped scores, which those
    kernels cannot compute, go through MathBlocks (plain torch in fp32)."""

    takes_intervals = False
    first_step_writes_every_row = False

    def __init__(self, cpu_blocks, cuda_blocks):
        self.blocks_by_device = {"cpu": cpu_blocks, "cuda": cuda_blocks}

    def _blocks(self, q, softcap):
        return MATH_BLOCKS if softcap > 0 else self.blocks_by_device[q.device.type]

    def prepare_backward(self, out, dout):
        return None  # the library backward computes rowsum(dout * out) itself

    def forward(self, q, k, v, out, lse, spec, causal, first_step=False):
        block_out, block_lse = self._forward(q, k, v, spec, causal, None)
        attention_merge_(out, lse, block_out, block_lse)

    def forward_masked(self, q, k, v, out, lse, spec, mask, empty_rows):
        # The kernels return lse 0 (not -inf) or NaN outputs for a row whose mask is all
        # -inf: its lse is set to -inf so that the merge leaves it untouched.
        block_out, block_lse = self._forward(q, k, v, spec, False, mask)
        attention_merge_(out, lse, block_out, block_lse.masked_fill(empty_rows, float("-inf")))

    def _forward(self, q, k, v, spec, causal, mask):
        blocks = self._blocks(q, spec.softcap)
        more = (spec.softcap,) if blocks is MATH_BLOCKS else ()
        return blocks.forward(q, k, v, spec.scale, causal, mask, *more)

    def forward_intervals(self, q, k, v, out, lse, spec, intervals, first_step=False):
        raise NotImplementedError("the aten step backend takes masked blocks, not intervals")

    def backward(self, dout, q, k, v, out, lse, delta, dq, grad_kv, spec, causal):
        self._backward(dout, q, k, v, out, lse, dq, grad_kv, spec, causal, None)

    def backward_masked(self, dout, q, k, v, out, lse, delta, dq, grad_kv, spec, mask):
        # exp(s + mask - lse) is exactly 0 where the mask is -inf: the masked keys and the
        # empty rows get nothing.
        self._backward(dout, q, k, v, out, lse, dq, grad_kv, spec, False, mask)

    def backward_intervals(self, dout, q, k, v, out, lse, delta, dq, grad_kv, spec, intervals):
        raise NotImplementedError("the aten step backend takes masked blocks, not intervals")

    def _backward(self, dout, q, k, v, out, lse, dq, grad_kv, spec, causal, mask):
        # Given the final out and lse, the kernels rebuild this block's probabilities as
        # exp(s - lse) and its delta from the final out: the block's exact share. A row
        # that saw no key (final lse -inf) gets lse +inf, as the Triton kernels map it:
        # exp(s - inf) = 0, where exp(-inf - (-inf)) would be NaN.
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        blocks = self._blocks(q, spec.softcap)
        more = (spec.softcap,) if blocks is MATH_BLOCKS else ()
        value_dim = v.shape[-1]
        if dout.shape[-1] == value_dim + 1:  # lse's gradient rides in one more column (steps.backward_inputs)
            v = torch.nn.functional.pad(v, (0, 1))
        grad_q, grad_k, grad_v = blocks.backward(dout, q, k, v, out, lse, spec.scale, causal, mask, *more)
        grad_v = grad_v[..., :value_dim]
        dq.add_(grad_q)
        dk, dv = grad_kv()
        dk.add_(grad_k)
        dv.add_(grad_v)


class TritonSteps:
    """The fused step kernels (seqpar_kernels/kernels/; on CPU tensors the Triton
    interpreter, in tests); softcap inside the kernels. The kernels are imported at the
    first call: Triton is needed on GPUs only (CPU-only torch wheels lack it)."""

    takes_intervals = True
    first_step_writes_every_row = True

    @staticmethod
    def _kernels():
        from seqpar_kernels.kernels import attention_step_launch

        return attention_step_launch

    def prepare_backward(self, out, dout):
        return self._kernels().attention_backward_preprocess(out, dout)

    def forward(self, q, k, v, out, lse, spec, causal, first_step=False):
        kernels = self._kernels()
        mode = kernels.MASK_CAUSAL if causal else kernels.MASK_FULL
        options = dict(softmax_scale=spec.scale, mask_mode=mode, first_step=first_step, softcap=spec.softcap)
        kernels.attention_step_forward(q, k, v, out, lse, **options)

    def forward_masked(self, q, k, v, out, lse, spec, mask, empty_rows):
        raise NotImplementedError("the Triton step backend takes intervals, not masked blocks")

    def forward_intervals(self, q, k, v, out, lse, spec, intervals, first_step=False):
        kernels = self._kernels()
        options = dict(softmax_scale=spec.scale, mask_mode=kernels.MASK_INTERVALS, first_step=first_step,
                       softcap=spec.softcap)  # fmt: skip
        kernels.attention_step_forward(q, k, v, out, lse, intervals=intervals, **options)

    def backward(self, dout, q, k, v, out, lse, delta, dq, grad_kv, spec, causal):
        kernels = self._kernels()
        mode = kernels.MASK_CAUSAL if causal else kernels.MASK_FULL
        self._backward(dout, q, k, v, lse, delta, dq, grad_kv, spec, mode, None)

    def backward_masked(self, dout, q, k, v, out, lse, delta, dq, grad_kv, spec, mask):
        raise NotImplementedError("the Triton step backend takes intervals, not masked blocks")

    def backward_intervals(self, dout, q, k, v, out, lse, delta, dq, grad_kv, spec, intervals):
        self._backward(dout, q, k, v, lse, delta, dq, grad_kv, spec, self._kernels().MASK_INTERVALS, intervals)

    def _backward(self, dout, q, k, v, lse, delta, dq, grad_kv, spec, mode, intervals):
        # The dq kernel first, then the dk/dv kernel into grad_kv()'s (dk, dv), asked for
        # only once dq is launched.
        kernels = self._kernels()
        options = dict(softmax_scale=spec.scale, mask_mode=mode, intervals=intervals, softcap=spec.softcap)
        kernels.attention_step_backward_dq(q, k, v, dout, lse, delta, dq, **options)
        kernels.attention_step_backward_dkdv(q, k, v, dout, lse, delta, *grad_kv(), **options)


MATH_BLOCKS = MathBlocks()

STEP_KERNELS = {
    "aten": AtenSteps(CpuFlashBlocks(repeat_kv_heads=not CPU_FLASH_READS_GQA), CudaLibraryBlocks()),
    "aten-repeated-kv": AtenSteps(CpuFlashBlocks(repeat_kv_heads=True), CudaLibraryBlocks()),
    "triton": TritonSteps(),
}

# The public choices of ring_attention(step_backend=...) and usp_attention.
AUTO = "auto"
STEP_BACKENDS = (AUTO, "triton", "aten")
# Where "auto" looks up each GPU family's backend: python -m bench --only
# ring-step rewrites a family's entry in the source tree with what it measured.
STEP_BACKEND_TABLE = os.path.join(os.path.dirname(__file__), "step_backends.json")


def gpu_family(capability: int) -> str:
    """The family key of the table for a GPU of compute capability `capability` (90
    for sm_90): GPUs of one family share their tile choices and library kernels."""
    if capability >= 120:
        return "sm_120"  # RTX 50xx, RTX PRO Blackwell, DGX Spark
    if capability >= 100:
        return "sm_100"  # B200, B300
    if capability >= 90:
        return "sm_90"  # H100, H200
    if capability in (86, 89):
        return "sm_86"  # RTX 30xx/40xx, A10, A40, L4, L40S
    return "sm_80"  # A100, A30, Orin


@functools.cache
def step_backend_table() -> dict:
    """{family: {"backend", "measured", "basis", ...}} from STEP_BACKEND_TABLE."""
    with open(STEP_BACKEND_TABLE) as f:
        return json.load(f)["families"]


def record_measured_step_backend(family: str, backend: str, basis: str, path: str) -> None:
    """Writes `backend` as the measured choice of `family` into the table at `path` (the
    source tree's step_backends.json: the GPU benchmark names it, never an installed
    copy), with `basis` (what was measured, where). Other families' entries stay."""
    assert backend in STEP_BACKENDS[1:], backend
    with open(path) as f:
        table = json.load(f)
    table["families"][family] = {"backend": backend, "measured": True, "basis": basis}
    with open(path, "w") as f:
        json.dump(table, f, indent=2)
        f.write("\n")
    step_backend_table.cache_clear()


@functools.cache
def _device_capability(device_index: int) -> int:
    major, minor = torch.cuda.get_device_capability(device_index)
    return 10 * major + minor


def auto_step_backend(device: torch.device, dtype: torch.dtype, in_kernel_features: bool = False) -> str:
    """The backend "auto" runs for tensors of `dtype` on `device` (CPU or CUDA: the
    public entry checks it): "aten" on CPUs (Triton kernels run there only in the
    interpreter); on GPUs "triton" for fp32 (exact fp32 products, where the library
    kernels round to TF32 or refuse fp32) and for what only the Triton kernels do in the
    kernel (in_kernel_features: softcapped scores, windows and chunks, which the library
    kernels would take as plain torch or masked blocks), and the table's entry for the
    GPU's family otherwise. v's head dim does not enter: both backends take one that
    differs from q's (multi-head latent attention)."""
    if device.type == "cpu":
        return "aten"
    if dtype == torch.float32 or in_kernel_features:
        return "triton"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return step_backend_table()[gpu_family(_device_capability(index))]["backend"]


def step_kernels_for(name: str, q: torch.Tensor, in_kernel_features: bool = False) -> StepBackend:
    """The step backend called `name` (a key of STEP_KERNELS, or AUTO: auto_step_backend's
    choice for q's device and dtype and in_kernel_features). The name was checked at the
    public entry (parallel/attention_checks.py)."""
    if name == AUTO:
        name = auto_step_backend(q.device, q.dtype, in_kernel_features)
    return STEP_KERNELS[name]
