"""graph_mode's rewrites compute what the ops they replace compute: each op alone in a graph,
rewritten, run eagerly against the op itself (edge cases included: negative indices, an empty
index set, shifts past the end, a symbolic size, unassigned experts, every kind of float for
the bit-level rewrites). torch_npu's ops run as `testing.torchair_standin`'s CPU kernels of
their documented forms; the MX quantisation against the official rounding (`numerics`), with
its one documented difference."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41_compile.deepseek_v41.adapter import DeepseekV41Adapter
from dsv41_compile.deepseek_v41.model.numerics import act_quant
from dsv41_compile.deepseek_v41.model.quant import quantize_fp4, quantize_fp8
from dsv41_compile.targets import npu_passes
from dsv41_compile.targets.npu_dtypes import DTYPE_CODES, E2M1, E4M3, E8M0
from dsv41_compile.targets.npu_passes import rewrite_for_graph_mode
from dsv41_compile.testing.graphs import rewritten_for_graph_mode
from dsv41_compile.testing.torchair_standin import register_npu_ops

register_npu_ops()  # torch_npu's ops graph mode emits, with the stand-in's CPU kernels

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def check(op, *args, atol=0.0, **kwargs):
    gm, tensors = rewritten_for_graph_mode(op, *args, **kwargs)
    expected = op(*args, **kwargs)
    actual = gm(*tensors)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0 if atol == 0 else 1e-5)


@pytest.mark.parametrize("beta, threshold", [(1, 20), (2, 5)])
def test_softplus(beta, threshold):
    check(aten.softplus.default, randn(256) * 30, beta, threshold, atol=1e-6)


@pytest.mark.parametrize("x, other", [(randn(5, 3), -1.5), (torch.arange(15).view(5, 3), -1)])
def test_where_with_a_scalar(x, other):
    check(aten.where.ScalarOther, randn(5, 3) > 0, x, other)


def test_index_put_one_index_wraps_negatives():
    check(aten.index_put.default, randn(6, 4), [torch.tensor([0, -2, 3])], randn(3, 4))


def test_index_put_two_indices_write_the_addressed_rows():
    i, j = torch.tensor([0, 2, -1, 1]), torch.tensor([1, 4, 0, -1])
    check(aten.index_put.default, randn(3, 5, 4), [i, j], randn(4, 4))


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("index", [[0, 0, 2, 4], []])
def test_scatter_reduce_keeps_untouched_slots(reduce, index):
    a = torch.tensor([3, 0, 7, 1, 2])
    src = torch.tensor([5, 1, 6, 9][: len(index)], dtype=torch.int64)
    check(aten.scatter_reduce.two, a, 0, torch.tensor(index, dtype=torch.int64), src, reduce)


def test_unflatten_and_amax():
    check(aten.unflatten.int, randn(6, 8), 1, [4, 2])
    check(aten.amax.default, randn(3, 4, 5), [0, -1])
    check(aten.amax.default, randn(3, 4, 5), [1], True)


@pytest.mark.parametrize("shift, dims", [(1, [0]), (-1, [0]), (3, [0]), (-9, [0]), (1, [])])
def test_roll(shift, dims):
    x = randn(7) if not dims else randn(7, 3)
    check(aten.roll.default, x, [shift], dims)


@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("T", [1, 2, 7])
def test_roll_of_a_symbolic_size(shift, T):
    """The token dim is symbolic in our graphs: the rewrite may not assume a size."""
    gm = make_fx(lambda x: aten.roll.default(x, [shift], [0]), tracing_mode="symbolic")(randn(5, 3))
    assert isinstance(gm.graph.find_nodes(op="placeholder")[0].meta["val"].shape[0], torch.SymInt)
    rewrite_for_graph_mode(gm)
    assert not gm.graph.find_nodes(op="call_function", target=aten.roll.default)
    x = randn(T, 3)
    torch.testing.assert_close(gm(x), torch.roll(x, shift, 0), atol=0, rtol=0)


def test_bitwise_xor_of_hash_sized_integers():
    """Engram's rolling hash: int64 products up to 2^63, XORed."""
    a = torch.randint(0, 2**62, (64,), generator=g) * 2 + 1
    b = torch.randint(-(2**62), 2**62, (64,), generator=g)
    check(aten.bitwise_xor.Tensor, a, b)


