"""The model a researcher edits: the edits of the corpus (`deepseek_v41.testing.edits`) compiled on 4 gloo
ranks (tp=4, eager) against the same edited model on one device, through steps whose token
counts the shards do not divide evenly: a prefill of T = 7 with two padding rows of the model's own
(slot -1) among the tokens, a decode of T = 3 < tp (rank 3 holds no token: an empty shard),
and T = 8.

Each edit changes one thing a researcher changes first on a new architecture: new modules and
parameters in attention, mHC, the MoE and the head, a bias on the row-parallel `wo_b` and an
RMSNorm of its partial sum (with the attention exit that reduce-scatters it), another
activation, another norm, ops along the head and expert dims, and -- the edits that mix tokens
-- statistics over the batch's tokens, token shifts (slices and a cat, `torch.roll`, a causal
conv as padded shifts, `F.conv1d` over the batch), a cumulative sum over a request, and
reductions keyed by request (`index_add`, `scatter_reduce` over the cache's slots).

A compile costs seconds per layer kind and rank group, so the edits are compiled together: each
run is one model whose decoder layers carry different edits (edits of different modules combine
in a layer; a layer's edits are its own kind), and each edit is checked where it is: the
residual streams leaving its layer (captured on both sides) and the logits match at the fp32
bound of tests/distributed/test_numerics.py, so does the cache, and its layer's collectives are
the layout's plus the exchanges its ops need, each the cheapest exact one (`spmd.token_ops`).
The run with edits that mix tokens is compiled with `mark_token_dim` and without it (Dynamo's
static trace of the first T, then its dynamic one). One edit is refused: its errors, on one
fake rank, are asserted verbatim. Each op kind's placements and collectives, on a small graph:
tests/spmd/test_token_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import dsv41_compile.deepseek_v41.testing.edits as edits_module
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.strategy import Strategy
from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.cases import CaseSpec, compare_on_rank
from dsv41_compile.deepseek_v41.testing.edits import EDITS
from dsv41_compile.deepseek_v41.testing.presets import SINKHORN_3, compile_config
from dsv41_compile.spmd.rules import RULES
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank
from dsv41_compile.testing.multirank import RankPool

WORLD = TP = 4
STEPS = (
    # T = 7, not a multiple of tp, with two padding rows of the model's own (slot -1): the
    # first call, which Dynamo traces with static sizes without `mark_token_dim`
    ((Request(0, [1, 2, 3], 0), Request(-1, [0, 0], 0), Request(1, [4, 5], 0)),),
    # a decode of T = 3 < tp: rank 3 holds no token (an empty shard); request 2 is new
    ((Request(0, [17], 3), Request(1, [18], 2), Request(2, [19], 0)),),
    # T = 8
    ((Request(0, [21, 22], 4), Request(1, [23, 24, 25], 3), Request(2, [26, 27, 28], 1)),),
)
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@dataclass(frozen=True)
class EditedModel:
    """tiny-swa with one decoder layer per entry of `layers`, each carrying those edits, and
    the edits `around` the layers (the head)."""

    layers: tuple[tuple[str, ...], ...]
    around: tuple[str, ...] = ()
    modes: tuple[str, ...] = ("marked",)

    @property
    def edits(self) -> list[str]:
        return [name for layer in self.layers for name in layer] + list(self.around)

    def options(self) -> tuple[tuple[str, object], ...]:
        # a prefill-sized workload: attn_exit="auto" times the all-to-all shorter there (the
        # default 8 rows give the ReduceScatter, the partial-sums run's exit)
        options = {"tp": TP, "lowering": "eager", "rows_per_step": 4096}
        for name in self.edits:
            for key, value in EDITS[name].options:
                assert options.setdefault(key, value) == value, (name, key)
        return tuple(options.items())

    def capture(self) -> tuple[str, ...]:
        """The residual streams after each layer's attention half and after the layer."""
        n = len(self.layers)
        after = [f"layers.{i + 1}.hc_attn" if i + 1 < n else "norm" for i in range(n)]
        return tuple(p for i in range(n) for p in (f"layers.{i}.hc_ffn", after[i]))

    def spec(self) -> CaseSpec:
        return CaseSpec(
            steps=STEPS,
            preset="tiny-swa",
            overrides=(*SINKHORN_3, ("n_layers", len(self.layers))),
            options=self.options(),
            modes=self.modes,
            edits=tuple(
                (name, (i,)) for i, layer in enumerate(self.layers) for name in layer
            ) + tuple((name, None) for name in self.around),
            capture=self.capture(),
            max_len=32,
        )  # fmt: skip


