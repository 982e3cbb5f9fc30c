"""The short GPU check (scripts/gpu_check.sh --short) without a GPU: its plan (the dry
run: stages in order, time boxes within 540 s, at most 8 files, no package index asked),
its time boxes (a run with stand-ins for the build and the tests, a stage stopped at its
box, the real bench's short plan on CPU with tiny shapes), and what its folder gives
back: the headline numbers and the measured step backend written into a checkout's table.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.runner import headline, step_table
from bench.runner.rows import CSV_COLUMNS
from seqpar_kernels.engine import step_backends

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SHORT_LIMIT = 540  # seconds: one command on a GPU machine lent for about 15 minutes
SHORT_STAGES = ["prepare", "build", "info", "preflight", "test", "bench", "report"]

# The GPU a dry run or a stand-in run plans for (nvidia-smi's name, compute capability,
# driver), in place of nvidia-smi's answer.
STAND_IN_GPU = 'gpu_query() { echo "NVIDIA H100 80GB HBM3, 9.0, 580.159.04"; }\n'


def run_script(*args: str, overrides: str | None = None, tmp_path: Path, env: dict | None = None,
               timeout: int = 120) -> subprocess.CompletedProcess:  # fmt: skip
    environment = dict(os.environ, **(env or {}))
    environment.pop("SEQPAR_OFFLINE", None)
    environment.pop("SEQPAR_OFFLINE_REASON", None)
    if overrides is not None:
        path = tmp_path / "overrides.sh"
        path.write_text(overrides)
        environment["SEQPAR_GPU_CHECK_OVERRIDES"] = str(path)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env=environment, timeout=timeout, check=False)  # fmt: skip


def test_short_plan_fits_one_command_and_asks_no_package_index(tmp_path):
    result = run_script("--short", "--offline", "--dry-run", "--out", str(tmp_path), overrides=STAND_IN_GPU,
                        tmp_path=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    boxes = [(match[1], int(match[2])) for line in lines
             if (match := re.match(r"\[gpu-check\] box (\w+) (\d+) s", line))]  # fmt: skip
    assert [stage for stage, _ in boxes] == SHORT_STAGES
    total = sum(seconds for _, seconds in boxes)
    assert total <= SHORT_LIMIT and f"total {total} s of {SHORT_LIMIT}" in result.stdout
    (files,) = [line for line in lines if line.startswith("[gpu-check] files (")]
    assert int(re.search(r"files \((\d+)\)", files)[1]) == len(files.split(":", 1)[1].split()) <= 8
    commands = {stage: line for line in lines for stage in SHORT_STAGES
                if line.startswith(f"[gpu-check] box {stage} ")}  # fmt: skip
    # This GPU's architecture only, every core; the tests on the GPU with their junit file
    # in the run's folder; the bench's short plan on one GPU into that folder.
    assert "SEQPAR_CUDA_ARCHS=9.0a" in commands["build"] and "MAX_JOBS=" in commands["build"]
    run = re.search(r"the run's folder would be (\S+)", result.stdout)[1]
    assert Path(run).parent == tmp_path and run.endswith("-short") and "nvidia-h100-80gb-hbm3" in run
    assert f"--junitxml={run}/junit.xml" in commands["test"] and "not\\ gpu_long" in commands["test"]
    assert "tests/test_gpu_paths.py" in commands["test"] and "tests/test_attention_step_forward.py" in commands["test"]
    # Every test the GPU runs exists (a missing file stops pytest before the first test).
    selected = re.findall(r"(tests/test_\w+\.py)(?:::(\w+))?", commands["test"])
    for path, test in selected:
        assert (ROOT / path).exists(), path
        assert not test or f"def {test}(" in (ROOT / path).read_text(), (path, test)
    assert "-m bench --short --world-size 1" in commands["bench"] and f"--out {run}" in commands["bench"]
    # NCCL's pre-flight before the tests, a minute at most; two OpenMP threads for each of
    # the 16 test workers; the bench's dk/dv tile comparison and its yardsticks.
    assert "NCCL_PREFLIGHT_SECONDS=60" in commands["preflight"] and "timeout 60" in commands["preflight"]
    assert "OMP_NUM_THREADS=2" in commands["test"] and "OMP_NUM_THREADS=2 for each" in result.stdout
    assert "(16,128,8,2) (32,32,4,2) (32,64,8,2) (64,64,4,2)" in result.stdout and "matmul" in result.stdout
    # Offline: pip is told to use no index, scripts/setup.sh installs nothing, and the one
    # pip command left (the build) asks no index either.
    assert "PIP_NO_INDEX=1" in result.stdout and "SEQPAR_OFFLINE=1" in result.stdout
    assert "would install" not in result.stdout and "installing" not in result.stdout.replace("not installing", "")
    pip_commands = [line for line in lines if "pip install" in line]
    assert pip_commands and all("--no-index" in line for line in pip_commands), pip_commands
    assert not re.search(r"https?://|pip download|curl |wget ", result.stdout)
    assert [path.name for path in tmp_path.iterdir()] == ["overrides.sh"]  # a dry run writes nothing


def test_offline_is_detected_without_a_flag(tmp_path):
    # An index that cannot answer (a missing local folder here; a host that does not
    # answer within 2 s on a machine without network): offline, nothing installed.
    result = run_script("--short", "--dry-run", "--out", str(tmp_path), overrides=STAND_IN_GPU, tmp_path=tmp_path,
                        env={"PIP_INDEX_URL": f"file://{tmp_path}/no-index", "HTTPS_PROXY": "", "https_proxy": "",
                             "PIP_NO_INDEX": ""})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offline: 1 (no connection to the package index" in result.stdout
    assert "PIP_NO_INDEX=1" in result.stdout and "would install" not in result.stdout


# Stand-ins for a short run without a GPU: the build and info stages echo; the test stage
# is a stand-in for pytest that runs past its box and, stopped by SIGINT, writes its junit
# file as pytest does; the bench stage runs the real short plan on CPU with tiny shapes.
STAND_IN_PYTEST = """
import sys, time
print("tests/test_a.py::test_ok PASSED", flush=True)
print("FAILED tests/test_a.py::test_broken (call), reported at once:", flush=True)
try:
    time.sleep(600)
