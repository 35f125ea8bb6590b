"""A CPU stand-in for torchair, for tests and `tools/torchair_coverage.py` (torch_npu cannot be
installed without the Ascend toolkit).

It replaces the one entry point the torchair lowering calls, `get_npu_backend(compiler_config=)`,
and the config it builds, with the attribute paths of torch-npu 2.13.0's `CompilerConfig`
(configs/compiler_config.py, experimental_config.py, debug_config.py; setting any other
attribute is an error, as in torchair). Its backend records what it is handed and then does what
torchair's does before converting to GE (npu_fx_compiler.py, `_compile_graph_with_aot`): runs
AOTAutograd on the graph, which decomposes every CompositeImplicit op, with
`keep_inference_input_mutations=True`. The graph that comes out is what torchair's converters
would see (`aot_graphs`); the stand-in runs it eagerly. That step depends only on the graph
and its inputs' shapes, so the stand-in does it once per host for each graph it is handed (the
host's other ranks load the result: `runtime.host_cache.shared`), where torchair does
it on every rank. torchair's own decomposition table
(`_c10d_functional.all_to_all_single` -> its HCCL all-to-all op) is not applied: the functional
all-to-all stays, and runs on gloo. torch_npu's ops graph mode uses are defined with their
schemas and CPU kernels (`register_npu_ops`).

    standin = TorchairStandIn()
    with dsv41_compile.core.hooks.installed(Hooks(torchair=standin)):
        compiled(input_ids, positions, slots, cache)  # lowering="torchair"
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch.fx import GraphModule
from torch.library import Library

from dsv41_compile.core.torch_private import (
    OpOverload,
    aot_module_simplified,
    make_boxed_func,
    op_short_name,
    overload_name,
)
from dsv41_compile.formats import e2m1_values, e8m0_powers
from dsv41_compile.runtime.host_cache import load_graph, program_key, save_graph, shared
from dsv41_compile.targets.npu_dtypes import E2M1, E4M3, E8M0, NPU_DTYPES

__all__ = [
    "Strict",
    "TorchairStandIn",
    "aot_graph",
    "graph_ops",
    "op_name",
    "register_npu_ops",
]


class Strict(SimpleNamespace):
    """Like torchair's config sections: setting an attribute it does not have is an error."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.__dict__:
            raise AttributeError(f"torchair's CompilerConfig has no {name!r}")
        super().__setattr__(name, value)


class TorchairStandIn:
    """`torch_npu.dynamo.torchair` as the torchair lowering uses it."""

    def __init__(self) -> None:
        register_npu_ops()  # importing torch_npu registers its ops; so does the stand-in
        self.handed: list[tuple[GraphModule, list[Any], Any]] = []
        self.aot_graphs: list[GraphModule] = []

    @staticmethod
    def CompilerConfig() -> Strict:
        return Strict(
            mode="reduce-overhead",  # not torchair's default: the lowering must set it
            experimental_config=Strict(frozen_parameter=False),
            debug=Strict(graph_dump=Strict(type=None, path=None)),
        )

    def get_npu_backend(self, *, compiler_config: Any) -> Any:
        def backend(gm: GraphModule, example_inputs: list[Any]) -> Any:
            self.handed.append((gm, example_inputs, compiler_config))
            graph = aot_graph_for_host(gm, example_inputs)
            self.aot_graphs.append(graph)
            return graph.forward

        return backend


def op_name(target: object) -> str:
    """The name torchair registers `target`'s converter under: `torch.ops.aten.mm.default`,
    `operator.add` (read by tools/torchair_coverage.py)."""
    if isinstance(target, OpOverload):
        return f"torch.ops.{target.namespace}.{op_short_name(target)}.{overload_name(target)}"
    module = getattr(target, "__module__", "") or ""
    return f"{module.removeprefix('_')}.{getattr(target, '__name__', target)}"