RUNS = {
    # the default layout (attention's exit an all-to-all): every part of the block, and in
    # each layer an edit that mixes the tokens of the attention input and one of the FFN input
    "every-part": EditedModel(
        layers=(
            ("attn_output_gate", "shared_expert_gelu", "router_softmax_topk")
            + ("token_shift_cat", "ffn_batch_centering"),
            ("q_head_scale", "ffn_layernorm", "expert_load_bias")
            + ("causal_conv", "ffn_batch_scale"),
            ("shared_expert_gate", "q_head_softmax") + ("request_running_mean", "token_shift_roll"),
            ("hc_post_scale",) + ("conv1d_over_batch",),
        ),
        around=("capped_head",),
        modes=("marked", "unmarked"),
    ),
    # reductions keyed by request (the cache slot of each token): the per-request sums and
    # maxima of each rank's rows all-reduced; a mean, whose ranks' results do not combine,
    # on gathered rows
    "keyed": EditedModel(
        layers=(
            ("request_max_scatter_reduce", "request_mean_index_add"),
            ("top_token_boost", "request_mean_scatter_reduce"),
            ("masked_token_mean",),
        ),
        modes=("marked", "unmarked"),
    ),
    # the seed's exit (wo_b row-parallel, its fp32 partial sum reduce-scattered)
    "partial-sums": EditedModel(layers=(("wo_b_bias",), ("attn_out_norm",))),
}

LAYOUT = {  # each layer's collectives in the layout
    "all_to_all": ["all_gather(tp)", "all_to_all(tp)"],  # attention's entry and exit
    "reduce_scatter": ["all_gather(tp)", "reduce_scatter(tp)"],
}
OUTSIDE_LAYERS = ["all_gather(tp)"]  # the head's input gathered
EXTRA = {
    # the exchanges an edit's ops need, by the rules (spmd/token_ops.py): a statistic over
    # the tokens is a partial all-reduced ...
    "ffn_batch_centering": ["all_reduce(tp)"] * 2,  # the masked sums, the valid count
    "ffn_batch_scale": ["all_reduce(tp)"] * 2,  # the max, the mean
    "expert_load_bias": ["all_reduce(tp)"] * 2,  # the experts' counts, the valid count
    # ... a shift needs the rows before each shard; a roll also the rows it brings around
    "token_shift_cat": ["all_gather(tp)"],  # 1 row per rank
    # two rolls, of the FFN input and of the slots (token-sharded in the layer, like every
    # activation entering it): for each, the row before each shard and the row brought around
    "token_shift_roll": ["all_gather(tp)"] * 4,
    "causal_conv": ["all_gather(tp)"] * 3,  # 1, 2 and 3 rows per rank
    # a scan adds the totals of the shards before it (1 row per rank); an index by a
    # replicated index of a token shard gathers the value
    "request_running_mean": ["all_gather(tp)"] * 2,
    # a reduction keyed by request is a partial of the slots' rows, all-reduced (its self
    # counted once: rank 0's for a sum, every rank's for a max); the rows at each token's slot
    # are read on the token shard
    "request_mean_index_add": ["all_reduce(tp)"] * 2,  # the sums, the counts
    "request_max_scatter_reduce": ["all_reduce(tp)"],  # the max
    # a keyed mean (and include_self=False): no partial combines, so the index and the rows
    # are gathered
    "request_mean_scatter_reduce": ["all_gather(tp)"] * 2,
    # a row read at a computed token index: the rank holding it gives it, a partial of one
    # row all-reduced (five reads: x[top] before the first write, x[last] and x[top] before
    # the second, x[first] and x[top] before the third); writes there: each rank writes the
    # rows it holds (no exchange); the argmax over the tokens gathers its scores
    "top_token_boost": ["all_gather(tp)"] + ["all_reduce(tp)"] * 5,
    # ops whose output size the values decide gather their token-sharded inputs (the rows,
    # the mask, its first channel, the slots); the kept tokens' count, a sum, is a partial
    # all-reduced
    "masked_token_mean": ["all_gather(tp)"] * 4 + ["all_reduce(tp)"],
    # a softmax across the heads, which tp shards: the per-head weights [T, H/tp] gathered
    # whole on the head dim
    "q_head_softmax": ["all_gather(tp)"],
    # no rule of the rules: the conv's input is gathered (a transpose moves the tokens off
    # dim 0)
    "conv1d_over_batch": ["all_gather(tp)"],
}
STATIC_LITERAL_T = {
    # `F.pad(x, (0, 0, j, 0))[:T]` with `T = x.shape[0]`: a static trace writes T as the number
    # 7 and the slice keeps it (the front porch generalizes the sizes of views and factories, not
    # a slice's bounds), so in the static program for T = 7 the slice is not a shift and the
    # padded value is gathered (exact, dearer); the dynamic and marked programs shift
    "causal_conv",
}
REFUSED = {
    # (with `mark_token_dim`, the error's type and message: None where Dynamo refuses the op
    # itself; without it, the same); {line}: the line of testing/edits.py that has the op
    "token_diff": (
        None,
        ValueError,
        "dsv41_sp compiles one graph for every token count T, and diff at {line}: "
        "delta_TD = torch.diff(x_TD, dim=0, prepend=x_TD[:1]) branches on T "
        "(1 > T + Min(1, T)): no graph can serve every T with it. Write it as x[1:] - x[:-1], "
        "with a cat or a pad for a row it lacks (torch.diff checks T >= 1)",
    ),
}
REFUSED_AT = {"token_diff": "torch.diff(x_TD"}
COMPILED = sorted(name for run in RUNS.values() for name in run.edits)
SELECTIONS = ["max_token_gather", "sorted_tokens_blend", "top_token_row", "top_tokens_mean"]
"""Tokens selected by value: compiled in three meshes by tests/distributed/test_selections.py."""