except KeyboardInterrupt:
    with open(sys.argv[1], "w") as junit:
        junit.write('<testsuites><testsuite name="stand-in" tests="2" failures="1" errors="0" skipped="0" '
                    'time="3"><testcase classname="tests.test_a" name="test_ok"/><testcase '
                    'classname="tests.test_a" name="test_broken"><failure message="assert 0"/></testcase>'
                    '</testsuite></testsuites>')
    sys.exit(2)
"""

STAND_IN_RUN = (
    STAND_IN_GPU
    + """
SHORT_BOXES=([prepare]=1 [build]=1 [info]=1 [preflight]=1 [test]=6 [bench]=240 [report]=60)
SHORT_GRACE=([build]=1 [info]=1 [preflight]=1 [test]=2 [bench]=5)
short_command() {
  case $1 in
    build) command=(echo built) ;;
    info) command=(echo info) ;;
    preflight) command=(echo "NCCL pre-flight: stand-in") ;;
    test) command=("$PYTHON" "$STAND_IN_PYTEST" "$RUN/junit.xml") ;;
    bench) command=(env PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES= "$PYTHON" -m bench "${SHORT_BENCH[@]}" --quick
                    --out "$RUN") ;;
  esac
}
"""
)


def test_short_run_stops_a_stage_at_its_box_and_goes_on(tmp_path):
    stand_in = tmp_path / "stand_in_pytest.py"
    stand_in.write_text(STAND_IN_PYTEST)
    out = tmp_path / "out"
    result = run_script(
        "--short",
        "--offline",
        "--out",
        str(out),
        overrides=STAND_IN_RUN,
        tmp_path=tmp_path,
        env={"STAND_IN_PYTEST": str(stand_in), "SEQPAR_GIT_COMMIT": "abc1234"},
        timeout=400,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 124, output[-3000:]  # the first failure: the test stage's box
    (run,) = out.iterdir()
    files = sorted(path.name for path in run.iterdir())
    (stem,) = [name.removesuffix(".csv") for name in files if name.endswith(".csv")]
    assert files == sorted(["summary.txt", "build.log", "test.log", "junit.xml", "bench.log",
                            f"{stem}.csv", f"{stem}.json", f"{stem}.png"]), files  # fmt: skip
    summary = (run / "summary.txt").read_text()
    first = summary.splitlines()[0]
    for part in ("device: NVIDIA H100 80GB HBM3", "driver: 580.159.04", "torch: ", "triton: ", "commit: abc1234"):
        assert part in first, first
    assert re.search(r"^test: STOPPED at its time box \(SIGINT; exit 124\)", summary, re.MULTILINE), summary
    stages = re.findall(r"^(\w+): (?:exit|STOPPED)", summary, re.MULTILINE)
    assert stages == ["build", "info", "preflight", "test", "bench"], summary
    assert "NCCL pre-flight: stand-in" in (run / "test.log").read_text()
    # The test stage's limit: the boxes so far less the time spent (at least its grace + 2
    # s); its output and the junit file it wrote when stopped are kept; the failure shows
    # on the console too.
    assert int(re.search(r"^test: .* limit (\d+) s", summary, re.MULTILINE)[1]) >= 4
    assert "FAILED tests/test_a.py::test_broken" in (run / "test.log").read_text()
    assert "FAILED tests/test_a.py::test_broken" in result.stdout
    # The bench ran its short plan after it: every row checked; the headline at the end
    # of the output and in the summary, with the tests' counts from junit.xml.
    assert re.search(r"^bench: exit 0 ", summary, re.MULTILINE), summary
    document = json.loads((run / f"{stem}.json").read_text())
    assert document["benches"] == ["ring-step", "kernels", "ring-probe"] and document["short"] is True
    assert document["git_commit"] == "abc1234" and document["triton"]
    rows = list(csv.DictReader((run / f"{stem}.csv").open()))
    assert {row["bench"] for row in rows} == {"pack", "unpack", "merge"}
    assert all(row["check"] in ("identical", "matches") and row["copy_gbps"] for row in rows), rows
    assert all(row["git_commit"] == "abc1234" and row["torch"] and row["triton"] for row in rows)
    tail = result.stdout[result.stdout.index("===== seqpar-kernels short GPU check") :]
    assert "tests: 1 passed, 1 failed" in tail and "data movement" in tail and "merge" in tail
    assert "===== headline =====" in summary and "tests: 1 passed, 1 failed" in summary


# ----------------------------------------------------------------------------------
# What comes back: the headline, the step backend
# ----------------------------------------------------------------------------------

MEASURED = {
    "family": "sm_90",
    "entry": {"backend": "triton", "measured": True, "basis": "measured on NVIDIA H100 80GB HBM3: ..."},
    "summary": "triton 40.1 ms, aten 45.2 ms over 2 cases (ring-step-fwd/bwd)",
    "cases": [{"bench": "ring-step-fwd", "case": "causal S=4096 D=128 bf16", "shape": "B=1 S_q=S_k=4096 H=32 D=128",
               "tflops": {"triton": 450.0, "aten": 420.0, "flash": 380.0, "cudnn": 510.0},
               "checks": {"triton": "matches", "aten": "matches"}, "sdpa_baselines": ["flash", "cudnn"]}],
}  # fmt: skip


def gpu_results(folder: Path, measured: dict | None = MEASURED) -> Path:
    """A GPU check's folder with made-up results: a step row, a merge row, a probe row."""
    folder.mkdir(parents=True, exist_ok=True)
    common = dict(world_size="1", backend="nccl", device="NVIDIA H100 80GB HBM3", reps="10", noise="0.01",
                  ours_faster_share="0.9", dtype="bf16", detail="")  # fmt: skip
    rows = [
        dict(common, bench="ring-step-fwd", case="causal S=4096 D=128 bf16", shape="B=1 S_q=S_k=4096 H=32 D=128",
             ours_s="0.001", baseline_s="0.0011", speedup="0.88", check="matches", ours_tflops="450",
             baseline_tflops="510", peak_tflops="989", peak_tflops_source="spec sheet, dense bf16",
             ours_fraction_of_peak_tflops="0.455"),
        dict(common, bench="ring-step-tiles", case="dkdv (32, 64, 8, 2) full S=4096 D=128 bf16",
             shape="B=1 S_q=S_k=4096 H=32 D=128", ours_s="0.001", baseline_s="0.0012", speedup="1.2", check="matches",
             ours_tflops="300", baseline_tflops="250"),
        dict(common, bench="merge", case="H=32 D=128 S=16384 bf16 block", shape="", ours_s="0.0003",
             baseline_s="0.002", speedup="6.7", check="matches", ours_gbps="2700", baseline_gbps="400",
             copy_gbps="2900"),
        dict(common, bench="ring-probe", case="contigu full MHA S_l=4096 P=8 fwd", shape="", ours_s="0.005",
             baseline_s="0.0055", speedup="1.1", check="identical", overlap_efficiency="0.97", compute_only_s="0.00485",
             serial_s="0.0055", compute_per_step_s="0.0006", transfer_per_step_s="0.00008"),
    ]  # fmt: skip
    stem = folder / "nvidia-h100-80gb-hbm3-nccl1-20261126-0900-short"
    with stem.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    document = {"device": "NVIDIA H100 80GB HBM3", "status": "finished, 0 failed cases",
                "calibration": {"spec_bf16_tflops": 989.0, "spec_gbps": 3350.0, "matmul_bf16_tflops": 750.0,
                                "copy_gbps": 2900.0}}  # fmt: skip
    if measured is not None:
        document["step_backend"] = measured
    stem.with_suffix(".json").write_text(json.dumps(document))
    (folder / "junit.xml").write_text(
        '<testsuites><testsuite name="s" tests="3" failures="1" errors="0" skipped="1" time="100">'
        '<testcase classname="tests.test_a" name="test_ok"/><testcase classname="tests.test_a" name="test_b">'
        '<failure message="AssertionError: out: err 0.1 &gt; 0.01"/></testcase></testsuite></testsuites>'
    )  # fmt: skip
    return folder


