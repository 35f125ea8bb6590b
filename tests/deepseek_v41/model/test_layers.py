"""RMSNorm, RoPE and the delayed-mHC coefficients."""

from __future__ import annotations

import torch

from dsv41_compile.deepseek_v41.model import ModelConfig
from dsv41_compile.deepseek_v41.model.layers import (
    HyperConnection,
    apply_rope,
    hc_collapse,
    hc_expand,
    rope_inv_freq,
)
from dsv41_compile.deepseek_v41.model.model import DeepseekV41


def tiny_hc() -> tuple[ModelConfig, HyperConnection]:
    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny"))
    return model.cfg, model.layers[1].hc_ffn


def test_comb_is_doubly_stochastic_and_pre_post_ranges() -> None:
    cfg, hc = tiny_hc()
    x_TND = 3 * torch.randn(64, cfg.hc_mult, cfg.dim)
    with torch.no_grad():
        pre, post, comb = hc(x_TND)
    ones = torch.ones(64, cfg.hc_mult)
    # Sinkhorn ends on a column normalisation: columns are exact, rows converged after the
    # configured 20 iterations to about 1e-3 (not to fp32 rounding) on these inputs.
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), ones, atol=2e-3, rtol=0)
    assert (comb > 0).all()
    assert (pre > 0).all() and (pre <= 1 + cfg.hc_eps).all()
    assert (post > 0).all() and (post < 2).all()


def test_one_hot_pre_selects_exactly_one_stream() -> None:
    x_TND = torch.randn(5, 4, 16)
    for i in range(4):
        pre = torch.nn.functional.one_hot(torch.full((5,), i), 4).float()
        assert torch.equal(hc_collapse(x_TND, pre), x_TND[:, i])


def test_expand_uses_transposed_comb() -> None:
    x_TND = torch.randn(3, 4, 8)
    f_TD = torch.randn(3, 8)
    post = torch.rand(3, 4)
    comb = torch.rand(3, 4, 4)
    got = hc_expand(x_TND, f_TD, post, comb)
    for t in range(3):
        for j in range(4):
            want = post[t, j] * f_TD[t] + sum(comb[t, i, j] * x_TND[t, i] for i in range(4))
            torch.testing.assert_close(got[t, j], want)


def test_rope_interleaved_pairs_and_inverse() -> None:
    inv_freq = rope_inv_freq(4, 10000.0)
    x = torch.randn(3, 2, 10)
    pos = torch.tensor([0, 1, 7])
    y = apply_rope(x, pos, inv_freq)
    assert torch.equal(y[..., :6], x[..., :6])  # only the last R dims rotate
    assert torch.equal(y[0], x[0])  # position 0 is the identity
    # Pair (x6, x7) of token 2 is the complex number x6 + i x7 rotated by 7 * inv_freq[0].
    angle = 7 * inv_freq[0]
    z = torch.complex(x[2, :, 6], x[2, :, 7]) * torch.polar(torch.tensor(1.0), angle)
    torch.testing.assert_close(y[2, :, 6], z.real)
    torch.testing.assert_close(y[2, :, 7], z.imag)
    torch.testing.assert_close(apply_rope(y, pos, inv_freq, inverse=True), x)
