"""The fsdp bench family's verdicts and arithmetic that `python -m bench --quick` does not
reach (it measures no peaks on CPU, and its bytes and losses agree): a rank holding other
bytes than the formula, or a loss off SP alone's, is a MISMATCH; the longest sequence is
the budget less the parameters and Adam's states, over the fitted bytes per token."""

from __future__ import annotations

import pytest

from bench.bench_fsdp import CONFIGURATIONS, FsdpCase, Measured, StateBytes, configuration_row, storage_bytes
from bench.bench_memory import QUICK_MODEL

MiB = 2**20


class Ctx:
    world_size, backend, device_name = 4, "gloo", "CPU"


# 1000 parameters in 10 tensors over 4 shards, fp32: 1000 B of parameters a rank.
FORMULA = StateBytes.formula(parameters=1000, tensors=10, element_size=4, shards=4)
CASE = FsdpCase(CONFIGURATIONS[1], QUICK_MODEL, (2048, 4096), (2, 2), peaks=True)


def measured(states=None, losses=(2.0, 1.5), peaks=(10 * MiB, 18 * MiB)) -> Measured:
    return Measured(list(losses), list(peaks), states or [FORMULA] * 4, FORMULA, 4, 1000, 10)


def test_formula_is_n_bytes_over_shards_and_adams_two_states():
    assert FORMULA == StateBytes(1000, 1000, 2000 + 40)
    assert measured().bytes_per_parameter == pytest.approx(16.0)  # 4 + 4 + 2 x 4, the step counters left out


@pytest.mark.parametrize(
    ("ours", "verdict"),
    [
        (measured(), "matches"),
        (measured(states=[FORMULA] * 3 + [StateBytes(1000, 1004, 2040)]), "MISMATCH state bytes"),
        (measured(losses=(2.0, 1.5001)), "MISMATCH loss"),
    ],
)
def test_check_names_what_differs(ours, verdict):
    row = configuration_row(CASE, Ctx(), ours, measured(), budget=2**30, source="test")
    assert row.check == verdict, row.detail
    assert ("rank 3 1000 + 1004 + 2040 B" in row.detail) == (verdict == "MISMATCH state bytes"), row.detail


def test_longest_sequence_is_the_budget_less_the_held_state_over_the_slope():
    # Peaks 10 and 18 MiB at 2048 and 4096 tokens: 4096 B a token, intercept 2 MiB.
    budget = 1000 * MiB
    row = configuration_row(CASE, Ctx(), measured(), measured(), budget=budget, source="test")
    longest = int((budget - FORMULA.held - 2 * MiB) / 4096)
    assert "4096 bytes per token, intercept 2.00 MiB" in row.detail, row.detail
    assert f"{longest} tokens, {longest // 2} a rank, extrapolated" in row.detail, row.detail


def test_storage_bytes_counts_a_shared_storage_once():
    import torch

    flat = torch.zeros(100)
    views = [flat[:30], flat[30:], torch.zeros(5, dtype=torch.float64)]
    assert storage_bytes(views) == 100 * 4 + 5 * 8
