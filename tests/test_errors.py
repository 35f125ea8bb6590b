"""Every user mistake the backend can see is an error that says what to change, asserted
verbatim: options, the mesh, the model's inputs, a graph break, an op without a rule, a model
that would be compiled past Dynamo's recompile limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo

import dsv41_compile
from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.presets import ENGRAM_0, ONE_LAYER, compile_config
from dsv41_compile.options import BackendOptions
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank, layer_collectives
from dsv41_compile.testing.torch_shims import fake_process_group
from dsv41_compile.testing.toy import ToyLM, toy_family

REQUESTS = [Request(0, [1, 2, 3], 0), Request(1, [4, 5], 0)]


@torch.library.custom_op("dsv41_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


# What the model's errors are raised on: one window-only layer (no error depends on the layer
# count). The errors of the options, the mesh, the pipeline and Dynamo's limits are the same for
# every model family: they are raised on the toy (`compile_toy`, `testing.toy`).
ONE_LAYER_MODEL = compile_config("tiny-swa", ONE_LAYER)


def compile_and_run(options: dict, *, cfg=None, patch=None, fullgraph=True, model=None):
    """The DeepSeek model (one window-only layer unless given) compiled and called as rank 1 of
    a fake world of 8 ranks, its token count marked."""
    torch.manual_seed(0)
    model = model or DeepseekV41(cfg or ONE_LAYER_MODEL)
    if patch is not None:
        patch(model)
    torch._dynamo.reset()
    ids, positions, slots = pack(REQUESTS)
    dsv41_compile.mark_token_dim(ids, positions, slots)
    compiled = torch.compile(
        model, backend="dsv41_sp", options={"lowering": "eager", **options}, fullgraph=fullgraph
    )
    with fake_process_group(world_size=8, rank=1):
        return compiled(ids, positions, slots, model.new_cache(4, 16))


def compile_toy(options: dict):
    """The toy model (`testing.toy`) compiled and called as rank 1 of a fake world of 8: for
    the errors that depend on the options and the mesh, not on the model, at a fraction of the
    DeepSeek layer's trace."""
    with toy_family():
        return compile_model_on_fake_rank(ToyLM(), (torch.arange(8),), options)


def raised(call) -> BaseException:
    """The backend's own error, out of Dynamo's wrapper."""
    with pytest.raises(Exception) as info:
        call()
    error = info.value
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    return error


def assert_error(error: BaseException, kind: type, message: str) -> None:
    assert type(error) is kind, f"{type(error).__name__}: {error}"
    assert str(error) == message


def test_world_size_not_divisible_by_tp():
    assert_error(
        raised(lambda: compile_toy({"tp": 3})),
        ValueError,
        "tp=3 does not divide the world size 8: the world is split into world/tp data-parallel "
        "groups of tp ranks; choose tp in [1, 2, 4, 8]",
    )


@pytest.mark.parametrize(
    ("overrides", "tp", "message"),
    [
        (
            {"o_groups": 2},
            4,
            "tp=4 does not divide this model's attention: it shards its 8 heads and 2 output "
            "groups over tp; choose tp in [1, 2]",
        ),
        (
            {"n_heads": 2, "o_groups": 2},
            8,
            "tp=8 does not divide this model's attention: it shards its 2 heads and 2 output "
            "groups over tp; choose tp in [1, 2]",
        ),
    ],
)
def test_tp_not_dividing_heads_or_output_groups(overrides, tp, message):
    cfg = compile_config("tiny-swa", ONE_LAYER, tuple(overrides.items()))
    assert_error(raised(lambda: compile_and_run({"tp": tp}, cfg=cfg)), ValueError, message)


def test_ep_must_be_the_world_or_one():
    assert_error(
        raised(lambda: compile_toy({"tp": 4, "ep": 4})),
        ValueError,
        "ep=4: the expert-parallel group is the whole world, so ep must be the world size 8 "
        "(experts sharded over every rank) or 1 (every rank holds every routed expert)",
    )


