"""Compressed attention: compressor, indexer top-k, candidate blocks, shared sources, caches."""

from __future__ import annotations

import pytest
import torch

import dsv41_compile.deepseek_v41.model.attention as attention
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.attention import (
    candidate_blocks,
    compressed_visible,
    sink_attention,
)
from dsv41_compile.deepseek_v41.model.layers import rope_inv_freq, yarn_inv_freq
from dsv41_compile.deepseek_v41.testing.batches import Request, incremental_schedule, pack

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    torch.manual_seed(0)
    return DeepseekV41(ModelConfig.from_name("tiny")).eval()


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]


def logits_by_token(model: DeepseekV41, cache, requests: list[Request]) -> dict:
    ids, positions, slots = pack(requests)
    with torch.inference_mode():
        logits = model(ids, positions, slots, cache)
    return {(s, p): row for s, p, row in zip(slots.tolist(), positions.tolist(), logits)}


class SelectionRecorder:
    """Wraps the top-k and candidate selection to record how much they prune."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.topk_pruned = 0  # queries that had more visible candidates than picks
        self.candidates_pruned = 0  # queries whose candidate mask hid a visible entry
        select_topk, blocks = attention.select_topk, attention.candidate_blocks

        def recording_topk(scores_TC, k):
            idx, picked = select_topk(scores_TC, k)
            eligible = (scores_TC > float("-inf")).sum(-1)
            self.topk_pruned += int((eligible > picked.sum(-1)).sum())
            return idx, picked

        def recording_blocks(scores_TC, positions_T, ratio, block, n_blocks):
            keep = blocks(scores_TC, positions_T, ratio, block, n_blocks)
            visible = scores_TC > float("-inf")
            self.candidates_pruned += int((visible & ~keep).any(-1).sum())
            return keep

        monkeypatch.setattr(attention, "select_topk", recording_topk)
        monkeypatch.setattr(attention, "candidate_blocks", recording_blocks)


@pytest.mark.parametrize("step", [1, 3], ids=["decode", "multi_token_decode"])
def test_prefill_equals_decode_with_pruning(
    model: DeepseekV41, step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long enough that ratio-2 (4 of 10 entries) and ratio-1 top-k (4 of 6 candidates of 21
    # entries) prune, and the candidate filter hides entries. Odd prefill lengths split ratio-2
    # pairs across calls.
    reqs = prompts([21, 14, 18], seed=7)
    full = logits_by_token(
        model, model.new_cache(3, 32), [Request(s, p) for s, p in enumerate(reqs)]
    )

    recorder = SelectionRecorder(monkeypatch)
    cache = model.new_cache(3, 32)
    got = {}
    for batch in incremental_schedule(reqs, prefill=[3, 1, 6], step=step):
        got |= logits_by_token(model, cache, batch)

    assert recorder.topk_pruned > 0 and recorder.candidates_pruned > 0
    keys = sorted(full)
    torch.testing.assert_close(
        torch.stack([got[k] for k in keys]), torch.stack([full[k] for k in keys]), **FP32_TOL
    )


def test_compressed_visibility() -> None:
    positions = torch.arange(8)
    visible2 = compressed_visible(positions, 4, ratio=2)
    assert visible2.sum(-1).tolist() == [0, 1, 1, 2, 2, 3, 3, 4]  # c < (t+1)//2
    visible1 = compressed_visible(positions, 8, ratio=1)
    assert torch.equal(visible1, torch.ones(8, 8, dtype=torch.bool).tril())  # sees its own entry


def test_topk_covering_everything_equals_attention_over_all_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.from_name("tiny", index_topk=64, candidate_topk_blocks=64)
    model = DeepseekV41(cfg).eval()
    batch = [Request(s, p) for s, p in enumerate(prompts([19, 12], seed=8))]
    via_indexer = logits_by_token(model, model.new_cache(2, 32), batch)

    def all_visible(scores_TC, k):
        T, C = scores_TC.shape
        return torch.arange(C).expand(T, C), scores_TC > float("-inf")

    monkeypatch.setattr(attention, "select_topk", all_visible)
    everything = logits_by_token(model, model.new_cache(2, 32), batch)
    keys = sorted(everything)
    torch.testing.assert_close(
        torch.stack([via_indexer[k] for k in keys]),
        torch.stack([everything[k] for k in keys]),
        **FP32_TOL,
    )


def test_sink_softmax_is_a_zero_value_extra_key() -> None:
    T, H, S, d = 3, 2, 5, 8
    q, kv = torch.randn(T, H, d), torch.randn(T, S, d)
    visible = torch.rand(T, S) > 0.3
    visible[:, 0] = True
    sink = torch.randn(H)
    got = sink_attention(q, kv, visible, sink)

    logits = torch.einsum("thd,tsd->ths", q, kv) * d**-0.5
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    extra_logit = sink[None, :, None].expand(T, H, 1)
    probs = torch.softmax(torch.cat((logits, extra_logit), -1), -1)
    values = torch.cat((kv, torch.zeros(T, 1, d)), 1)  # the sink's value is zero
    torch.testing.assert_close(got, torch.einsum("ths,tsd->thd", probs, values))


def test_ratio2_compressor_pools_pairs_with_gated_softmax(model: DeepseekV41) -> None:
    layer = model.layers[2].attn
    assert layer.role.mode == "full" and layer.role.ratio == 2
    comp = layer.compressor
    x = torch.randn(4, model.cfg.dim)
    state = torch.zeros(2, 2 * model.cfg.head_dim)
    with torch.no_grad():
        ckv, closes = comp(x, torch.arange(4), torch.zeros(4, dtype=torch.int64), state)
        a, g = x @ comp.wkv.weight.T, x @ comp.wgate.weight.T
        w = torch.softmax(torch.stack((g[2], g[3])), dim=0)  # per channel, over the pair
        want = comp.norm(w[0] * a[2] + w[1] * a[3])
    assert closes.tolist() == [False, True, False, True]
    torch.testing.assert_close(ckv[3], want)


def test_candidate_blocks_force_last_block_and_keep_best() -> None:
    inf = float("inf")
    # One query at position 7 (ratio 1: 8 visible entries), blocks of 2, keep 2 blocks.
    scores = torch.tensor([[5.0, 0.0, 1.0, 1.0, 9.0, 0.0, 0.0, -1.0, -inf, -inf]])
    keep = candidate_blocks(scores, torch.tensor([7]), ratio=1, block=2, n_blocks=2)
    # Block 3 holds the last visible entry (7) and is forced in; block 2 (max 9) is the best.
    assert keep.tolist() == [[False, False, False, False, True, True, True, True, False, False]]
    # No visible entry: nothing is kept.
    none = candidate_blocks(
        torch.full((1, 4), -inf), torch.tensor([0]), ratio=2, block=2, n_blocks=2
    )
    assert not none.any()


def test_roles_own_exactly_their_parameters(model: DeepseekV41) -> None:
    owned = {}
    for i, block in enumerate(model.layers):
        names = [
            name.removesuffix(".weight")
            for name, _ in block.attn.named_parameters()
            if name.startswith(("compressor.", "indexer."))
        ]
        owned[i] = (block.attn.role.mode, sorted(names))
    assert owned == {
        0: ("swa", []),
        1: ("swa", []),
        2: (
            "full",
            [
                "compressor.norm",
                "compressor.wgate",
                "compressor.wkv",
                "indexer.k_norm",
                "indexer.weights_proj",
                "indexer.wk",
                "indexer.wq_b",
            ],
        ),
        3: ("reuse", []),
        4: (
            "full",
            [
                "compressor.norm",
                "compressor.wkv",
                "indexer.k_norm",
                "indexer.weights_proj",
                "indexer.wk",
                "indexer.wq_b",
            ],
        ),
        5: ("reuse", []),
        6: ("reindex", ["indexer.weights_proj", "indexer.wq_b"]),
        7: ("reuse", []),
    }


def test_cache_holds_compressed_state_only_for_sources(model: DeepseekV41) -> None:
    cache = model.new_cache(num_slots=3, max_len=9)
    assert sorted(cache.compressed_kv) == sorted(cache.index_k) == [2, 4]
    assert cache.compressed_kv[2].shape == (4, 5, 32)  # ceil(9 / 2) entries, + scratch slot
    assert cache.compressed_kv[4].shape == (4, 9, 32)
    assert cache.index_k[4].shape == (4, 9, 16)
    assert list(cache.pair_state) == [2] and cache.pair_state[2].dtype == torch.float32


def test_yarn_frequencies_at_flash_sizes() -> None:
    base = rope_inv_freq(64, 160000.0)
    yarn = yarn_inv_freq(64, 160000.0, factor=16, original_max_pos=65536, beta_fast=32, beta_slow=1)
    # Correction range for R=64, base 160000, 65536 original positions: low 15, high 25.
    torch.testing.assert_close(yarn[:16], base[:16])  # fast pairs untouched (ramp 0 up to 15)
    torch.testing.assert_close(yarn[25:], base[25:] / 16)  # slow pairs interpolated
    ramp = (torch.arange(16, 25) - 15) / 10
    torch.testing.assert_close(yarn[16:25], base[16:25] / 16 * ramp + base[16:25] * (1 - ramp))


def test_top_k_takes_the_lower_index_of_equal_values_in_index_order():
    """Against a stable descending sort, on values with many ties (and -inf): the same entries,
    listed by index, whatever the row's length."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        C = int(torch.randint(1, 40, (), generator=g))
        k = int(torch.randint(1, C + 1, (), generator=g))
        v = torch.randint(-3, 3, (5, C), generator=g).float()
        v[v == -3] = float("-inf")
        values, idx = attention.top_k(v, k)
        want = torch.sort(v, dim=-1, descending=True, stable=True).indices[:, :k].sort(-1).values
        assert torch.equal(idx, want) and torch.equal(values, v.gather(-1, want))


def test_the_logits_do_not_depend_on_the_caches_length():
    """The index scores' relu ties at exactly 0 often (tiny, from position 12 on here): which of
    the tied entries are picked must not change with the number of compressed entries."""
    cfg = ModelConfig.from_name("tiny", window_size=8)
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    ids = torch.randint(0, 500, (17,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = pack([Request(0, ids, 0)])
    logits = [model(*batch, model.new_cache(1, n)) for n in (22, 32, 64)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