def test_copysign_keeps_the_sign_of_a_negative_zero():
    check(
        aten.copysign.Tensor, randn(8), torch.tensor([1.0, -1.0, 0.0, -0.0, 3.0, -3.0, 2.0, -2.0])
    )


def symbolic_rewritten(fn, *tensors):
    """`fn` traced (ATen, multi-output ops as getitems), rewritten for graph mode with the
    model's rewrites."""
    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    rewrite_for_graph_mode(gm, DeepseekV41Adapter.graph_mode_rewrites)
    return gm


def test_frexp_from_bits_at_every_kind_of_float():
    x = torch.tensor(
        [0.0, -0.0, 1.0, 0.5, -0.75, 3.0, 1e-40, -1e-45, 2.0**-126, 3.4e38, 1e-4 / 448, 1234.5]
    )
    gm = symbolic_rewritten(lambda x: torch.frexp(x), x)
    assert not gm.graph.find_nodes(op="call_function", target=aten.frexp.Tensor)
    (mantissa, exponent), (m, e) = gm(x), torch.frexp(x)
    assert torch.equal(mantissa, m) and torch.equal(mantissa.signbit(), m.signbit())
    assert torch.equal(exponent, e)


def test_ldexp_makes_every_power_of_two_e8m0_can_hold():
    """The e8m0 decode (`quant.e8m0_powers`): 2^(byte - 127), byte 0..255 (255: 2^128 = inf),
    and a product with other values."""
    ones, exponent = torch.ones(256), torch.arange(256, dtype=torch.int32) - 127
    gm = symbolic_rewritten(lambda x, e: torch.ldexp(x, e), ones, exponent)
    assert not gm.graph.find_nodes(op="call_function", target=aten.ldexp.Tensor)
    assert torch.equal(gm(ones, exponent), torch.ldexp(ones, exponent))
    x, e = randn(64) * 10, torch.randint(-60, 60, (64,), generator=g, dtype=torch.int32)
    assert torch.equal(gm(x, e), torch.ldexp(x, e))


@pytest.mark.parametrize("n", [1, 2, 5, 8, 9])
def test_cummax_values_as_a_scan(n):
    x = randn(3, 4, n)
    x[0, 0] = float("-inf")
    gm = symbolic_rewritten(lambda x: torch.cummax(x, -1).values, x)
    assert not gm.graph.find_nodes(op="call_function", target=aten.cummax.default)
    assert torch.equal(gm(x), torch.cummax(x, -1).values)


def test_cummax_along_a_symbolic_dim():
    """The attention's running max is [T, H, blocks], T symbolic, and the blocks too where the
    cache's length is (a second cache length): the max over a mask j <= i."""
    gm = make_fx(lambda x: torch.cummax(x, -1).values, tracing_mode="symbolic")(randn(5, 2, 6))
    rewrite_for_graph_mode(gm)
    assert not gm.graph.find_nodes(op="call_function", target=aten.cummax.default)
    for T, blocks in ((1, 6), (3, 1), (7, 9)):
        x = randn(T, 2, blocks)
        assert torch.equal(gm(x), torch.cummax(x, -1).values)


def test_cummax_indices_are_refused():
    with pytest.raises(ValueError, match="reads output 1"):
        symbolic_rewritten(lambda x: torch.cummax(x, 0).indices, randn(5))


def model_check(op, *args):
    gm, tensors = rewritten_for_graph_mode(
        op, *args, rewrites=DeepseekV41Adapter.graph_mode_rewrites
    )
    return gm(*tensors), op(*args)


def official_activations(rows=6, n=96):
    """bf16 rows of magnitudes 1e-3 .. 1e3 (blocks of every scale), one row with a block at
    exactly 448 (a code at the top of e4m3) and one all zero."""
    x = randn(rows, n) * torch.logspace(-3, 3, rows)[:, None]
    x[1, :32] = 0.0
    x[2, 5] = 448.0
    return x.to(torch.bfloat16)


