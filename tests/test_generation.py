"""model.generate over a KV cache sharded across ranks
(seqpar_kernels/integrations/transformers/generation.py): small random models after
apply(model, mode) on gloo ranks against the same model's generate in one process:
greedy tokens equal, scores to fp32 rounding, sampling with the same seed, left-padded
batches, a next turn over the returned cache, every rank's share of the cache, the
layers sharded by tensor parallelism beside the sequence; what cannot run raises."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("generate over a sharded cache needs transformers 5", allow_module_level=True)

import test_transformers_integration as integration  # noqa: E402
from conftest import pool_for  # noqa: E402
from on_ranks import on_every_rank, raises  # noqa: E402

SCORE_ATOL = 2e-4
NEW_TOKENS = 5


def _prompt(batch: int, length: int, padded: bool, seed: int = 3, pads=(3, 5)):
    """Token ids (batch, length) from 3 up, the rows after the first left-padded by 0s
    (`pads` of them) where padded; and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, integration.VOCAB, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        for row, count in zip(range(1, batch), pads):
            ids[row, :count], mask[row, :count] = 0, 0
    return ids, mask


class _Streamer:
    """A streamer as generate feeds one (put each step's tokens, end): what it was given."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.reshape(-1, value.shape[-1] if value.dim() > 1 else 1))

    def end(self):
        pass


def _generate(model, ids, mask, seed, cache=None, sample=False, streamer=None, new_tokens=NEW_TOKENS):
    torch.manual_seed(seed)
    options = dict(do_sample=True, top_k=20) if sample else dict(do_sample=False)
    if streamer is not None:
        options["streamer"] = streamer
    # use_cache: the families' configs (built for training) say False.
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, pad_token_id=0, cache=cache,
                          use_cache=True, return_dict_in_generate=True, output_scores=True, **options)  # fmt: skip


def _compare(name: str, ours, theirs) -> list[str]:
    failures = []
    if not torch.equal(ours.sequences, theirs.sequences):
        failures.append(f"{name}: tokens {ours.sequences.tolist()} != {theirs.sequences.tolist()}")
    else:
        for step, (mine, expected) in enumerate(zip(ours.scores, theirs.scores)):
            # Sampling's top-k leaves -inf where a token is filtered out: the same ones on both sides.
            finite = torch.isfinite(expected)
            if not torch.equal(finite, torch.isfinite(mine)):
                failures.append(f"{name}: step {step} filters other tokens")
            elif finite.any() and not (mine[finite] - expected[finite]).abs().max().item() <= SCORE_ATOL:
                failures.append(f"{name}: step {step} scores differ by {(mine - expected)[finite].abs().max():.2e}")
    return failures


def _groups(case) -> tuple[dict, int]:
    """apply()'s groups for the case, and the sequence's ranks: the whole world, or with
    tensor_parallel a (cp, tp 2) mesh whose tp dim shards the layers (each rank's cache
    then holds its tensor rank's kv heads and its share of the sequence)."""
    import torch.distributed as dist

    if not case.get("tensor_parallel"):
        return integration._parallelism(case["mode"], case.get("ulysses", 2)), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    pieces = dist.get_world_size() // 2
    mesh = init_device_mesh("cpu", (pieces, 2), mesh_dim_names=("cp", "tp"))
    return dict(mesh=mesh, sequence_dims="cp", tensor_dims="tp"), pieces


@on_every_rank
def run_generate(cases):
    """Per case: what differs from one process (empty: nothing)."""

    import seqpar_kernels.integrations.transformers as sp_transformers

    failures = []
    for case in cases:
        groups, pieces = _groups(case)
        reference = integration._family_model(case.get("family", "mistral"), spec=case.get("family_spec")).eval()
        model = copy.deepcopy(reference)
        sp_transformers.apply(model, case["mode"], layout=case.get("layout", "contiguous"), **groups)
        ids, mask = _prompt(case.get("batch", 2), case.get("length", 19), case.get("padded", True),
                            pads=case.get("pads", (3, 5)))  # fmt: skip
        name = case["id"]
        streamers = (_Streamer(), _Streamer()) if case.get("streamer") else (None, None)
        ours, theirs = (_generate(m, ids, mask, seed=11, sample=case.get("sample", False), streamer=streamer)
                        for m, streamer in zip((model, reference), streamers))  # fmt: skip
        failures += _compare(name, ours, theirs)
        if case.get("streamer"):
            streamed = [torch.cat([t.reshape(ids.shape[0], -1) for t in s.tokens], 1) for s in streamers]
            if not torch.equal(streamed[0], ours.sequences) or not torch.equal(streamed[0], streamed[1]):
                failures.append(f"{name}: the streamer got {streamed[0].tolist()}, generate returned "
                                f"{ours.sequences.tolist()}")  # fmt: skip
        cache = ours.cache
        failures += _within_share(f"{name} after generate", cache, theirs.sequences, pieces, 1)
        if case.get("next_turn"):
            more = torch.randint(3, integration.VOCAB, (ids.shape[0], 6), generator=torch.Generator().manual_seed(5))
            ids2 = torch.cat([theirs.sequences, more], 1)
            mask2 = torch.cat([mask, torch.ones(ids.shape[0], ids2.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
            # next_turn_tokens=1: the cache right after the turn's chunk, before decode steps even it out.
            turn_tokens = case.get("next_turn_tokens", NEW_TOKENS)
            ours2 = _generate(model, ids2, mask2, seed=12, cache=cache, new_tokens=turn_tokens)
            theirs2 = _generate(reference, ids2, mask2, seed=12, cache=theirs.cache, new_tokens=turn_tokens)
            failures += _compare(f"{name} next turn", ours2, theirs2)
            failures += _within_share(f"{name} after a next turn", ours2.cache, theirs2.sequences, pieces, 1)
    return failures


def _within_share(name: str, cache, sequences, ranks: int, slack: int) -> list[str]:
    """What breaks the memory bound: this rank's attention layers hold more slots than
    ceil(total / ranks) + slack, total one process's slots a layer: batch x the columns
    whose keys it caches (all of `sequences` (batch, columns) but the last token's; a
    DynamicCache without a sliding window, left padding included); or another count than
    the cache's own."""
    total = sequences.shape[0] * (sequences.shape[1] - 1)
    bound = -(-total // ranks) + slack
    held = {layer.keys.shape[2] for layer in cache.layers if getattr(layer, "keys", None) is not None} | {cache.slots}
    if max(held) > bound:
        return [f"{name}: this rank's layers hold {sorted(held)} slots, its share is {bound} (one process: {total})"]
    if len(held) != 1 or int(cache.lengths.sum()) != cache.slots:
        return [f"{name}: the layers hold {sorted(held)} slots, the cache counts {cache.slots}"]
    return []


@on_every_rank
def run_generate_under_autocast(cases):
    """Per case: generate under torch.autocast in the case's dtype, ours against the
    model's own in one process, by the accuracy rule (tools/reference.py): the same
    tokens as theirs (greedy; and a next turn over the cache), each step's scores within
    twice theirs' error plus a unit of roundoff, both against the one process without
    autocast (fp32: the exact answer), while theirs had drawn the exact run's tokens."""
    import seqpar_kernels.integrations.transformers as sp_transformers
    from tools import reference as accuracy

    failures = []
    for case in cases:
        groups = integration._parallelism(case["mode"], 2)
        exact_model = integration._family_model(case.get("family", "mistral")).eval()
        model = copy.deepcopy(exact_model)
        sp_transformers.apply(model, case["mode"], layout=case.get("layout", "contiguous"), **groups)
        ids, mask = _prompt(2, 19, True)
        more = torch.randint(3, integration.VOCAB, (ids.shape[0], 6), generator=torch.Generator().manual_seed(5))
        turns = {}
        for name, each, autocast in (("exact", exact_model, False), ("theirs", exact_model, True),
                                     ("ours", model, True)):  # fmt: skip
            with torch.autocast("cpu", dtype=case["dtype"], enabled=autocast):
                first = _generate(each, ids, mask, seed=11)
                # The next turn after the exact tokens: every run extends the same sequences.
                ids2 = torch.cat([turns["exact"][0].sequences if turns else first.sequences, more], 1)
                mask2 = torch.cat([mask, torch.ones(ids.shape[0], ids2.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
                turns[name] = (first, _generate(each, ids2, mask2, seed=12, cache=first.cache))
        for turn, label in enumerate(("", " next turn")):
            ours, theirs, exact = (turns[name][turn] for name in ("ours", "theirs", "exact"))
            if not torch.equal(ours.sequences, theirs.sequences):
                failures.append(f"{case['id']}{label}: tokens {ours.sequences.tolist()} != {theirs.sequences.tolist()}")
                continue
            # A step's scores compare where theirs and the exact run had drawn the same tokens before it.
            agree = (theirs.sequences == exact.sequences)[:, -NEW_TOKENS:].all(0).cumprod(0).tolist()
            for step, (mine, plain, want) in enumerate(zip(ours.scores, theirs.scores, exact.scores)):
                if step > 0 and not agree[step - 1]:
                    break
                error, yardstick = accuracy.max_error(mine, want), accuracy.max_error(plain, want)
                bound = accuracy.error_bound(case["dtype"], yardstick, accuracy.magnitude(want))
                if not error <= bound:
                    failures.append(f"{case['id']}{label}: step {step} scores err by {error:.3g} > {bound:.3g}")
    return failures


def _case(mode, **extra):
    named = [f"{key}={value}" for key, value in extra.items() if key != "family_spec"]
    return dict(id="-".join([mode, *named]), mode=mode, **extra)


@pytest.mark.parametrize("world_size", [2, 3])
def test_greedy_and_sampled_match_one_process(world_size):
    cases = [
        _case("ring", layout="balanced", next_turn=True),
        _case("ulysses", sample=True, next_turn=True),
        _case("ring", family="gemma2", padded=False),
        _case("ring", layout="balanced", family="gpt_oss", batch=3),
        # Chunked attention (chunks of 6 over a 23-token prompt) and a no-RoPE layer's
        # temperature, one sequence; a streamer fed on every rank.
        _case("ring", layout="balanced", family="llama4", batch=1, length=23, padded=False, streamer=True),
    ]
    failures = [failure for per_rank in pool_for(world_size).run(run_generate, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_under_autocast_matches_one_process(dtype):
    """generate under torch.autocast (TRL's default bf16 generates so): the decode
    partials and the prefill keep fp32 statistics under it."""
    cases = [_case("ring", layout="balanced", dtype=dtype), _case("ulysses", family="gemma2", dtype=dtype)]
    failures = [failure for per_rank in pool_for(2).run(run_generate_under_autocast, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_usp_grid():
    """Decode and a next turn over the cache (pass-Q over the 2 x 2 grid)."""
    cases = [_case("usp", layout="balanced", next_turn=True),
             _case("usp", family="cohere2", sample=True, batch=1, length=23)]  # fmt: skip
    failures = [failure for per_rank in pool_for(4).run(run_generate, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_holds_at_most_its_share_of_the_cache(world_size):
    """A left-padded batch of unequal prompts (19, 10, 15, 17 and 12 tokens) in every mode
    and layout, and an unpadded batch of 5 (where the share has no padding to spare):
    every rank's cache within ceil(one process's slots / P) + 1 a layer, after generate
    and right after a next turn's chunk (computed in pieces of whole columns of the batch:
    kept where computed, a rank would pass its share by up to batch - 1)."""
    usp = dict(ulysses=2 if world_size % 2 == 0 else 1)
    turn = dict(batch=5, next_turn=True, next_turn_tokens=1)
    cases = [_case(mode, layout=layout, pads=(9, 4, 2, 7), **turn, **(usp if mode == "usp" else {}))
             for mode, layout in (("ring", "contiguous"), ("ring", "balanced"), ("ulysses", "contiguous"),
                                  ("usp", "contiguous"), ("usp", "balanced"))]  # fmt: skip
    cases += [_case("ring", layout="contiguous", padded=False, **turn),
              _case("usp", layout="balanced", padded=False, **turn, **usp)]  # fmt: skip
    failures = [failure for per_rank in pool_for(world_size).run(run_generate, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_hybrid_models():
    """Models with recurrent mixers: their states after the prompt come from the
    sequence-parallel ops (every sequence's, on every rank), the decode steps run on
    every rank alike."""
    from test_transformers_hybrid import HYBRID_FAMILIES, _here

    cases = [
        _case("ring", layout="balanced", family=family, family_spec=HYBRID_FAMILIES[family], sample=index % 2 == 1)
        for index, family in enumerate(_here())
    ]  # fmt: skip
    cases.append(_case("usp", family="qwen3_next", family_spec=HYBRID_FAMILIES["qwen3_next"]))
    failures = [failure for per_rank in pool_for(4).run(run_generate, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_with_tensor_parallelism():
    """On a (cp 2, tp 2) mesh, the layers sharded over tp: decode and a next turn."""
    cases = [_case("ring", layout="balanced", tensor_parallel=True, next_turn=True),
             _case("ulysses", tensor_parallel=True, next_turn=True)]  # fmt: skip
    failures = [failure for per_rank in pool_for(4).run(run_generate, cases) for failure in per_rank]
    assert not failures, "\n".join(failures)


def test_one_process():
    """Without torch.distributed: the model alone, the same tokens."""
    import seqpar_kernels.integrations.transformers as sp_transformers

    reference = integration._family_model("mistral").eval()
    model = copy.deepcopy(reference)
    sp_transformers.apply(model, "ring")
    ids, mask = _prompt(2, 13, True)
    assert not _compare("one process", _generate(model, ids, mask, 1), _generate(reference, ids, mask, 1))


@on_every_rank
def run_refusals():
    import torch.distributed as dist

    import seqpar_kernels.integrations.transformers as sp_transformers

    groups = integration._parallelism("ring", 2)
    model = copy.deepcopy(integration._family_model("mistral")).eval()
    sp_transformers.apply(model, "ring", **groups)
    ids, mask = _prompt(2, 11, True)
    problems = {}
    right = mask.flip(1)
    problems["right padding"] = raises(lambda: _generate(model, ids, right, 1), "left")
    problems["beams"] = raises(
        lambda: model.generate(ids, attention_mask=mask, max_new_tokens=2, num_beams=2, pad_token_id=0, use_cache=True),
        "beam",
    )
    # Samplers seeded differently on the ranks: the first step that differs raises everywhere.
    problems["different draws"] = raises(
        lambda: _generate(model, ids, mask, seed=1 + dist.get_rank(), sample=True), "different tokens"
    )
    problems["different prompts"] = raises(lambda: _generate(model, ids + dist.get_rank(), mask, 1), "different tokens")
    return {name: problem for name, problem in problems.items() if problem}


def test_what_cannot_run_raises():
    for rank, problems in enumerate(pool_for(2).run(run_refusals)):
        assert not problems, f"rank {rank}: {problems}"
