"""The microbenchmark suite runs end to end (tiny shapes) and writes its CSV, JSON and
plot, with every case computing what its baseline or reference computes and volumes at
theory; a case that fails, or a run killed partway, loses none of the other rows."""

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from test_bench_budget import assert_figures_readable

from bench.families.inference import generate_unavailable
from bench.runner import hardware
from bench.runner.budget import MIN_SCALE, REFERENCE, Budget
from bench.runner.cases import failed_row
from bench.runner.family import runs
from bench.runner.plan import DEFAULT_BUDGET_S, REFERENCE_CORES, SIZE_NAMES, RunPlan
from bench.runner.results import progress_line, summary_table
from bench.runner.rows import INFERENCE_BENCHES, Row, is_failed
from bench.runner.targets import target_checks

ROOT = Path(__file__).resolve().parent.parent
# Lines that read as a failure: kineto's ERROR / USDT lines, tracebacks and their
# "SomeError: ..." lines, FAILED rows.
ALARMING = re.compile(r"^(ERROR|USDT|WARNING|Traceback)|FAILED|gpuGetDeviceCount|\w+Error:")


def test_bench_quick_runs_and_writes_results(tmp_path):
    # A subprocess: the suite forks its ranks, which is unsafe from a process that has
    # already used OpenMP threads (as pytest's has).
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    csv_files = list(tmp_path.glob("*.csv"))
    assert len(csv_files) == 1 and list(tmp_path.glob("*.png")) and list(tmp_path.glob("*.json"))
    # Nothing reads as a failure where nothing failed: the memory measurements (loss,
    # transformers) run torch's profiler, whose routine lines are dropped.
    alarming = [line for line in (result.stdout + result.stderr).splitlines() if ALARMING.search(line)]
    assert not alarming, alarming
    # The plan first, then a line per family with the time left; the JSON keeps each
    # family's estimate and time.
    assert result.stdout.count("plan: quick sizes, about ") == 1, result.stdout[:3000]
    document = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert document["size"] == "quick" and list(document["plan"]) == list(runs()), document["plan"]
    assert all(family["elapsed_s"] is not None for family in document["plan"].values()), document["plan"]
    rows = list(csv.DictReader(csv_files[0].open()))
    assert {row["bench"] for row in rows} >= {"reshard", "ulysses"}
    # Data movement must be identical to the baseline's; attention must match the
    # reference within the 2x rule ("matches"). (The memory family's "fit" rows compare
    # nothing: a configuration's bytes per token.)
    assert all(row["check"] in ("identical", "matches") for row in rows if row["check"] != "fit"), rows
    assert {row["bench"] for row in rows} >= {"ring", "ring-train"}
    assert all(row["volume_at_theory"] == "True" for row in rows if row["volume_at_theory"]), rows
    # USP: every grid of the 4 ranks (pure ring 1x4, hybrid 2x2, pure Ulysses 4x1), forward
    # and forward + backward, each matching the exact reference (so they agree with each
    # other), its bytes split between the two groups (none in a group of one rank).
    usp = [row for row in rows if row["bench"] in ("usp", "usp-train")]
    grids = {(row["bench"], int(row["ulysses_degree"]), int(row["ring_degree"])) for row in usp}
    assert grids == {(bench, u, 4 // u) for bench in ("usp", "usp-train") for u in (1, 2, 4)}, usp
    assert all(row["check"] == "matches" for row in usp), usp
    for row in usp:
        ulysses, ring = int(row["bytes_sent_ulysses_group"]), int(row["bytes_sent_ring_group"])
        assert ulysses + ring == int(row["bytes_sent_ours"]) > 0, row
        assert (ulysses == 0) == (row["ulysses_degree"] == "1") and (ring == 0) == (row["ring_degree"] == "1"), row
    # The LM loss on rank 0: the fused loss within its memory bound, far below materialised
    # logits (which fit at these sizes), both gradients compared.
    loss = [row for row in rows if row["bench"] == "loss"]
    assert [row["case"].split()[0] for row in loss] == ["T=256", "T=1024"], loss
    for row in loss:
        ours_peak, bound, baseline_peak = (int(row[key]) for key in ("ours_peak_bytes", "peak_bound_bytes",
                                                                      "baseline_peak_bytes"))  # fmt: skip
        assert 0 < ours_peak <= bound < baseline_peak, row
        assert "weight grad vs materialised" in row["detail"], row
    # A transformers training step (a tiny Llama, 64 packed tokens): every mode on its grid,
    # its loss and gradients equal to the single process's, both peaks measured. Without
    # transformers the family is skipped, with the reason (see the test below).
    hf = [row for row in rows if row["bench"] == "transformers"]
    if importlib.util.find_spec("transformers") is None:
        assert not hf and "transformers: skipped" in result.stdout, hf
    else:
        modes = [(row["case"].split()[0], row["ulysses_degree"], row["ring_degree"], row["layout"]) for row in hf]
        assert modes == [("ulysses", "4", "1", "contiguous"), ("ring", "1", "4", "balanced"),
                         ("usp", "2", "2", "balanced")], hf  # fmt: skip
        for row in hf:
            assert row["check"] == "matches" and "relative error" in row["detail"], row
            assert int(row["ours_peak_bytes"]) > 0 and int(row["baseline_peak_bytes"]) > 0, row
            assert float(row["ours_s"]) > 0 and float(row["baseline_s"]) > 0, row
    # diffusers video transformers: Latte under DSP, Ulysses, ring and USP, Wan under the
    # last three, each output equal to the single process's, its bytes at the formulas;
    # diffusers' own context parallelism covers no Latte and needs an accelerator, so on
    # CPU the baseline is the single process, the reason in the detail. Skipped, with the
    # reason, without diffusers.
    video = [row for row in rows if row["bench"] == "video"]
    if importlib.util.find_spec("diffusers") is None:
        assert not video and "video: skipped" in result.stdout, video
    else:
        cases = [row["case"] for row in video]
        assert cases == [f"{model} {mode} vs single process" for model, modes in
                         (("Latte", ("dsp", "ulysses", "ring", "usp")), ("Wan", ("ulysses", "ring", "usp")))
                         for mode in modes], cases  # fmt: skip
        for row in video:
            assert row["check"] == "matches" and row["volume_at_theory"] == "True", row
            reason = "has no _cp_plan" if row["case"].startswith("Latte") else "enable_parallelism needs an accelerator"
            assert "diffusers' context parallelism not run: " in row["detail"] and reason in row["detail"], row
    # Hybrid mixers: every mixer in both layouts against one process (its output and
    # gradients), the state passing's bytes at the formula, beside what gathering the
    # inputs and Ulysses would send.
    hybrid = [row for row in rows if row["bench"] == "hybrid"]
    cases = [(row["case"].split()[0], row["layout"]) for row in hybrid]
    mixers = ("causal_conv1d", "ssd_scan", "selective_scan", "gated_delta_rule")
    assert cases == [(mixer, layout) for mixer in mixers for layout in ("contiguous", "zigzag")], cases
    for row in hybrid:
        assert row["check"] == "matches" and row["volume_at_theory"] == "True", row
        assert int(row["bytes_if_gathered"]) > 0 and int(row["bytes_if_ulysses"]) > 0, row
    # Inference over a KV cache sharded across the ranks: a prompt's two ways, a decode
    # step, a turn each way (the short follow-up over the long cache pass-Q's by auto, the
    # long chunk pass-KV's), generate's first token and step (transformers 5), each against
    # the exact result or one process's tokens, its bytes at the formula, the fullest rank
    # holding a quarter of the whole cache (generate's: its rows and their spare capacity).
    inference = [row for row in rows if row["bench"] in INFERENCE_BENCHES]
    expected = ["inference-prefill"] * 2 + ["inference-decode"] + ["inference-turn"] * 4
    expected += [] if generate_unavailable() else ["generate-ttft", "generate-decode"]
    assert [row["bench"] for row in inference] == expected, inference
    for row in inference:
        assert row["check"] == "matches" and row["volume_at_theory"] == "True", row
        per_rank, whole = int(row["kv_bytes_per_rank"]), int(row["kv_bytes_whole"])
        assert 4 * per_rank == whole if row["bench"].startswith("inference") else 0 < per_rank < whole / 2, row
    turns = [row["detail"] for row in inference if row["bench"] == "inference-turn"]
    assert all("auto chose pass-q" in detail for detail in turns[:2]), turns
    assert all("auto chose pass-kv" in detail for detail in turns[2:]), turns
    # Memory: every configuration at both lengths (its loss one rank's), then its fitted line;
    # the log-prob path at both lengths, below the materialised logits.
    memory = [row for row in rows if row["bench"] == "memory" and not row["case"].startswith("fsdp: ")]
    if importlib.util.find_spec("transformers") is not None:
        # FSDP2 over dp x cp and over dp beside SP alone: each rank's state bytes at the formula (check above).
        fsdp = [row["case"] for row in rows if row["case"].startswith("fsdp: ")]
        assert fsdp == ["fsdp: SP alone", "fsdp: FSDP2 dp x cp", "fsdp: FSDP2 dp"], fsdp
        measured = [row for row in memory if row["check"] != "fit"]
        assert len(measured) == 12 and all(row["check"] == "matches" for row in measured), memory
        logprobs = [row for row in measured if row["case"].startswith("logprobs ")]
        assert len(logprobs) == 2, memory
        assert all(int(row["ours_peak_bytes"]) < int(row["baseline_peak_bytes"]) for row in logprobs), logprobs
        assert all(int(row["ours_peak_bytes"]) > 0 for row in measured), memory
        fits = [row for row in memory if row["check"] == "fit"]
        assert len(fits) == 5 and all("bytes per token" in row["detail"] for row in fits), fits
    # The figures (the headline and each family's) and the report, named on the last line.
    assert_figures_readable(tmp_path)
    assert result.stdout.splitlines()[-1] == f"report: {next(tmp_path.glob('*.md'))}", result.stdout[-500:]


def test_the_default_fits_the_budget():
    # The estimates each family declares (its FAMILY's sizes) were measured on the
    # reference machine; on it the default run fits the default budget with more than the
    # fewest timed rounds, so that a machine somewhat slower still fits (a slower machine
    # keeps fewer: test_bench_budget).
    quick, default, full = (RunPlan(runs(), size, on_gpu=False).total_estimate for size in SIZE_NAMES)
    budget = Budget(RunPlan(runs(), "default", on_gpu=False), REFERENCE, DEFAULT_BUDGET_S)
    assert budget.fits and budget.scale >= 1.25 * MIN_SCALE and REFERENCE_CORES == 2, (default, budget.scale)
    assert budget.planned_total() <= DEFAULT_BUDGET_S * 1.001, budget.planned_total()
    assert quick < default < full, (quick, default, full)


def test_hybrid_ulysses_bytes_are_the_attention_formula_for_attention():
    # The hybrid bench's Ulysses formula for any mixer's inputs: for attention's q (H
    # groups), k and v (H_kv groups) and out it is traffic.ulysses_bytes.
    from bench.families.hybrid import ulysses_mixer_bytes
    from seqpar_kernels.traffic import ulysses_bytes

    head_dim, element_size = 16, 2
    row = head_dim * element_size
    for seq_lens, heads, kv_heads in [([8, 8, 8, 8], 8, 2), ([5, 3, 4], 6, 6), ([4, 4, 4, 4], 4, 1), ([7, 9], 3, 1)]:
        for rank in range(len(seq_lens)):
            mixer = ulysses_mixer_bytes(seq_lens, rank, heads=heads, inputs=[(heads, row), (kv_heads, row),
                                        (kv_heads, row)], output_bytes_per_head=row)  # fmt: skip
            attention = ulysses_bytes(seq_lens, rank, batch=1, num_heads=heads, num_kv_heads=kv_heads,
                                      head_dim=head_dim, element_size=element_size)  # fmt: skip
            assert mixer == attention, (seq_lens, heads, kv_heads, rank)


def test_bench_varlen_quick_runs_every_function_and_layout(tmp_path):
    # Packed documents on 4 ranks: the ring, Ulysses and the 2x2 hybrid with the balanced
    # plan against one dense sequence, and the balanced plan against the contiguous one,
    # forward and forward + backward; each varlen result matches attention within each
    # document, its bytes at the formulas; the layout table printed and in the JSON.
    from bench.runner.targets import VARLEN_BENCHES

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--only", "varlen", "--world-size", "4",
         "--backend", "gloo", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "per-document zigzag (padded to 16)" in result.stdout  # the layout table, P = 8
    rows = read_rows(tmp_path)
    grids = [(row["bench"], row["ulysses_degree"], row["ring_degree"]) for row in rows]
    assert grids == [
        (f"varlen-{kind}{suffix}", u, r)
        for suffix in ("", "-train")
        for kind, u, r in (("ring", "1", "4"), ("layout", "1", "4"), ("ulysses", "4", "1"), ("usp", "2", "2"))
    ], grids
    assert all(row["bench"] in VARLEN_BENCHES for row in rows)
    assert all(row["check"] == "matches" and row["volume_at_theory"] == "True" for row in rows), rows
    assert all(float(row["error_vs_plain"]) <= 2 and "work imbalance" in row["detail"] for row in rows), rows
    document = json.loads(next(tmp_path.glob("*.json")).read_text())
    (cpu_speed,) = [check for check in document["targets"] if check["target"].startswith("CPU: fused")]
    assert cpu_speed["status"] == "n/a (not run)"  # no unfused baseline in the varlen rows
    table = document["varlen_layouts"]
    mixes = {(line["mix"], line["P"]) for line in table}
    assert mixes == {(mix, p) for mix in ("long-tailed", "short") for p in (2, 4, 8)}
    for mix, p in mixes:
        contiguous, balanced, padded = [line for line in table if (line["mix"], line["P"]) == (mix, p)]
        assert balanced["work_imbalance"] <= contiguous["work_imbalance"] and balanced["padding_tokens"] == 0
        assert padded["padding_tokens"] > 0 and padded["token_imbalance"] > 1.0


# A run with failures injected (python -c, patches made before the ranks fork): the
# ulysses bench raises before its first case, one reshard case raises on every rank,
# and one unpack case raises on rank 0 (kernels run there alone).
INJECTED_FAILURES = """
import sys
from bench.families import kernels as bench_kernels, reshard as bench_reshard, ulysses as bench_ulysses
from bench.__main__ import parse_options
from bench.runner.launch import launch

def no_cases(ctx):
    raise ValueError("injected: ulysses cases")

def reshard(case, ctx, original=bench_reshard.measure):
    if case.direction == "S->T":
        raise RuntimeError("injected: reshard S->T")
    return original(case, ctx)

def unpack(case, ctx, destinations, original=bench_kernels.measure_unpack):
    if case.kv_heads != case.heads:
        raise RuntimeError("injected: unpack GQA")
    return original(case, ctx, destinations)

bench_ulysses.attention_cases = no_cases
bench_reshard.measure = reshard
bench_kernels.measure_unpack = unpack
launch(parse_options(sys.argv[1:]))
"""

# A run killed partway: the process ends (as at a time limit) in the first unpack case.
KILLED_PARTWAY = """
import os, sys
from bench.families import kernels as bench_kernels
from bench.__main__ import parse_options
from bench.runner.launch import launch

def unpack(case, ctx, destinations):
    os._exit(7)

bench_kernels.measure_unpack = unpack
launch(parse_options(sys.argv[1:]))
"""


def run_bench_script(script: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-c", script, "--quick", "--out", str(out), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT, check=False)


def read_rows(out: Path) -> list[dict]:
    csv_files = list(out.glob("*.csv"))
    assert len(csv_files) == 1, list(out.iterdir())
    return list(csv.DictReader(csv_files[0].open()))


# The transformers family where transformers cannot be imported (None in sys.modules
# before the ranks fork): skipped with the reason, no row, the run still exits 0.
WITHOUT_TRANSFORMERS = """
import sys
sys.modules["transformers"] = None
from bench.__main__ import parse_options
from bench.runner.launch import launch
launch(parse_options(sys.argv[1:]))
"""


def test_bench_transformers_without_transformers_is_skipped(tmp_path):
    result = run_bench_script(WITHOUT_TRANSFORMERS, tmp_path, "--world-size", "2", "--only", "transformers")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "transformers: skipped (ImportError: " in result.stdout, result.stdout[-3000:]
    assert read_rows(tmp_path) == []
    document = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert document["transformers_skipped"].startswith("ImportError: ")


def test_bench_failed_cases_keep_the_other_rows_and_exit_nonzero(tmp_path):
    result = run_bench_script(
        INJECTED_FAILURES, tmp_path, "--world-size", "2",
        "--only", "ulysses", "--only", "reshard", "--only", "kernels",
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    rows = read_rows(tmp_path)
    verdicts = [(row["bench"], row["case"].split()[0], row["check"]) for row in rows]
    assert verdicts == [
        ("ulysses", "(bench", "FAILED ValueError"),
        ("reshard", "S->T", "FAILED RuntimeError"),
        ("reshard", "T->S", "identical"),
        ("pack", "MHA", "identical"),
        ("unpack", "MHA", "identical"),
        ("pack", "GQA", "identical"),
        ("unpack", "GQA", "FAILED RuntimeError"),
        ("merge", "H=8", "matches"),
    ], output[-3000:]
    assert "injected: reshard S->T" in rows[1]["detail"]
    assert "FAILED: RuntimeError: injected: unpack GQA" in result.stdout  # the progress line
    document = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert document["complete"] is True and document["failed_cases"] == 3
    assert document["targets"][0]["status"] == "NOT MET"
    assert list(tmp_path.glob("*.png"))  # plotted from the cases that ran


def test_bench_killed_partway_leaves_the_rows_so_far(tmp_path):
    result = run_bench_script(KILLED_PARTWAY, tmp_path, "--world-size", "1",
                              "--only", "reshard", "--only", "kernels")  # fmt: skip
    assert result.returncode == 7, (result.stdout + result.stderr)[-3000:]
    rows = read_rows(tmp_path)
    assert [row["bench"] for row in rows] == ["reshard", "reshard", "pack"]
    assert all(row["check"] == "identical" for row in rows), rows
    document = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert document["complete"] is False and len(document["targets"]) > 1
    assert sorted(path.suffix for path in tmp_path.iterdir()) == [".csv", ".json"]  # no .tmp, no .png


def zigzag_row(world_size: int, time_ratio: float) -> Row:
    return Row(
        bench="ring", case=f"zigzag causal P={world_size}", shape="", dtype="bf16",
        world_size=world_size, backend="nccl", device="GPU", ours_s=1.0, baseline_s=1.0,
        speedup=1.0, ours_faster_share=0.5, noise=0.0, reps=3, check="matches",
        layout="zigzag", time_ratio=time_ratio, overlap_efficiency=0.95,
    )  # fmt: skip


def zigzag_status(rows: list[Row]) -> str:
    (check,) = [check for check in target_checks(rows, on_gpu=True) if "zigzag" in check.target]
    return check.status


def test_zigzag_target_not_judged_at_world_size_1():
    assert zigzag_status([zigzag_row(1, 3.0)]) == "n/a (world size 1)"
    assert zigzag_status([zigzag_row(8, 1.25)]) == "NOT MET"  # 80% of ideal
    assert zigzag_status([zigzag_row(8, 1.05)]) == "met"


def cpu_speed_status(cases: list[tuple[float, float]]) -> str:
    """The CPU target's status for pack rows of these (speedup, ours_faster_share)."""
    rows = [
        Row(bench="pack", case=f"case {index}", shape="", dtype="bf16", world_size=4, backend="gloo",
            device="CPU", ours_s=1.0, baseline_s=speedup, speedup=speedup, ours_faster_share=share,
            noise=0.1, reps=20, check="identical")
        for index, (speedup, share) in enumerate(cases)
    ]  # fmt: skip
    (check,) = [check for check in target_checks(rows, on_gpu=False) if check.target.startswith("CPU: fused")]
    return check.status


def test_cpu_target_allows_a_slower_median_only_within_the_noise():
    assert cpu_speed_status([(1.3, 0.9), (1.0, 0.5)]) == "met"
    assert cpu_speed_status([(1.3, 0.9), (0.97, 0.4)]) == "met"  # the rounds cannot tell them apart
    assert cpu_speed_status([(1.3, 0.9), (0.97, 0.1)]) == "NOT MET"  # slower in 90% of the rounds


def test_failed_rows_are_left_out_of_the_targets_and_listed():
    class Ctx:
        world_size, backend, device_name = 8, "nccl", "GPU"

    failed = failed_row(Ctx(), "ring", "zigzag causal P=8", RuntimeError("out of\nmemory"))
    rows = [zigzag_row(8, 1.05), failed]
    assert is_failed(failed) and failed.detail == "RuntimeError: out of memory"
    assert zigzag_status(rows) == "met"
    assert "FAILED (1 cases raised" in summary_table(rows, target_checks(rows, on_gpu=True))
    assert "FAILED: RuntimeError: out of memory" in progress_line(failed)


def test_spec_sheet_lookup_matches_whole_names():
    assert hardware.spec_memory_bandwidth_gbps("NVIDIA H200") == 4800.0
    assert hardware.spec_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert hardware.spec_memory_bandwidth_gbps("NVIDIA H100 PCIe") == 2000.0
    assert hardware.spec_memory_bandwidth_gbps("NVIDIA A100-SXM4-80GB") == 2039.0
    # GH200 (Grace Hopper) has other peaks: unknown, not taken for an H200.
    assert hardware.spec_memory_bandwidth_gbps("NVIDIA GH200 480GB") is None
    assert hardware.spec_bf16_tflops("NVIDIA GH200 480GB") is None


def test_step_bench_drops_a_baseline_that_computes_wrong():
    # The GPU step bench times ours against SDPA backends; one whose result breaks the
    # error rule must not become the baseline (its speed would mean nothing).
    import torch

    from bench.families.ring_step import StepCase, check_step
    from bench.families.shared.baselines import sdpa

    case = StepCase(1, 64, 2, 64, torch.bfloat16, causal=True, backward=False)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=generator).bfloat16() for _ in range(3))

    def right():
        return [sdpa(q, k, v, True)]

    def wrong():
        return [sdpa(q, k, v, False)]  # the causal mask forgotten

    accuracy, trusted, untrusted = check_step(
        case, {"ours": right, "aten": wrong, "flash": right, "cudnn": wrong}, q, k, v, None
    )
    assert accuracy["ours"].check == "matches" and accuracy["aten"].check.startswith("MISMATCH")
    assert trusted == ["flash"]  # the aten step backend is a candidate, never a baseline
    assert len(untrusted) == 1 and untrusted[0].startswith("cudnn not used as a baseline")


def test_nccl_rank_without_a_gpu_is_told_why(monkeypatch, tmp_path):
    # torchrun with more ranks per node than GPUs: a clear exit, not "invalid device ordinal".
    import pytest
    import torch

    from bench.runner.launch import Options, run_rank

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    options = Options(backend="nccl", world_size=None, quick=True, only=("reshard",), out=tmp_path)
    with pytest.raises(SystemExit, match="LOCAL_RANK 1 has no GPU; this node has 1"):
        run_rank(1, 2, 1, 2, "env://", options)


def test_step_bench_records_the_faster_backend_only_when_both_are_right():
    import torch

    from bench.families.ring_step import StepCase, choose_step_backend

    forward = StepCase(1, 64, 2, 64, torch.bfloat16, causal=True, backward=False)
    backward = StepCase(1, 64, 2, 64, torch.bfloat16, causal=True, backward=True)
    assert choose_step_backend([])[0] is None
    # triton faster forward, aten much faster backward: aten by total time.
    times = [(forward, 1.0, 1.5, "matches", "matches"), (backward, 4.0, 2.0, "matches", "matches")]
    assert choose_step_backend(times)[0] == "aten"
    assert choose_step_backend(times[:1])[0] == "triton"
    backend, summary = choose_step_backend([times[0], (backward, 4.0, 2.0, "matches", "MISMATCH dq")])
    assert backend is None and "aten ring-step-bwd" in summary


def test_step_bench_writes_the_table_of_the_source_tree():
    # Never an installed package's copy: the measured entry is to be committed.
    import os

    from bench.runner.step_table import SOURCE_TABLE

    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert str(SOURCE_TABLE) == os.path.join(repository, "seqpar_kernels", "engine", "step_backends.json")
    assert SOURCE_TABLE.exists()


def test_plot_draws_the_gpu_step_rows_and_the_tile_sweep(tmp_path):
    # GPU rows cannot be measured here; the plot of a GPU run is drawn from made-up ones.
    from bench.runner.plot import family_figure
    from bench.runner.rows import Row

    def row(bench, case, ours, baseline):
        return Row(bench=bench, case=case, shape="B=1 S_q=S_k=4096 H=32 D=128", dtype="bf16", world_size=1,
                   backend="nccl", device="NVIDIA H100 80GB HBM3", ours_s=1.0, baseline_s=1.0, speedup=1.0,
                   ours_faster_share=0.5, noise=0.01, reps=10, check="matches", ours_tflops=ours,
                   baseline_tflops=baseline, peak_tflops=989.0, peak_tflops_source="spec sheet")  # fmt: skip

    rows = [row("ring-step-fwd", "causal S=4096 D=128 bf16", 420.0, 600.0),
            row("ring-step-tiles", "forward (128, 128, 8, 3) causal S=4096 D=128 bf16", 450.0, 420.0)]  # fmt: skip
    metadata = dict(device_type="cuda", backend="nccl", world_size=1, device="NVIDIA H100 80GB HBM3",
                    torch="2.14.1", git_commit="abc", date="2026-11-23")  # fmt: skip
    figure = family_figure("ring-step", rows, metadata, tmp_path / "plot.png")
    assert figure.path.exists() and all(count > 0 for count in figure.panels.values()), figure.panels


def test_tile_override_replaces_one_kernels_gpu_tiles_for_the_block():
    import torch

    from bench.families.ring_step import SWEEP_TILES
    from seqpar_kernels.kernels import attention_step_tiles as tiles

    hopper = tiles.GpuTarget.of_capability(90)
    shipped = {kernel: tiles._tiles(kernel, torch.bfloat16, 128, hopper) for kernel in SWEEP_TILES}
    with tiles.tile_override("dkdv", (64, 64, 4, 3)):
        assert tiles._tiles("dkdv", torch.bfloat16, 128, hopper) == (64, 64, 4, 3)
        assert tiles._tiles("dq", torch.bfloat16, 128, hopper) == shipped["dq"]
        assert tiles._tiles("dkdv", torch.bfloat16, 128, None) == tiles._INTERPRETER_TILES  # CPU tensors
    assert {kernel: tiles._tiles(kernel, torch.bfloat16, 128, hopper) for kernel in SWEEP_TILES} == shipped


def test_short_bench_times_the_four_dkdv_tiles_on_the_full_backward_step():
    # The short GPU check's tile comparison: dk/dv only, bf16 d128, the full (not causal)
    # backward step; the default run sweeps every kernel, --quick none.
    import types

    from bench.families.ring_step import SHORT_SWEEP_TILES, SWEEP_TILES, tile_cases

    def context(**sizes):
        return types.SimpleNamespace(**{"quick": False, "short": False, "full": False, **sizes})

    short = tile_cases(context(short=True))
    assert [case.tiles for case in short] == [(16, 128, 8, 2), (32, 32, 4, 2), (32, 64, 8, 2), (64, 64, 4, 2)]
    assert list(SHORT_SWEEP_TILES) == ["dkdv"] and {case.kernel for case in short} == {"dkdv"}
    assert all(case.step.backward and not case.step.causal and case.step.head_dim == 128 for case in short)
    assert len(tile_cases(context())) == sum(map(len, SWEEP_TILES.values()))
    assert tile_cases(context(quick=True)) == []