def graph_ops(gm: GraphModule) -> Counter[str]:
    """How often each op (by `op_name`) is called in `gm`."""
    return Counter(op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")


def fp4_ops(gm: GraphModule) -> Counter[str]:
    """How often each of torch_npu's ops takes a weight or decodes values as FP4
    (`weight_dtype` / `src_type` float4_e2m1) in `gm`: a grouped matmul of FP4 weights, a
    decode of them."""
    return Counter(
        op_name(n.target)
        for n in gm.graph.nodes
        if n.op == "call_function"
        and E2M1 in (n.kwargs.get("weight_dtype"), n.kwargs.get("src_type"))
    )


def aot_graph(gm: GraphModule, example_inputs: list[Any]) -> GraphModule:
    """The ATen graph torchair's AOT step makes of `gm` (what its converters see)."""
    graphs: list[GraphModule] = []

    def compiler(gm: GraphModule, example_inputs: Sequence[Any]) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=compiler,
        inference_compiler=compiler,
        keep_inference_input_mutations=True,
    )
    (graph,) = graphs
    return graph


def aot_graph_for_host(gm: GraphModule, example_inputs: list[Any]) -> GraphModule:
    """`aot_graph(gm, example_inputs)`, made by the first rank of the host that needs it and
    loaded by the others. The graph keeps the cache writes (`keep_inference_input_mutations`)
    and aliases no input, so it runs on the handed inputs as they are, like the AOT step's
    own wrapper does."""
    key = program_key(gm, example_inputs, ("torchair-standin-aot",))
    if key is None:  # inputs' symbols without canonical names: no key to share under
        return aot_graph(gm, example_inputs)
    with shared(key, folder="torchair_standin") as slot:
        if slot.artifact is None:
            graph = aot_graph(gm, example_inputs)
            slot.store(save_graph(graph))
            return graph
        saved = slot.artifact
    return load_graph(saved)  # outside the lock: the host's ranks load at the same time


# torch_npu's grouped matmul, for graph mode's routed experts (targets/npu_passes.py). Schema
# from torch-npu 2.13.0's csrc/aten/npu_native_functions_by_codegen.yaml:445.
GROUPED_MATMUL_SCHEMA = (
    "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, "
    "Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None, "
    "Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, Tensor? group_list=None, "
    "Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None, "
    "Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=None, "
    "int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, int? output_dtype=None, "
    "int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None, "
    "int? per_token_scale_dtype=None) -> Tensor[]"
)
# torch_npu's MX quantisation ops and its quantised matmul, for graph mode's FP8 / FP4 weights
# and the official numerics' activation quantisation (deepseek_v41/graph_mode.py).
# Schemas from the same yaml (lines 329, 335, 678).
MX_QUANT_SCHEMA = (
    'npu_dynamic_mx_quant(Tensor input, *, int axis=-1, str round_mode="rint", int dst_type=296, '
    "int block_size=32, int? scale_alg=0, float dst_type_max=0.0, float max_low_bound=0.0) "
    "-> (Tensor, Tensor)"
)
ANTI_MX_QUANT_SCHEMA = (
    "npu_anti_mx_quant(Tensor x, Tensor mxscale, *, int? axis=-1, int? dst_type=15, "
    "int? src_type=292) -> Tensor"
)
QUANT_MATMUL_SCHEMA = (
    "npu_quant_matmul(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, "
    "Tensor? pertoken_scale=None, Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, "
    "int? x2_dtype=None, int? pertoken_scale_dtype=None, int? scale_dtype=None, "
    "int[]? group_sizes=None, Tensor? y_scale=None) -> Tensor"
)
SPARSE_FLASH_ATTENTION_SCHEMA = (
    "npu_sparse_flash_attention(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, "
    "float scale_value, *, Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, "
    "Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, "
    'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, '
    "int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, "
    "int attention_mode=0, bool return_softmax_lse=False, Tensor? sinks=None) "
    "-> (Tensor, Tensor, Tensor)"
)
_LIBRARY: list[Library] = []
A8W4_WEIGHT_FACTOR = 1.0
"""What the A8W4 form's FP4 weights are multiplied by (`_a8w4_matmul`): 1, the documented
formula. A test sets 1 / 64 (the op-plugin golden's reading) to show the comparisons tell."""


