"""python -m bench.runner.headline RUN: the headline numbers of a GPU check's folder
(scripts/gpu_check.sh), as a table: the tests' counts and first failures (junit.xml),
the GPU's yardsticks (spec sheet, and a bf16 matmul and a device copy measured in the
run), the step kernels' TFLOP/s by backend against SDPA's and against the measured
matmul, candidate tiles against the shipped ones, the data-movement kernels' GB/s
against a plain device copy and the spec sheet, the ring's overlap on one GPU, and the
step backend the run measured. Reads the folder's files only (no torch): any machine
can print it.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from bench.runner.rows import FAILED, KERNEL_BENCHES, PROBE_BENCH, STEP_BENCHES, STEP_TILES_BENCH

# Failed tests listed by name (the rest are counted).
LISTED_FAILURES = 10


def _number(text: str) -> float | None:
    return float(text) if text not in ("", None) else None


def _rate(value: float | None, width: int = 7) -> str:
    return f"{value:>{width}.4g}" if value is not None else f"{'-':>{width}}"


def test_lines(junit: Path) -> list[str]:
    """The counts of junit.xml's suites and the first failures, by name and message."""
    if not junit.exists():
        return [f"tests: no {junit.name} (the test stage did not run, or was killed before pytest wrote it)"]
    root = ElementTree.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites)
              for key in ("tests", "failures", "errors", "skipped")}  # fmt: skip
    seconds = sum(float(suite.get("time", 0)) for suite in suites)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [f"tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped in {seconds:.0f} s ({junit.name})"]  # fmt: skip
    failures = [
        (case, problem)
        for case in root.iter("testcase")
        for problem in list(case.findall("failure")) + list(case.findall("error"))
    ]
    for case, problem in failures[:LISTED_FAILURES]:
        message = " ".join((problem.get("message") or "").split())[:160]
        lines.append(f"  FAILED {case.get('classname', '')}::{case.get('name', '')}: {message}")
    if len(failures) > LISTED_FAILURES:
        lines.append(f"  ... and {len(failures) - LISTED_FAILURES} more (test.log)")
    return lines


def _section(title: str, header: str, rows: list[dict], lead, cells) -> list[str]:
    """A table of `rows` under `title`: each row's lead columns, then its cells and its
    check, or for a case that raised its error."""
    if not rows:
        return []
    lines = ["", title, f"  {header}"]
    for row in rows:
        if row["check"].startswith(FAILED):
            lines.append(f"  {lead(row)} {row['check']}: {row['detail'][:100]}")
        else:
            lines.append(f"  {lead(row)} {cells(row)}  {row['check']}")
    return lines


def _share(part: float | None, whole: float | None) -> str:
    return f"{part / whole:.0%}" if part and whole else "-"


def calibration_lines(calibration: dict | None) -> list[str]:
    """The GPU's yardsticks: the spec sheet's, and what a matmul and a copy gave in this run."""
    if not calibration:
        return []
    matmul, copy = calibration["matmul_bf16_tflops"], calibration["copy_gbps"]
    spec_tflops, spec_gbps = calibration["spec_bf16_tflops"], calibration["spec_gbps"]
    return ["", f"this GPU in this run: bf16 matmul {matmul:.4g} TFLOP/s ({_share(matmul, spec_tflops)} of the "
                f"spec sheet's {spec_tflops or 'unknown'}); device copy {copy:.4g} GB/s ({_share(copy, spec_gbps)} "
                f"of the spec sheet's {spec_gbps or 'unknown'})"]  # fmt: skip


def step_lines(rows: list[dict], measured: dict | None, calibration: dict | None = None) -> list[str]:
    steps = [row for row in rows if row["bench"] in STEP_BENCHES]
    if not steps:
        return []
    rates = {(case["bench"], case["case"]): case["tflops"] for case in (measured or {}).get("cases", [])}
    matmul = (calibration or {}).get("matmul_bf16_tflops")

    def cells(row):
        tflops = rates.get((row["bench"], row["case"]), {"triton": _number(row["ours_tflops"])})
        fraction = _number(row["ours_fraction_of_peak_tflops"])
        return (" ".join(_rate(tflops.get(name)) for name in ("triton", "aten", "flash", "cudnn"))
                + f" {float(row['speedup']):>10.2f}x {'-' if fraction is None else f'{fraction:.0%}':>7}"
                + f" {_share(_number(row['ours_tflops']), matmul):>9}")  # fmt: skip

    peak = _number(steps[0]["peak_tflops"])
    heads = re.sub(r" S_q=S_k=\d+", "", steps[0]["shape"])
    title = (f"step kernels, one ring step of {heads} (TFLOP/s; peak {peak or 'unknown'}: "
             f"{steps[0]['peak_tflops_source']}; triton/SDPA: against SDPA's faster backend; "
             f"of matmul: triton against the bf16 matmul of this run)")  # fmt: skip
    header = (f"{'bench':<14} {'case':<26} {'triton':>7} {'aten':>7} {'flash':>7} {'cudnn':>7} {'triton/SDPA':>11} "
              f"{'of peak':>7} {'of matmul':>9}  check")  # fmt: skip
    return _section(title, header, steps, lambda row: f"{row['bench']:<14} {row['case']:<26}", cells)


