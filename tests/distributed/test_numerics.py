"""The compiled model on 8 real gloo processes (tp=4, dp=2) against the single-device model on
each DP group's batches, step by step through the cache.

Tolerances: |sp - ref| <= 1e-5 + 1e-5 |ref| (fp32's bound) in every run. In fp32 the sharded
program sums some values in another order than the single-device model (the EP combine of the
per-rank rows, the seed layout's ReduceScatter of wo_b partials), so the gap stays at a few fp32
ulps of the logits (measured ~2e-6); intermediates use the same bound scaled by the tensor's
largest magnitude (the residual streams grow with depth). The official numerics (bf16, FP8 /
FP4 roundings) are compared at the same bound: their runs take no re-associating sum (wo_b's
input moved to its tokens' ranks, one EP row per assignment added in the single-device
order), so every rounding sees the single-device operands and the logits come out equal
(measured: max |sp - ref| = 0). A re-associated sum would not be within it: a different fp32
ulp can land on the other side of a bf16 or FP8 rounding step (measured with one EP row per
token and destination rank: up to 1.1e-2). The bf16 numerics run in fp32 here: their bf16
roundings are the official numerics' minus the FP8 / FP4 steps.

Runs (steps: `deepseek_v41.testing.cases.SERVING_STEPS`, the last with DP group 0 idle, T = 0), all with 3
Sinkhorn iterations, on the session's pool of 8 ranks (`testing.multirank.RankPool`):
- tiny cut to six layers that keep every attention mode and meet one kind twice (a ratio-1
  REUSE at layers 3 and 5: one subgraph traced by Dynamo, copied in at both,
  `deepseek_v41.testing.presets.EVERY_MODE_6`), at twice its width (D = 128, where the entry cut gathers
  the q / kv latents in five of the six layers and the input in the ratio-2 one:
  `attn_entry="auto"`), sp, ep=8 exact, eager, per-layer
  intermediates captured, `DeepseekV41.without_weights` compiled with the `checkpoint` option:
  each rank reads its own slices of a synthetic checkpoint in the released format, and the
  single-device reference is loaded from all of it (`load_checkpoint`);
- one window-only layer (tiny-swa's), the replicated baseline, ep=8 padded, as handed to
  torchair (graph-mode rewrites and torchair's AOT step, run eagerly:
  `testing.torchair_standin`; the attention one `npu_sparse_flash_attention`);
- one window-only layer, the seed layout exactly (sp, the input gathered, the wo_b partial
  reduce-scattered, ep=8 exact with one row per assignment), inductor, vocab-sharded embedding: a cold compile cache
  shared by the 8 ranks (the session's);
- one window-only layer under the official numerics (bf16), the weights held as released
  (FP8 linears with their block scales, each rank its heads' and output groups' blocks; FP4
  routed experts with theirs, each rank its own experts'), one EP row per assignment, the
  exit all-to-all (no re-associating sum): ep=8 exact, eager; ep=8 padded as handed to
  npugraph_ex (the model's rewrites to torch_npu's kernels: the FP8 linears as MXFP8 quantised
  matmuls, the FP8 rows of the quantised transport made and read by torch_npu's MX ops,
  `deepseek_v41/graph_mode.py`; npugraph_ex's AOT step, each call captured, replayed or, past
  `capture_tokens`, uncaptured: `testing.npugraph_ex_standin`; `npu_attention="gathered"`:
  the official rounding of the probabilities, which the fused kernel does not keep);
- on one rank: the five every-mode layers as released (the official numerics) as handed to
  torchair (`npu_attention="gathered"`, as above).
These call the model with `mark_token_dim`; tests/distributed/test_front_door.py calls it the
other ways. The EP runs also check the seed's assignment counts and the traffic each
rank records in comm.json. The every-mode run states 4096 rows per step, at which
`attn_exit="auto"` times the all-to-all shorter (wo_b's input moved to its tokens' ranks, wo_b
whole on every rank, no cross-rank sum); the official runs name that exit; the other runs take
`ep_rows="auto"`: one EP row per token and destination rank. The EP exchange adds
no tolerance: a token's expert outputs are the single-device kernel's values, added in fp32 --
at the source one per assignment, or per rank on the expert rank and then over the ranks at
the source (expert order, re-associated; in fp32 the combine's cast is the identity).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.model.checkpoint import INDEX
from dsv41_compile.deepseek_v41.testing.cases import (
    SERVING_STEPS,
    CaseSpec,
    compare_on_rank,
    model_config,
)
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint
from dsv41_compile.deepseek_v41.testing.presets import (
    AS_RELEASED,
    ENGRAM_0,
    EVERY_MODE_5,
    EVERY_MODE_6,
    ONE_LAYER,
    SINKHORN_3,
    SLOW_LINK,
    WIDE,
    compile_config,
)
from dsv41_compile.testing.multirank import RankPool, run_ranks

pytestmark = pytest.mark.slow

WORLD, TP, EP = 8, 4, 8
STEPS = SERVING_STEPS
FP32_BOUND = {"atol": 1e-5, "rtol": 1e-5}


def capture_points(cfg: ModelConfig) -> tuple[str, ...]:
    """Per layer: the attention input (replicated), the residual streams after the attention
    half (entering hc_ffn) and after the MoE half (entering the next hc_attn; the last layer's
    collapsed streams enter the final norm). Plus the shared expert's input of layer 0 (its
    local rows: the seed's "2 rows per rank")."""
    points = []
    for i in range(cfg.n_layers):
        points += [f"layers.{i}.attn", f"layers.{i}.hc_ffn"]
        points.append(f"layers.{i + 1}.hc_attn" if i + 1 < cfg.n_layers else "norm")
    return (*points, "layers.0.ffn.shared_expert")