def run_of(name: str) -> tuple[str, EditedModel]:
    return next((key, run) for key, run in RUNS.items() if name in run.edits)


def layer_of(name: str, run: EditedModel) -> int | None:
    return next((i for i, layer in enumerate(run.layers) if name in layer), None)


_RESULTS: dict[str, list | RuntimeError] = {}


def results_of(key: str) -> list:
    """One run per edited model on the session's 4 ranks, shared by the tests of this module."""
    if key not in _RESULTS:
        try:
            _RESULTS[key] = RankPool.shared(WORLD).run(compare_on_rank, RUNS[key].spec())
        except RuntimeError as error:  # fail every dependent test without re-running
            _RESULTS[key] = error
    if isinstance(_RESULTS[key], RuntimeError):
        raise _RESULTS[key]
    return _RESULTS[key]


def test_the_corpus_has_edits_of_every_kind():
    """At least twelve edits, each compiled in exactly one run (here, or the selections in
    their own file) or refused; the edits that mix tokens are compiled with and without
    `mark_token_dim`."""
    assert len(EDITS) >= 12
    assert sorted(COMPILED + list(REFUSED) + SELECTIONS) == sorted(EDITS)
    assert len(set(COMPILED)) == len(COMPILED)
    for key, run in RUNS.items():
        assert all(EDITS[n].in_layers for layer in run.layers for n in layer), key
        assert not any(EDITS[n].in_layers for n in run.around), key
        if any(EDITS[n].mixes_tokens for n in run.edits):
            assert set(run.modes) == {"marked", "unmarked"}, key
    assert sum(EDITS[n].mixes_tokens for n in COMPILED) >= 6
    assert set(EXTRA) <= set(COMPILED)


def test_edits_of_one_module_or_site_do_not_combine():
    """Edits of different modules, and edits that mix tokens at the attention and at the FFN
    input, combine in a layer; two of one module's forward, or two at one site, do not."""
    model = DeepseekV41(compile_config())
    EDITS["token_shift_cat"].apply(model, [0])
    EDITS["ffn_batch_centering"].apply(model, [0])
    assert sorted(model.layers[0].token_mixes) == ["attention", "ffn"]
    with pytest.raises(ValueError) as info:
        EDITS["causal_conv"].apply(model, [0])
    assert str(info.value) == (
        "the attention input of layer 0 mixes tokens already: one edit that mixes tokens per site"
    )
    EDITS["q_head_scale"].apply(model, [0])
    with pytest.raises(ValueError) as info:
        EDITS["q_head_softmax"].apply(model, [0])
    assert (
        str(info.value) == "Linear.forward of this module was edited already: one edit per module"
    )


