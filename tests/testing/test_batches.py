"""The packed-batch builders used by tests, tools and (later) the multi-rank harness."""

from __future__ import annotations

from dsv41_compile.deepseek_v41.testing.batches import Request, incremental_schedule, pack


def test_pack_concatenates_requests() -> None:
    ids, positions, slots = pack([Request(1, [7, 8], start=3), Request(-1, [0]), Request(0, [9])])
    assert ids.tolist() == [7, 8, 0, 9]
    assert positions.tolist() == [3, 4, 0, 0]
    assert slots.tolist() == [1, 1, -1, 0]


def test_incremental_schedule_prefill_then_steps() -> None:
    batches = incremental_schedule([[1, 2, 3, 4, 5], [6, 7]], prefill=[2, 0], step=2)
    as_tuples = [[(r.slot, list(r.ids), r.start) for r in batch] for batch in batches]
    assert as_tuples == [
        [(0, [1, 2], 0)],
        [(0, [3, 4], 2), (1, [6, 7], 0)],
        [(0, [5], 4)],
    ]