def test_act_quant_through_the_mx_ops_is_the_official_rounding():
    """npu_dynamic_mx_quant with scale_alg=1 (S = amax / 448 rounded up to a power of two) gives
    the codes and scales of the official `act_quant` (amax * fp32(1/448), rounded up), but for
    the all-zero block (the official floor: see below), whose codes and values are zero in
    both."""
    actual, expected = model_check(
        torch.ops.dsv41.act_quant_dequant.default, official_activations()
    )
    assert torch.equal(actual, expected)
    x = official_activations()
    codes, scales = torch.ops.npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1)
    official_codes, official_scales = act_quant(x)
    assert torch.equal(codes.view(torch.uint8), official_codes.view(torch.uint8))
    assert scales.shape == (6, 2, 2)  # 3 blocks of 32 as pairs, the last one padded
    scales, official_scales = scales.flatten(-2), official_scales.view(torch.uint8)
    assert (scales[:, 3] == 0).all()  # the pad
    zero_block = torch.zeros(6, 3, dtype=torch.bool)
    zero_block[1, 0] = True
    assert torch.equal(scales[:, :3][~zero_block], official_scales[~zero_block])
    assert (scales[1, 0], official_scales[1, 0]) == (0, 105)


def test_act_quant_below_the_official_floor_differs_as_documented():
    """The one documented difference: a block whose largest magnitude is below 1e-4. The
    official rule floors it at 1e-4 (scale 2^-22, byte 105); the MX op takes the block's own."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 1e-5
    _, scales = torch.ops.npu.npu_dynamic_mx_quant(x, dst_type=E4M3, scale_alg=1)
    _, official = act_quant(x)
    assert official.view(torch.uint8).item() == 105
    assert scales[0, 0, 0].item() == 102  # 1e-5 / 448 rounded up: 2^-25


def test_fp8_weight_decoded_by_the_mx_op():
    """48 x 96: a short last block of rows and an odd count of blocks along a row."""
    codes, scale = quantize_fp8(randn(48, 96))
    actual, expected = model_check(torch.ops.dsv41.fp8_weight.default, codes, scale, torch.bfloat16)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("n", [64, 96])
def test_fp8_rows_encoded_and_decoded_by_the_mx_ops(n):
    """The bytes a collective moves: the eager rows but for the all-zero block's scale byte (0,
    not 105); decoded, the same values; and each side decodes the other's rows."""
    x = official_activations(5, n)
    encoded, expected = model_check(torch.ops.dsv41.fp8_encode_rows.default, x)
    differ = (encoded != expected).nonzero().tolist()
    assert differ == [[1, n]]  # row 1's first scale byte
    decode = torch.ops.dsv41.fp8_decode_rows.default
    for rows in (encoded, expected):
        actual, expected_values = model_check(decode, rows)
        assert torch.equal(actual, expected_values)
        assert torch.equal(actual, torch.ops.dsv41.act_quant_dequant(x))


@pytest.mark.parametrize("fp8_hidden", [False, True])
def test_routed_experts_with_fp4_weights_decoded_by_the_mx_op(fp8_hidden):
    """4 experts, rows routed top-2 with an unassigned one; the experts' FP4 weights decoded,
    and under the official numerics the hidden activation quantised before w2."""
    E, D, I = 4, 64, 32
    fp4 = [[quantize_fp4(randn(o, i)) for _ in range(E)] for o, i in ((I, D), (D, I), (I, D))]
    weights = [
        t
        for pairs in fp4
        for t in (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    ]
    x = randn(7, D, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [0, 2], [1, 1], [2, 3]])
    w = torch.rand(7, 2, generator=g)
    op = torch.ops.dsv41.routed_experts_fp4.default
    actual, expected = model_check(op, x, idx, w, *weights, 10.0, fp8_hidden)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_an_official_fp8_linear_is_one_mxfp8_quant_matmul():
    """`F.linear(act_quant_dequant(x), fp8_weight(w, s))`: one npu_quant_matmul of the codes and
    their scales, nothing left of the decodes; the stand-in's product is the eager one."""
    codes, scale = quantize_fp8(randn(64, 96))
    x = official_activations(5, 96)

    def linear(x, codes, scale):
        weight = torch.ops.dsv41.fp8_weight(codes, scale, torch.bfloat16)
        return torch.nn.functional.linear(torch.ops.dsv41.act_quant_dequant(x), weight)

    _one_quant_matmul(linear, x, codes, scale)


