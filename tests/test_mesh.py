"""Sequence parallelism with data parallelism on one DeviceMesh: a (dp 2, cp 2) mesh of 4
gloo ranks, each data replica reading its own packed batch (documents of other lengths,
another number of real tokens), a tiny Llama trained three SGD steps, against one process
on the global batch (every replica's rows): the loss of every step and every parameter
after the steps, fp32. Gradients summed by all_reduce_gradients over both dims, by DDP
over the data dim, by FSDP2 (fully_shard) over data x sequence (with activation
checkpointing too, around a tensor dim named by no argument, and a LoRA PeftModel whose
adapter alone trains) and over data alone,
by HSDP; USP's pair of dims on a mesh of its own
names; tensor 2 x sequence 2 (apply's tensor_dims: the model's own plan, Ulysses and
the ring on each tensor rank's heads, heads that Ulysses splits unevenly); each
replica's per-document log-prob sums; and the mesh's arguments that cannot work (heads
a tensor dim cannot split, a gradient reduction over the tensor dim) raise on every
rank.

The loss is the mean over every real token of the global batch: the test also computes
the LM head's gradient of the mean of the replicas' means and checks that it is far from
the one-process gradient, so that a loss counted per replica would fail it.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from on_ranks import raises  # noqa: E402
from test_transformers_integration import VOCAB, _config, _model, _relative_error  # noqa: E402

FP32_LOSS_RTOL = 1e-5
# Each step's update is lr x the gradient, whose fp32 rounding the integration tests hold
# to 1e-4 of its largest element; three steps of it.
FP32_UPDATE_RTOL = 3e-4
STEPS = 3
LR = 1.0
# Each replica's packed documents: 23 and 37 real targets, so that a mean of the two
# replicas' means weighs a token of the first replica 37/23 times one of the second.
REPLICA_DOCUMENTS = ([6, 1, 11, 9], [14, 20, 6])


def _mesh(shape, names):
    """A DeviceMesh of the rank pool's processes (collective: every rank makes it alike).
    Made per case: the pool destroys its groups once the case is done, as a cache of
    every case's mesh would keep dozens of gloo groups, and their threads, alive."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _packed(lengths, seed):
    """One packed row (1, sum(lengths)): random tokens, positions restarting at 0 at each
    document, labels -100 at each document's first token (the flattening collator's)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _reference_loss(model, batches):
    """The one-process loss of the global batch: the mean over every real target of every
    replica's row (each row's mean weighted by its target count)."""
    counts = [(batch["labels"][0, 1:] != -100).sum() for batch in batches]
    sums = [model(**batch).loss * count for batch, count in zip(batches, counts)]
    return sum(sums) / sum(counts)


def _reference_document_logprobs(model, batch) -> torch.Tensor:
    """Each packed document's sum of its targets' log-probabilities in one process:
    (documents,) fp64."""
    with torch.no_grad():
        logits = model(**batch).logits[0].double()  # (S, vocab)
    targets = torch.cat([batch["labels"][0, 1:], torch.tensor([-100])])
    chosen = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[:, None])[:, 0] * (targets != -100)
    documents = torch.cumsum(batch["position_ids"][0] == 0, 0) - 1
    return torch.zeros(int(documents[-1]) + 1, dtype=torch.float64).index_add(0, documents, chosen)


def run_mesh_case(case):
    """Three SGD steps of a tiny Llama on the (dp, cp) mesh as `case` says, against one
    process: failures (empty when every step's loss and every parameter match), and the
    relative error of the LM head's first gradient from a mean of the replicas' means
    (wrapper "none" on the (dp, cp) mesh; else None)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    import seqpar_kernels.integrations.transformers as sp_transformers
    from seqpar_kernels.integrations.transformers.adapters import transformers_model
    from seqpar_kernels.integrations.transformers.loss import loss_through_forward

    mesh = _mesh(*case.get("mesh", ((2, 2), ("dp", "cp"))))
    mode, layout, wrapper = case["mode"], case["layout"], case["wrapper"]
    sequence_dims, data_dims = case.get("sequence_dims", "cp"), case.get("data_dims", "dp")
    dims = dict(mesh=mesh, sequence_dims=sequence_dims, data_dims=data_dims)
    reference = _model(_config(**case.get("heads", {})))
    if case.get("lora"):  # PEFT's wrapper around the model: the adapter alone trains
        from peft import LoraConfig, get_peft_model

        reference = get_peft_model(reference, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                         init_lora_weights=False))  # fmt: skip
    model = copy.deepcopy(reference)
    inner = transformers_model(model, "run_mesh_case")
    initial = [parameter.detach().clone() for parameter in reference.parameters()]
    sp = sp_transformers.apply(model, mode, layout=layout, tensor_dims=case.get("tensor_dims", ()), **dims)
    failures, mean_of_means = [], None
    if case.get("tensor_dims"):  # each tensor rank holds its share of the heads' rows
        q_weight = model.model.layers[0].self_attn.q_proj.weight
        rows = q_weight.to_local().shape[0] if isinstance(q_weight, DTensor) else None
        if rows != q_weight.shape[0] // sp.tensor_size:
            failures.append(f"q_proj {tuple(q_weight.shape)}: {rows} rows on this rank at tensor size {sp.tensor_size}")
    if case.get("checkpointing"):  # the layers run again in the backward, their collectives too
        model.gradient_checkpointing_enable()
        model.train()
    batches = [_packed(lengths, seed=index + 1) for index, lengths in enumerate(REPLICA_DOCUMENTS[: sp.data_size])]
    local = sp_transformers.shard_batch(batches[sp.data_rank], mode=mode, layout=layout, **dims)
    shift_labels = local.pop("shift_labels")

    wrapped, scale = model, 1
    if wrapper in ("fsdp_data_sequence", "fsdp_data"):
        wrapper_mesh = sp.data_parallel_mesh(shard_sequence=wrapper == "fsdp_data_sequence",
                                             replicate_dims=case.get("replicate_dims", ()))  # fmt: skip
        for layer in inner.model.layers:
            fully_shard(layer, mesh=wrapper_mesh)
        wrapped, scale = fully_shard(model, mesh=wrapper_mesh), wrapper_mesh.size()
    elif wrapper == "ddp":
        wrapper_mesh = sp.data_parallel_mesh(shard_sequence=False)
        wrapped = DistributedDataParallel(model, process_group=wrapper_mesh.get_group())
        scale = wrapper_mesh.size()
    # What all_reduce_gradients sums over: the dims no wrapper sums over.
    left = {"none": dims, "ddp": dict(mesh=mesh, sequence_dims=sequence_dims),
            "fsdp_data": dict(mesh=mesh, sequence_dims=sequence_dims), "fsdp_data_sequence": None}[wrapper]  # fmt: skip
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in (reference, model)]
    no_logits = torch.empty(0, dtype=torch.long)
    for step in range(STEPS):
        expected = _reference_loss(reference, batches)
        expected.backward()
        captured = []

        def loss_of(hidden):
            captured.append(hidden.detach())
            return sp_transformers.causal_lm_loss(model, hidden, shift_labels)

        loss = loss_through_forward(lambda: wrapped(**local, logits_to_keep=no_logits, use_cache=False), model,
                                    inner.model, loss_of)  # fmt: skip
        (loss * scale).backward()  # a wrapper averages over `scale` ranks what the loss wants summed
        if left is not None:
            sp_transformers.all_reduce_gradients(model, **left)
        error = _relative_error(loss.detach(), expected.detach())
        if not error <= FP32_LOSS_RTOL:
            failures.append(f"step {step}: loss {loss.item():.7f} vs {expected.item():.7f} (rel {error:.2e})")
        if step == 0 and wrapper == "none" and "mesh" not in case:
            # The LM head's gradient of each replica's own mean (its tokens counted over the sequence dim
            # alone), averaged over the replicas, as DDP would average it.
            own = sp_transformers.causal_lm_loss(model, captured[0], shift_labels, mesh=mesh, sequence_dims="cp")
            (head,) = torch.autograd.grad(own, model.lm_head.weight)
            dist.all_reduce(head)  # the mesh is the world: every replica's every sequence rank
            mean_of_means = _relative_error(head / 2, reference.lm_head.weight.grad)
            # Log-probs summed per document over the sequence dim alone: each replica has documents of its own.
            logps = sp_transformers.causal_lm_logprobs(model, captured[0], shift_labels, per_sequence=True,
                                                       sequence_shard=local["sequence_shard"])  # fmt: skip
            error = _relative_error(logps, _reference_document_logprobs(reference, batches[sp.data_rank]))
            if not error <= FP32_LOSS_RTOL:
                failures.append(f"per-document log-probs: relative error {error:.2e}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, ours), theirs, start in zip(model.named_parameters(), reference.parameters(), initial):
        ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
        error = _relative_error(ours.detach() - start, theirs.detach() - start)
        if not error <= FP32_UPDATE_RTOL:
            failures.append(f"{name}: update after {STEPS} steps, relative error {error:.2e}")
    return failures, mean_of_means


TENSOR_SEQUENCE = ((2, 2), ("tp", "cp"))
TENSOR_2 = dict(wrapper="none", mesh=TENSOR_SEQUENCE, data_dims=(), tensor_dims="tp")

MESH_CASES = [
    dict(mode="ring", layout="balanced", wrapper="none"),
    dict(mode="ulysses", layout="contiguous", wrapper="none"),
    dict(mode="ring", layout="balanced", wrapper="ddp"),
    dict(mode="ring", layout="balanced", wrapper="fsdp_data_sequence"),
    dict(mode="ulysses", layout="contiguous", wrapper="fsdp_data_sequence", checkpointing=True),
    dict(mode="ulysses", layout="contiguous", wrapper="fsdp_data"),
    dict(mode="ring", layout="balanced", wrapper="fsdp_data_sequence", lora=True),
    # HSDP: replicated over dp_replicate, sharded over dp_shard x cp (dp_shard of size 1).
    dict(
        mode="ring",
        layout="balanced",
        wrapper="fsdp_data_sequence",
        mesh=((2, 1, 2), ("dp_replicate", "dp_shard", "cp")),
        data_dims=("dp_replicate", "dp_shard"),
        replicate_dims=("dp_replicate",),
    ),
    # A tensor-parallel dim between data and sequence, named by no argument: FSDP2 over dp x cp around it.
    dict(mode="ring", layout="balanced", wrapper="fsdp_data_sequence", mesh=((2, 1, 2), ("dp", "tp", "cp"))),
    # USP's pair named by the user, one data replica (a dim of size 1).
    dict(mode="usp", layout="balanced", wrapper="none", mesh=((1, 2, 2), ("dp", "u", "r")), sequence_dims=("u", "r")),
    # Tensor 2 x sequence 2: each tensor rank's 4 of 8 heads (1 of 2 kv heads) split 2 and 2 by Ulysses, the kv
    # head shared; the ring on its 2 of 4 heads; 6 heads (3 per tensor rank) split 2 and 1 by Ulysses.
    dict(mode="ulysses", layout="contiguous", heads=dict(heads=8, kv_heads=2, head_dim=8), **TENSOR_2),
    dict(mode="ring", layout="balanced", **TENSOR_2),
    dict(mode="ulysses", layout="contiguous", heads=dict(heads=6, kv_heads=2, head_dim=8), **TENSOR_2),
]


def _case_id(case) -> str:
    extras = [*case.get("replicate_dims", ()), *(["checkpointing"] if case.get("checkpointing") else []),
              *(["lora"] if case.get("lora") else []),
              *([f"{case['heads']['heads']}heads"] if "heads" in case else [])]  # fmt: skip
    mesh = ["x".join(case["mesh"][1])] if "mesh" in case else []
    return "-".join([case["mode"], case["wrapper"], *extras, *mesh])


@pytest.mark.parametrize("case", MESH_CASES, ids=_case_id)
def test_data_times_sequence_matches_one_process(case):
    results = pool_for(4).run(run_mesh_case, case)
    failures = [failure for per_rank, _ in results for failure in per_rank]
    assert not failures, "\n".join(failures)
    if case["wrapper"] == "none" and "mesh" not in case:
        # The replicas' token counts differ enough that a mean of their means misses by far more than the tolerance.
        assert all(mean_of_means > 100 * FP32_UPDATE_RTOL for _, mean_of_means in results), results


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["fsdp_data", "fsdp_data_sequence"])
def test_data_tensor_sequence_with_fsdp2_on_tensor_parallel_parameters(wrapper):
    """8 ranks, data 2 x tensor 2 x sequence 2: FSDP2 over the data dim on parameters
    tensor parallelism sharded already (2-D DTensors), then all_reduce_gradients over
    the sequence dim; or FSDP2 over data x sequence alone; against one process."""
    case = dict(mode="ulysses", layout="contiguous", wrapper=wrapper, mesh=((2, 2, 2), ("dp", "tp", "cp")),
                tensor_dims="tp", heads=dict(heads=8, kv_heads=2, head_dim=8))  # fmt: skip
    failures = [failure for per_rank, _ in pool_for(8).run(run_mesh_case, case) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_data_times_usp_with_fsdp2():
    """8 ranks, data 2 x USP's pair (ulysses 2 x ring 2) on one mesh of the user's names,
    FSDP2 over data x both sequence dims, against one process."""
    case = dict(mode="usp", layout="balanced", wrapper="fsdp_data_sequence", mesh=((2, 2, 2), ("dp", "u", "r")),
                sequence_dims=("u", "r"))  # fmt: skip
    failures = [failure for per_rank, _ in pool_for(8).run(run_mesh_case, case) for failure in per_rank]
    assert not failures, "\n".join(failures)


def run_refusals():
    """What cannot work on a (dp, cp) mesh, each call on every rank: None where it raised
    the expected ValueError, else what happened."""
    import seqpar_kernels.integrations.transformers as sp_transformers
    from seqpar_kernels.parallel.parallelism import SequenceParallelism

    mesh = _mesh((2, 2), ("dp", "cp"))
    model = _model(_config())
    hidden, weight = torch.randn(1, 5, 8), torch.randn(VOCAB, 8)
    labels = torch.randint(0, VOCAB, (1, 5))
    named = r"mesh \(2, 2\) with dims \('dp', 'cp'\)"
    calls = {
        "a dim the mesh lacks": (
            lambda: sp_transformers.apply(model, "ring", mesh=mesh, sequence_dims="sp", data_dims="dp"),
            r"no dims \['sp'\].*" + named,
        ),
        "a data dim the mesh lacks": (
            lambda: sp_transformers.shard_batch(
                _packed([4, 4], 0), mode="ring", mesh=mesh, sequence_dims="cp", data_dims=("dp", "dp_shard")
            ),
            r"no dims \['dp_shard'\].*" + named,
        ),
        "a dim named twice": (
            lambda: sp_transformers.sequence_parallel_cross_entropy(
                hidden, weight, labels, mesh=mesh, sequence_dims="cp", data_dims=("dp", "cp")
            ),
            r"\['cp'\] named more than once.*" + named,
        ),
        "the sequence dim twice": (
            lambda: SequenceParallelism.resolve("resolve", "usp", mesh=mesh, sequence_dims=("cp", "cp")),
            r"\['cp'\] named more than once",
        ),
        "usp on one dim": (
            lambda: SequenceParallelism.resolve("resolve", "usp", mesh=mesh, sequence_dims="cp"),
            r"mode='usp' splits the sequence over two dims.*\('cp',\)",
        ),
        "ring on two dims": (
            lambda: SequenceParallelism.resolve("resolve", "ring", mesh=mesh, sequence_dims=("dp", "cp")),
            r"over one dim",
        ),
        "data dims without sequence dims": (
            lambda: sp_transformers.all_reduce_gradients(model, mesh=mesh, data_dims="dp"),
            r"needs sequence_dims=",
        ),
        "sequence dims with a group": (
            lambda: sp_transformers.causal_lm_logprobs(
                model, torch.randn(1, 5, 64), labels, group=mesh.get_group("cp"), mesh=mesh, sequence_dims="cp"
            ),
            r"pass no group=",
        ),
        "a mesh without names": (
            lambda: sp_transformers.all_reduce_gradients(model, mesh=_mesh((4,), None), sequence_dims="cp"),
            r"a DeviceMesh with named dims",
        ),
        "a wrapper's mesh without data dims": (
            lambda: SequenceParallelism.resolve("resolve", "ring", group=mesh.get_group("cp")).data_parallel_mesh(),
            r"knows no data dims",
        ),
    }
    return {what: raises(call, match) for what, (call, match) in calls.items()}


def run_tensor_refusals():
    """What tensor parallelism cannot honour on a (tp 2, cp 2) mesh, each call on every
    rank: None where it raised the expected ValueError, else what happened."""
    import seqpar_kernels.integrations.transformers as sp_transformers
    from seqpar_kernels.parallel.parallelism import SequenceParallelism

    mesh = _mesh(*TENSOR_SEQUENCE)
    dims = dict(mesh=mesh, sequence_dims="cp")
    sharded = _model(_config())
    sp_transformers.apply(sharded, "ring", tensor_dims="tp", **dims)
    calls = {
        # 3 kv heads over 2 tensor ranks: a rank would hold half a kv head.
        "heads that cannot be split": (
            lambda: sp_transformers.apply(
                _model(_config(heads=6, kv_heads=3, head_dim=8)), "ulysses", tensor_dims="tp", **dims
            ),
            r"over 2 ranks .* must divide the attention heads and the key/value heads: the model has 6 and 3",
        ),
        "a reduction over the tensor dim": (
            lambda: sp_transformers.all_reduce_gradients(sharded, data_dims="tp", **dims),
            r"model.layers.0.self_attn.q_proj.weight \(64, 64\) is sharded \(S\(0\)\) over mesh dim 'tp'",
        ),
        "a model sharded already": (
            lambda: sp_transformers.apply(sharded, "ring", tensor_dims="tp", **dims),
            r"DTensors already",
        ),
        "tensor dims without sequence dims": (
            lambda: SequenceParallelism.resolve("resolve", "ring", mesh=mesh, tensor_dims="tp"),
            r"tensor_dims='tp' needs sequence_dims=",
        ),
        "a dim both the data's and the tensor's": (
            lambda: SequenceParallelism.resolve("resolve", "ring", data_dims="tp", tensor_dims="tp", **dims),
            r"\['tp'\] named more than once",
        ),
    }
    return {what: raises(call, match) for what, (call, match) in calls.items()}


def run_other_dims_never_reduced():
    """On a (tp, cp) mesh whose tensor-parallel ranks hold different labels, the loss
    over sequence_dims="cp" counts its cp group's tokens alone: (its group's loss, the
    loss of one process over those tokens)."""
    import torch.distributed as dist

    from seqpar_kernels.parallel.cross_entropy import sequence_parallel_cross_entropy_from_logits

    mesh = _mesh((2, 2), ("tp", "cp"))
    tp, cp = mesh.get_local_rank("tp"), mesh.get_local_rank("cp")
    generator = torch.Generator().manual_seed(3)
    # (tp, cp, tokens): tp row 0 holds 3 tokens per rank, tp row 1 holds 7.
    logits = [[torch.randn(1, 3 + 4 * row, VOCAB, generator=generator) for _ in range(2)] for row in range(2)]
    labels = [[torch.randint(0, VOCAB, (1, 3 + 4 * row), generator=generator) for _ in range(2)] for row in range(2)]
    loss = sequence_parallel_cross_entropy_from_logits(logits[tp][cp], labels[tp][cp], mesh=mesh, sequence_dims="cp")
    expected = torch.nn.functional.cross_entropy(torch.cat(logits[tp], 1)[0], torch.cat(labels[tp], 1)[0])
    assert dist.get_world_size() == 4
    return loss.item(), expected.item()


def test_refusals_raise_on_every_rank_and_other_dims_are_never_reduced():
    for refusals in (run_refusals, run_tensor_refusals):
        for per_rank in pool_for(4).run(refusals):
            assert all(result is None for result in per_rank.values()), per_rank
    for loss, expected in pool_for(4).run(run_other_dims_never_reduced):
        assert loss == pytest.approx(expected, rel=FP32_LOSS_RTOL)
