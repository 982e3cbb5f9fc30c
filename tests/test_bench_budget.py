"""The benchmark suite's time budget (bench/runner/budget.py) on a simulated slow or busy
machine, and its figures and report: every figure a run writes has the size it declares
and data in each panel (the --quick run of tests/test_bench_smoke.py checks its own with
assert_figures_readable)."""

import json
import types
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot
import pytest
import torch

from bench.runner.budget import MIN_SCALE, REFERENCE, START_S, Budget, Calibration
from bench.runner.family import Family, runs
from bench.runner.plan import RunPlan
from bench.runner.plot import DPI, HEADLINE_SIZE_IN, family_figure, headline_figure, panel_data
from bench.runner.rows import Row
from bench.runner.timing import _repetitions
from bench.runner.work import KINDS, WorkMeter, check_work

# A machine four times slower than the reference (or as busy): the calibration scaled by 4.
SLOWER = 4.0
# The headline figure's most pixels: readable at 100% on a laptop's screen.
HEADLINE_MOST_PX = (1600, 1000)


def simulate(budget: Budget, overrun: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Runs the plan's families on a simulated machine whose speed the calibration
    measured: each takes its calibrated fixed seconds plus its timed rounds at the scale
    the budget gave it (its fewest_share at least), times overrun[name] (default 1). Returns per family (the estimate
    when it started, the seconds it took)."""
    plan, clock, taken = budget.plan, budget.factor * START_S, {}
    for name in plan.families:
        scale = budget.start(name)
        estimate = plan.estimates[name]
        seconds = budget.seconds_at(name, scale) * overrun.get(name, 1.0)
        clock += seconds
        plan.elapsed[name] = seconds
        budget.finish(name, seconds, clock)
        taken[name] = (estimate, seconds)
    return taken


def test_budget_sizes_the_rounds_of_a_busy_machine_to_fit():
    plan = RunPlan(runs(), "default", on_gpu=False)
    reference_total = plan.total_estimate
    budget = Budget(plan, REFERENCE.scaled(SLOWER), budget_s=1.3 * reference_total * SLOWER * 0.6)
    assert abs(budget.factor - SLOWER) < 1e-9 and budget.fits
    assert MIN_SCALE < budget.scale < 1.0  # fewer rounds than declared, more than the fewest
    assert budget.planned_total() <= budget.budget_s * 1.001, (budget.planned_total(), budget.budget_s)
    taken = simulate(budget, {})
    for name, (estimate, seconds) in taken.items():
        assert abs(estimate - seconds) <= 0.2 * seconds + 1e-9, (name, estimate, seconds)
    assert sum(seconds for _, seconds in taken.values()) + budget.overhead() <= budget.budget_s * 1.001
    assert not budget.notes


def test_a_family_over_its_share_shrinks_the_rest_and_says_so():
    plan = RunPlan(runs(), "default", on_gpu=False)
    budget = Budget(plan, REFERENCE.scaled(SLOWER), budget_s=1.3 * plan.total_estimate * SLOWER * 0.6)
    first = budget.scale
    taken = simulate(budget, {"ulysses": 2.0})
    assert abs(budget.scales["reshard"] - first) < 1e-9 and abs(budget.scales["ulysses"] - first) < 1e-9
    assert budget.scales["ring"] < first and len(budget.notes) == 1, budget.notes
    assert budget.notes[0].startswith("ulysses took ") and f"x{first:.2f} -> x" in budget.notes[0]
    # The rest, sized again at the pace so far, still ends within the budget.
    assert sum(seconds for _, seconds in taken.values()) + budget.overhead() <= budget.budget_s * 1.02
    record = budget.record(1000.0)
    assert record["notes"] == budget.notes and record["within_budget"] == (1000.0 <= budget.budget_s)


def test_a_budget_too_small_for_the_cases_is_named():
    plan = RunPlan(runs(), "default", on_gpu=False)
    budget = Budget(plan, REFERENCE.scaled(SLOWER), budget_s=60.0)
    assert not budget.fits and budget.scale == MIN_SCALE
    assert budget.notes[0].startswith("the plan does not fit the budget of 1 min"), budget.notes


def test_quick_and_no_budget_keep_the_declared_rounds():
    for size, seconds in (("quick", 1.0), ("full", None)):
        plan = RunPlan(runs(), size, on_gpu=False)
        declared = plan.total_estimate
        budget = Budget(plan, REFERENCE.scaled(SLOWER), budget_s=seconds)
        assert budget.scale == 1.0
        # The estimate is still this machine's: the declared seconds times its factor.
        assert abs(sum(budget.planned.values()) - declared * SLOWER) < 1e-6


def test_a_cpu_slow_at_bf16_slows_only_the_families_that_spend_their_time_there():
    # A CPU without bf16 instructions: the half probe 20 times the reference's, the rest alike.
    slow_half = Calibration({**REFERENCE.seconds, "half": REFERENCE.seconds["half"] * 20})
    plan = RunPlan(runs(), "default", on_gpu=False)
    declared = dict(plan.estimates)
    budget = Budget(plan, slow_half, budget_s=None)
    for name, own in plan.own.items():
        if not declared[name]:
            continue
        half = own[0].work["half"]
        assert abs(budget.planned[name] - declared[name] * (1 + 19 * half)) < 1e-6 * declared[name], name
    shares = {name: own[0].work["half"] for name, own in plan.own.items() if own and declared[name]}
    most, least = max(shares, key=shares.get), min(shares, key=shares.get)
    assert shares[most] > shares[least]
    assert budget.planned[most] / declared[most] > budget.planned[least] / declared[least]


def test_a_family_of_few_rounds_keeps_them_at_the_fewest():
    plan = RunPlan(runs(), "default", on_gpu=False)
    budget = Budget(plan, REFERENCE, budget_s=None)
    family = plan.own["transformers"][0]
    assert family.fewest_share > MIN_SCALE
    fixed, timed = budget.parts(["transformers"])
    assert abs(budget.seconds_at("transformers", MIN_SCALE) - (fixed + family.fewest_share * timed)) < 1e-9
    assert abs(budget.seconds_at("transformers", 1.0) - (fixed + timed)) < 1e-9
    assert abs(budget.seconds_at("ring", MIN_SCALE) - sum(budget.parts(["ring"])) * MIN_SCALE) > 1.0


def test_work_shares_are_checked_where_a_family_declares_them():
    assert check_work({"half": 0.7, "host": 0.3}, "x") == {"float": 0.0, "half": 0.7, "exchange": 0.0, "host": 0.3}
    for wrong in ({"gpu": 1.0}, {"float": 0.5}, {"float": 1.2, "host": -0.2}):
        with pytest.raises(ValueError, match="family 'made-up': work"):
            Family("made-up", 0, "", lambda ctx: None, runs()["ring"][0].sizes, work=wrong)


def test_the_meter_counts_each_kind_of_work():
    a32 = torch.ones(128, 128)
    a16 = a32.bfloat16()
    with WorkMeter() as meter:
        for _ in range(3):
            a16 @ a16
            a32 @ a32
            a32.add(1.0)
    assert all(meter.seconds[kind] > 0 for kind in ("float", "half", "host")), meter.seconds
    assert meter.seconds["exchange"] == 0.0
    shares = meter.shares()
    assert set(shares) == set(KINDS) and abs(sum(shares.values()) - 1.0) < 1e-9, shares


def test_rounds_follow_the_scale_and_keep_a_median():
    ctx = types.SimpleNamespace(reps=15, max_reps=75, seconds_per_case=3.0, repeat_scale=1.0)
    assert _repetitions(0.001, ctx, collective=False) == 75
    assert _repetitions(1.0, ctx, collective=False) == 15
    ctx.repeat_scale = MIN_SCALE
    assert _repetitions(0.001, ctx, collective=False) == 15
    assert _repetitions(1.0, ctx, collective=False) == 3


def assert_figures_readable(folder: Path) -> None:
    """Every figure of the run in `folder`: listed in its JSON, the size listed, each
    panel with data; the headline at most HEADLINE_MOST_PX; the report shows them all."""
    (document,) = [json.loads(path.read_text()) for path in folder.glob("*.json")]
    figures = document["figures"]
    assert {entry["file"] for entry in figures} == {str(path.relative_to(folder)) for path in folder.rglob("*.png")}
    headline = figures[0]
    assert headline["width_px"] <= HEADLINE_MOST_PX[0] and headline["height_px"] <= HEADLINE_MOST_PX[1], headline
    assert len(headline["panels"]) <= 4
    (report,) = folder.glob("*.md")
    text = report.read_text()
    for entry in figures:
        height, width, _ = matplotlib.image.imread(folder / entry["file"]).shape
        assert (width, height) == (entry["width_px"], entry["height_px"]), entry
        assert width <= HEADLINE_MOST_PX[0], entry
        assert entry["panels"] and all(count > 0 for count in entry["panels"].values()), entry
        assert f"]({entry['file']})" in text, entry["file"]


def made_up_rows() -> list[Row]:
    """One row of each kind the headline draws: a fused case, a ring case with its bytes
    and accuracy, a transformers step in two modes at two lengths."""

    def row(bench, case, **extra):
        return Row(bench=bench, case=case, shape="", dtype="bf16", world_size=4, backend="gloo", device="CPU",
                   ours_s=0.01, baseline_s=0.02, speedup=2.0, ours_faster_share=1.0, noise=0.1, reps=5,
                   check="matches", **extra)  # fmt: skip

    steps = [row("transformers", f"{mode} (balanced) T={tokens}", ulysses_degree=1, ring_degree=4, layout="balanced",
                 ours_peak_bytes=2**20, baseline_peak_bytes=2**22)
             for mode in ("ring", "usp") for tokens in (1024, 2048)]  # fmt: skip
    return [row("reshard", "S->T", bytes_sent_ours=4096, bytes_sent_theory=4096, volume_at_theory=True),
            row("ring", "zigzag causal", bytes_sent_ours=2**20, bytes_sent_theory=2**20, volume_at_theory=True,
                error_vs_plain=0.6), *steps]  # fmt: skip


def test_headline_and_family_figures_have_their_size_and_data(tmp_path):
    metadata = dict(device="CPU AMD EPYC", device_type="cpu", backend="gloo", world_size=4, cpu_count=2,
                    torch="2.14.1", git_commit="abc", date="2026-12-07 10:00")  # fmt: skip
    rows = made_up_rows()
    figure = headline_figure(rows, metadata, tmp_path / "run.png")
    assert (figure.width_px, figure.height_px) == tuple(size * DPI for size in HEADLINE_SIZE_IN) == HEADLINE_MOST_PX
    assert len(figure.panels) == 4 and all(count > 0 for count in figure.panels.values()), figure.panels
    assert matplotlib.image.imread(figure.path).shape[:2] == (figure.height_px, figure.width_px)
    # A panel with a target line and a note only (a kind of row not in the run) counts as empty.
    axis = matplotlib.pyplot.figure().add_subplot()
    axis.axvline(2.0)
    axis.text(0.5, 0.5, "not in this run")
    assert panel_data(axis) == 0
    axis.barh([0], [1.0])
    assert panel_data(axis) == 1
    matplotlib.pyplot.close("all")
    family = family_figure("transformers", rows[2:], metadata, tmp_path / "run" / "transformers.png")
    assert len(family.panels) == 2 and all(count > 0 for count in family.panels.values()), family.panels
