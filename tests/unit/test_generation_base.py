"""EngineLayout: generation work is split by engine (consecutive ranks), not by the policy's data-parallel rank."""

from __future__ import annotations

import pytest

from nemo_disco.generation.base import EngineLayout


def test_policy_tp2_with_generation_tp1_gives_every_rank_its_own_share():
    # 8 ranks, policy TP 2 (DP 4), generation TP 1: 8 engines. The two TP peers of a policy replica
    # (ranks 0 and 1) generate different prompts, each once.
    layouts = [EngineLayout.of(r, 8, 1) for r in range(8)]
    assert [lay.index for lay in layouts] == list(range(8)) and all(lay.leader for lay in layouts)
    shares = [list(range(128))[lay.share(128)] for lay in layouts]
    assert shares[0] == list(range(16)) and shares[1] == list(range(16, 32))
    assert sorted(x for s in shares for x in s) == list(range(128))


def test_generation_tp2_engines_share_their_requests():
    layouts = [EngineLayout.of(r, 8, 2) for r in range(8)]
    assert [(lay.index, lay.leader) for lay in layouts[:4]] == [(0, True), (0, False), (1, True), (1, False)]
    assert layouts[0].count == 4 and layouts[0].share(10) == layouts[1].share(10)


def test_uneven_shares_cover_everything_once():
    layouts = [EngineLayout.of(r, 3, 1) for r in range(3)]
    shares = [list(range(10))[lay.share(10)] for lay in layouts]
    assert [len(s) for s in shares] == [3, 3, 4] and sum(shares, []) == list(range(10))
    assert [list(range(2))[lay.share(2)] for lay in layouts] == [[], [0], [1]]  # fewer items than engines


def test_bad_layout():
    with pytest.raises(ValueError, match="does not divide"):
        EngineLayout.of(0, 6, 4)


def test_buckets_hold_at_most_bucket_bytes_and_a_larger_tensor_alone():
    import torch

    from nemo_disco.generation.base import buckets

    # float32 tensors of 4, 8, 40 and 4 elements: 16, 32, 160 and 16 bytes; buckets of 64 bytes.
    stream = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([4, 8, 40, 4])]
    assert [[name for name, _ in b] for b in buckets(stream, 64)] == [["t0", "t1"], ["t2"], ["t3"]]
    # Aligned to 64 bytes every tensor takes a whole bucket of 64: t0 and t1 no longer share one.
    assert [[name for name, _ in b] for b in buckets(stream, 64, align=64)] == [["t0"], ["t1"], ["t2"], ["t3"]]
    assert list(buckets([], 64)) == []
