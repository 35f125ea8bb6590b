"""16 gloo ranks, beyond the 8 of one host's tests: tiny-swa (two window layers, 16 experts)
with the experts over the whole world (ep=16, one expert per rank), in the sp layout at tp=4
(four DP groups) and in attention data-parallel, tp=1 (sixteen DP groups of one rank: no TP
collective, every layer's rows exchanged by the EP all-to-alls alone). Every rank's logits and
cache match the single-device model at the fp32 bound through a prefill, a decode of uneven
groups (1 to 3 rows: ranks with no row at tp=4) and a step with DP group 0 idle
(`cases.serving_steps`).

Marked `wide`: 16 processes on a 2-core machine take minutes, so the default suite skips them;
`make test-wide` runs them."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.testing.cases import CaseSpec, compare_on_rank, serving_steps
from dsv41_compile.deepseek_v41.testing.presets import SINKHORN_3
from dsv41_compile.testing.multirank import RankPool

pytestmark = [pytest.mark.slow, pytest.mark.wide]

WORLD = 16
LAYOUTS = {
    # the requirement's layout, four DP groups: the q / kv latents gathered, wo_b's partial
    # reduce-scattered, one EP row per rank out and back
    "tp4-dp4-ep16": (
        4,
        ["all_gather(tp)", "all_to_all(ep)", "all_to_all(ep)", "reduce_scatter(tp)"],
    ),
    # attention data-parallel: a DP group is one rank; the EP all-to-alls alone
    "tp1-dp16-ep16": (1, ["all_to_all(ep)", "all_to_all(ep)"]),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def run(request):
    tp, collectives = LAYOUTS[request.param]
    spec = CaseSpec(
        steps=serving_steps(WORLD // tp),
        overrides=SINKHORN_3,
        options=(("tp", tp), ("ep", WORLD), ("lowering", "eager")),
    )
    return request.param, collectives, RankPool.shared(WORLD).run(compare_on_rank, spec)


def test_sixteen_ranks_match_the_single_device_model(run):
    name, _, results = run
    for rank, result in enumerate(results):
        out = result["modes"]["marked"]
        for step, (logits, ref) in enumerate(zip(out["logits"], result["ref"])):
            torch.testing.assert_close(
                logits, ref, atol=1e-5, rtol=1e-5,
                msg=lambda m, at=f"{name} rank {rank} step {step}": f"{at}: {m}",
            )  # fmt: skip
        assert out["cache_diff"] <= 1e-5, (name, rank)
    tp = LAYOUTS[name][0]
    assert [results[r]["T"][2] for r in range(0, WORLD, tp)][:2] == [0, 1]  # group 0 idle


def test_every_layer_has_the_layouts_collectives(run):
    name, collectives, results = run
    for rank, result in enumerate(results):
        for program in result["modes"]["marked"]["programs"]:
            assert program == {0: collectives, 1: collectives}, (name, rank)
