"""Launch configuration of the ring-attention step kernels (attention_step_kernels.py).

Per GPU target: the tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) of each
kernel, the shared memory a target offers, the choices that depend on the
installed Triton release (SPLIT_FORWARD_SWEEP, SPLIT_BACKWARD_SWEEPS), and the functions that turn a
(dtype, head dim, mask, target) into a KernelLaunch.  The full and the causal
launches of a kernel share their tiles; the interval mask (packed documents)
takes them too, except for two dk/dv tiles that spill with it
(_INTERVAL_TILE_OVERRIDES).  The launchers
(attention_step_launch.py) and the ahead-of-time compile (ahead_of_time.py)
both take their launches from here, so what CI compiles for GPUs that are not
present is what the launchers run.  docs/tuning.md gives the measurements
behind the tiles.
"""

import contextlib
import functools
import re
from typing import Any, NamedTuple

import torch
import triton

from .attention_step_kernels import (
    attention_bwd_preprocess_kernel,
    attention_step_bwd_dkdv_kernel,
    attention_step_bwd_dq_kernel,
    attention_step_fwd_kernel,
)

# The oldest GPUs the kernels run on: bf16 tensor cores came with sm_80.
MIN_CAPABILITY = 80
# CUDA's limit on grid axes 1 and 2, which the kernels index by head and by batch.
MAX_GRID_YZ = 65535


class KernelLaunch(NamedTuple):
    """How a launcher starts one kernel: which kernel, its compile-time
    (``tl.constexpr``) arguments, and the launch options Triton compiles with."""

    kernel: Any  # the @triton.jit function
    constexprs: dict
    num_warps: int
    num_stages: int

    def __call__(self, grid, *args, axes=None):
        """Launch the kernel on ``grid`` with the runtime arguments ``args``, on
        the device of its first tensor argument and that device's current stream.
        A grid axis 1 or 2 beyond MAX_GRID_YZ raises ValueError naming it (``axes``:
        what each axis counts, for the message)."""
        for axis in (1, 2)[: len(grid) - 1]:
            if grid[axis] > MAX_GRID_YZ:
                what = f" ({axes[axis]})" if axes else ""
                raise ValueError(
                    f"{getattr(self.kernel, '__name__', self.kernel)}: grid axis {axis}{what} is {grid[axis]}, "
                    f"more than the {MAX_GRID_YZ} a CUDA launch allows; grid {tuple(grid)}"
                )
        device = next(arg.device for arg in args if isinstance(arg, torch.Tensor))
        if device.type != "cuda":
            self._launch(grid, args)
            return
        # Triton launches on the *current* CUDA device; a caller whose tensors
        # are on cuda:1 while cuda:0 is current would otherwise get cuda:0's
        # stream and context for cuda:1's pointers.
        with torch.cuda.device(device):
            self._launch(grid, args)

    def _launch(self, grid, args):
        self.kernel[grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


# ----------------------------------------------------------------------------
# GPU targets
# ----------------------------------------------------------------------------


class GpuTarget(NamedTuple):
    """The properties of a CUDA GPU that decide the step kernels' launches."""

    capability: int  # 10 * major + minor: 90 for sm_90 (H100/H200)
    shared_memory_per_block: int  # bytes one block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    # Streaming multiprocessors: whether a dk/dv grid fills the GPU.  A GPU
    # known only by its capability (ahead-of-time compiles) is taken to have
    # an H100 SXM's 132.
    multiprocessors: int = 132

    @classmethod
    def of_capability(cls, capability):
        """The target of a GPU known only by its compute capability (ahead-of-time
        compiles, tests), with the shared memory that capability has."""
        if capability not in SHARED_MEMORY_PER_BLOCK:
            raise ValueError(
                f"no shared-memory size on record for sm_{capability}; known: {sorted(SHARED_MEMORY_PER_BLOCK)}"
            )
        return cls(capability, SHARED_MEMORY_PER_BLOCK[capability])

    @property
    def matrix_instruction(self):
        """How Triton drives this GPU's tensor cores: 'mma.sync' (per warp,
        accumulators in registers: sm_8x and the sm_12x GeForce/workstation
        Blackwells) or 'warpgroup' (wgmma on sm_90, tcgen05 on sm_100-sm_11x)."""
        return "warpgroup" if 90 <= self.capability < 120 else "mma.sync"


# Largest dynamic shared memory one block may use, by compute capability (CUDA
# programming guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_PER_BLOCK = {
    80: 166912,
    87: 166912,  # A100, A30; Jetson Orin
    86: 101376,
    89: 101376,  # RTX 30xx, A10, A40; RTX 40xx, L4, L40S
    90: 232448,
    100: 232448,
    103: 232448,  # H100, H200; B200; B300
    120: 101376,
    121: 101376,  # RTX 50xx, RTX PRO 6000 Blackwell; DGX Spark
}
# The 99 KiB parts (sm_86/89/12x): a tile must fit there on its own (fp32 dq at
# d256 with the sm_90 tile takes 133120 B).
_SMALLEST_SHARED_MEMORY = min(SHARED_MEMORY_PER_BLOCK.values())