def test_ep_not_dividing_the_routed_experts():
    cfg = compile_config("tiny-swa", ONE_LAYER, (("n_routed_experts", 12),))
    assert_error(
        raised(lambda: compile_and_run({"tp": 4, "ep": 8}, cfg=cfg)),
        ValueError,
        "ep=8 does not divide the 12 routed experts of layers.0.ffn.experts.w1: every rank must "
        "hold the same number of experts; use a model whose n_routed_experts is a multiple of "
        "ep, or ep=1",
    )


def test_no_process_group():
    torch._dynamo.reset()
    options = {"tp": 4, "lowering": "eager"}
    compiled = torch.compile(ToyLM(), backend="dsv41_sp", options=options, fullgraph=True)
    with toy_family():
        error = raised(lambda: compiled(torch.arange(8)))
    assert_error(
        error,
        ValueError,
        "dsv41_sp needs a process group: call torch.distributed.init_process_group() (e.g. "
        "under torchrun) before the first call of the compiled model",
    )


def _break_before(module):
    """Patch `module.forward` to graph-break before it runs."""
    forward = module.forward

    def broken(*args):
        torch._dynamo.graph_break()
        return forward(*args)

    module.forward = broken


def test_graph_break_between_layers():
    """A break in the model's own code, before a layer: Dynamo hands the backend the model in
    pieces, and a piece is refused before anything runs."""
    error = raised(
        lambda: compile_and_run(
            {"tp": 4}, patch=lambda model: _break_before(model.layers[0]), fullgraph=False
        )
    )
    assert type(error) is ValueError
    assert str(error).startswith("dsv41_sp does not know this graph: its inputs are [")
    assert str(error).endswith(
        "The model families it shards are: deepseek_v41 (inputs input_ids, positions, slots, "
        "...). If this is a piece of such a model, Dynamo split the model at a graph break: "
        "compile with torch.compile(..., fullgraph=True) to see where, and remove the break. "
        "Otherwise add an adapter for your model family (docs/architecture.md)"
    )


def test_graph_break_before_the_head():
    """A break after the layers: the first piece is a model family's, without its head."""
    error = raised(
        lambda: compile_and_run(
            {"tp": 4}, patch=lambda model: _break_before(model.norm), fullgraph=False
        )
    )
    assert_error(
        error,
        ValueError,
        "dsv41_sp compiles the whole model as one graph, but this graph has no head module: "
        "Dynamo split the model at a graph break. Compile with torch.compile(..., "
        "fullgraph=True) to see where, and remove the break.",
    )


def test_graph_break_inside_a_layer():
    """A decoder layer is a compiled region (`nested_compile_region`): Dynamo cannot split it,
    and says so at the first call, naming the break and the line (no piece reaches the
    backend, nothing runs unsharded)."""
    error = raised(
        lambda: compile_and_run(
            {"tp": 4}, patch=lambda model: _break_before(model.layers[0].ffn), fullgraph=False
        )
    )
    assert isinstance(error, torch._dynamo.exc.UncapturedHigherOrderOpError)
    assert "Call to `torch._dynamo.graph_break()`" in str(error)
    assert "ffn_out_TD = self.ffn(ffn_in_TD, valid_T)" in str(error)


def test_model_inputs_under_other_names():
    class Renamed(DeepseekV41):
        def forward(self, tokens, positions, slots, cache):
            return super().forward(tokens, positions, slots, cache)

    model = Renamed(compile_config())
    assert_error(
        raised(lambda: compile_and_run({"tp": 4}, model=model)),
        ValueError,
        "dsv41_sp expects the deepseek_v41 model's inputs input_ids, positions, slots: no input "
        "named input_ids among ['cache.lengths', 'cache.window_kv[0]', 'cache.window_kv[1]', "
        "'positions', 'slots', 'tokens']",
    )


def test_parameters_that_require_grad_name_the_fix():
    model = DeepseekV41(compile_config()).requires_grad_(True)
    assert_error(
        raised(lambda: compile_and_run({"tp": 4}, model=model)),
        ValueError,
        "dsv41_sp compiles inference graphs, but 51 parameters of this model require grad "
        "(embed.weight, ...) and grad mode is on; call the compiled model under "
        "torch.no_grad() or torch.inference_mode(), or call model.requires_grad_(False) first",
    )


