"""The call a user writes first: `torch.compile(model, backend="dsv41_sp", options=...)`, with no
`mark_token_dim`, and with `dynamic=True`, on 8 gloo ranks (tp=4, dp=2) through serving steps of
mixed T: a prefill (T = 8), a decode with T = 3 < tp (tp_rank 3 holds no token) in one DP group
and T = 1 in the other, then one group idle (T = 0) while the other verifies 6 draft tokens.

Every program each rank compiles has the seed's per-layer collectives, whatever T
Dynamo traced it with, and the logits and caches match the single-device model at the fp32
bound. How many programs each rank compiles is Dynamo's choice, counted here (docs/backend.md,
"Token counts"): without `mark_token_dim`, a static graph for the first T, one with a dynamic T
from the next T >= 2 on, and a static one for each of T = 0 and T = 1; with `dynamic=True` the
dynamic one from the start.

The sp run compiles `DeepseekV41.without_weights` with the `checkpoint` option: each rank reads
its own slices of a synthetic checkpoint once, for all its programs, and its single-device
reference is loaded from the whole checkpoint. Its head is vocab-sharded (`head="auto"` on a
device of the user's own with slow memory; the 950DT's choice, replicated, is the other runs')
and each call asks for
the rows a serving loop reads (`logit_rows`: each request's last row at prefill, every row of a
decode or a verify); those rows' logits match the single-device model's.

Each DP group compiles in one of the two modes, and the two runs swap them: each layout is
served in both modes, and each mode serves both groups' sequences of T (8, 3, 0 and 8, 1, 6).
The groups' programs differ; their collectives, which the EP all-to-alls of the sp run share
across the groups, do not. (Both modes on every rank would trace and compile each run's model
twice as often for the same programs.)

Not run here: `dynamic=False`, a static graph per distinct T. A static T is made symbolic before
any layout is planned (`frontend.tokens.generalized`), so each of those programs is planned
as the unmarked mode's static ones for T = 8, 0 and 1 are; tests/test_errors.py checks that
`dynamic=False` is refused before it would pass Dynamo's recompile limit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from dsv41_compile.deepseek_v41.model.checkpoint import INDEX, read_weights
from dsv41_compile.deepseek_v41.testing.batches import Request
from dsv41_compile.deepseek_v41.testing.cases import CaseSpec, compare_on_rank, model_config
from dsv41_compile.deepseek_v41.testing.checkpoints import rank_weight_inputs, synthetic_checkpoint
from dsv41_compile.deepseek_v41.testing.presets import (
    SINKHORN_3,
    SLOW_HBM,
    WIDE,
)
from dsv41_compile.testing.multirank import RankPool

pytestmark = pytest.mark.slow

WORLD, TP = 8, 4
STEPS = (
    (
        (Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0), Request(2, [6, 7, 8], 0)),
        (Request(0, [9, 10, 11], 0), Request(1, [12, 13], 0), Request(2, [14, 15, 16], 0)),
    ),
    ((Request(0, [17], 3), Request(1, [18], 2), Request(2, [19], 3)), (Request(1, [20], 2),)),
    ((), (Request(0, [26, 27, 28], 3), Request(1, [29, 30, 31], 3))),
)
# Programs per rank in each mode, by DP group (T: group 0 8, 3, 0; group 1 8, 1, 6).
COMPILES = {
    "unmarked": (3, 3),  # static 8, dynamic (at 3 / at 6), static 0 / static 1
    "dynamic": (2, 2),  # dynamic, static 0 / static 1
}
# Window-only layers with 3 Sinkhorn iterations instead of 20: the same code, less to trace;
# the subject here is how Dynamo traces T, and each mode traces the model two or three times on
# each of the 8 ranks. (Every attention mode is tests/distributed/test_numerics.py's.) The sp
# run has two layers, twice as wide (D = 128), where the default cuts move all three boundaries:
# the q / kv latents gathered, wo_b's partial reduce-scattered, one EP row per rank; layer 1
# has an Engram table, whose exchange rides in layer 0's EP exchange. The replicated run has
# three: layers 1 and 2 are one kind, which Dynamo traces once -- at a
# static T, then at a symbolic one -- and calls twice (`regions`).
MODEL = {"preset": "tiny-swa", "overrides": (("n_layers", 3), *SINKHORN_3)}
ENGRAM_1 = (("engram_layer_ids", (1,)), ("engram_num_embeddings", (384,)))
"""tiny's Engram layer (before layer 1), in a window-only configuration."""
WIDE_MODEL = {
    "preset": "tiny-swa",
    "overrides": (("n_layers", 2), *SINKHORN_3, *WIDE, *ENGRAM_1),
}
_CHECKPOINT = tempfile.TemporaryDirectory(prefix="dsv41_ckpt_")
RUNS = {
    # sp, experts over the world, padded dispatch: the all-to-alls need the idle group's ranks
    # and the model without weights: each rank reads its slices of a synthetic checkpoint; its
    # Engram tables split by columns over the world in host memory (the exchange needs the
    # idle group's ranks too)
    "sp-ep8-padded": CaseSpec(
        steps=STEPS,
        options=(
            ("tp", TP),
            ("ep", 8),  # ep_dispatch="auto": padded at 8 rows per step (LAYOUT below)
            ("lowering", "eager"),
            ("engram", "host"),
            # where head="auto" shards the head and shared_expert="auto" splits the shared
            # expert (tests/test_backend.py)
            ("device", SLOW_HBM),
        ),  # fmt: skip
        group_modes=("unmarked", "dynamic"),
        logit_rows=True,
        checkpoint=_CHECKPOINT.name,
        **WIDE_MODEL,
    ),
    # the replicated baseline, every rank holding every expert
    "replicated-ep1": CaseSpec(
        steps=STEPS,
        options=(("tp", TP), ("layout", "replicated"), ("lowering", "eager")),
        group_modes=("dynamic", "unmarked"),
        **MODEL,
    ),
}
LAYOUT = {
    # the default cuts: the q and kv latents gathered in one AllGather (attn_entry, then
    # coalesce: their rows side by side), wo_b's fp32 partial
    # reduce-scattered (attn_exit="auto" at the default 8 rows per step: the all-to-all's
    # whole wo_b would cost more reads than its bytes save), one EP row per rank with its routes
    # (padded: ep_dispatch="auto" at 8 rows; one all-to-all out, one back; layer 0's also carry
    # the Engram exchange of layer 1: row ids out with the rows, table rows back with the
    # combine); and the shared expert split over tp (shared_expert="auto" on the slow device:
    # its input gathered, its partial output reduce-scattered)
    "sp-ep8-padded": [
        *["all_gather(tp)"] * 2,
        *["all_to_all(ep)"] * 2,
        *["reduce_scatter(tp)"] * 2,
    ],
    "replicated-ep1": ["all_reduce(tp)"],
}