# Every run compiles with 3 Sinkhorn iterations (`deepseek_v41.testing.presets`), on both sides of every
# comparison.
def spec(preset: str, *, capture: bool = False, overrides=(), **options) -> CaseSpec:
    cfg = compile_config(preset, overrides)  # what `model_config(case)` builds
    return CaseSpec(
        steps=STEPS,
        preset=preset,
        overrides=(*SINKHORN_3, *overrides),
        options=(("tp", TP), *options.items()),
        capture=capture_points(cfg) if capture else (),
        max_len=32,
        dump=options.get("ep", 1) > 1,
        npu_standin=options.get("lowering") in ("torchair", "npugraph_ex"),
    )


ENGRAM_1_4 = (("engram_layer_ids", (1, 4)), ("engram_num_embeddings", (384, 552)))
"""tiny's Engram layer and one more: two tables, 6 columns each (other primes)."""

RUNS = {
    # tiny's Engram layer (before layer 1) and a second one (before layer 4), their tables
    # split by columns over the world and looked up in one exchange (`tables`);
    # stated as a prefill-sized workload on a device with a slow link, where attn_exit="auto"
    # times the all-to-all shorter (tests/distributed/test_front_door.py's sp run, at the
    # default 8 rows, gets the ReduceScatter) and ep_dispatch="auto" the exact dispatch (the
    # front door's, on a fast link, gets the padded one)
    "tiny-every-mode-ep-exact-eager": spec(
        "tiny",
        overrides=(*EVERY_MODE_6, *WIDE, *ENGRAM_1_4),
        capture=True,
        ep=EP,
        lowering="eager",
        engram="sharded",
        rows_per_step=4096,
        device=SLOW_LINK,
    ),
    # an Engram layer, its tables replicated (the replicated layout's)
    "tiny-swa-replicated-ep-padded-torchair": spec(
        "tiny-swa",
        overrides=(*ONE_LAYER, *ENGRAM_0),
        layout="replicated",
        ep=EP,
        ep_dispatch="padded",
        lowering="torchair",
    ),
    "tiny-swa-ep-exact-inductor-vocab": spec(
        "tiny-swa",
        overrides=ONE_LAYER,
        ep=EP,
        ep_dispatch="exact",
        lowering="inductor",
        embedding="vocab_sharded",
        ep_rows="per_assignment",
        attn_exit="reduce_scatter",
        attn_entry="input",
    ),
    # the official numerics (bf16): FP8 / FP4 roundings, bf16 probabilities, the fp32 head;
    # each rank holds its experts' FP4 codes and scales (`weight_format="released"`): the exact
    # EP lowering eager, the padded one captured by npugraph_ex (the released weights and the
    # official quantisations through torch_npu's MX ops, `deepseek_v41/graph_mode.py`, run by
    # the CPU stand-in), steps of more than 8 tokens uncaptured
    **{
        f"tiny-swa-official-ep-{dispatch}-{lowering}": spec(
            "tiny-swa",
            overrides=(*ONE_LAYER, *AS_RELEASED),
            ep=EP,
            ep_dispatch=dispatch,
            ep_rows="per_assignment",
            attn_exit="all_to_all",
            lowering=lowering,
            # the model's own attention (its blockwise bf16 rounding, exactly): the fused
            # kernel's softmax is its own (tests/targets/test_sparse_attention.py)
            **(
                {"capture_tokens": 8, "npu_attention": "gathered"}
                if lowering == "npugraph_ex"
                else {}
            ),
        )
        for dispatch, lowering in (("exact", "eager"), ("padded", "npugraph_ex"))
    },
}
EP_RUNS = sorted(name for name, case in RUNS.items() if dict(case.options).get("ep", 1) > 1)
TORCHAIR_RUNS = sorted(
    name for name, case in RUNS.items() if dict(case.options).get("lowering") == "torchair"
)