def test_op_without_a_rule_names_node_op_placements_and_source_line():
    model = ToyLM()
    block = model.blocks[1]
    forward = block.forward
    block.forward = lambda h: forward(torch.ops.dsv41_test.mystery(h))
    with toy_family():
        error = raised(lambda: compile_model_on_fake_rank(model, (torch.arange(8),), {"tp": 4}))
    assert type(error) is NotImplementedError
    line = next(
        i + 1
        for i, text in enumerate(Path(__file__).read_text().splitlines())
        if "mystery(h))" in text
    )
    assert str(error) == (
        "no sharding rule for node mystery (dsv41_test.mystery.default) in module blocks.1 "
        f"at {__file__}:{line}: block.forward = lambda h: "
        "forward(torch.ops.dsv41_test.mystery(h)) with input placements (S(0)); add a "
        "rule for it (dsv41_compile/spmd/rules/, or the model adapter's `rules`: "
        'docs/architecture.md, "Adding an op rule") or change the model so this op sees '
        "replicated inputs"
    )


def test_a_value_computed_from_a_sharded_parameter_is_not_gathered_per_call():
    """A row of `down.weight.t()` (the weight is sharded on its columns, so its transpose on its
    rows) where every rank needs the whole row: gathering it would re-gather the parameter on
    every call, so it is the plan's error, as for the parameter itself."""
    model = ToyLM()
    block = model.blocks[1]
    base = type(block)

    def forward(self, h):
        return base.forward(self, h + self.mlp.down.weight.t()[0])

    block.__class__ = type("Block", (base,), {"forward": forward})
    tokens = torch.arange(7)
    with toy_family():
        error = raised(
            lambda: compile_model_on_fake_rank(model, (tokens,), {"tp": 4}, token_inputs=(tokens,))
        )
    line = next(
        i + 1
        for i, text in enumerate(Path(__file__).read_text().splitlines())
        if "self.mlp.down.weight.t()[0])" in text
    )
    assert_error(
        error,
        ValueError,
        "the plan places blocks.1.mlp.down.weight as S(1), but node select (aten.select.int) in "
        f"module blocks.1 at {__file__}:{line}: return base.forward(self, h + "
        "self.mlp.down.weight.t()[0]) needs t_2, computed from it (S(0)), as R (rule (R) -> R); "
        "the parameter would be re-gathered on every call. If the op splits the sharded dim, "
        "choose a tp that divides it; otherwise change the plan or the model so this op sees "
        "the shard",
    )