def test_only_the_layouts_collectives_carry_the_layouts_choices():
    """A collective's reason ends with the decision behind it: the attention exit's on the
    exit's reduce-scatter (its region is the whole layer), not on a statistic's all-reduces in
    the same layer (one rank of a fake world, `extra_weight_bytes=0` to make `"auto"` choose
    the reduce-scatter)."""
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", (("n_layers", 1),)))
    EDITS["ffn_batch_centering"].apply(model)
    ids, positions, slots = pack(list(STEPS[0][0]))
    _, ctx, _ = compile_model_on_fake_rank(
        model, (ids, positions, slots, model.new_cache(4, 32)),
        {"tp": TP, "extra_weight_bytes": 0}, world_size=WORLD, token_inputs=(ids, positions, slots),
    )  # fmt: skip
    reasons = {}
    for record in ctx.comm:
        reasons.setdefault(record["kind"], []).append(record["reason"])
    (exit_,) = reasons["reduce_scatter"]
    assert exit_.endswith("; attn_exit='auto': reduce_scatter, 10.002 us per layer against "
                          "10.003 us all_to_all on 950dt at 8 rows per step (10 us per "
                          "collective; 192 B per token against 48 B; all_to_all would read "
                          "+12,288 B of wo_b per layer) (all_to_all would replicate 12,288 B > "
                          "extra_weight_bytes)")  # fmt: skip
    assert len(reasons["all_reduce"]) == 2
    assert all(r.startswith("P -> R: ") and ";" not in r for r in reasons["all_reduce"])


def _streams(values: list[torch.Tensor], T: int) -> torch.Tensor:
    """The TP group's token shards of a value reassembled (rank k holds rows [k*Tl, (k+1)*Tl),
    padded at the tail)."""
    return torch.cat(values)[:T]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_edit_compiles_to_the_edited_single_device_model(name):
    """The logits of every rank, mode and step, and the residual streams leaving the edit's
    layer (after its attention half and after the layer), match the edited model on one
    device; so does the cache."""
    key, run = run_of(name)
    results = results_of(key)
    for rank, result in enumerate(results):
        assert result["T"] == [7, 3, 8]
        assert set(result["modes"]) == set(run.modes)
        for mode, out in result["modes"].items():
            for step, (sp, ref) in enumerate(zip(out["logits"], result["ref"])):
                assert sp.shape == ref.shape == (result["T"][step], 512)
                torch.testing.assert_close(
                    sp, ref, **TOLERANCE,
                    msg=lambda m, at=f"{name} {mode} rank {rank} step {step}": f"{at}: {m}",
                )  # fmt: skip
            assert out["cache_diff"] <= 1e-5, (name, mode)
    layer = layer_of(name, run)
    points = run.capture()[2 * layer : 2 * layer + 2] if layer is not None else ()
    for point in points:
        refs = results[0]["captures"][point][1]
        assert len(refs) == len(STEPS)
        for step, ref in enumerate(refs):
            sp = _streams([r["captures"][point][0][step] for r in results], ref.shape[0])
            scale = max(1.0, float(ref.abs().amax()))  # the streams grow with depth
            torch.testing.assert_close(
                sp, ref, atol=1e-5 * scale, rtol=1e-5,
                msg=lambda m, at=f"{name}: {point} step {step}": f"{at}: {m}",
            )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_edit_gets_the_layouts_collectives_and_what_its_ops_need(name):
    """With `mark_token_dim`: one program for every T; without it, a static program for T = 7
    and a dynamic one from T = 3 on (docs/backend.md, "Token counts"). Every program gives the
    edit's layer the layout's collectives plus the exchanges its edits' ops need, and the
    modules around the layers the layout's; a static program whose edit writes T as a number
    gathers instead of exchanging rows (`STATIC_LITERAL_T`)."""
    key, run = run_of(name)
    exit_ = dict(run.options()).get("attn_exit", "all_to_all")
    layer = layer_of(name, run)
    for result in results_of(key):
        programs = [
            (mode, i, program, outside)
            for mode, out in result["modes"].items()
            for i, (program, outside) in enumerate(zip(out["programs"], out["outside_layers"]))
        ]
        assert [(mode, i) for mode, i, *_ in programs] == [
            ("marked", 0), *((("unmarked", 0), ("unmarked", 1)) if "unmarked" in run.modes else ())
        ]  # fmt: skip
        for mode, i, program, outside in programs:
            assert outside == OUTSIDE_LAYERS
            if layer is None:
                continue
            edits = run.layers[layer]
            expected = sorted(LAYOUT[exit_] + [c for n in edits for c in EXTRA.get(n, [])])
            if (mode, i) == ("unmarked", 0) and STATIC_LITERAL_T & set(edits):
                # the other edits' exchanges, and gathers of values for the literal one's
                others = [c for n in edits if n not in STATIC_LITERAL_T for c in EXTRA.get(n, [])]
                gathers = list(program[layer])
                for c in LAYOUT[exit_] + others:
                    gathers.remove(c)
                assert set(gathers) == {"all_gather(tp)"}, (name, layer, program[layer])
                assert len(program[layer]) <= len(expected), (name, layer, program[layer])
            else:
                assert program[layer] == expected, f"{name} {mode} {i}: {program[layer]}"