def test_headline_reads_a_gpu_folder(tmp_path):
    text = headline.headline(gpu_results(tmp_path / "run"))
    assert "tests: 1 passed, 1 failed, 0 errors, 1 skipped" in text
    assert "FAILED tests.test_a::test_b: AssertionError: out: err 0.1 > 0.01" in text
    (step,) = [line for line in text.splitlines() if line.strip().startswith("ring-step-fwd")]
    assert step.split()[5:9] == ["450", "420", "380", "510"] and "46%" in step  # triton, aten, flash, cudnn
    assert step.split()[11] == "60%"  # triton against the run's bf16 matmul
    assert "bf16 matmul 750 TFLOP/s (76% of the spec sheet's 989.0)" in text
    assert "device copy 2900 GB/s (87% of the spec sheet's 3350.0)" in text
    (tile,) = [line for line in text.splitlines() if line.strip().startswith("dkdv (32, 64, 8, 2)")]
    assert tile.split()[-4:] == ["300", "250", "1.20x", "matches"]
    (merge,) = [line for line in text.splitlines() if line.strip().startswith("merge")]
    assert "2700" in merge and "2900" in merge and "93%" in merge and "81%" in merge  # the copy, the spec sheet
    (probe,) = [line for line in text.splitlines() if "contigu full MHA" in line]
    assert probe.split()[6:8] == ["0.97", "0.88"]  # overlapped, serial: compute only / time
    assert 'step_backend="auto" on sm_90: triton' in text and "python -m bench.runner.step_table" in text


