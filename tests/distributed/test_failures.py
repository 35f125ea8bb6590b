"""Faults serving hits, on real gloo ranks, each asserting what the user sees: a TP rank handed
another batch (`check_inputs`; 8 ranks, tp=4, dp=2), a rank that dies, a rank that hangs (4
ranks, tp=2, dp=2, experts over all 4: a lost rank's TP peers and the other DP group's ranks
both wait on it, as on 8; each of these runs starts its own process group, with a timeout)."""

from __future__ import annotations

import pytest

from dsv41_compile.deepseek_v41.testing.faults import different_batch_on_one_rank, peer_lost
from dsv41_compile.testing.multirank import RankPool, run_ranks

pytestmark = pytest.mark.slow

WORLD, TP = 8, 4
LOST_WORLD, LOST_TP = 4, 2
TIMEOUT = 10.0
"""The process group's timeout in these runs, seconds."""


def test_a_tp_rank_with_another_batch_is_an_error_naming_the_ranks_and_the_row():
    """With check_inputs, every rank of the TP group whose rank 2 got another batch raises the
    same error before any collective (the other group, experts replicated, serves on);
    validate_batch checks a batch against the cache the compiled model writes."""
    results = RankPool.shared(WORLD).run(different_batch_on_one_rank, 2)
    message = (
        "check_inputs: the ranks of TP group 0 were given different batches: rank 0 has 3 "
        "tokens and rank 2 3; they differ first at token 1, where positions is 2 on rank 0 "
        "and 7 on rank 2. Every rank of a TP group must be called with its DP group's whole "
        "batch (the same input_ids, positions, slots)"
    )
    assert [r["error"] for r in results] == [message] * TP + [None] * TP
    for r in results:
        assert r["stale"] == (
            "token 0: position 0 does not continue the cache: slot 0 holds 3 tokens, so the "
            "next position must be 3, got 0"
        )


@pytest.mark.parametrize("hang", [0.0, TIMEOUT + 5], ids=["dies", "hangs"])
def test_a_lost_rank_fails_the_others_within_the_timeout(hang):
    """Rank 3 dies (its process exits) or hangs (it stops calling, for 5 s longer than the
    timeout, then exits) after the first batch; every other rank's next call fails with an
    error that says so, within the process group's timeout (and before a hung rank's exit
    could end it) -- also in rank 3's own TP group, which c10d would have given 30 minutes."""
    results = run_ranks(peer_lost, LOST_WORLD, 3, hang, LOST_TP, pg_timeout=TIMEOUT, may_exit=(3,))
    assert results[3] is None
    for rank, result in enumerate(results):
        if rank == 3:
            continue
        assert result["error"].startswith(
            f"dsv41_sp: rank {rank}'s program failed in a collective at call 2: a peer rank "
            "died, hung, or stopped calling the compiled model (a rank waits at most the "
            "process group's timeout, init_process_group(timeout=...)). The collective's "
            "error: "
        ), result["error"]
        assert result["seconds"] < TIMEOUT + 5, (rank, result["seconds"])