def register_npu_ops() -> None:
    """Define the torch_npu ops graph mode emits on a machine without torch_npu: their schemas,
    shape functions (those of torch_npu's meta registrations), and CPU kernels for the forms
    graph mode uses. Each kernel does what torch_npu's documentation says of the op; where the
    documentation leaves something open the kernel says so. Any other form is an error.

    - `npu_grouped_matmul`: one 2-D `x`, one 3-D `weight` [G, K, N], `group_list` the row count
      of each group (`group_list_type=1`), groups along x's rows (`group_type=0`), one output
      (`split_item=3`): rows [start_g, start_g + count_g) of x times weight[g]. What the NPU
      kernel leaves in rows past the last group is not documented; here they are NaN, so a
      graph that reads them fails its numerics. Also its MX A8W4 form (`_a8w4_matmul`).
    - `npu_dynamic_mx_quant` to float8_e4m3fn along the last axis, blocks of 32, `scale_alg=1`
      (aclnnDynamicMxQuant, scenario 2): `S = amax / 448` in fp32, rounded up to a power of two
      (`2^E`, E the exponent of S, plus one when S has a mantissa); codes `e4m3(x / 2^E)`; the
      scales as e8m0 bytes `E + 127`, `[..., ceil(n / 64), 2]` (pairs of blocks, the last pair
      padded with 0). An all-zero block (S = 0) gets byte 0.
    - `npu_anti_mx_quant` along the last axis: codes (float8_e4m3fn, or float4_e2m1 pairs in
      uint8, low nibble first) times `2^(byte - 127)` of their block, in fp32, then `dst_type`.
    - `npu_quant_matmul` in its MXFP8 form (`group_sizes=[1, 1, 32]`, both scales e8m0):
      x1 e4m3 [M, K] with `pertoken_scale` [M, K/64, 2], x2 e4m3 [K, N] with `scale` [K/64, N, 2]
      -> `output_dtype` [M, N]. The NPU kernel accumulates in fp32 in its own order; this one
      decodes both operands to `output_dtype` (exact: a code times a power of two) and
      multiplies there, as the eager program multiplies the decoded values.
    - `npu_sparse_flash_attention` (`_sparse_flash_attention_cpu`).

    No-op when the ops exist."""
    if hasattr(torch.ops.npu, "npu_grouped_matmul"):  # torch_npu's, or already defined
        return
    library = Library("npu", "FRAGMENT")
    library.define(GROUPED_MATMUL_SCHEMA)
    library.impl("npu_grouped_matmul", _grouped_matmul_cpu, "CPU")
    torch.library.register_fake("npu::npu_grouped_matmul", _grouped_matmul_fake, lib=library)
    for schema, name, cpu, fake in (
        (MX_QUANT_SCHEMA, "npu_dynamic_mx_quant", _mx_quant_cpu, _mx_quant_fake),
        (ANTI_MX_QUANT_SCHEMA, "npu_anti_mx_quant", _anti_mx_quant_cpu, _anti_mx_quant_fake),
        (QUANT_MATMUL_SCHEMA, "npu_quant_matmul", _quant_matmul_cpu, _quant_matmul_fake),
        (
            SPARSE_FLASH_ATTENTION_SCHEMA,
            "npu_sparse_flash_attention",
            _sparse_flash_attention_cpu,
            _sparse_flash_attention_fake,
        ),
    ):
        library.define(schema)
        library.impl(name, cpu, "CPU")
        torch.library.register_fake(f"npu::{name}", fake, lib=library)
    _LIBRARY.append(library)  # keep the registration alive


def _mx_form(op: str, **given: Any) -> None:
    """The one form of `op` the stand-in implements (`expected`), or an error naming it."""
    expected = {
        "npu_dynamic_mx_quant": {"axis": -1, "dst_type": E4M3, "block_size": 32, "scale_alg": 1},
        "npu_anti_mx_quant": {"axis": -1},
    }[op]
    wrong = {k: v for k, v in given.items() if k in expected and v != expected[k]}
    if wrong:
        raise ValueError(
            f"the CPU stand-in of {op} implements {expected}; got {wrong}: extend "
            "testing/torchair_standin.py with the documented semantics of that form"
        )