def test_step_table_writes_the_measured_entry_into_a_checkouts_table(tmp_path):
    table = tmp_path / "step_backends.json"
    shutil.copy(step_table.SOURCE_TABLE, table)
    before = json.loads(table.read_text())["families"]
    wrote = step_table.apply(gpu_results(tmp_path / "run"), table)
    families = json.loads(table.read_text())["families"]
    assert families["sm_90"] == MEASURED["entry"] and "sm_90: triton" in wrote
    assert {name: entry for name, entry in families.items() if name != "sm_90"} == {
        name: entry for name, entry in before.items() if name != "sm_90"}  # fmt: skip
    # A run whose checks failed recorded no entry; one that did not run ring-step, none at all.
    unrecorded = dict(MEASURED, entry=None, summary="not recorded, accuracy check failed: aten ...")
    with pytest.raises(ValueError, match="no backend recorded: not recorded, accuracy check failed"):
        step_table.apply(gpu_results(tmp_path / "failed", unrecorded), table)
    with pytest.raises(ValueError, match="measured no step backend|found none"):
        step_table.apply(gpu_results(tmp_path / "none", None), table)
    step_table.main([str(tmp_path / "run"), "--table", str(table)])
    with pytest.raises(SystemExit, match="python -m bench.runner.step_table: .*measured no step backend"):
        step_table.main([str(tmp_path / "none" / next((tmp_path / "none").glob("*.json")).name), "--table", str(table)])


