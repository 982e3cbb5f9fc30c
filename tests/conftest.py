import os
import sys

import pytest
import torch

# The references and the accuracy rule (tools/reference.py) and the developer tools live
# in the checkout's tools/, importable from its root also when pytest runs from elsewhere.
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPOSITORY not in sys.path:
    sys.path.insert(0, _REPOSITORY)

# Triton kernels run on CPU tensors through the interpreter when there is no GPU; with
# one, the kernel tests run the compiled kernels. (The gloo rank pool's workers always
# interpret: their tensors are on the CPU.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rank_pool import RankPool  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)
_pools: dict[int, RankPool] = {}


def pool_for(world_size: int) -> RankPool:
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size)
    return _pools[world_size]


@pytest.fixture(params=WORLD_SIZES, ids=lambda size: f"P{size}")
def ranks(request) -> RankPool:
    """A pool of local gloo ranks; tests run once per world size 1, 2, 3 and 4
    (3 catches power-of-two assumptions)."""
    return pool_for(request.param)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu_long: a GPU test the short GPU check (scripts/gpu_check.sh --short) leaves out, "
        "e.g. a variant of the Triton kernels this Triton release does not ship, compiled only to test it",
    )  # fmt: skip
    config.addinivalue_line(
        "markers", "slow: a test of 8 ranks or more, which the test command (scripts/test.sh, CI's) leaves out: "
        "run them with bash scripts/test.sh -m slow",
    )  # fmt: skip


# The terminal reporter of the process that prints (set at the session start).
_terminal_reporter: list = []


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    # xdist workers report to the controller: only the process with a terminal prints.
    if not hasattr(session.config, "workerinput"):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            _terminal_reporter.append(reporter)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """SEQPAR_FAILURES_AT_ONCE=1 (scripts/gpu_check.sh): a failure's report is printed
    as it happens, not only in the summary at the end, so that a run stopped at its time
    limit still shows it (under pytest-xdist: by the controller, which gets every report)."""
    if not (report.failed and os.environ.get("SEQPAR_FAILURES_AT_ONCE") == "1"):
        return
    reporter = _terminal_reporter[0] if _terminal_reporter else None
    if reporter is None:
        return
    reporter.ensure_newline()
    reporter.write_line(f"FAILED {report.nodeid} ({report.when}), reported at once:", red=True, bold=True)
    reporter.write_line(report.longreprtext)


def pytest_terminal_summary(terminalreporter):
    """How often each rank pool started (a start costs seconds: 20 s for 4 ranks on 2 cores)."""
    started = [f"{size} ranks {pool.starts}x ({pool.restarts_for_groups} past MAX_GROUPS)"
               for size, pool in sorted(_pools.items()) if pool.starts]  # fmt: skip
    if started:
        terminalreporter.write_line("rank pools started: " + ", ".join(started))


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
