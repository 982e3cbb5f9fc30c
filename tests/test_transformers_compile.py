"""torch.compile of a whole model under apply(): the package's path from the model's
attention (and mixers) to its ops breaks no graph, and the compiled step's loss and
gradients are eager's. Llama (Ulysses, dense), Qwen3 with a sliding window (ring,
balanced, packed documents) and a hybrid (LFM2's convolutions, USP), on 2 gloo ranks;
torch._dynamo.explain counts the graph breaks, and those with a frame of the package in
their stack fail the test (a model's own code may break where transformers' does without
us)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank  # noqa: E402
from test_transformers_hybrid import HYBRID_FAMILIES  # noqa: E402
from test_transformers_integration import (  # noqa: E402
    FAMILIES,
    _batch,
    _config,
    _family_model,
    _model,
    _parallelism,
    _relative_error,
)

PACKAGE = os.path.dirname(os.path.abspath(__import__("seqpar_kernels").__file__))
FP32_RTOL = 1e-5  # compiled against eager in fp32: the same operations, reordered at most

CASES = [
    dict(id="llama-ulysses", family=None, mode="ulysses", layout="contiguous", batch="dense"),
    dict(id="qwen3-ring-balanced-packed", family="qwen3", mode="ring", layout="balanced", batch="packed"),
    dict(id="lfm2-usp", family="lfm2", mode="usp", layout="contiguous", batch="dense"),
]


def _tiny_model(family):
    if family is None:
        return _model(_config())
    spec = FAMILIES.get(family) or HYBRID_FAMILIES[family]
    return _family_model(family, spec=spec)


def _step(model, local, groups):
    import seqpar_kernels.integrations.transformers as sp_transformers

    inputs = {key: value for key, value in local.items() if key != "shift_labels"}
    hidden = model.model(**inputs).last_hidden_state
    loss = sp_transformers.causal_lm_loss(model, hidden, local["shift_labels"], **groups)
    loss.backward()
    return loss.detach()


@on_every_rank
def run_compiled_cases(cases):
    import seqpar_kernels.integrations.transformers as sp_transformers

    failures = []
    for case in cases:
        torch._dynamo.reset()
        groups = _parallelism(case["mode"], 2)
        eager = _tiny_model(case["family"])
        sp_transformers.apply(eager, case["mode"], layout=case["layout"], **groups)
        compiled = copy.deepcopy(eager)
        batch, _, _ = _batch(case["batch"], 37)
        local = sp_transformers.shard_batch(batch, mode=case["mode"], layout=case["layout"], **groups)
        inputs = {key: value for key, value in local.items() if key != "shift_labels"}
        explained = torch._dynamo.explain(compiled.model)(**inputs)
        ours = [
            f"{reason.reason.splitlines()[0]} at {where[-1].filename[len(PACKAGE) + 1 :]}:{where[-1].lineno}"
            for reason in explained.break_reasons
            for where in [[frame for frame in reason.user_stack if frame.filename.startswith(PACKAGE)]]
            if where
        ]
        if ours:
            failures.append(f"{case['id']}: {len(ours)} graph breaks in the package: {sorted(set(ours))}")
        torch._dynamo.reset()
        compiled.model = torch.compile(compiled.model, backend="aot_eager")
        expected, loss = _step(eager, local, groups), _step(compiled, local, groups)
        if not _relative_error(loss, expected) <= FP32_RTOL:
            failures.append(f"{case['id']}: compiled loss {loss.item():.7f} vs eager {expected.item():.7f}")
        for (name, theirs), mine in zip(eager.named_parameters(), compiled.parameters()):
            if not _relative_error(mine.grad, theirs.grad) <= FP32_RTOL:
                failures.append(
                    f"{case['id']}: grad of {name} relative error {_relative_error(mine.grad, theirs.grad):.2e}"
                )
    return failures


def test_a_compiled_model_breaks_no_graph_in_the_package_and_matches_eager():
    cases = [case for case in CASES if case["family"] is None or case["family"] in (*FAMILIES, *HYBRID_FAMILIES)]
    failures = [failure for per_rank in pool_for(2).run(run_compiled_cases, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)