NPUGRAPH_EX_RUN = "tiny-swa-official-ep-padded-npugraph_ex"

ONE_RANK = "tiny-every-mode-one-rank-torchair"
ONE_RANK_TORCHAIR = CaseSpec(
    steps=STEPS,
    preset="tiny",
    # the released model: its every attention mode through graph mode's MX ops
    overrides=(*SINKHORN_3, *EVERY_MODE_5, *AS_RELEASED),
    # the model's own attention: the official rounding exactly (see the npugraph_ex run)
    options=(("tp", 1), ("lowering", "torchair"), ("npu_attention", "gathered")),
    npu_standin=True,
)

_RESULTS: dict[str, list | RuntimeError] = {}

CHECKPOINT_RUN = "tiny-every-mode-ep-exact-eager"
"""The run whose ranks load their weights from a synthetic checkpoint in the released format
(FP8 / FP4 with their scales, 3 shards) instead of the seed: each compiled rank reads only its
slices, each single-device reference all of it."""
_CHECKPOINT = tempfile.TemporaryDirectory(prefix="dsv41_ckpt_")


def spec_of(name: str) -> CaseSpec:
    if name != CHECKPOINT_RUN:
        return RUNS[name]
    root = Path(_CHECKPOINT.name)
    if not (root / INDEX).exists():
        synthetic_checkpoint(model_config(RUNS[name]), root, seed=1)
    return dataclasses.replace(RUNS[name], checkpoint=str(root))


def results_of(name: str) -> list:
    """One run per configuration (the session's 8 processes; ONE_RANK_TORCHAIR on one),
    shared by the tests of this module."""
    if name not in _RESULTS:
        try:
            if name == ONE_RANK:
                _RESULTS[name] = run_ranks(compare_on_rank, 1, ONE_RANK_TORCHAIR)
            else:
                _RESULTS[name] = RankPool.shared(WORLD).run(compare_on_rank, spec_of(name))
        except RuntimeError as error:  # fail every dependent test without re-running
            _RESULTS[name] = error
    if isinstance(_RESULTS[name], RuntimeError):
        raise _RESULTS[name]
    return _RESULTS[name]


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request):
    return request.param, RUNS[request.param], results_of(request.param)