def test_step_bench_records_into_the_json_and_the_given_table(tmp_path, monkeypatch):
    # The ring-step family's record at the end of a GPU run: the JSON gets the entry and every
    # case's rates; the checkout's table (here a copy) the entry.
    import torch

    from bench.families import ring_step as bench_ring_step
    from bench.families.ring_step import StepCase

    table = tmp_path / "step_backends.json"
    shutil.copy(step_table.SOURCE_TABLE, table)
    monkeypatch.setattr(step_table, "SOURCE_TABLE", table)
    cases = [StepCase(1, 4096, 32, 128, torch.bfloat16, causal=True, backward=False),
             StepCase(1, 4096, 32, 128, torch.bfloat16, causal=True, backward=True)]  # fmt: skip
    monkeypatch.setattr(bench_ring_step, "step_cases", lambda ctx: cases)
    monkeypatch.setattr(bench_ring_step, "BACKEND_TIMES", [(cases[0], 1.0, 2.0, "matches", "matches")])
    monkeypatch.setattr(bench_ring_step, "STEP_RATES", MEASURED["cases"])

    class Ctx:
        device_name = "NVIDIA H100 80GB HBM3"
        quick, recorded = False, {}

        def log(self, message):
            pass

        def record_metadata(self, entries):
            self.recorded.update(entries)

    ctx = Ctx()
    shipped = Path(step_backends.STEP_BACKEND_TABLE).read_text()
    # One of the two cases raised: nothing recorded, the JSON says why.
    bench_ring_step.record_step_backend(ctx, "sm_90")
    measured = ctx.recorded[step_table.RESULTS_KEY]
    assert measured["entry"] is None and "not recorded: 1 cases raised" in measured["summary"]
    assert json.loads(table.read_text()) == json.loads(shipped)
    bench_ring_step.BACKEND_TIMES.append((cases[1], 3.0, 2.5, "matches", "matches"))
    bench_ring_step.record_step_backend(ctx, "sm_90")
    measured = ctx.recorded[step_table.RESULTS_KEY]
    assert measured["family"] == "sm_90" and measured["cases"] == MEASURED["cases"]
    assert measured["entry"]["backend"] == "triton" and measured["entry"]["measured"] is True
    assert "triton" in measured["entry"]["basis"] and "commit" in measured["entry"]["basis"]
    assert json.loads(table.read_text())["families"]["sm_90"] == measured["entry"]
    assert Path(step_backends.STEP_BACKEND_TABLE).read_text() == shipped  # only the table given