def _one_quant_matmul(linear, *args):
    """`linear` rewritten: one MXFP8 quant matmul, no bf16 mm, no decode; its values."""
    gm = symbolic_rewritten(linear, *args)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.npu.npu_quant_matmul.default) == 1
    assert aten.mm.default not in targets
    assert torch.ops.npu.npu_anti_mx_quant.default not in targets
    assert torch.equal(gm(*args), linear(*args))


def _fp4_experts(E=4, D=64, I=32):
    """E experts' FP4 weights as released (codes, e8m0 scales) for w1, w2, w3, interleaved."""
    fp4 = [[quantize_fp4(randn(o, i)) for _ in range(E)] for o, i in ((I, D), (D, I), (I, D))]
    return [
        t
        for pairs in fp4
        for t in (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    ]


def _official_experts(x, idx, w, *weights):
    """The official numerics' routed experts: the input FP8-quantised before the op (the model's
    `expert_inputs` step), the hidden activation inside it."""
    x = torch.ops.dsv41.act_quant_dequant(x)
    return torch.ops.dsv41.routed_experts_fp4(x, idx, w, *weights, 10.0, True)


@pytest.mark.parametrize(
    "idx",
    [
        # 7 rows: one unassigned route (-1), a padding row routed nowhere, expert 3 idle
        [[0, 1], [2, 0], [1, -1], [-1, -1], [0, 2], [1, 1], [2, 0]],
        [[3, 1]],  # T = 1
        [],  # T = 0: no row, every group empty
    ],
    ids=["7-rows", "T=1", "T=0"],
)
def test_official_routed_experts_are_a8w4_grouped_matmuls_of_the_fp4_weights(idx):
    """With FP8 rows (the official numerics), the FP4 experts become three MX A8W4 grouped
    matmuls of the weights as released -- none decoded, no bf16 matmul -- and the output is the
    single-device op's, bit for bit (the stand-in multiplies the decoded values as the eager
    kernel does; a hidden block below 1e-4 would differ as the activation quantisation does)."""
    weights = _fp4_experts()
    idx = torch.tensor(idx, dtype=torch.int64).reshape(-1, 2)
    T = idx.shape[0]
    # magnitudes that keep every hidden block above the official rule's floor of 1e-4, where
    # the MX op differs as documented (test_act_quant_below_the_official_floor_...)
    x = (randn(T, 64) * 4).to(torch.bfloat16)
    w = torch.rand(T, 2, generator=g)
    gm = symbolic_rewritten(_official_experts, x, idx, w, *weights)
    grouped = gm.graph.find_nodes(
        op="call_function", target=torch.ops.npu.npu_grouped_matmul.default
    )
    assert [n.kwargs["weight_dtype"] for n in grouped] == [E2M1] * 3
    decodes = gm.graph.find_nodes(
        op="call_function", target=torch.ops.npu.npu_anti_mx_quant.default
    )
    assert all(n.kwargs["src_type"] != E2M1 for n in decodes)
    assert not gm.graph.find_nodes(op="call_function", target=aten.mm.default)
    actual, expected = gm(x, idx, w, *weights), _official_experts(x, idx, w, *weights)
    assert actual.shape == expected.shape == (T, 64)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize(
    ("lowered", "experts", "dim", "form"),
    [
        (None, 4, 64, "a8w4"),  # npugraph_ex's kernels take every shape
        (("torchair", "950dt"), 4, 128, "a8w4"),
        (("torchair", "950pr"), 4, 128, "a8w4"),
        (("torchair", "a3"), 4, 128, "decoded"),  # GE maps the MX form on a 950 only
        (("torchair", "950dt"), 4, 64, "decoded"),  # GE refuses K = 64
        (("torchair", "950dt"), 1, 128, "decoded"),  # GE refuses one group of weights
    ],
)
def test_torchair_keeps_the_decoded_experts_where_ge_refuses_the_a8w4_form(
    lowered, experts, dim, form
):
    """torchair hands GE the MX A8W4 grouped matmul only where torch-npu 2.13.0's converter takes
    it (`targets.npu_passes.ge_refuses_mx_a8w4`); elsewhere the experts' FP4 weights are decoded
    per call, as before the A8W4 form. Both forms compute the single-device op's values."""
    weights = _fp4_experts(E=experts, D=dim)
    idx = torch.tensor([[0, experts - 1], [experts - 1, 0], [0, -1]], dtype=torch.int64)
    x = (randn(3, dim) * 4).to(torch.bfloat16)
    w = torch.rand(3, 2, generator=g)
    token = npu_passes._LOWERED.set(None if lowered is None else npu_passes.Lowered(*lowered))
    try:
        gm = symbolic_rewritten(_official_experts, x, idx, w, *weights)
    finally:
        npu_passes._LOWERED.reset(token)
    grouped = gm.graph.find_nodes(
        op="call_function", target=torch.ops.npu.npu_grouped_matmul.default
    )
    decodes = gm.graph.find_nodes(
        op="call_function", target=torch.ops.npu.npu_anti_mx_quant.default
    )
    fp4_decodes = [n for n in decodes if n.kwargs["src_type"] == E2M1]
    if form == "a8w4":
        assert [n.kwargs.get("weight_dtype") for n in grouped] == [E2M1] * 3 and not fp4_decodes
    else:
        assert len(fp4_decodes) == 3 and all(n.kwargs.get("weight_dtype") is None for n in grouped)
    assert torch.equal(gm(x, idx, w, *weights), _official_experts(x, idx, w, *weights))


def test_a8w4_stand_in_reads_the_fp4_values_themselves():
    """The reading the stand-in fixes where the sources disagree (torchair_standin's
    `_a8w4_matmul`): the documented formula's FP4 values, not the op-plugin golden's value / 64
    -- all-ones rows (e4m3 1.0, scale byte 127) times all-ones weights (e2m1 1.0 twice a byte:
    0x22, scale byte 127) give K. Rows past the groups' total are NaN (the kernel leaves them
    unwritten), and a group of no rows writes nothing."""
    K, N = 64, 8
    x = torch.ones(5, K, dtype=torch.float8_e4m3fn)
    pairs = torch.full((5, K // 64, 2), 127, dtype=torch.uint8)
    w = torch.full((2, N, K // 2), 0x22, dtype=torch.uint8).transpose(1, 2)
    s = torch.full((2, N, K // 64, 2), 127, dtype=torch.uint8).transpose(1, 2)
    (y,) = torch.ops.npu.npu_grouped_matmul(
        [x], [w], antiquant_scale=[s], per_token_scale=[pairs], group_list=torch.tensor([0, 3]),
        split_item=3, group_type=0, group_list_type=1, output_dtype=DTYPE_CODES[torch.bfloat16],
        weight_dtype=E2M1, per_token_scale_dtype=E8M0,
    )  # fmt: skip
    assert y.dtype == torch.bfloat16 and y.shape == (5, N)
    assert (y[:3] == K).all() and y[3:].isnan().all()


def test_fp8_rows_rearranged_whole_blocks_at_a_time_still_make_one_quant_matmul():
    """An FP8 linear whose input reaches it rearranged -- rows exchanged by head group
    (unflatten, permute, a view joining a token's groups into one row: what the attention
    exit's all-to-all makes of `wo_b`'s input), its padding rows dropped (a split), cast to
    fp32 and back -- is still one MXFP8 `npu_quant_matmul`: the codes and their block scales
    are rearranged the same way (no block is split), and no activation is decoded for it."""
    codes, scale = quantize_fp8(randn(48, 128))
    x = official_activations(4 * 3, 32)  # 4 groups x 3 rows, 32 values: one block each

    def linear(x, codes, scale):
        rows = torch.ops.dsv41.act_quant_dequant(x)
        joined = rows.unflatten(0, (4, 3)).permute(1, 0, 2).contiguous().view(3, 128)
        kept = torch.split(joined.float(), [2, 1])[0].to(torch.bfloat16)
        weight = torch.ops.dsv41.fp8_weight(codes, scale, torch.bfloat16)
        return torch.nn.functional.linear(kept, weight)

    _one_quant_matmul(linear, x, codes, scale)