def test_logits_match_single_device_on_every_rank_and_step(run):
    name, case, results = run
    for rank, result in enumerate(results):
        assert result["T"] == [sum(len(r.ids) for r in step[rank // TP]) for step in case.steps]
        assert 0 in result["T"] or rank >= TP  # DP group 0 idles in the last step
        (marked,) = result["modes"].values()
        for i, (sp, ref) in enumerate(zip(marked["logits"], result["ref"])):
            assert sp.shape == ref.shape == (result["T"][i], 512)
            torch.testing.assert_close(
                sp, ref, **FP32_BOUND,
                msg=lambda m, at=f"{name} rank {rank} step {i}": f"{at}: {m}",
            )  # fmt: skip
        assert marked["cache_diff"] <= 1e-5, name


def test_tp_ranks_of_a_group_return_the_same_logits(run):
    _, _, results = run
    for rank, result in enumerate(results):
        (mine,) = result["modes"].values()
        (leader,) = results[rank // TP * TP]["modes"].values()
        for a, b in zip(mine["logits"], leader["logits"]):
            assert torch.equal(a, b)


def test_one_compile_serves_every_token_count(run):
    """T = 8, 3, 1, 5, 6, 16, 21, 0, 4: one graph per rank, shared by the host (one rank
    compiled it, the others loaded it: runtime.host_cache)."""
    _, _, results = run
    assert [r["modes"]["marked"]["compiles"] for r in results] == [1] * WORLD
    shared = [r["host_cache"] for r in results]
    assert sum(s.get("compiled", 0) for s in shared) == 1, shared
    assert sum(s.get("loaded", 0) for s in shared) == WORLD - 1, shared


def test_inductor_compiles_once_per_host_from_a_cold_cache():
    """8 ranks on one host, one cold cache: every rank compiled or loaded without error, and
    inductor compiled the one per-rank graph once (a miss of its FX graph cache); the other
    seven ranks found it there."""
    results = results_of("tiny-swa-ep-exact-inductor-vocab")
    misses = sum(r["inductor"].get("fxgraph_cache_miss", 0) for r in results)
    hits = sum(r["inductor"].get("fxgraph_cache_hit", 0) for r in results)
    assert (misses, hits) == (1, WORLD - 1), [r["inductor"] for r in results]


def test_intermediates_match_for_every_layer():
    """The attention input equals the single-device attention input (same rows, same order):
    all-gathered, or token-sharded where the entry cut runs the projections on the shard; and
    the residual streams reassembled from the TP group's token shards equal the
    single-device streams, after the attention half and after the MoE half of every layer."""
    case = RUNS["tiny-every-mode-ep-exact-eager"]
    results = results_of("tiny-every-mode-ep-exact-eager")
    cfg = model_config(case)
    for dp in range(WORLD // TP):
        group = results[dp * TP : (dp + 1) * TP]
        for point in case.capture:
            sp_by_rank = [r["captures"][point][0] for r in group]
            ref = group[0]["captures"][point][1]
            # the reference records a step only when the module runs: not at T = 0 for some
            assert all(len(v) == len(sp_by_rank[0]) for v in sp_by_rank)
            # gathered (every rank holds all T rows) or token-shards: as at the longest step
            longest = max(range(len(ref)), key=lambda s: ref[s].shape[0])
            whole = all(v[longest].shape[0] == ref[longest].shape[0] for v in sp_by_rank)
            if point.endswith(".attn"):  # the ratio-2 layer's compressor: the input is cheaper
                assert whole == (point == "layers.1.attn"), point
            for step, ref_value in enumerate(ref):
                T = ref_value.shape[0]
                if whole:
                    values = [v[step] for v in sp_by_rank]
                else:  # token-sharded: rank k holds rows [k*Tl, (k+1)*Tl) (+ tail padding)
                    values = [torch.cat([v[step] for v in sp_by_rank])[:T]]
                # fp32 rounding relative to the tensor's scale: the streams grow with depth
                scale = max(1.0, float(ref_value.abs().amax())) if ref_value.numel() else 1.0
                for value in values:
                    assert value.shape == ref_value.shape, (point, step)
                    torch.testing.assert_close(
                        value, ref_value, atol=1e-5 * scale, rtol=1e-5,
                        msg=lambda m, at=f"dp {dp} {point} step {step}": f"{at}: {m}",
                    )  # fmt: skip
    assert len(case.capture) == 3 * cfg.n_layers + 1


def test_graph_mode_keeps_every_attention_mode_exact_on_one_rank():
    """tiny (5 layers, every attention mode) as released (FP8 / FP4 weights, the official
    numerics) on one rank with lowering="torchair": graph mode's rewrites (cache writes as
    scatters, the routed experts' FP4 weights decoded and grouped with ep = 1, the FP8 linears
    as MXFP8 quantised matmuls, the KV and indexer quantisations in bit operations, ...) and
    torchair's AOT step (`testing.torchair_standin`), run on CPU, against the single-device
    model -- the rewrites the 8-rank runs (tiny-swa) do not reach."""
    (result,) = results_of(ONE_RANK)
    (marked,) = result["modes"].values()
    for i, (sp, ref) in enumerate(zip(marked["logits"], result["ref"])):
        torch.testing.assert_close(sp, ref, **FP32_BOUND, msg=f"{i}")
    assert marked["cache_diff"] <= 1e-5 and marked["compiles"] == 1


@pytest.mark.parametrize("name", [ONE_RANK, *TORCHAIR_RUNS])
def test_every_op_torchair_would_see_has_a_converter(name, torchair_registry):
    """The ops of the graphs the torchair runs hand over, after torchair's AOT step, against
    torchair's converters (tools/torchair_coverage.py's registry)."""
    tool, registry = torchair_registry
    for result in results_of(name):
        assert tool.unsupported(result["npu_ops"], registry) == {}


def test_the_torchair_run_attends_through_sparse_flash_attention():
    """The fp32 run as handed to torchair (its logits at fp32's bound, above): its one layer's
    attention is one `npu_sparse_flash_attention` over the layer's KV rows, the queries' keys
    never gathered (tests/targets/test_sparse_attention.py checks the rewrite op by op)."""
    for name in TORCHAIR_RUNS:
        for result in results_of(name):
            ops = result["npu_ops"]
            assert ops["torch.ops.npu.npu_sparse_flash_attention.default"] == 1, ops
            assert not [op for op in ops if op.startswith("torch.ops.dsv41.")], ops


def test_graph_mode_runs_the_released_formats_through_torch_npus_mx_ops():
    """Under the official numerics with the weights as released, the graph npugraph_ex gets
    holds none of the model's quantisation ops: each FP8 linear whose input is quantised is one
    MXFP8 `npu_quant_matmul`, each other quantisation an `npu_dynamic_mx_quant`, each decode an
    `npu_anti_mx_quant` (the FP8 rows moved by the quantised transport); the routed experts are
    three grouped matmuls in their MX A8W4 form, the FP4 weights as released, and no FP4 weight
    is decoded; the logits match the single-device model (test above)."""
    for result in results_of(NPUGRAPH_EX_RUN):
        ops, fp4 = result["npu_ops"], result["npu_fp4_ops"]
        assert not [op for op in ops if op.startswith("torch.ops.dsv41.")], ops
        # tiny-swa's FP8 linears whose input the official numerics quantise: wq_a, wkv, wq_b,
        # wo_b (its rows moved as FP8, exchanged by head group and joined into rows) and the
        # shared expert's w1, w3, w2 (the MoE input cast to the expert's dtype; its hidden)
        assert ops["torch.ops.npu.npu_quant_matmul.default"] == 7
        assert ops["torch.ops.npu.npu_dynamic_mx_quant.default"] >= 4
        assert ops["torch.ops.npu.npu_anti_mx_quant.default"] >= 1  # the FP8 rows received
        grouped = "torch.ops.npu.npu_grouped_matmul.default"
        assert ops[grouped] == fp4[grouped] == 3  # w1, w3, w2 of the one layer's experts
        assert fp4["torch.ops.npu.npu_anti_mx_quant.default"] == 0


def _compare_with_the_golden_reading(rank: int, world_size: int, spec: CaseSpec) -> dict:
    """`compare_on_rank` with the A8W4 stand-in multiplying the FP4 weights by 1/64 (the
    op-plugin golden's reading, which the stand-in's docstring sets aside): the same program,
    loaded from the host cache, run with another kernel."""
    from dsv41_compile.testing import torchair_standin

    torchair_standin.A8W4_WEIGHT_FACTOR = 1 / 64
    try:
        return compare_on_rank(rank, world_size, spec)
    finally:
        torchair_standin.A8W4_WEIGHT_FACTOR = 1.0


@pytest.mark.slow
def test_a_perturbed_a8w4_stand_in_fails_the_comparison():
    """The 8-rank comparison of the npugraph_ex run tells the grouped matmul's readings apart:
    with the FP4 weights / 64 the logits leave the single-device model's."""
    results = RankPool.shared(WORLD).run(_compare_with_the_golden_reading, RUNS[NPUGRAPH_EX_RUN])
    worst = max(
        float((sp.float() - ref.float()).abs().max())
        for result in results
        for sp, ref in zip(result["modes"]["marked"]["logits"], result["ref"])
        if ref.numel()
    )
    assert worst > 1e-2, worst


def test_npugraph_ex_captures_each_decode_size_once_and_runs_prefill_uncaptured():
    """capture_tokens=8: each step of at most 8 tokens captured on the first call of its size
    and replayed after, the longer ones (16, 21) uncaptured; every rank the same way (the DP
    groups' steps have the same sizes here)."""
    for result in results_of(NPUGRAPH_EX_RUN):
        captured: set[int] = set()
        want = []
        for T in result["T"]:
            if T > 8:
                want.append(("uncaptured", T))
            else:
                want.append(("replay" if T in captured else "capture", T))
                captured.add(T)
        assert result["npu_calls"] == want


def valid_tokens(step) -> int:
    return sum(len(r.ids) for group in step for r in group if r.slot >= 0)


@pytest.mark.parametrize("name", EP_RUNS)
def test_the_seeds_example_dispatches_each_valid_assignment_once(name):
    """Two DP groups of 3 + 2 + 3 tokens: 16 unique tokens, top-6 -> exactly 96 routed
    assignments leave their source ranks in total (not 8 ranks x 8 tokens x 6 = 384), and the
    shared expert runs on 2 rows per rank, 16 in all."""
    results = results_of(name)
    cfg = model_config(RUNS[name])
    K = cfg.n_activated_experts
    assert valid_tokens(STEPS[0]) == 16 and K == 6
    first = [r["comm"]["ep_steps"][0]["layers"] for r in results]
    for layer in range(cfg.n_layers):
        assert sum(rank[layer]["assignments_sent"] for rank in first) == 96
        assert sum(rank[layer]["assignments_received"] for rank in first) == 96
        if first[0][layer]["rows"] == "per_rank":  # one row per token and destination rank
            rows = sum(sum(rank[layer]["rows_sent_per_rank"]) for rank in first)
            assert 16 <= rows < 96  # each token reaches 1 to 6 ranks; 16 x 6 is unlikely
            assert rows == sum(sum(rank[layer]["rows_received_per_rank"]) for rank in first)
    if RUNS[name].capture:
        rows = [r["captures"]["layers.0.ffn.shared_expert"][0][0].shape[0] for r in results]
        assert rows == [2] * WORLD


@pytest.mark.parametrize("name", EP_RUNS)
def test_ep_traffic_adds_up_on_every_step(name):
    """From each rank's comm.json: what rank r sent to rank d is what d received from r; the
    valid assignments are K per valid token -- padding rows (SP tail padding, slot -1) and an
    idle DP group route nothing; the bytes follow from the counts (exact) or the padded
    capacity (padded)."""
    case, results = RUNS[name], results_of(name)
    cfg = model_config(case)
    K, D, per_rank = cfg.n_activated_experts, cfg.dim, cfg.n_routed_experts // EP
    size = cfg.torch_dtype.itemsize  # the expert outputs move in the activation dtype
    # the token rows too, or (official numerics: the experts' input is quantised) as FP8 rows:
    # D codes and D / 32 scales
    token = D + D // 32 if cfg.numerics == "official" else D * size
    padded = dict(case.options).get("ep_dispatch") == "padded"
    for i, step in enumerate(STEPS):
        calls = [r["comm"]["ep_steps"][i] for r in results]
        group_tokens = [sum(len(r.ids) for r in group) for group in step]
        assert [c["ep_tokens"] for c in calls] == [
            -(-max(group_tokens) // TP) if padded else -(-group_tokens[r // TP] // TP)
            for r in range(WORLD)
        ]
        for layer in range(cfg.n_layers):
            records = [c["layers"][layer] for c in calls]
            per_row = K if records[0]["rows"] == "per_rank" else 1  # routes per row
            row = token + 8 * per_row  # token row + (local expert, weight) per route
            sent = [rec["assignments_sent_per_rank"] for rec in records]
            received = [rec["assignments_received_per_rank"] for rec in records]
            assert sent == [list(col) for col in zip(*received)], (name, i, layer)
            assert sum(rec["assignments_sent"] for rec in records) == K * valid_tokens(step)
            rows_sent = [rec["rows_sent_per_rank"] for rec in records]
            rows_received = [rec["rows_received_per_rank"] for rec in records]
            assert rows_sent == [list(col) for col in zip(*rows_received)], (name, i, layer)
            for rows, assignments in zip(sum(rows_sent, []), sum(sent, [])):
                # a row carries 1 to min(K, E/ep) of a token's assignments (one per assignment)
                assert rows <= assignments <= min(K, per_rank) * rows
                assert per_row == K or rows == assignments
            for r, rec in enumerate(records):
                to_peers = sum(rows_sent[r]) - rows_sent[r][r]
                back = sum(rows_received[r]) - rows_received[r][r]
                assert rec["valid_dispatch_bytes_sent"] == to_peers * row
                assert rec["valid_combine_bytes_sent"] == back * D * size
                if padded:
                    n = (EP - 1) * calls[r]["ep_tokens"] * (1 if per_row == K else min(K, per_rank))
                    assert rec["dispatch_bytes_sent"] == n * row
                    assert rec["combine_bytes_sent"] == n * D * size
                else:
                    counts = (EP - 1) * 8 * (2 if per_row == K else 1)
                    assert rec["dispatch_bytes_sent"] == to_peers * row + counts
                    assert rec["combine_bytes_sent"] == back * D * size


TP_SHARDED = {"attn.wq_b": 0, "attn.wo_a": 0, "attn.attn_sink": 0}
"""The plan's tp shards (`deepseek_v41/plan.py`): checkpoint name suffix -> dim. The
checkpoint run exits attention with the all-to-all (`attn_exit="auto"` at tiny's sizes and
4096 rows per step), so `wo_b` is whole on every rank."""


SIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}


def checkpoint_headers(root: Path) -> dict[str, tuple[list[int], str]]:
    """Checkpoint tensor -> its shape and safetensors dtype, from the files' headers."""
    headers = {}
    for file in set(json.loads((root / INDEX).read_text())["weight_map"].values()):
        with safe_open(str(root / file), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safe_open handle is not a dict)
                part = f.get_slice(name)
                headers[name] = (part.get_shape(), part.get_dtype())
    return headers


def expected_read(
    headers: dict[str, tuple[list[int], str]], rank: int, tokenizer: int
) -> dict[str, int]:
    """The bytes rank `rank` should read of each checkpoint tensor: a quarter of a tp-sharded
    weight (and the rows or columns of its scale blocks the quarter touches), the experts of
    its EP shard and none of the others', the rows of its column of each Engram table (6
    columns over 8 ranks: rank r < 6 holds column r, the others none) and their scales, all
    of every other tensor; and the tokenizer (`tokenizer` bytes), whole. From the files'
    headers (`checkpoint_headers`)."""
    cfg = model_config(RUNS[CHECKPOINT_RUN])
    mine = range(rank * cfg.n_routed_experts // EP, (rank + 1) * cfg.n_routed_experts // EP)
    tp_rank = rank % TP
    column_rows = {
        layer: primes[rank] if rank < len(primes) else 0
        for layer, primes in zip(cfg.engram_layer_ids, cfg.engram_primes, strict=True)
    }
    want = {"tokenizer.json": tokenizer}
    for name, (shape, dtype) in headers.items():
        stem = name.removesuffix(".weight").removesuffix(".scale")
        numel = math.prod(shape)
        expert = re.search(r"\.experts\.(\d+)\.", name)
        dim = next((d for s, d in TP_SHARDED.items() if stem.endswith(s)), None)
        if expert is not None:
            numel = numel if int(expert[1]) in mine else 0
        elif ".engram.embed." in name:
            numel = numel // shape[0] * column_rows[int(name.split(".")[1])]
        elif dim is not None and name.endswith(".scale"):  # the blocks of 32 the slice touches
            full = headers[stem + ".weight"][0][dim]
            lo, hi = tp_rank * full // TP, (tp_rank + 1) * full // TP
            numel = numel // shape[dim] * (-(-hi // 32) - lo // 32)
        elif dim is not None:
            numel //= TP
        want[name] = numel * SIZE[dtype]
    return want


def test_each_rank_read_only_its_slices_of_the_checkpoint():
    """The every-mode run compiled `DeepseekV41.without_weights` with the `checkpoint` option:
    each rank read its share of every sharded tensor and nothing of the other ranks' experts,
    counted per tensor; a tp group read each sharded weight exactly once between its ranks,
    the world each row of the Engram tables exactly once. The single-device reference read the
    whole checkpoint."""
    results = results_of(CHECKPOINT_RUN)
    root = Path(spec_of(CHECKPOINT_RUN).checkpoint)
    index = json.loads((root / INDEX).read_text())
    headers = checkpoint_headers(root)
    tokenizer = (root / "tokenizer.json").stat().st_size
    for rank, result in enumerate(results):
        want = expected_read(headers, rank, tokenizer)
        got = {n: result["checkpoint_read"].get(n, 0) for n in want}
        assert got == want, rank
        assert set(result["checkpoint_read"]) <= set(want)
        total = sum(result["reference_read"].values())
        assert total == index["metadata"]["total_size"] + tokenizer
    tables = [n for n in headers if ".engram.embed." in n]
    assert len(tables) == 4, tables  # two layers' codes and scales
    for name in tables:
        shape, dtype = headers[name]
        read = sum(result["checkpoint_read"].get(name, 0) for result in results)
        assert read == math.prod(shape) * SIZE[dtype], name
    for name, (shape, dtype) in headers.items():
        if not name.endswith(".scale") and name.removesuffix(".weight").endswith(tuple(TP_SHARDED)):
            read = sum(results[r]["checkpoint_read"][name] for r in range(TP))
            assert read == math.prod(shape) * SIZE[dtype], name


def test_ep_dispatch_auto_takes_the_exact_dispatch_on_a_slow_link_at_a_prefill():
    """`ep_dispatch="auto"` (the default) on a 100 MB/s link at 4096 rows per step: the padded
    dispatch's worst-case rows would cost more than the exact one's count exchange and host
    read, so every MoE layer is exact (its logits above equal the single-device model's);
    tests/distributed/test_front_door.py's sp run, on a fast link at 8 rows, gets the padded
    one, as exact."""
    for result in results_of("tiny-every-mode-ep-exact-eager"):
        layers = result["comm"]["ep_layers"]
        assert layers and {layer["dispatch"] for layer in layers} == {"exact"}
        assert layers[0]["why"].startswith("ep_dispatch='auto': exact, "), layers[0]["why"]


def test_the_engram_layers_share_one_exchange():
    """The every-mode run's two Engram layers (before layers 1 and 4) hash the input ids: both
    tables' row ids go out in one all-to-all and their rows come back in another, placed with
    the first layer (its logits above equal the single-device model's)."""
    for result in results_of("tiny-every-mode-ep-exact-eager"):
        table = [c for c in result["comm"]["collectives"] if c["reason"].startswith("table rows")]
        assert [(c["kind"], c["dtype"], c["region"]) for c in table] == [
            ("all_to_all", "int64", "layers.1"),
            ("all_to_all", "uint8", "layers.1"),
        ], table
        assert (
            "1 + 1 (the 2 lookups of layers.1.engram.embed, layers.4.engram.embed)"
            in (table[0]["reason"])
        )


@pytest.mark.parametrize("name", sorted(n for n in RUNS if "official" in n))
def test_the_official_runs_move_fp8_rows_where_the_receiver_quantises(name):
    """Under the official numerics every layer's attention entry gather (of what wq_a / wkv
    quantise), its exit all-to-all (of what wo_b quantises) and its EP dispatch (of the experts'
    quantised input) move FP8 rows, D codes and D / 32 scales as bytes (the dispatch's with
    each row's fp32 route beside them, `core.packing`); the head's gather and the EP combine,
    which no quantisation reads, move bf16 and (exact) the counts int64
    (`spmd.quantised_transport`). The logits above are equal all the same."""
    cfg = model_config(RUNS[name])
    for result in results_of(name):
        layers = [c for c in result["comm"]["collectives"] if c["layer"] is not None]
        moved = sorted((c["axis"], c["kind"], c["dtype"]) for c in layers)
        assert (
            moved
            == sorted(
                [("tp", "all_gather", "uint8"), ("tp", "all_to_all", "uint8")]
                + [("ep", "all_to_all", t) for t in ("uint8", "bfloat16")]
                + [("ep", "all_to_all", "int64")]
                * (dict(RUNS[name].options)["ep_dispatch"] == "exact")
            )
            * cfg.n_layers
        ), moved
        gathered = next(c for c in layers if c["kind"] == "all_gather")
        assert gathered["input_shape"][1] == str(cfg.dim + cfg.dim // 32)
        dispatch = next(c for c in layers if c["axis"] == "ep" and c["dtype"] == "uint8")
        route = 2 * 4  # one route per row (ep_rows="per_assignment"): index and weight, fp32
        assert dispatch["input_shape"][1] == str(cfg.dim + cfg.dim // 32 + route)
        (head,) = [c for c in result["comm"]["collectives"] if c["layer"] is None]
        assert head["dtype"] == "bfloat16"