def tile_lines(rows: list[dict]) -> list[str]:
    def cells(row):
        ours, shipped = _number(row["ours_tflops"]), _number(row["baseline_tflops"])
        return f"{_rate(ours)} {_rate(shipped)} {float(row['speedup']):>9.2f}x"

    title = "tiles (TFLOP/s of each candidate beside the shipped tile, timed side by side; > 1x: candidate faster)"
    header = f"{'case':<44} {'tile':>7} {'shipped':>7} {'tile/ship':>10}  check"
    tiles = [row for row in rows if row["bench"] == STEP_TILES_BENCH]
    return _section(title, header, tiles, lambda row: f"{row['case']:<44}", cells)


def kernel_lines(rows: list[dict], calibration: dict | None = None) -> list[str]:
    spec = (calibration or {}).get("spec_gbps")

    def cells(row):
        ours, baseline, copy = (_number(row[key]) for key in ("ours_gbps", "baseline_gbps", "copy_gbps"))
        return f"{_rate(ours)} {_rate(baseline)} {_rate(copy)} {_share(ours, copy):>9} {_share(ours, spec):>8}"

    title = ("data movement (GB/s = bytes read + written / time; a plain device copy of as many bytes beside; "
             f"of spec: against the spec sheet's {spec or 'unknown'})")  # fmt: skip
    header = f"{'bench':<7} {'case':<34} {'ours':>7} {'unfused':>7} {'copy':>7} {'ours/copy':>9} {'of spec':>8}  check"
    kernels = [row for row in rows if row["bench"] in KERNEL_BENCHES]
    return _section(title, header, kernels, lambda row: f"{row['bench']:<7} {row['case']:<34}", cells)


def probe_lines(rows: list[dict]) -> list[str]:
    def cells(row):
        compute, serial = _number(row["compute_only_s"]), _number(row["serial_s"])
        step, copy = _number(row["compute_per_step_s"]), _number(row["transfer_per_step_s"])
        return (f"{float(row['overlap_efficiency']):>7.2f} {compute / serial:>7.2f} {step * 1e3:>6.2f} ms "
                f"{copy * 1e3:>6.2f} ms")  # fmt: skip

    title = "ring overlap on one GPU (the exchange a copy on a side stream; compute only / time: 1.0 hides it)"
    header = f"{'case':<40} {'overlap':>7} {'serial':>7} {'step':>9} {'copy':>9}  check"
    probes = [row for row in rows if row["bench"] == PROBE_BENCH]
    return _section(title, header, probes, lambda row: f"{row['case']:<40}", cells)


def backend_lines(measured: dict | None, folder: Path) -> list[str]:
    if measured is None:
        return []
    if measured["entry"] is None:
        return ["", f'step_backend="auto" on {measured["family"]}: not recorded ({measured["summary"]})']
    return ["", f"step_backend=\"auto\" on {measured['family']}: {measured['entry']['backend']} "
                f"(measured: {measured['summary']})",
            f"  into a checkout's table: python -m bench.runner.step_table {folder}"]  # fmt: skip


def headline(folder: Path) -> str:
    lines = test_lines(folder / "junit.xml")
    tables = sorted(folder.glob("*.csv"))
    if not tables:
        lines += ["", "bench: no results (the bench stage did not run, or was killed before its first case)"]
        return "\n".join(lines)
    with tables[-1].open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    document_path = tables[-1].with_suffix(".json")
    document = json.loads(document_path.read_text()) if document_path.exists() else {}
    measured, calibration = document.get("step_backend"), document.get("calibration")
    lines += calibration_lines(calibration) + step_lines(rows, measured, calibration) + tile_lines(rows)
    lines += kernel_lines(rows, calibration) + probe_lines(rows) + backend_lines(measured, folder)
    failed = [row for row in rows if row["check"].startswith(FAILED)]
    status = document.get("status", "no JSON")
    lines += ["", f"bench: {len(rows)} cases, {len(failed)} failed; {status} ({tables[-1].name})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.runner.headline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("folder", type=Path, help="a GPU check's results folder")
    print(headline(parser.parse_args(argv).folder))


if __name__ == "__main__":
    main()
