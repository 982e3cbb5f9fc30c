"""examples/dsp_video_dit.py: DSP and Ulysses on a small video DiT match the
single-process model (outputs and parameter gradients), with the volumes the papers
give: on 2 and 3 (uneven) ranks through the test pool, on 2 from the command line."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "dsp_video_dit.py"


def load_example():
    """The example as a module (examples/ is not a package). Cached, so that the
    workers load it once."""
    name = "_seqpar_example_dsp_video_dit"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_example_check(config_overrides, break_dsp_switch=False):
    """run_check on this rank. break_dsp_switch: DSP never switches the sharded dim (a
    deliberately wrong model), to show that the check can fail."""
    example = load_example()
    config = example.Config(**config_overrides)
    if not break_dsp_switch:
        return example.run_check(config, verbose=False)
    original = example.DSP.prepare
    example.DSP.prepare = lambda self, x, stage: x
    try:
        return example.run_check(config, verbose=False)
    finally:
        example.DSP.prepare = original


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["P2"])
def test_dsp_and_ulysses_match_single_process(ranks):
    # T=8, S=16, 4 heads: even on 2 ranks, so the volumes are exactly the formulas.
    summaries = ranks.run(run_example_check, {})
    world = ranks.world_size
    activation = 2 * 8 * 16 * 64 * 4  # B T S C x fp32 bytes
    for rank, summary in enumerate(summaries):
        assert summary["world_size"] == world
        assert set(summary["plans"]) == {"DSP", "Ulysses"}
        for name, result in summary["plans"].items():
            assert result["out_error"] <= 1, (rank, name, result)
            assert result["grad_error"] <= 1, (rank, name, result)
        assert summary["ok"], (rank, summary)
        dsp, ulysses = summary["plans"]["DSP"], summary["plans"]["Ulysses"]
        # Per layer: DSP two switches, Ulysses q, k, v and out; each (P-1)/P x M/P.
        assert dsp["bytes_per_layer"] == [2 * (world - 1) * activation // world**2] * 2
        assert ulysses["bytes_per_layer"] == [4 * (world - 1) * activation // world**2] * 2
        assert dsp["backward_bytes"] == sum(dsp["bytes_per_layer"])
        assert ulysses["backward_bytes"] == sum(ulysses["bytes_per_layer"])
        assert dsp["volume_at_theory"] and ulysses["volume_at_theory"]


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["P2"])
def test_check_fails_for_a_wrong_parallel_model(ranks):
    for summary in ranks.run(run_example_check, {"layers": 1}, break_dsp_switch=True):
        assert not summary["ok"]
        assert summary["plans"]["DSP"]["out_error"] > 1
        assert summary["plans"]["Ulysses"]["out_error"] <= 1


@pytest.mark.parametrize("ranks", [3], indirect=True, ids=["P3"])
def test_uneven_splits_match_single_process(ranks):
    # 3 ranks: frames (8), patches (16) and heads (4) all split unevenly.
    for rank, summary in enumerate(ranks.run(run_example_check, {})):
        assert summary["ok"], (rank, summary)
        for name, result in summary["plans"].items():
            assert result["out_error"] <= 1 and result["grad_error"] <= 1, (rank, name, result)


def test_command_line_on_2_ranks():
    # The script as a user runs it: it spawns its own gloo ranks (two: each a second of
    # startup on a small machine) and exits non-zero if any check fails.
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--world-size", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    lines = result.stdout.splitlines()
    assert lines[-1] == "OK", output
    for name in ("DSP", "Ulysses"):
        match = next(line for line in lines if line.strip().startswith(f"{name} ") and "output" in line)
        out_error, grad_error = (float(word) for word in match.split() if word[0].isdigit())
        assert out_error <= 1 and grad_error <= 1, match
    ratio = float(next(line for line in lines if "DSP / Ulysses" in line).split("=")[1])
    assert 0.4 < ratio < 0.6, output
