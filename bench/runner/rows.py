"""The result row: one case's CSV columns, the benchmark names it can carry, and the
small conversions its fields use. Imports nothing from bench/: every other module may
import it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Row.bench of the families whose rows read differently from a fused-vs-unfused row
# (progress lines, the summary, the targets, the plot).
# bench/families/kernels.py: the kernels alone, no collective (attention_merge_: the ring's merge)
KERNEL_BENCHES = ("pack", "unpack", "merge")
RING_BENCHES = ("ring", "ring-train")  # bench/families/ring.py: ring_attention vs single-device SDPA
STEP_BENCHES = ("ring-step-fwd", "ring-step-bwd")  # bench/families/ring_step.py (GPU): the Triton step kernel
STEP_TILES_BENCH = "ring-step-tiles"  # bench/families/ring_step.py (GPU): candidate tiles vs the shipped ones
PROBE_BENCH = "ring-probe"  # bench/families/ring_probe.py (GPU): the single-GPU overlap probe
RING_ALL = RING_BENCHES + STEP_BENCHES + (STEP_TILES_BENCH, PROBE_BENCH)
USP_BENCHES = ("usp", "usp-train")  # bench/families/usp.py: usp_attention on every grid U x R of the ranks
LOSS_BENCH = "loss"  # bench/families/loss.py: the fused LM loss against materialised logits, one rank's tokens
# bench/families/transformers.py: a transformers model's training step, one process against each mode
TRANSFORMERS_BENCH = "transformers"
# bench/families/video.py: a diffusers video transformer's call under each mode of the diffusers integration
VIDEO_BENCH = "video"
# bench/families/memory.py: peak memory per rank of a training step at growing lengths, one rank
# against P ranks, tiled MLPs and activation offload; "<configuration> fit" rows hold a
# configuration's bytes per token
MEMORY_BENCH = "memory"
# bench/families/hybrid.py: hybrid models' mixers on P ranks, their state passed across ranks,
# against the same function on the whole sequence in one process
HYBRID_BENCH = "hybrid"
# Indexer-sparse attention: fetching the chosen K/V rows against all-gathering them.
SPARSE_BENCH = "sparse"
# bench/families/inference.py: a KV cache sharded across ranks against one process holding it whole:
# the ops (a first prompt's attention, a decode step's, a next turn's) and generate's
# first token and decode step
INFERENCE_PREFILL_BENCH = "inference-prefill"
INFERENCE_DECODE_BENCH = "inference-decode"
INFERENCE_TURN_BENCH = "inference-turn"
GENERATE_TTFT_BENCH = "generate-ttft"
GENERATE_DECODE_BENCH = "generate-decode"
INFERENCE_BENCHES = (INFERENCE_PREFILL_BENCH, INFERENCE_DECODE_BENCH, INFERENCE_TURN_BENCH, GENERATE_TTFT_BENCH,
                     GENERATE_DECODE_BENCH)  # fmt: skip
# The check column of a case that raised instead of finishing (bench/runner/cases.py: failed_row);
# the error is in the detail column.
FAILED = "FAILED"
# The timing candidate name for ours called without sizes (see Row.ours_default_call_s).
OURS_DEFAULT_CALL = "ours default call"


@dataclass
class Row:
    """One case: ours and the baseline measured side by side. CSV columns in this order."""

    bench: str  # reshard | ulysses | ulysses-exchange | pack | unpack | ring | ring-train | usp | ...
    case: str  # short label, e.g. "S->T bf16"
    shape: str  # the case's shapes
    dtype: str
    world_size: int
    backend: str
    device: str
    ours_s: float
    baseline_s: float
    speedup: float  # baseline_s / ours_s: above 1, ours is faster
    ours_faster_share: float  # fraction of rounds in which ours beat the baseline
    noise: float  # the larger interquartile range / median of the two timings
    reps: int  # timed rounds (one call of each candidate); the medians are over these
    check: str  # do ours and the baseline agree: "identical", "max err 1e-3", "MISMATCH ..."
    # Ours as a user calls it by default, with the ranks' sizes exchanged inside the
    # call (one small extra collective); ours_s passes the sizes, as the baseline
    # implicitly does (it assumes even sizes). Empty where not measured.
    ours_default_call_s: float | None = None
    bytes_sent_ours: int | None = None  # comm_stats().bytes_sent on rank 0
    bytes_sent_theory: int | None = None  # the formula's value on rank 0
    volume_at_theory: bool | None = None  # measured == theory on every rank
    bytes_sent_baseline: int | None = None  # counted around the baseline's collectives
    gbps_basis: str = ""  # which bytes the GB/s columns divide by the time
    ours_gbps: float | None = None
    baseline_gbps: float | None = None
    peak_gbps: float | None = None  # memory bandwidth reference (kernels rows)
    peak_source: str = ""  # "spec sheet" or "measured large copy"
    ours_fraction_of_peak: float | None = None
    # A plain device copy of as many bytes (read + written) as ours moves, timed side by
    # side with it (kernels rows): the practical ceiling of a data-movement kernel.
    copy_gbps: float | None = None
    # Ring attention (bench/families/ring.py, bench/families/ring_step.py, bench/families/ring_probe.py); empty
    # elsewhere. In ring / ring-train rows ours is the ring on P ranks and the baseline
    # single-device SDPA of the whole sequence.
    layout: str = ""  # contiguous | zigzag
    ideal_s: float | None = None  # baseline_s / P: a perfectly parallel ring
    time_ratio: float | None = None  # ours_s / ideal_s: 1.0 is ideal
    compute_only_s: float | None = None  # the ring with its exchange removed
    exchange_only_s: float | None = None  # the ring's exchanges alone (probe: the copies)
    overlap_efficiency: float | None = None  # compute_only_s / ours_s
    # No overlap: compute_only_s + exchange_only_s, each timed on its own (so without the
    # ring's step-by-step coupling of the ranks); probe: measured (copy on the compute stream).
    serial_s: float | None = None
    compute_per_step_s: float | None = None  # compute_only_s / steps
    transfer_per_step_s: float | None = None  # exchange_only_s / exchanges
    ours_tflops: float | None = None  # ring-step rows: matmul FLOPs / time
    baseline_tflops: float | None = None  # SDPA's best backend
    peak_tflops: float | None = None  # spec-sheet dense bf16
    peak_tflops_source: str = ""
    ours_fraction_of_peak_tflops: float | None = None
    # Largest error / plain torch's error in the same dtype, against an exact result
    # (the flash-attention rule: at most targets.FLASH_RULE_FACTOR).
    error_vs_plain: float | None = None
    # USP (bench/families/usp.py): the row's grid, U Ulysses ranks per ring slot x R ring slots,
    # and the bytes rank 0 sent in each group (their sum is bytes_sent_ours); empty elsewhere.
    ulysses_degree: int | None = None
    ring_degree: int | None = None
    bytes_sent_ulysses_group: int | None = None
    bytes_sent_ring_group: int | None = None
    # The LM loss (bench/families/loss.py): the most bytes the CPU allocator held during one forward
    # + backward of ours and of the baseline (empty where it was not run), and ours' bound.
    # A transformers row (bench/families/transformers.py): the largest over the ranks of a mode's
    # step, and the single process's; no bound. A memory row (bench/families/memory.py): the
    # configuration's largest over the ranks, and one rank's.
    ours_peak_bytes: int | None = None
    baseline_peak_bytes: int | None = None
    peak_bound_bytes: int | None = None
    # A hybrid row (bench/families/hybrid.py): what rank 0 would send per layer (forward + backward)
    # if the mixer gathered its inputs, or ran under Ulysses' all-to-alls (the formulas);
    # bytes_sent_ours is the state passing's. Empty elsewhere.
    bytes_if_gathered: int | None = None
    bytes_if_ulysses: int | None = None
    # An inference row (bench/families/inference.py): the keys and values the largest rank holds
    # (its cache shard; generate: its ShardedCache) and one process's whole cache.
    kv_bytes_per_rank: int | None = None
    kv_bytes_whole: int | None = None
    detail: str = ""  # per-case notes: errors against the exact result, backends ...


CSV_COLUMNS = [field.name for field in dataclasses.fields(Row)]


def is_failed(row: Row) -> bool:
    return row.check.startswith(FAILED)


def short_dtype(dtype) -> str:
    """torch.bfloat16 -> "bf16", as the case labels spell dtypes."""
    names = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
    name = str(dtype).removeprefix("torch.")
    return names.get(name, name)


def usp_grid_label(ulysses_degree: int, ring_degree: int) -> str:
    """How a USP row's case label ends: "U2xR2" (the plot groups a case's grids by the rest)."""
    return f"U{ulysses_degree}xR{ring_degree}"


def gbps(num_bytes: int, seconds: float) -> float | None:
    """num_bytes / seconds in GB/s; None when nothing moved (world size 1 sends nothing)."""
    return num_bytes / seconds / 1e9 if num_bytes and seconds > 0 else None