def test_a_size_that_makes_t_a_number_names_the_op():
    """Without `mark_token_dim` Dynamo traces the first call with T = 7 written as a number;
    the backend makes it T again where a view's or a factory's size is T, but not in
    `torch.full`'s size tuple: meeting that value against T rows would make the graph one for
    T = 7 only. The error names the op and what to write instead, and `mark_token_dim` (where
    the same model compiles) is the way out, not a way back here."""
    model = ToyLM()
    block = model.blocks[1]
    base = type(block)

    def forward(self, h):
        return base.forward(self, h + torch.full((h.shape[0], 1), 0.5))

    block.__class__ = type("Block", (base,), {"forward": forward})
    tokens = torch.arange(7)
    with toy_family():
        error = raised(lambda: compile_model_on_fake_rank(model, (tokens,), {"tp": 4}))
        marked = compile_model_on_fake_rank(model, (tokens,), {"tp": 4}, token_inputs=(tokens,))
    assert marked[2].shape == (7, 64)
    line = next(
        i + 1
        for i, text in enumerate(Path(__file__).read_text().splitlines())
        if "torch.full((h.shape[0], 1), 0.5)" in text
    )
    assert_error(
        error,
        ValueError,
        f"dsv41_sp compiles one graph for every token count T, and add at {__file__}:{line}: "
        "return base.forward(self, h + torch.full((h.shape[0], 1), 0.5)) makes T the number 7: "
        "Dynamo traced the first call with static sizes, and this op meets T rows against a "
        "size 7 that the backend could not tell from T (a size given to torch.full, a slice's "
        "bound). Call dsv41_compile.mark_token_dim(tokens) before each call (Dynamo then "
        "traces T as a symbol), or make the value from a tensor with the T rows "
        "(torch.full_like(x[:, :1], v), x.new_full((T, 1), v))",
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp": 4, "ep": 0}, "ep must be a positive int, got 0"),
        (
            {"tp": 4, "ep": 8, "ep_dispatch": "capped"},
            "ep_dispatch='capped' is not supported; choose one of ('auto', 'exact', 'padded')",
        ),
        (
            {"tp": 4, "lowering": "xla"},
            "lowering='xla' is not supported; choose one of ('auto', 'eager', 'inductor', "
            "'npugraph_ex', 'torchair')",
        ),
        (
            {"tp": 4, "ep": 8, "ep_dispatch": "exact", "lowering": "torchair"},
            "lowering='torchair' needs ep_dispatch='padded' with ep > 1: the exact EP lowering "
            "reads the assignment counts on the host (data-dependent sizes), which torchair's "
            "GE graphs cannot run",
        ),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError) as info:
        BackendOptions.from_dict(options)
    assert str(info.value) == message
    assert_error(raised(lambda: compile_toy(options)), ValueError, message)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"tp": 4, "dump_after": ["insert", "lower"]},
            "dump_after names no pass: ['lower']; the passes are ('token_sizes', 'annotate', "
            "'token_shifts', 'entry_cut', 'insert', 'localize', 'expert_parallel', 'tables', "
            "'quantised_transport', 'coalesce', 'one_rank', 'graph_mode', 'npu_ops', 'capture_check', 'verify')",
        ),
        (
            {"tp": 4, "layout": "replicated"},
            "layout='replicated' is not a layout of the toy_lm model family; choose one of ('sp',)",
        ),
    ],
)
def test_options_checked_against_the_pipeline_and_the_model_family(options, message):
    """Pass names and layouts are the pipeline's and the family's: checked at compile time."""
    assert_error(raised(lambda: compile_toy(options)), ValueError, message)


GENERIC_OPTIONS = (
    "['capture_tokens', 'check_inputs', 'checkpoint', 'device', 'dump_after', 'dump_dir', 'ep', "
    "'ep_dispatch', 'ep_rows', 'extra_weight_bytes', 'layout', 'lowering', 'rows_per_step', "
    "'share_compile', 'skip_unimplemented_parts', 'tp']"
)


def test_an_unknown_option_is_refused_with_the_generic_and_the_familys_options():
    assert_error(
        raised(lambda: compile_toy({"tp": 4, "pipeline": 2})),
        ValueError,
        f"unknown dsv41_sp option(s) ['pipeline']. The options are {GENERIC_OPTIONS}, and the "
        "toy_lm model family's ['mlp']",
    )


def test_a_familys_own_option_is_its_own():
    """The toy family's `mlp` changes the toy's program; given to DeepSeek V4.1, it is refused,
    naming the family it belongs to."""
    with toy_family():
        _, ctx, _ = compile_model_on_fake_rank(
            ToyLM(), (torch.arange(8),), {"tp": 4, "mlp": "replicated"}
        )
        assert layer_collectives(ctx.comm) == {0: ["all_gather(tp)"], 1: ["all_gather(tp)"]}
        assert_error(
            raised(lambda: compile_and_run({"tp": 4, "mlp": "replicated"})),
            ValueError,
            "unknown dsv41_sp option(s) ['mlp']; 'mlp' is an option of the toy_lm model family, "
            f"not of deepseek_v41. The options are {GENERIC_OPTIONS}, and the deepseek_v41 model "
            "family's ['attn_entry', 'attn_exit', 'embedding', 'head', 'engram', "
            "'shared_expert', 'npu_attention']",
        )
    assert_error(
        raised(lambda: compile_and_run({"tp": 4, "embedding": "tied"})),
        ValueError,
        "embedding='tied' is not supported; choose one of ('replicated', 'vocab_sharded')",
    )


def test_the_attention_exit_all_to_all_is_a_cut_of_the_sp_layout():
    assert_error(
        raised(
            lambda: compile_and_run({"tp": 4, "layout": "replicated", "attn_exit": "all_to_all"})
        ),
        ValueError,
        "attn_exit='all_to_all' is a cut of the sp layout; layout='replicated' all-reduces "
        "attention's output (use attn_exit='auto' or 'reduce_scatter')",
    )