def _compare_with_a_planted_rule(rank: int, world_size: int, spec: CaseSpec) -> dict:
    """`compare_on_rank` with a wrong rule for `index_add` in place of ours: each rank's sum
    over its own tokens called replicated (no all-reduce) -- placements that verify cannot
    tell from right ones."""
    aten = torch.ops.aten

    def wrong(node, given):
        return Strategy(inputs=(Replicate(), Shard(0), Shard(0)), outputs=(Replicate(),))

    with RULES.restored():
        RULES.remove(aten.index_add.default)
        RULES.add(aten.index_add.default, wrong)
        return compare_on_rank(rank, world_size, spec)


@pytest.mark.slow
def test_a_wrong_rule_makes_the_comparison_fail():
    """The comparison can fail: the request mean (`index_add`) compiled with a planted rule
    that skips the all-reduce gives logits off the single-device model's, at the steps whose
    requests span ranks, where the right rule's run above matches."""
    # (the host cache keys the program by the rules in force: the right rule's compiles of
    # the same model never load this one, tests/runtime/test_host_cache.py)
    spec = EditedModel(layers=(("request_mean_index_add",),)).spec()
    results = RankPool.shared(WORLD).run(_compare_with_a_planted_rule, spec)
    worst = max(
        float((sp - ref).abs().max())
        for result in results
        for sp, ref in zip(result["modes"]["marked"]["logits"], result["ref"])
    )
    assert worst > 100 * TOLERANCE["atol"], worst


def _source_line(text: str) -> str:
    """`path:line` of the line of testing/edits.py that contains `text`."""
    path = Path(edits_module.__file__)
    lines = path.read_text().splitlines()
    return f"{path}:{next(i + 1 for i, line in enumerate(lines) if text in line)}"


def _compile_error(name: str, *, mark: bool) -> BaseException:
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", (("n_layers", 1),)))
    EDITS[name].apply(model)
    ids, positions, slots = pack([r for r in STEPS[0][0]])
    marked = (ids, positions, slots) if mark else ()
    with pytest.raises(Exception) as info:
        compile_model_on_fake_rank(
            model, (ids, positions, slots, model.new_cache(4, 32)), {"tp": TP},
            world_size=WORLD, token_inputs=marked,
        )  # fmt: skip
    error = info.value
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    return error


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_edit_names_the_op_its_line_and_what_to_do(name):
    """The error names the op and its line and says what to do. `torch.diff` along the tokens:
    without `mark_token_dim` the backend meets it when it makes T a symbol, and says what to
    write; with it, Dynamo refuses the op itself while tracing (its own error, at the model
    line), before the backend is called. Neither error sends the user to the other way."""
    marked, unmarked, message = REFUSED[name]
    message = message.format(line=_source_line(REFUSED_AT[name]))
    error = _compile_error(name, mark=False)
    assert type(error) is unmarked and str(error) == message
    error = _compile_error(name, mark=True)
    if marked is not None:
        assert type(error) is marked and str(error) == message
        return
    assert isinstance(error, torch._dynamo.exc.UserError) and not isinstance(error, InternalError)
    assert "Could not guard on data-dependent expression" in str(error)
    assert "torch.diff(x_TD, dim=0, prepend=x_TD[:1])" in str(error)
    assert "mark_token_dim" not in str(error)
