"""What machine the benchmark ran on: device names, peak memory bandwidth and bf16
TFLOP/s, the Triton release, git commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import time
from pathlib import Path

import torch

# Spec-sheet HBM bandwidth in GB/s, matched against torch.cuda.get_device_name as whole
# words (spec_lookup: "H200" is not found in "NVIDIA GH200 480GB", a different product
# with other peaks, which stays unknown), most specific first ("H100 PCIe" before "H100").
SPEC_MEMORY_BANDWIDTH_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 (get_device_name: "NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
)

# Spec-sheet dense (no sparsity) bf16 tensor-core TFLOP/s, looked up the same way.
SPEC_BF16_DENSE_TFLOPS = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # SXM
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM5
    ("A100", 312.0),
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else whatever platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_name()}"


def device_slug(name: str) -> str:
    """A file-name-safe short form: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    slug = re.sub(r"\(r\)|\(tm\)|processor", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "device"


def spec_lookup(table: tuple[tuple[str, float], ...], name: str) -> float | None:
    """The value of the first key found in the device name as whole words (case
    insensitive; no letter or digit just before or after it), else None (unknown)."""
    for key, value in table:
        if re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![a-z0-9])", name.lower()):
            return value
    return None


def spec_memory_bandwidth_gbps(name: str) -> float | None:
    return spec_lookup(SPEC_MEMORY_BANDWIDTH_GBPS, name)


def spec_bf16_tflops(name: str) -> float | None:
    return spec_lookup(SPEC_BF16_DENSE_TFLOPS, name)


def peak_bf16_tflops(device: torch.device, name: str) -> tuple[float | None, str]:
    """(dense bf16 TFLOP/s, where it comes from): the spec sheet for known GPUs; None
    elsewhere (CPUs, unknown GPUs: no fraction of peak is claimed)."""
    spec = spec_bf16_tflops(name) if device.type == "cuda" else None
    return (spec, "spec sheet, dense bf16") if spec is not None else (None, "unknown")


def measured_copy_bandwidth_gbps(device: torch.device, num_bytes: int, reps: int = 5) -> float:
    """Best-of-`reps` bandwidth of one large tensor copy, counting bytes read plus written:
    the practical peak when the spec sheet is unknown (and the reference on CPUs)."""
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: page faults and allocator warm-up are not bandwidth
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - begin
        best = min(best, seconds)
    return 2 * num_bytes / best / 1e9


def measured_matmul_tflops(device: torch.device, size: int = 8192, reps: int = 5) -> float:
    """Best-of-`reps` TFLOP/s of one (size x size) @ (size x size) bf16 matmul (2 size^3
    FLOPs), CUDA events: what this GPU gives torch's own matmul, beside the spec sheet."""
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b  # warm-up: cuBLAS's handle and workspace
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * size**3 / best / 1e12


def calibration(device: torch.device, name: str) -> dict:
    """A GPU's yardsticks, each measured in the run that reports against them: the spec
    sheet's dense bf16 TFLOP/s and memory bandwidth (None: unknown), a bf16 matmul's
    TFLOP/s and a 1 GiB device copy's GB/s (read + written)."""
    return {
        "spec_bf16_tflops": spec_bf16_tflops(name),
        "spec_gbps": spec_memory_bandwidth_gbps(name),
        "matmul_bf16_tflops": measured_matmul_tflops(device),
        "copy_gbps": measured_copy_bandwidth_gbps(device, 1 << 30),
    }


def peak_memory_bandwidth(device: torch.device, name: str) -> tuple[float, str]:
    """(GB/s, where it comes from): the spec sheet for known GPUs, else a measured copy."""
    spec = spec_memory_bandwidth_gbps(name) if device.type == "cuda" else None
    if spec is not None:
        return spec, "spec sheet"
    num_bytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    return measured_copy_bandwidth_gbps(device, num_bytes), "measured large copy"


def triton_version() -> str:
    """The installed Triton's release, from its metadata (no import), or "not installed"."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str:
    """Short hash of HEAD (read only: `git rev-parse`), "+dirty" when the package, its C++
    or the bench have uncommitted changes (the results then do not describe HEAD exactly),
    or "unknown". SEQPAR_GIT_COMMIT overrides it, for copies of the tree made without
    .git (scripts/gpu_check.sh)."""
    if os.environ.get("SEQPAR_GIT_COMMIT"):
        return os.environ["SEQPAR_GIT_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        changed = git("status", "--porcelain", "--", "seqpar_kernels", "csrc", "bench", ":!bench/results")
        return f"{commit}+dirty" if changed else commit
    except (OSError, subprocess.SubprocessError):
        return "unknown"
