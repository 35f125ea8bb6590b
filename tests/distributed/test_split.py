"""Prefill in one layout and decode in another on the same 8 gloo ranks: prefill at tp=4 (two DP
groups of 4 ranks), decode at tp=1 (eight DP groups of one rank), the experts over the world in
both. Group 0 prefills 4 requests, group 1 three: each decode rank takes one of its prefill
group's requests (`serving.Split.share`) and rank 7 none, joining each decode step with no token.

On every rank: the prefill's logits, the cache handed over (`serving.hand_over`: the rank's
requests' rows, copied from the prefill group's cache, which every rank of the group holds
whole) and each decode step's logits match the single-device model at the fp32 bound; and
`serving.generate(..., split=...)` gives the single-device model's greedy tokens for every
request of the group."""

from __future__ import annotations

import pytest

from dsv41_compile.deepseek_v41.serving import Split
from dsv41_compile.deepseek_v41.testing.presets import ONE_LAYER, SINKHORN_3
from dsv41_compile.deepseek_v41.testing.split import SplitSpec, split_on_rank
from dsv41_compile.testing.multirank import RankPool

SPEC = SplitSpec(overrides=(*ONE_LAYER, *SINKHORN_3), requests=(4, 3))


@pytest.fixture(scope="module")
def results():
    return RankPool.shared(8).run(split_on_rank, SPEC)


@pytest.mark.slow
def test_prefill_at_tp4_then_decode_at_tp1_match_the_single_device_model(results):
    assert [r["mine"] for r in results] == [[0], [1], [2], [3], [0], [1], [2], []]
    for rank, r in enumerate(results):
        assert r["prefill"] <= 1e-5, (rank, r["prefill"])
        assert r["cache"] <= 1e-5, (rank, r["cache"])
        assert len(r["decode"]) == SPEC.decode_steps
        assert max(r["decode"]) <= 1e-5, (rank, r["decode"])


@pytest.mark.slow
def test_generate_split_gives_the_greedy_tokens_of_one_device(results):
    for rank, r in enumerate(results):
        assert len(r["tokens"]) == SPEC.requests[rank // 4]
        assert all(len(t) == SPEC.max_new_tokens for t in r["tokens"])
        assert r["tokens"] == r["greedy"], rank
        # the prefill's program and the decode's, each compiled once (generate runs the
        # programs of the checked calls: the same token marks and rows asked for)
        assert r["programs"] == 2, (rank, r["programs"])


def test_a_decode_layout_that_crosses_prefill_groups_is_refused():
    with pytest.raises(ValueError, match=r"decode_tp must divide prefill_tp, so that each decode"):
        Split(lambda *a, **k: None, prefill_tp=2, decode_tp=4)
    # the share: a prefill group of 4 ranks decoding at tp=2 is two decode groups
    split = Split(lambda *a, **k: None, prefill_tp=4, decode_tp=2)
    assert [split.share(rank, 5) for rank in range(4)] == [[0, 2, 4], [0, 2, 4], [1, 3], [1, 3]]