_RESULTS: dict[str, list] = {}


def run_of(name: str) -> tuple[str, list]:
    """One run per configuration on the session's 8 processes, shared by this module's tests."""
    if name not in _RESULTS:
        if RUNS[name].checkpoint is not None and not (Path(_CHECKPOINT.name) / INDEX).exists():
            synthetic_checkpoint(model_config(RUNS[name]), _CHECKPOINT.name, seed=1)
        _RESULTS[name] = RankPool.shared(WORLD).run(compare_on_rank, RUNS[name])
    return name, _RESULTS[name]


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request):
    return run_of(request.param)


def test_logits_and_caches_match_single_device_in_every_mode(run):
    name, results = run
    for rank, result in enumerate(results):
        for mode, out in result["modes"].items():
            for i, (logits, ref) in enumerate(zip(out["logits"], result["ref"])):
                assert logits.shape == ref.shape == (result["R"][i], 512)
                torch.testing.assert_close(
                    logits, ref, atol=1e-5, rtol=1e-5,
                    msg=lambda m, at=f"{name} {mode} rank {rank} step {i}": f"{at}: {m}",
                )  # fmt: skip
            assert out["cache_diff"] <= 1e-5, (name, mode, rank)


def test_every_program_has_the_same_layout_whatever_t_it_was_traced_with(run):
    name, results = run
    layers = model_config(RUNS[name]).n_layers
    expected = dict.fromkeys(range(layers), LAYOUT[name])
    for rank, result in enumerate(results):
        for mode, out in result["modes"].items():
            assert out["programs"], (mode, rank)
            for layout in out["programs"]:
                assert layout == expected, (name, mode, rank)


def test_recompiles_are_dynamos_and_counted(run):
    _, results = run
    for rank, result in enumerate(results):
        for mode, out in result["modes"].items():
            assert out["compiles"] == COMPILES[mode][rank // TP], (mode, rank)


def test_every_program_of_a_rank_ran_on_one_read_of_its_slices():
    """The sp run compiled `DeepseekV41.without_weights` with the `checkpoint` option in both
    modes: each rank's three programs share one read of its slices, the bytes a direct read of
    that rank's slices takes (its quarter of the tp-sharded weights, of the vocab-sharded head
    and of the split shared expert, its two experts, the table rows of its Engram column)."""
    case = RUNS["sp-ep8-padded"]
    _, results = run_of("sp-ep8-padded")
    cfg = model_config(case)
    options = {k: v for k, v in case.options if k in ("tp", "ep", "engram")}
    # as head="auto" and shared_expert="auto" chose on the run's device
    options.update(head="vocab_sharded", shared_expert="split")
    for rank, result in enumerate(results):
        _, direct = read_weights(case.checkpoint, rank_weight_inputs(cfg, options, rank))
        # (a case records the tensors it read bytes of: ranks 6 and 7 hold no Engram column)
        assert result["checkpoint_read"] == {n: b for n, b in direct.items() if b}, rank


def test_the_vocab_sharded_head_gathers_only_the_rows_asked_for():
    """The sp run holds V/tp of the head per rank and asks for the rows a serving loop reads
    (`logit_rows`): outside its layers each program gathers the hidden (or, a program traced
    for one row, all-reduces that row from the rank holding it: `spmd.token_ops`) and then its
    rows' `[R, V/tp]` logits, two collectives over tp (the logits' above compared at the fp32
    bound)."""
    _, results = run_of("sp-ep8-padded")
    for rank, result in enumerate(results):
        assert result["R"] != result["T"], rank  # rows were left out
        for mode, out in result["modes"].items():
            for outside in out["outside_layers"]:
                assert outside in (
                    ["all_gather(tp)", "all_gather(tp)"],
                    ["all_gather(tp)", "all_reduce(tp)"],
                ), (mode, rank, outside)