def cuda_target(t):
    """The GpuTarget of ``t``'s CUDA device, or None for a tensor that is not on
    a CUDA device."""
    if not t.is_cuda:
        return None
    return _device_target(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_target(device_index):
    # Asked once per device, not at every ring step's launch.
    properties = torch.cuda.get_device_properties(device_index)
    capability = 10 * properties.major + properties.minor
    # The ring refuses older GPUs before it starts (parallel/attention_checks.py check_launchable).
    assert capability >= MIN_CAPABILITY, f"sm_{capability} is older than sm_{MIN_CAPABILITY}"
    # torch < 2.5 has no shared_memory_per_block_optin: fall back to the table,
    # and to the smallest size on record for a GPU not in it.
    shared_memory = getattr(properties, "shared_memory_per_block_optin", None) or SHARED_MEMORY_PER_BLOCK.get(
        capability, _SMALLEST_SHARED_MEMORY
    )
    return GpuTarget(
        capability,
        shared_memory,
        getattr(properties, "multi_processor_count", None) or GpuTarget._field_defaults["multiprocessors"],
    )


# ----------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------

# CUDA tiles, (BLOCK_M, BLOCK_N, num_warps, num_stages), by kernel and by (bytes
# per element, BLOCK_D); BLOCK_D 16 and 32 use the 64 entry.  _TILES holds the
# sm_90 choice; _TILE_OVERRIDES replace entries for other targets.  Where v's
# head dim differs from q's, the wider of BLOCK_D and BLOCK_DV picks the entry
# (what fits there for both dims fits the pair), then _VALUE_DIM_TILE_OVERRIDES.
#
# fp16/bf16 follow the Triton fused-attention tutorial: wide q tiles forward and
# in dq, wide k tiles in dk/dv (on sm_90 a tile dimension of 64+ rows per
# warpgroup is what lets Triton use wgmma).  fp32 asks for exact ("ieee")
# products, which run as FMAs on registers, not on tensor cores: small tiles,
# the wide ones spill.
#
# Every entry is compiled ahead of time for sm_80, sm_86, sm_90, sm_100 and
# sm_120 (tools/ahead_of_time.py; tests/test_attention_step_ahead_of_time.py):
# each fits the shared memory and has no register spill inside its K/V or Q
# sweep.  docs/tuning.md gives the spills and instruction counts behind each
# choice, and bench/families/ring_step.py times them on a GPU.
_FP32_TILES = (16, 32, 8, 2)
_FP32_NARROW_TILES = (16, 16, 8, 2)
_TILES = {
    "forward": {
        (2, 64): (128, 64, 4, 3),
        (2, 128): (128, 64, 8, 2),
        (2, 256): (64, 32, 8, 2),
        (4, 64): _FP32_TILES,
        (4, 128): _FP32_TILES,
        (4, 256): _FP32_TILES,
    },
    # bf16/fp16 d256: the widest tile that spills in no loop with the split sweeps.
    "dq": {
        (2, 64): (128, 32, 8, 2),
        (2, 128): (128, 32, 8, 2),
        (2, 256): (32, 64, 8, 2),
        (4, 64): _FP32_TILES,
        (4, 128): _FP32_TILES,
        (4, 256): _FP32_TILES,
    },
    # The widest tiles without a spill in a loop; d128 with pointer loads and the
    # split sweeps (SPLIT_BACKWARD_SWEEPS) is the narrowest of them.
    "dkdv": {
        (2, 64): (32, 128, 8, 2),
        (2, 128): (16, 128, 8, 2),
        (2, 256): (32, 32, 8, 1),
        (4, 64): _FP32_NARROW_TILES,
        (4, 128): (16, 32, 4, 2),
        (4, 256): _FP32_NARROW_TILES,
    },
}


def _uses_mma_sync(target):
    return target.matrix_instruction == "mma.sync"


def _is_datacenter_blackwell(target):
    return 100 <= target.capability < 120


def _has_small_shared_memory(target):
    return target.shared_memory_per_block <= _SMALLEST_SHARED_MEMORY


def _is_hopper(target):
    return target.matrix_instruction == "warpgroup" and not _is_datacenter_blackwell(target)


# (which targets, {kernel: {key: tiles}}), applied in order: a later match wins.
# Each replaces an sm_90 tile that spills in a loop on those targets, or does not
# fit 99 KiB of shared memory (docs/tuning.md, "The tiles per target").
_TILE_OVERRIDES = (
    (_uses_mma_sync, {"dkdv": {(2, 128): (32, 64, 8, 2)}}),
    (_is_datacenter_blackwell, {"forward": {(2, 64): (128, 64, 8, 3)}, "dkdv": {(2, 128): (16, 64, 8, 2)}}),
    (_has_small_shared_memory, {"dq": {(4, 256): _FP32_NARROW_TILES, (2, 256): (32, 32, 8, 1)}}),
)

# Tiles by Triton release (major, minor): (which targets, {kernel: {key: tiles}}),
# applied after _TILE_OVERRIDES. Triton 3.6's ptxas serializes the wgmma of the sm_90
# bf16/fp16 d128 dk/dv tile (16, 128, 8, 2); 3.6 takes (32, 64, 8, 2) there, the tile
# of the mma.sync targets, not yet timed against the others: the short GPU check times
# the four candidates (bench/families/ring_step.py SHORT_SWEEP_TILES) under its Triton.
_TILES_BY_TRITON_RELEASE = {
    (3, 6): ((_is_hopper, {"dkdv": {(2, 128): (32, 64, 8, 2)}}),),
}

# The interval mask's dk/dv loop holds its keys' column intervals and runs
# between bounds loaded from them, which costs registers: fp32 d128 takes the
# narrow tile everywhere (applied after _TILE_OVERRIDES; docs/tuning.md).
_INTERVAL_TILE_OVERRIDES = ((lambda target: True, {"dkdv": {(4, 128): (16, 16, 8, 2)}}),)

# sm_90 with tensor descriptors (fp16/bf16; uses_tensor_descriptors), applied
# last: without pointer or offset tensors in registers the wide tiles fit
# (registers and instructions per iteration in docs/tuning.md, "sm_90: loads
# through tensor descriptors").
_TENSOR_DESCRIPTOR_TILES = {
    "forward": {(2, 64): (128, 128, 8, 3), (2, 128): (128, 128, 8, 3)},
    "dq": {(2, 64): (128, 64, 8, 3), (2, 128): (128, 64, 8, 3)},
    "dkdv": {(2, 64): (32, 128, 8, 3), (2, 128): (32, 64, 8, 3)},
}

# The soft-capped scores (SOFTCAP), applied last: (which launches, given the
# target and whether the mask is the interval one; {kernel: {key: tiles}}).  The
# cap costs the backward kernels one more score-sized tile in registers; every
# other soft-capped launch keeps its tile (docs/tuning.md, "Soft-capped
# scores").  sm_120's interval dq at d128, (128, 32, 8, 2), spills 3 accesses in
# its loops with the cap; one stage spills none (255 registers, 8-24 B outside
# the loops), (64, 32, 4, 2) none either but takes 14% more instructions per
# score and loads K/V for half the rows.
_SOFTCAP_TILE_OVERRIDES = (
    (lambda target, intervals: target.capability >= 120 and intervals, {"dq": {(2, 128): (128, 32, 8, 1)}}),
)

# v of another head dim than q and k (multi-head latent attention), applied last:
# (which targets, {kernel: {(bytes per element, BLOCK_D, BLOCK_DV): tiles}}), BLOCK_D
# and BLOCK_DV at least 64 as in _TILES.  On sm_90 the full-mask MHA dk/dv kernel
# with BLOCK_DV != BLOCK_D up to 128 serializes its wgmma (C7515) with every tile
# of 64 or 128 keys (BLOCK_N) tried, through descriptors and pointers alike; 32
# keys do not (docs/tuning.md).  fp32 dk/dv at D = 192, Dv = 128 on sm_90 spills in
# its loop with 8 warps (2 accesses causal GQA, 1 with one stage causal MHA), with
# 4 none.
_VALUE_DIM_TILE_OVERRIDES = (
    (_is_hopper, {"dkdv": {(2, 128, 64): (64, 32, 8, 2), (2, 64, 128): (64, 32, 8, 2)}}),
    (_is_hopper, {"dkdv": {(4, 256, 128): (16, 16, 4, 2)}}),
)

# The Triton interpreter (CPU tensors, TRITON_INTERPRET=1): small tiles keep the
# numpy work cheap and still exercise multi-tile loops and edge masks on short
# test sequences.
_INTERPRETER_TILES = (16, 32, 4, 1)


# The interpreter's stand-in for a GPU's multiprocessor count: small, so that
# the tests' short MQA/GQA blocks run the dk/dv kernel with its q heads split
# (SPLIT_HEADS) and longer ones without.
_INTERPRETER_MULTIPROCESSORS = 4


@functools.lru_cache(maxsize=1024)
def dkdv_head_splits(programs, kv_group, multiprocessors):
    """Into how many programs the dk/dv kernel splits the ``kv_group`` q heads of
    each (k tile, kv head, batch), for a grid of ``programs`` such triples on a
    GPU of ``multiprocessors`` SMs: 1 when the grid fills the GPU (or there is
    no group), else the fewest splits that minimize waves x heads per program
    (the time of the longest program, at one program per SM).  MQA at 4096
    keys (64-key tiles, one kv head, batch 1) has 64 programs for 132 SMs: 2
    splits of 16 heads fill 128 SMs, half the time of one program sweeping all
    32 heads.  The split programs add with fp32 atomics: the sum is the same
    up to rounding, its order is not fixed."""
    if kv_group == 1 or programs >= multiprocessors:
        return 1
    best_cost, best_splits = None, 1
    for heads in range(kv_group, 0, -1):  # fewest splits first: a tie keeps them
        splits = -(-kv_group // heads)
        cost = -(-programs * splits // multiprocessors) * heads
        if best_cost is None or cost < best_cost:
            best_cost, best_splits = cost, splits
    return best_splits


def all_cuda_tiles():
    """Every tile shape (BLOCK_M, BLOCK_N) a CUDA launch can take, as one of its
    tiles (tests run each in the interpreter, which ignores warps and stages)."""
    tables = [*_TILES.values(), *_TENSOR_DESCRIPTOR_TILES.values()] + [
        table
        for _, overrides in _TILE_OVERRIDES
        + _INTERVAL_TILE_OVERRIDES
        + _SOFTCAP_TILE_OVERRIDES
        + _VALUE_DIM_TILE_OVERRIDES
        + tuple(entry for entries in _TILES_BY_TRITON_RELEASE.values() for entry in entries)
        for table in overrides.values()
    ]
    shapes = {}
    for tiles in sorted({tiles for table in tables for tiles in table.values()}):
        shapes.setdefault(tiles[:2], tiles)
    return list(shapes.values())


# Tiles a benchmark tries in place of the shipped ones (tile_override), by kernel.
_TRIED_TILES = {}


@contextlib.contextmanager
def tile_override(kernel, tiles):
    """Within the block, every GPU launch of ``kernel`` ("forward", "dq" or "dkdv")
    takes ``tiles`` (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of the shipped
    ones, whatever its dtype, head dim and mask: the GPU benchmark's tile sweep
    (bench/families/ring_step.py).  Not for use around collectives of other threads."""
    assert kernel in _TILES, kernel
    previous = _TRIED_TILES.get(kernel)
    _TRIED_TILES[kernel] = tuple(tiles)
    try:
        yield
    finally:
        if previous is None:
            del _TRIED_TILES[kernel]
        else:
            _TRIED_TILES[kernel] = previous


def _tiles(kernel, dtype, block_d, target, intervals=False, tensor_descriptors=False, softcap=False, block_dv=None):
    # kernel: "forward", "dq" or "dkdv"; target: a GpuTarget, None for CPU tensors;
    # intervals: the tiles of the interval mask; tensor_descriptors: of the
    # loads through tensor descriptors; softcap: of the soft-capped scores;
    # block_dv: v's BLOCK_DV, None for block_d (one head dim).
    if target is None:
        return _INTERPRETER_TILES
    if kernel in _TRIED_TILES:
        return _TRIED_TILES[kernel]
    pair = (dtype.itemsize, max(64, block_d), max(64, block_d if block_dv is None else block_dv))
    key = (dtype.itemsize, max(pair[1:]))
    tiles = _TILES[kernel][key]
    by_release = _TILES_BY_TRITON_RELEASE.get(TRITON_RELEASE, ())
    for applies, overrides in _TILE_OVERRIDES + by_release + (_INTERVAL_TILE_OVERRIDES if intervals else ()):
        if applies(target) and key in overrides.get(kernel, {}):
            tiles = overrides[kernel][key]
    if tensor_descriptors and key in _TENSOR_DESCRIPTOR_TILES[kernel]:
        tiles = _TENSOR_DESCRIPTOR_TILES[kernel][key]
    if softcap:
        for applies, overrides in _SOFTCAP_TILE_OVERRIDES:
            if applies(target, intervals) and key in overrides.get(kernel, {}):
                tiles = overrides[kernel][key]
    if pair[1] != pair[2]:
        for applies, overrides in _VALUE_DIM_TILE_OVERRIDES:
            if applies(target) and pair in overrides.get(kernel, {}):
                tiles = overrides[kernel][pair]
    return tiles


# ----------------------------------------------------------------------------
# Choices that depend on the Triton release
# ----------------------------------------------------------------------------


def _triton_version(version=triton.__version__):
    """(major, minor) of a Triton version string such as '3.6.0' or '3.8.0+git1a2b'."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


# The installed release, which keys _TILES_BY_TRITON_RELEASE.
TRITON_RELEASE = _triton_version()

# Whether the forward kernel sweeps the whole k tiles that every row sees
# without masks, apart from the diagonal and partial ones (SPLIT_SWEEP): two
# loops instead of one.  Triton 3.8 and 3.9 compile the two loops without a
# spill on every target of the ahead-of-time test.  Older Triton pipelines each
# loop with its own buffers and the pair does not fit: on sm_90 (bf16, d64 to
# d256) the split forward spills 40 to 135 accesses in its loops with Triton
# 3.3 to 3.7, and at d128 takes 163840 B of shared memory where one loop takes
# 98304 B.  The two forms have not been timed against each other on a GPU.
SPLIT_FORWARD_SWEEP = _triton_version() >= (3, 8)
# The same for the backward kernels: dq sweeps the whole k tiles every row of
# its q tile sees without a mask, then the diagonal and partial ones; dk/dv
# sweeps the diagonal q tiles (causal) with the mask, then the rest without.
# Taken on the forward's evidence: Triton 3.8 compiles the split dq and dk/dv
# without a spill in a loop on every target of the ahead-of-time test; older
# releases run one masked sweep, not measured split.
SPLIT_BACKWARD_SWEEPS = _triton_version() >= (3, 8)

# Whether the kernels build tensor descriptors inside a kernel
# (tl.make_tensor_descriptor; the global scratch they take comes from
# triton.set_allocator): where this Triton has both, and from 3.8 on, the
# release whose compiles (ahead of time, every target) and interpreter runs
# checked that path.  An older release with the feature (3.4 to 3.7) keeps
# pointer loads rather than run a code path nothing has compiled with it.
TENSOR_DESCRIPTORS_AVAILABLE = (
    hasattr(triton.language, "make_tensor_descriptor")
    and hasattr(triton, "set_allocator")
    and _triton_version() >= (3, 8)
)
# The interpreter runs the descriptor path as well (Triton 3.8: rows and
# columns past the descriptor's shape load as 0, as TMA does); the tests turn
# it on, the launchers keep pointer loads on CPU tensors.
_INTERPRETER_TENSOR_DESCRIPTORS = False


def uses_tensor_descriptors(dtype, headdim, target):
    """Whether the step kernels load q, k, v and dout through tensor descriptors
    (TMA on the GPU) for ``dtype`` and ``headdim`` (the wider of q's and v's
    head dims) on ``target`` (None: the interpreter), given tensors whose
    layout allows it (attention_step_launch checks that).

    sm_90 with fp16/bf16: TMA moves the tiles into shared memory without a
    pointer or an offset tensor in registers.  With pointer loads, the
    loop-invariant row offsets of the q and dout tiles in the dk/dv kernel
    alone hold 32 registers per thread at BLOCK_M 32 (8 warps), which is what
    puts that kernel at 255 registers.  Other families keep pointer loads:
    mma.sync GPUs have no TMA, and sm_100 (which has it) is compiled and
    checked with pointer loads.  fp32 runs its products as FMAs on small tiles:
    not where the loads cost.  Head dims above 128 keep pointer loads too: at
    d256 through descriptors the dq kernel (64, 32, 8, 1) spills 17-21
    accesses in its loops and the causal dk/dv kernel (32, 32, 8, 1) 226-416."""
    if not TENSOR_DESCRIPTORS_AVAILABLE:
        return False
    if target is None:
        return _INTERPRETER_TENSOR_DESCRIPTORS
    return _is_hopper(target) and dtype.itemsize == 2 and headdim <= 128


# ----------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------


def _block_d(headdim):
    # tl.arange needs a power of two and tl.dot wants every dim >= 16.
    return max(16, triton.next_power_of_2(headdim))


def _dot_precision(dtype):
    # fp32 inputs: exact fp32 products ("ieee") rather than TF32, whose ~1e-3
    # relative error would defeat the point of asking for fp32.  For fp16/bf16
    # the setting has no effect.
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_upcast(dtype, interpreted):
    # bf16 tl.dot is wrong in the Triton interpreter (see _dot in
    # attention_step_kernels.py): widen there.
    return dtype == torch.bfloat16 and interpreted


def _step_launch(kernel, tiles, dtype, headdim, value_dim, causal, intervals, softcap, interpreted, **more_constexprs):
    assert not (causal and intervals), "with intervals the causality is in the intervals"
    block_m, block_n, num_warps, num_stages = tiles
    constexprs = dict(
        CAUSAL=bool(causal),
        INTERVALS=bool(intervals),
        SOFTCAP=bool(softcap),
        HEAD_DIM=headdim,
        VALUE_DIM=value_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=_block_d(headdim),
        BLOCK_DV=_block_d(value_dim),
        DOT_PRECISION=_dot_precision(dtype),
        DOT_UPCAST=_dot_upcast(dtype, interpreted),
        **more_constexprs,
    )
    return KernelLaunch(kernel, constexprs, num_warps, num_stages)


def forward_launch(
    dtype,
    headdim,
    causal,
    *,
    value_dim=None,
    intervals=False,
    first_step=False,
    softcap=False,
    tensor_descriptors=False,
    target,
    interpreted,
):
    """The KernelLaunch of ``attention_step_fwd_kernel``.

    ``headdim``: q's and k's head dim; ``value_dim``: v's (and out's), None
    for headdim (the tiles are those of the wider of the two but where
    _VALUE_DIM_TILE_OVERRIDES replaces them; with equal dims the kernel is the
    one of a single head dim).
    ``causal``: the diagonal block's mask; ``intervals``: the mask of packed
    documents, windows or chunks given as index intervals (MASK_INTERVALS; not
    with ``causal``); ``first_step``: the kernel that neither reads the
    running (out, lse) nor leaves a row of it unwritten (FIRST_STEP);
    ``softcap``: the kernel of soft-capped scores (SOFTCAP);
    ``tensor_descriptors``: loads through tensor descriptors
    (TENSOR_DESCRIPTORS; see uses_tensor_descriptors).  ``target`` (a
    GpuTarget) picks the GPU tiles; None picks the small tiles used on CPU
    tensors, which only the interpreter runs.  ``interpreted`` says whether
    the Triton interpreter runs the kernel.
    """
    value_dim = headdim if value_dim is None else value_dim
    return _step_launch(
        attention_step_fwd_kernel,
        _tiles(
            "forward",
            dtype,
            _block_d(headdim),
            target,
            intervals,
            tensor_descriptors,
            softcap,
            block_dv=_block_d(value_dim),
        ),
        dtype,
        headdim,
        value_dim,
        causal,
        intervals,
        softcap,
        interpreted,
        SPLIT_SWEEP=SPLIT_FORWARD_SWEEP,
        FIRST_STEP=bool(first_step),
        TENSOR_DESCRIPTORS=bool(tensor_descriptors),
    )


def backward_preprocess_launch(headdim, *, target):
    """The KernelLaunch of ``attention_bwd_preprocess_kernel`` for out and dout
    of ``headdim`` columns (v's head dim; any input dtype: the kernel widens
    out and dout to fp32 before it multiplies)."""
    # num_warps / num_stages are Triton's defaults, written out so that the
    # ahead-of-time compile test builds exactly the kernel the launcher runs.
    return KernelLaunch(
        attention_bwd_preprocess_kernel,
        dict(HEAD_DIM=headdim, BLOCK_M=16 if target is None else 64, BLOCK_D=_block_d(headdim)),
        num_warps=4,
        num_stages=3,
    )


def backward_launches(
    dtype,
    headdim,
    causal,
    *,
    value_dim=None,
    intervals=False,
    softcap=False,
    tensor_descriptors=False,
    target,
    interpreted,
):
    """(dq KernelLaunch, dk/dv KernelLaunch) of the backward step kernels;
    ``value_dim``, ``causal``, ``intervals``, ``softcap``,
    ``tensor_descriptors``, ``target`` and ``interpreted`` as in
    forward_launch."""
    value_dim = headdim if value_dim is None else value_dim
    blocks = dict(block_d=_block_d(headdim), block_dv=_block_d(value_dim))
    return (
        _step_launch(
            attention_step_bwd_dq_kernel,
            _tiles(
                "dq",
                dtype,
                target=target,
                intervals=intervals,
                tensor_descriptors=tensor_descriptors,
                softcap=softcap,
                **blocks,
            ),
            dtype,
            headdim,
            value_dim,
            causal,
            intervals,
            softcap,
            interpreted,
            SPLIT_SWEEP=SPLIT_BACKWARD_SWEEPS,
            TENSOR_DESCRIPTORS=bool(tensor_descriptors),
        ),
        # fp32 dk/dv sweeps once, masked: its 16-row tiles save little from
        # the split, and with the split's second loop the fp32 tiles spill in
        # a loop on some target at every head dim (causal GQA d64: 2 accesses
        # with (16, 16, 8, 2) on sm_90 and sm_100, 1 on sm_86; causal MHA d128
        # with (16, 32, 4, 2): 94 on sm_86).  The interval mask sweeps once,
        # masked, in dk/dv: split in three (masked, unmasked, masked) its GQA
        # kernel spills in the loops at bf16 d128 (sm_90 through descriptors,
        # (32, 64, 8, 3): 4 accesses, 2 with softcap; the masked edges in one
        # loop, 2 and 12; sm_100, (16, 64, 8, 2): 25), for 12-16% fewer
        # instructions per iteration where it does not.
        _step_launch(
            attention_step_bwd_dkdv_kernel,
            _tiles(
                "dkdv",
                dtype,
                target=target,
                intervals=intervals,
                tensor_descriptors=tensor_descriptors,
                softcap=softcap,
                **blocks,
            ),
            dtype,
            headdim,
            value_dim,
            causal,
            intervals,
            softcap,
            interpreted,
            SPLIT_SWEEP=SPLIT_BACKWARD_SWEEPS and dtype.itemsize == 2 and not intervals,
            TENSOR_DESCRIPTORS=bool(tensor_descriptors),
            SPLIT_HEADS=False,
        ),
    )
