"""Gate, routed-experts custom op and its fake kernel."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.ops import routed_experts, swiglu_expert


def tiny_moe():
    torch.manual_seed(0)
    return DeepseekV41(ModelConfig.from_name("tiny")).layers[0].ffn


def test_bias_changes_selection_not_the_weight_formula() -> None:
    gate = tiny_moe().gate
    x = torch.randn(32, gate.weight.shape[1])
    valid = torch.ones(32, dtype=torch.bool)
    scores = torch.sqrt(torch.nn.functional.softplus(x @ gate.weight.T))

    with torch.no_grad():
        gate.bias.zero_()
        idx0, w0 = gate(x, valid)
        gate.bias[3] = 100.0  # expert 3 now wins every selection
        idx1, w1 = gate(x, valid)

    assert (idx1 == 3).any(-1).all() and not (idx0 == 3).any(-1).all()
    for idx, w in ((idx0, w0), (idx1, w1)):
        picked = scores.gather(1, idx)
        torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True) * gate.route_scale)


def test_gate_routes_padding_rows_nowhere() -> None:
    gate = tiny_moe().gate
    valid = torch.tensor([True, False, True])
    idx, w = gate(torch.randn(3, gate.weight.shape[1]), valid)
    assert (idx[1] == -1).all() and (w[1] == 0).all()
    assert (idx[valid] >= 0).all()


def test_reference_kernel_equals_naive_per_token_loop() -> None:
    experts = tiny_moe().experts
    T, K, E = 13, 2, experts.w1.shape[0]
    x = torch.randn(T, experts.w1.shape[2])
    idx = torch.randint(0, E, (T, K))
    idx[4] = -1  # a row with no assignment
    idx[7, 1] = idx[7, 0]  # the same expert twice for one token
    w = torch.rand(T, K)
    with torch.no_grad():
        got = routed_experts(x, idx, w, experts.w1, experts.w2, experts.w3, experts.swiglu_limit)
        want = torch.zeros(T, x.shape[1])
        for t in range(T):
            for k in range(K):
                e = int(idx[t, k])
                if e >= 0:
                    want[t] += swiglu_expert(
                        x[t : t + 1],
                        experts.w1[e],
                        experts.w2[e],
                        experts.w3[e],
                        experts.swiglu_limit,
                        w[t, k : k + 1],
                    )[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert torch.count_nonzero(got[4]) == 0


def test_swiglu_clamp() -> None:
    w1 = torch.eye(2)
    w3 = torch.eye(2)
    w2 = torch.eye(2)
    x = torch.tensor([[50.0, -50.0]])
    y = swiglu_expert(x, w1, w2, w3, swiglu_limit=10.0)
    # gate clamped from above only (silu(10), silu(-50)), up clamped to [-10, 10].
    want = torch.nn.functional.silu(torch.tensor([10.0, -50.0])) * torch.tensor([10.0, -10.0])
    torch.testing.assert_close(y[0], want)


def test_fake_kernel_shapes() -> None:
    experts = tiny_moe().experts
    weights = [p.detach() for p in (experts.w1, experts.w2, experts.w3)]
    with FakeTensorMode() as mode:
        x = torch.empty(9, 64, dtype=torch.bfloat16)
        idx = torch.empty(9, 2, dtype=torch.int64)
        w = torch.empty(9, 2)
        w1, w2, w3 = (mode.from_tensor(p) for p in weights)
        out = routed_experts(x, idx, w, w1, w2, w3, 10.0)
    assert out.shape == (9, 64) and out.dtype == torch.float32
    torch.library.opcheck(
        torch.ops.dsv41.routed_experts.default,
        (
            torch.randn(5, 64),
            torch.randint(0, 8, (5, 2)),
            torch.rand(5, 2),
            experts.w1.detach(),
            experts.w2.detach(),
            experts.w3.detach(),
            10.0,
        ),
    )
