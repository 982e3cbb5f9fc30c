"""The bytes ulysses_attention sends (comm_stats) on 1-4 gloo ranks, against the
formulas of seqpar_kernels.traffic (ulysses_bytes, derived from the head split alone):
heads not divisible by the ranks, GQA and MQA with kv heads fewer than the ranks, uneven
sequence pieces."""

from __future__ import annotations

import pytest
import torch
from on_ranks import backward_on_every_rank, on_every_rank, rank_and_world, timeout_group
from ulysses_cases import UNEVEN, full_inputs, lengths_for, make_case

from seqpar_kernels import comm_stats, ulysses_attention
from seqpar_kernels.traffic import kv_heads_read, ulysses_bytes
from tools import reference

NAMES = ("out", "dq", "dk", "dv")


# ----------------------------------------------------------------------------------
# communication volume
# ----------------------------------------------------------------------------------


EVEN_SHAPE = dict(batch=2, per_rank=12, head_dim=16)


@on_every_rank
def run_comm_stats(heads, kv_heads):
    """Bytes sent by one ulysses_attention call, forward and forward + backward, with
    heads and sequence divisible by P. Returns (forward, forward+backward, calls forward,
    calls forward+backward)."""
    _, world = rank_and_world()
    batch, per_rank, head_dim = EVEN_SHAPE["batch"], EVEN_SHAPE["per_rank"], EVEN_SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, per_rank, heads, head_dim, generator=gen)
    k = torch.randn(batch, per_rank, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch, per_rank, kv_heads, head_dim, generator=gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with comm_stats() as forward:
        out = ulysses_attention(q, k, v, causal=True)
    with comm_stats() as both:
        out = ulysses_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
    return forward.bytes_sent, both.bytes_sent, forward.calls, both.calls


@pytest.mark.parametrize("kv_heads", ["mha", "gqa"])
def test_comm_stats_match_formula(ranks, kv_heads):
    world = ranks.world_size
    heads = 12  # divisible by every world size tested
    # GQA with H_kv = P: each rank's q heads read exactly one kv head, kv split evenly.
    num_kv = heads if kv_heads == "mha" else world
    for rank, (forward, both, calls_fwd, calls_both) in enumerate(ranks.run(run_comm_stats, heads, num_kv)):
        expected = ulysses_bytes(
            [EVEN_SHAPE["per_rank"]] * world, rank, batch=EVEN_SHAPE["batch"], num_heads=heads, num_kv_heads=num_kv,
            head_dim=EVEN_SHAPE["head_dim"], element_size=4,
        )  # fmt: skip
        assert forward == expected.forward, f"rank {rank}: forward sent {forward} B, formula {expected.forward} B"
        assert both == expected.sent(with_backward=True), f"rank {rank}: fwd+bwd sent {both} B, formula {expected}"
        assert calls_fwd == 2, f"rank {rank}: {calls_fwd} collectives forward, expected 2 (qkv in one)"
        assert calls_both == 4, f"rank {rank}: {calls_both} collectives fwd+bwd, expected 4"


# GQA/MQA with fewer kv heads than ranks, kv groups split across ranks, a rank with no
# heads, uneven sequence pieces: the exact bytes, by traffic.ulysses_bytes, which derives
# them from the q head split alone (not from the library's plan), so that a plan that
# sends repeated K/V, or kv heads a rank does not read, or misses one that it does, is
# caught.

EVEN4 = {world: [4] * world for world in (1, 2, 3, 4)}

COMM_GQA_CASES = [
    # P=3: q heads [3,3,2], kv head 0 serves ranks 0 and 1 (a group split across
    # ranks); P=4: 2 kv heads < 4 ranks, each kv head goes to two ranks.
    make_case("gqa-8-2", H=8, H_kv=2, D=16, S=EVEN4, causal=True, B=2, dtype=torch.float32),
    # P=2: q heads [3,3] need kv {0,1} and {1,2}; P=4: q heads [2,2,1,1], kv 2 serves
    # ranks 2 and 3, 3 kv heads < 4 ranks.
    make_case("gqa-6-3", H=6, H_kv=3, D=16, S=EVEN4, causal=False, B=2, dtype=torch.float32),
    # MQA: the one kv head goes to every rank; bf16 (2-byte elements).
    make_case("mqa-5-1", H=5, H_kv=1, D=16, S=EVEN4, causal=True, B=2, dtype=torch.bfloat16),
    # MQA with a rank that has no q heads on P=4 (heads [1,1,1,0]): it is sent nothing.
    make_case("mqa-3-1", H=3, H_kv=1, D=16, S=EVEN4, causal=False, B=1, dtype=torch.float32),
    # GQA with sequence pieces that differ by rank (one empty on P=3).
    make_case("gqa-6-2-uneven", H=6, H_kv=2, D=16, S=UNEVEN, causal=True, B=2, dtype=torch.float32),
]


def expected_ulysses_bytes(case, world, sizes, num_kv_heads=None):
    """Per rank: the CallBytes (forward, backward) of one ulysses_attention call of
    `case` over pieces of `sizes` rows (traffic.ulysses_bytes). num_kv_heads=case["H"]:
    what an implementation that repeats K/V to H heads before the exchange would send."""
    shape = dict(batch=case["B"], num_heads=case["H"], num_kv_heads=num_kv_heads or case["H_kv"], head_dim=case["D"])
    element_size = torch.empty((), dtype=case["dtype"]).element_size()
    return [ulysses_bytes(sizes, rank, **shape, element_size=element_size) for rank in range(world)]


@on_every_rank
def run_comm_stats_gqa(cases):
    """Per case: (id, forward bytes, forward calls, backward bytes, backward calls) of
    one ulysses_attention call and its backward on this rank."""
    rank, world = rank_and_world()
    results = []
    for case in cases:
        sizes = lengths_for(case["S"], world)
        case = dict(case, S_total=sum(sizes))
        q, k, v, dout = (
            reference.contiguous_piece(t, sizes, rank).to(case["dtype"]).detach().clone()
            for t in full_inputs(case, seed=7)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with comm_stats() as forward:
            out = ulysses_attention(q, k, v, causal=case["causal"], seq_lens=sizes, group=timeout_group())
        with comm_stats() as backward:
            backward_on_every_rank(out, dout)
        results.append((case["id"], forward.bytes_sent, forward.calls, backward.bytes_sent, backward.calls))
    return results


def test_comm_stats_gqa_kv_heads_fewer_than_ranks_match_formula(ranks):
    world = ranks.world_size
    per_rank = ranks.run(run_comm_stats_gqa, COMM_GQA_CASES)
    # The cases cover what they claim on this world size.
    needed = {case["id"]: kv_heads_read(case["H"], case["H_kv"], world) for case in COMM_GQA_CASES}
    if world >= 3:
        assert any(case["H_kv"] < world for case in COMM_GQA_CASES)
    if world >= 2:
        # Some kv head is needed by two ranks (a GQA group split across ranks).
        assert any(
            any(len([s for s in sets if kv in s]) >= 2 for kv in range(case["H_kv"]))
            for case, sets in ((c, needed[c["id"]]) for c in COMM_GQA_CASES)
            if case["H_kv"] > 1
        )
    failures, tells_repeated_apart = [], []
    for case in COMM_GQA_CASES:
        sizes = lengths_for(case["S"], world)
        forward, backward = zip(*expected_ulysses_bytes(case, world, sizes))
        repeated = [sent.forward for sent in expected_ulysses_bytes(case, world, sizes, num_kv_heads=case["H"])]
        assert all(r >= f for r, f in zip(repeated, forward)), (case["id"], repeated, forward)
        if sum(repeated) > sum(forward):
            tells_repeated_apart.append(case["id"])
        if world == 1:
            assert forward == backward == (0,)
        for rank, results in enumerate(per_rank):
            (case_id, fwd, fwd_calls, bwd, bwd_calls) = results[COMM_GQA_CASES.index(case)]
            assert case_id == case["id"]
            kv_heads = [sorted(heads) for heads in needed[case_id]]
            where = f"P={world} rank {rank} {case_id} (seq {sizes}, kv heads needed {kv_heads})"
            if fwd != forward[rank]:
                failures.append(f"{where}: forward sent {fwd} B, formula {forward[rank]} B")
            if bwd != backward[rank]:
                failures.append(f"{where}: backward sent {bwd} B, formula {backward[rank]} B")
            if (fwd_calls, bwd_calls) != (2, 2):
                failures.append(f"{where}: {fwd_calls} + {bwd_calls} collectives, expected 2 + 2")
    assert not failures, "\n".join(failures)
    if world >= 2:
        # K/V repeated to H heads before the exchange would send more in these cases
        # (not in mqa-3-1 on P=3/4, where every rank has one q head), so the formula
        # tells the two apart and the test can fail.
        assert {"gqa-8-2", "gqa-6-3", "mqa-5-1", "gqa-6-2-uneven"} <= set(tells_repeated_apart), tells_repeated_apart