def test_a_split_engram_table_needs_experts_over_the_world():
    cfg = compile_config("tiny-swa", ONE_LAYER, ENGRAM_0)
    assert_error(
        raised(lambda: compile_and_run({"tp": 4, "engram": "sharded"}, cfg=cfg)),
        ValueError,
        "engram='sharded' splits the Engram tables over the world, which the EP group is: it "
        "needs ep = the world size and layout='sp' (got ep=1, layout='sp'); use "
        "engram='replicated'",
    )


def test_a_split_shared_expert_needs_the_sp_layout_and_fp32_activations():
    assert_error(
        raised(
            lambda: compile_and_run({"tp": 4, "layout": "replicated", "shared_expert": "split"})
        ),
        ValueError,
        "shared_expert='split' splits the shared expert over tp in the sp layout (got "
        "layout='replicated', tp=4); use shared_expert='auto'",
    )
    cfg = compile_config("tiny-swa", ONE_LAYER, (("dtype", "bfloat16"),))
    assert_error(
        raised(lambda: compile_and_run({"tp": 4, "shared_expert": "split"}, cfg=cfg)),
        ValueError,
        "shared_expert='split': the split expert's w2 gives each rank a partial sum in the "
        "activation dtype (torch.bfloat16), whose rounding before the sum differs from the "
        "single-device model's; the split needs fp32 activations. Use shared_expert='whole'",
    )


def test_auto_lowering_on_npu_tensors_refuses_the_exact_dispatch():
    """lowering="auto" resolves to npugraph_ex on NPU tensors, which cannot run the exact EP
    lowering: the same refusal as lowering="npugraph_ex", naming the choice "auto" made."""
    with pytest.raises(ValueError) as info:
        BackendOptions(tp=4, ep=8, ep_dispatch="exact").target("npu")
    assert str(info.value) == (
        "lowering='auto' chose npugraph_ex (NPU tensors) needs ep_dispatch='padded' with "
        "ep > 1: the exact EP lowering reads the assignment counts on the host (data-dependent "
        "sizes), which a captured ACL graph cannot run"
    )
    assert BackendOptions(tp=4, ep=8, ep_dispatch="padded").target("npu") == "npugraph_ex"
    # the default, "auto", takes the padded dispatch for npugraph_ex (expert_parallel)
    assert BackendOptions(tp=4, ep=8).target("npu") == "npugraph_ex"


def test_compiling_past_the_recompile_limit_is_refused():
    """dynamic=False compiles a graph per T; the compile that would use up Dynamo's recompile
    limit is refused (past it, Dynamo would run the model eagerly, unsharded)."""
    torch._dynamo.reset()
    compiled = torch.compile(
        ToyLM(), backend="dsv41_sp", options={"tp": 4, "lowering": "eager"}, dynamic=False
    )
    with toy_family(), torch._dynamo.config.patch(recompile_limit=2), fake_process_group(8, 1):
        compiled(torch.arange(2))
        error = raised(lambda: compiled(torch.arange(3)))
    assert_error(
        error,
        ValueError,
        "dsv41_sp: this is Dynamo's compile 2 of this model and its recompile limit is 2: past "
        "it, Dynamo would run the model eagerly -- unsharded, the whole model on every rank. "
        "With static token counts (dynamic=False) every new T is a new graph: call "
        "dsv41_compile.mark_token_dim(tokens) before each call (one graph for every T), or raise "
        "torch._dynamo.config.recompile_limit",
    )


def test_a_model_without_weights_needs_the_checkpoint_option():
    model = DeepseekV41.without_weights(ONE_LAYER_MODEL)
    n = len(list(model.parameters()))
    assert_error(
        raised(lambda: compile_and_run({"tp": 4}, model=model)),
        ValueError,
        f"{n} parameters of this model have no weights (embed.weight, ...): pass options "
        "checkpoint=DIR (each rank reads only its own shards), or load the weights into the "
        "model first",
    )
