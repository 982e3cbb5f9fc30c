"""Where the Triton interpreter cannot run the step kernels, and the one skip for the
tests that run Triton kernels on CPU tensors (the interpreter's); and the compiles for
GPUs that such tests check, which need the interpreter off.

    runs_triton_on(device)   mark for a test whose Triton kernels run on `device`
                             tensors ("cpu": interpreted; the rank pool's workers always
                             hold CPU tensors); skips it where the interpreter fails
    compiled_without_interpreter(script)
                             what a test file run as a program prints (its compiles for
                             GPUs, as JSON), run without the interpreter
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


def _release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _interpreter_loops_fail() -> bool:
    # The interpreter of Triton before 3.7 holds a runtime scalar (an int kernel argument
    # and what is computed from it) as a one-element 1-D numpy array, and its __index__
    # is int(array), which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted
    # to Python scalars"). So every `for ... in range(lo, hi, BLOCK)` with a runtime
    # bound fails, and every step kernel has one. Measured on a minimal such loop:
    # Triton 3.2.0, 3.3.0, 3.4.0, 3.5.1 and 3.6.0 fail with NumPy 2.4.6; Triton 3.2.0 with
    # NumPy 2.3.5 and Triton 3.7.0 and 3.7.1 with NumPy 2.4.6 run it. The kernels keep
    # their for loops: as while loops the interpreter runs them, but Triton pipelines
    # only for loops on the GPU.
    try:
        import numpy
        import triton
    except ImportError:
        return False  # no interpreter here: nothing fails for this reason
    return _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4)


INTERPRETER_LOOPS_FAIL = _interpreter_loops_fail()


def runs_triton_on(device: str):
    return pytest.mark.skipif(
        device == "cpu" and INTERPRETER_LOOPS_FAIL,
        reason="the interpreter of Triton < 3.7 cannot run a loop with a runtime bound "
        "under NumPy >= 2.4 (int() of a 1-element array); NumPy < 2.4 or Triton >= 3.7 run it",
    )


def compiled_without_interpreter(script: str) -> list:
    """The JSON of the last line `script` (a test file whose __main__ compiles its kernels
    for GPUs that are not here, tools/ahead_of_time.py) prints, run in a process of its
    own without the interpreter (conftest turns it on where there is no GPU, and
    interpreted kernels cannot be compiled), the checkout's root importable (tools/)."""
    pytest.importorskip("triton.backends.nvidia")
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [repository, environment.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, script], env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])
