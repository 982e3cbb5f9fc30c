"""The kinds of work a family's seconds go to, and this machine's speed at each.

A CPU's speed is not one number: one without bf16 instructions multiplies bf16 matrices
tens of times slower than fp32 ones (measured on a 2-core AMD EPYC without AVX-512: a
512 x 512 matmul 209 ms in bf16, 3.4 ms in fp32), where one with them runs both alike.
So the calibration times one probe per kind, and each family declares how its seconds
on the reference machine split between the kinds (measured: `python -m bench
--measure-work`), so that its estimate here follows the kinds it spends its time on.

    float     tensor operations on fp32 (or fp64) tensors
    half      tensor operations with a bf16 or fp16 operand
    exchange  the collectives and point-to-point calls (their time inside the call)
    host      the rest of the family's wall time: Python, waiting on peers and requests
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("float", "half", "exchange", "host")
# The kinds with a probe of their own. Host time (Python, waiting on peers) goes at the
# float probe's pace: the same cores run it, and a probe of small operations read 30 to
# 50 ms from one calibration to the next with 4 ranks on 2 cores, too noisy to weigh by.
PROBED = ("float", "half", "exchange")
HALF_DTYPES = (torch.bfloat16, torch.float16)
# The share of each kind the run's start and finish (ranks, calibration, summary, figures)
# spend their time on: Python and fp32 plots.
HOST_WORK = {"float": 0.3, "host": 0.7}
# A family that declares no work shares: mostly fp32 compute.
DEFAULT_WORK = {"float": 0.6, "half": 0.1, "exchange": 0.05, "host": 0.25}
PROBE_ROUNDS = 9


def check_work(work: Mapping[str, float], owner: str) -> dict[str, float]:
    """work as a dict over KINDS (missing kinds 0). Raises ValueError naming `owner` where a
    kind is unknown, a share negative or the shares do not add up to 1."""
    unknown = set(work) - set(KINDS)
    if unknown:
        raise ValueError(f"{owner}: work names unknown kinds {sorted(unknown)}; the kinds are {KINDS}")
    if any(share < 0 for share in work.values()) or abs(sum(work.values()) - 1.0) > 0.02:
        raise ValueError(f"{owner}: work's shares must be at least 0 and add up to 1, got {dict(work)}")
    return {kind: float(work.get(kind, 0.0)) for kind in KINDS}


# Each probe's length: tens of milliseconds with 4 ranks on 2 cores, many of the
# scheduler's slices, so that its median moves little from one calibration to the next
# (fp32 at 256: 9.5 to 13.5 ms, at 512 about four times that).
PROBE_LENGTH = {torch.float32: 512, torch.bfloat16: 256}


def _float_probe(dtype: torch.dtype) -> Callable[[], None]:
    """A matmul and a causal attention forward + backward in `dtype`: what the families time."""
    length = PROBE_LENGTH[dtype]
    a = torch.full((length, length), 0.01, dtype=dtype)
    q, k, v = (torch.full((1, 4, length, 64), 0.01, dtype=dtype, requires_grad=True) for _ in range(3))

    def probe() -> None:
        (a @ a).sum().item()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return probe


def _low_quartile_seconds(call: Callable[[], object], rounds: int) -> float:
    """The lower quartile of `rounds` timed calls after a warm-up one: a neighbour's burst
    only lengthens a round, so the lower quartile sees a steadily busier machine and
    leaves out the bursts (medians of the same probes moved by up to a fifth from one
    calibration to the next with 4 ranks on 2 cores)."""
    call()  # warm-up: lazy initialisation, first-touch pages
    samples = []
    for _ in range(rounds):
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    return statistics.quantiles(samples, n=4)[0]


def probe_seconds(world_size: int, barrier: Callable[[], None]) -> dict[str, float]:
    """This rank's seconds of each PROBED kind's probe (the lower quartile of PROBE_ROUNDS),
    every rank at once (call on every rank together). exchange: a 1 MiB all_reduce (0 on
    one rank)."""
    seconds = {}
    for kind, dtype in (("float", torch.float32), ("half", torch.bfloat16)):
        barrier()
        seconds[kind] = _low_quartile_seconds(_float_probe(dtype), PROBE_ROUNDS)
    seconds["exchange"] = 0.0
    if world_size > 1:
        payload = torch.zeros(2**18)
        barrier()
        seconds["exchange"] = _low_quartile_seconds(lambda: dist.all_reduce(payload), PROBE_ROUNDS)
    return seconds


def kind_of(func, args: tuple, kwargs: Mapping) -> str:
    """The kind of one dispatched operation: its namespace, else its tensors' dtypes."""
    if getattr(func, "namespace", "") == "c10d" or str(func).startswith("c10d."):
        return "exchange"
    for value in (*args, *kwargs.values()):
        values = value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(item, torch.Tensor) and item.dtype in HALF_DTYPES for item in values):
            return "half"
    return "float"


class WorkMeter(TorchDispatchMode):
    """Seconds of this thread's tensor operations by kind while active (the host kind:
    the wall time the operations leave). The dispatcher hands the mode each operation the
    code calls, backward ones included; the operations they run inside are not seen
    again, so no second counts twice."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self._began = 0.0

    def __enter__(self) -> WorkMeter:
        self._began = time.perf_counter()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        wall = time.perf_counter() - self._began
        self.seconds["host"] = max(0.0, wall - sum(self.seconds[kind] for kind in KINDS if kind != "host"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        begin = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds[kind_of(func, args, kwargs)] += time.perf_counter() - begin
        return out

    def shares(self) -> dict[str, float]:
        """The seconds as shares of the wall time, rounded to 0.01, adding up to 1."""
        total = sum(self.seconds.values()) or 1.0
        shares = {kind: round(seconds / total, 2) for kind, seconds in self.seconds.items()}
        shares["host"] = round(1.0 - sum(shares[kind] for kind in KINDS if kind != "host"), 2)
        return shares