def _scale_pairs(n: int) -> int:
    """e8m0 scale pairs along an axis of `n` values in blocks of 32."""
    return (-(-n // 32) + 1) // 2


def _mx_quant_fake(
    input,
    *,
    axis=-1,
    round_mode="rint",
    dst_type=296,
    block_size=32,
    scale_alg=0,
    dst_type_max=0.0,
    max_low_bound=0.0,
):
    _mx_form(
        "npu_dynamic_mx_quant",
        axis=axis,
        dst_type=dst_type,
        block_size=block_size,
        scale_alg=scale_alg,
    )
    shape = [*input.shape[:-1], _scale_pairs(input.shape[-1]), 2]
    return input.new_empty(input.shape, dtype=torch.float8_e4m3fn), input.new_empty(
        shape, dtype=torch.uint8
    )


def _mx_quant_cpu(input, **kwargs):
    _mx_quant_fake(input, **kwargs)  # the form
    n = input.shape[-1]
    blocks = -(-n // 32)
    x = torch.nn.functional.pad(input.float(), (0, blocks * 32 - n)).unflatten(-1, (blocks, 32))
    s = x.abs().amax(-1) / 448.0  # S = amax / Amax(e4m3), fp32
    mantissa, exponent = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1): S's exponent is e - 1
    exponent = exponent - 1 + (mantissa != 0.5).int()  # up when S has a mantissa
    byte = torch.where(s == 0, 0, exponent + 127).clamp(0, 254)
    codes = (x * torch.ldexp(torch.ones_like(s), 127 - byte)[..., None]).clamp(-448, 448)
    codes = codes.to(torch.float8_e4m3fn).flatten(-2)[..., :n]
    pairs = torch.nn.functional.pad(byte, (0, 2 * _scale_pairs(n) - blocks))
    return codes, pairs.to(torch.uint8).unflatten(-1, (-1, 2))


def _anti_mx_quant_fake(x, mxscale, *, axis=-1, dst_type=15, src_type=292):
    _mx_form("npu_anti_mx_quant", axis=axis)
    if src_type not in (E4M3, E2M1) or (src_type == E2M1) != (x.dtype == torch.uint8):
        raise ValueError(
            "the CPU stand-in of npu_anti_mx_quant decodes float8_e4m3fn codes (src_type 292) "
            f"or float4_e2m1 pairs in uint8 (296); got {x.dtype} with src_type {src_type}"
        )
    n = x.shape[-1] * (2 if src_type == E2M1 else 1)
    return x.new_empty((*x.shape[:-1], n), dtype=NPU_DTYPES[dst_type])


def _anti_mx_quant_cpu(x, mxscale, *, axis=-1, dst_type=15, src_type=292):
    out = _anti_mx_quant_fake(x, mxscale, axis=axis, dst_type=dst_type, src_type=src_type)
    values = e2m1_values(x) if src_type == E2M1 else x.float()
    n = values.shape[-1]
    powers = e8m0_powers(mxscale.flatten(-2))[..., : -(-n // 32)]
    blocks = torch.nn.functional.pad(values, (0, powers.shape[-1] * 32 - n))
    decoded = (blocks.unflatten(-1, (-1, 32)) * powers[..., None]).flatten(-2)[..., :n]
    return decoded.to(out.dtype)


def _quant_matmul_form(
    x1, x2, scale, pertoken_scale, scale_dtype, pertoken_scale_dtype, group_sizes, rest
):
    unsupported = {k: v for k, v in rest.items() if v is not None}
    if (
        x1.dim() != 2
        or x2.dim() != 2
        or x1.dtype != torch.float8_e4m3fn
        or x2.dtype != torch.float8_e4m3fn
        or pertoken_scale is None
        or (scale_dtype, pertoken_scale_dtype) != (E8M0, E8M0)
        or list(group_sizes or ()) != [1, 1, 32]
        or unsupported
    ):
        raise ValueError(
            "the CPU stand-in of npu_quant_matmul implements its MXFP8 form: x1 and x2 2-D "
            "float8_e4m3fn, scale and pertoken_scale e8m0 (293), group_sizes=[1, 1, 32]; got "
            f"{x1.dtype} {list(x1.shape)}, {x2.dtype} {list(x2.shape)}, scale_dtype="
            f"{scale_dtype}, pertoken_scale_dtype={pertoken_scale_dtype}, group_sizes="
            f"{group_sizes}, other arguments {unsupported}"
        )


def _quant_matmul_fake(
    x1,
    x2,
    scale,
    *,
    pertoken_scale=None,
    output_dtype=None,
    scale_dtype=None,
    pertoken_scale_dtype=None,
    group_sizes=None,
    **rest,
):
    _quant_matmul_form(
        x1, x2, scale, pertoken_scale, scale_dtype, pertoken_scale_dtype, group_sizes, rest
    )
    return x1.new_empty((x1.shape[0], x2.shape[1]), dtype=NPU_DTYPES[output_dtype])


def _quant_matmul_cpu(x1, x2, scale, *, pertoken_scale=None, output_dtype=None, **rest):
    out = _quant_matmul_fake(
        x1, x2, scale, pertoken_scale=pertoken_scale, output_dtype=output_dtype, **rest
    )
    dtype = out.dtype
    a = _anti_mx_quant_cpu(x1, pertoken_scale, dst_type=output_dtype)
    b = _anti_mx_quant_cpu(x2.t(), scale.transpose(0, 1), dst_type=output_dtype)  # [N, K]
    return (a @ b.t()).to(dtype)


A8W4_KEYS = ("antiquant_scale", "per_token_scale", "output_dtype", "weight_dtype",
             "per_token_scale_dtype")  # fmt: skip
"""The arguments of the grouped matmul's MX A8W4 form."""


def _a8w4_form(x, weight, rest) -> bool:
    """Whether the grouped matmul is called in its MX A8W4 form (`_a8w4_matmul`); an error
    for a form between the two."""
    given = {k: rest.get(k) for k in A8W4_KEYS}
    if all(v is None for v in given.values()):
        return False
    antiquant, per_token = given["antiquant_scale"], given["per_token_scale"]
    if not (
        x[0].dtype == torch.float8_e4m3fn
        and weight[0].dtype == torch.uint8
        and given["weight_dtype"] == E2M1
        and given["per_token_scale_dtype"] == E8M0
        and given["output_dtype"] in NPU_DTYPES
        and antiquant is not None
        and per_token is not None
        and len(antiquant) == len(per_token) == 1
        and antiquant[0].shape
        == (*weight[0].shape[:1], -(-weight[0].shape[1] // 32), weight[0].shape[2], 2)
        and per_token[0].shape == (x[0].shape[0], -(-x[0].shape[1] // 64), 2)
    ):
        raise ValueError(
            "the CPU stand-in of npu_grouped_matmul implements the MX A8W4 form with x float8_e4m3fn "
            "[M, K], per_token_scale [[M, K/64, 2]] e8m0 (293), weight uint8 [G, K/2, N] "
            "float4_e2m1 (296), antiquant_scale [[G, K/64, N, 2]], output_dtype a float's code; "
            f"got x {x[0].dtype} {list(x[0].shape)}, weight {weight[0].dtype} "
            f"{list(weight[0].shape)}, { ({k: v for k, v in given.items() if not isinstance(v, list)}) }"
        )
    return True


def _a8w4_matmul(x, pairs, weight, scale, counts, out_code):
    """The MX A8W4 form (aclnnGroupedMatmulWeightNz, its MX pseudo-quantisation scenario:
    `y_g = (x_g * per_token_scale_g) @ (w_g * antiquant_scale_g)^T`): the rows' e4m3 codes times
    their block's power of two (an e8m0 byte b is 2^(b - 127)), each expert's e2m1 values (low
    nibble first along K) times theirs, both exact in the output dtype, multiplied there as the
    eager program multiplies the decoded values (`F.linear`: the kernel accumulates in fp32 in
    its own order). Reading chosen: the documented formula -- the FP4 values themselves. The
    op-plugin golden divides the weight by 64 (the e2m1 -> e4m3 exponent gap of an older
    kernel, which newer kernels compensate with a factor 64 before the output); a hardware
    check settles it (all-ones x and w, scale byte 127: K, not K/64). Rows past the groups'
    total are NaN, as in the other form."""
    out_dtype = NPU_DTYPES[out_code]
    decoded_x = _anti_mx_quant_cpu(x, pairs, dst_type=out_code)
    out = decoded_x.new_full((x.shape[0], weight.shape[2]), float("nan"))
    start = 0
    for g, count in enumerate(counts.tolist()):
        if count:
            w = _anti_mx_quant_cpu(
                weight[g].t(), scale[g].transpose(0, 1), dst_type=out_code, src_type=E2M1
            )  # [N, K]
            if A8W4_WEIGHT_FACTOR != 1.0:
                w = w * A8W4_WEIGHT_FACTOR
            out[start : start + count] = torch.nn.functional.linear(
                decoded_x[start : start + count], w
            )
        start += count
    return out.to(out_dtype)


def _grouped_form(x, weight, group_list, split_item, group_type, group_list_type, **rest):
    rest = {k: v for k, v in rest.items() if k not in A8W4_KEYS}
    unsupported = {k: v for k, v in rest.items() if v not in (None, 0)}
    if (
        len(x) != 1
        or len(weight) != 1
        or x[0].dim() != 2
        or weight[0].dim() != 3
        or group_list is None
        or (split_item, group_type, group_list_type) != (3, 0, 1)
        or unsupported
    ):
        raise ValueError(
            "the CPU stand-in of npu_grouped_matmul implements one form: x=[2-D], "
            "weight=[3-D], group_list=counts, split_item=3, group_type=0, group_list_type=1; "
            f"got split_item={split_item}, group_type={group_type}, "
            f"group_list_type={group_list_type}, other arguments {unsupported}"
        )
    return x[0], weight[0]


def _grouped_matmul_cpu(
    x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **rest
):
    a8w4 = _a8w4_form(x, weight, rest)
    x, weight = _grouped_form(
        x, weight, group_list, split_item, group_type, group_list_type, **rest
    )
    if a8w4:
        (scale,), (pairs,) = rest["antiquant_scale"], rest["per_token_scale"]
        return [_a8w4_matmul(x, pairs, weight, scale, group_list, rest["output_dtype"])]
    out = x.new_full((x.shape[0], weight.shape[2]), float("nan"))
    start = 0
    for g, count in enumerate(group_list.tolist()):
        out[start : start + count] = x[start : start + count] @ weight[g]
        start += count
    return [out]


def _grouped_matmul_fake(
    x, weight, *, group_list=None, split_item=0, group_type=None, group_list_type=0, **rest
):
    a8w4 = _a8w4_form(x, weight, rest)
    x, weight = _grouped_form(
        x, weight, group_list, split_item, group_type, group_list_type, **rest
    )
    dtype = NPU_DTYPES[rest["output_dtype"]] if a8w4 else x.dtype
    return [x.new_empty((x.shape[0], weight.shape[2]), dtype=dtype)]


SFA_FORM = {
    "layout_query": "BSND",
    "layout_kv": "BSND",
    "sparse_mode": 0,
    "sparse_block_size": 1,
    "attention_mode": 0,
    "return_softmax_lse": False,
    "block_table": None,
    "query_rope": None,
    "key_rope": None,
    "actual_seq_lengths_query": None,
    "actual_seq_lengths_kv": None,
}
"""The one form of `npu_sparse_flash_attention` the stand-in implements (what
`deepseek_v41.graph_mode.sparse_attention_sfa` hands it)."""


SFA_SINKS = True
"""Whether the stand-in's softmax takes the sinks (the golden's reading). A test sets False to
show the comparisons tell."""

SFA_DEFAULTS = {**SFA_FORM, "sparse_mode": 3}
"""The schema's defaults of the keywords `SFA_FORM` names (the dispatcher passes a kernel only
the keywords that differ from them)."""


def _sparse_flash_attention_fake(query, key, value, sparse_indices, scale_value, **given):
    """torch_npu's meta function for the BSND form (its checks included: an empty query,
    key or index list is refused), after the stand-in's check of the form."""
    form = {**SFA_DEFAULTS, **given}
    wrong = {k: form[k] for k in SFA_FORM if form[k] is not SFA_FORM[k]}
    wrong = {k: v for k, v in wrong.items() if v != SFA_FORM[k]}
    if wrong:
        raise ValueError(
            f"the CPU stand-in of npu_sparse_flash_attention implements {SFA_FORM}; got "
            f"{wrong}: extend testing/torchair_standin.py with the documented semantics of "
            "that form"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        message = f"Input {name} should not be empty."
        torch._check(x is not None and x.numel() > 0, lambda: message)  # noqa: B023
    torch._check(sparse_indices.numel() > 0, lambda: "Input sparse_indices should not be empty.")
    torch._check(query.dim() == 4, lambda: "BSND: the query is 4-D")
    empty = query.new_empty([0], dtype=torch.float32)
    return query.new_empty(query.shape), empty, empty.clone()


def _sparse_flash_attention_cpu(query, key, value, sparse_indices, scale_value, **form):
    """`npu_sparse_flash_attention`, written from op-plugin's CPU golden
    (test_npu_sparse_flash_attention.py, `cpu_sparse_flash_attention`) for the form `SFA_FORM`:
    per batch b, query s and KV head n2 (the query heads in groups of N1 / N2 per KV head), the
    KV rows `sparse_indices[b, s, n2]` names, up to the first -1 (blocks of one row); in fp32,
    `softmax(q k^T * scale_value)` with the sinks in the denominator (`exp(sink - m)` added to
    the sum, m the largest of the logits and the sink), times the values; the query's dtype.

    Readings where the golden is silent or narrower:
    - `attention_mode=0` takes the whole head width as one part, no rope split (the golden's
      mode 2 splits off `query_rope` / `key_rope` and its values are the key's first part);
    - the values are `value` (the golden's are a copy of the key: V4.1 passes the key itself);
    - a query whose list starts with -1 attends to nothing: with sinks its output is 0 (the
      sink takes all the weight), without them 0 as well (the golden has no such query).
    Its softmax and products are exact fp32 here; the kernel's own tiling and rounding (the
    golden is checked against it at rtol 0.005) are not modelled."""
    _sparse_flash_attention_fake(query, key, value, sparse_indices, scale_value, **form)
    sinks = form.get("sinks") if SFA_SINKS else None
    B, S1, N1, D = query.shape
    N2 = key.shape[2]
    index = sparse_indices.long()  # [B, S1, N2, K]
    valid = torch.cumprod((index >= 0).int(), dim=-1).bool()  # up to the first -1
    safe = index.clamp(min=0)
    batch = torch.arange(B)[:, None, None, None]
    heads = torch.arange(N2)[None, None, :, None]
    k = key[batch, safe, heads].float()  # [B, S1, N2, K, D]
    v = value[batch, safe, heads].float()
    q = query.float().unflatten(2, (N2, N1 // N2))  # [B, S1, N2, G, D]
    logits = torch.einsum("bsngd,bsnkd->bsngk", q, k) * scale_value
    logits = logits.masked_fill(~valid[:, :, :, None, :], float("-inf"))
    if sinks is None:
        sink = torch.full(logits.shape[:-1], float("-inf"))
    else:
        sink = sinks.float().unflatten(0, (N2, N1 // N2)).expand(logits.shape[:-1])
    top = torch.maximum(logits.amax(-1), sink).clamp(min=-3e38)  # no key, no sink: -inf
    weights = torch.exp(logits - top[..., None])
    total = weights.sum(-1) + torch.exp(sink - top)
    out = torch.einsum("bsngk,bsnkd->bsngd", weights, v) / total.clamp(min=1e-38)[..., None]
    empty = query.new_empty([0], dtype=torch.float32)
    return out.flatten(2, 3).to(query.dtype), empty, empty.clone()
