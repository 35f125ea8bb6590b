"""The NPU lowerings' attention: `dsv41::sparse_attention` (each query over its window and its
compressed picks) rewritten into one `npu_sparse_flash_attention` over a KV source of the
layer's rows (`deepseek_v41.graph_mode.sparse_attention_sfa`), run through the stand-in's CPU
kernel (`testing.torchair_standin`), against the model's own computation of the op
(`model.attention.sparse_attention_aten`), on hand-made caches and batches: requests that
continue from their rings, a request longer than its ring, padding rows, T = 1, T = 0, every
slot's compressed entries, the cache formats of the official numerics. And the stand-in itself
against the op-plugin golden's reading, query by query."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.adapter import SPARSE_ATTENTION, DeepseekV41Adapter
from dsv41_compile.deepseek_v41.graph_mode import _sfa_source
from dsv41_compile.deepseek_v41.model.attention import sparse_attention_aten
from dsv41_compile.deepseek_v41.model.numerics import fp4_rows, fp8_rows
from dsv41_compile.targets import npu_passes
from dsv41_compile.testing import torchair_standin
from dsv41_compile.testing.graphs import rewritten_for_graph_mode
from dsv41_compile.testing.torchair_standin import register_npu_ops

register_npu_ops()

H, D, W, C, K = 4, 64, 8, 6, 4
SLOTS = 3  # and the scratch slot
SFA = torch.ops.npu.npu_sparse_flash_attention.default


def batch(requests, *, pad=0, compressed=True, official=False, seed=0):
    """The op's arguments for `requests` [(slot, first position, tokens)], then `pad` padding
    rows (the scratch slot); each slot's ring holds its positions before the first
    (`lengths`), as the model's cache does."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if official else torch.float32
    slot = [s for s, _, n in requests for _ in range(n)] + [SLOTS] * pad
    positions = [p + i for _, p, n in requests for i in range(n)] + [0] * pad
    lengths = torch.zeros(SLOTS, dtype=torch.int64)
    for s, p, _ in requests:
        lengths[s] = p
    slot_T = torch.tensor(slot, dtype=torch.int64)
    positions_T = torch.tensor(positions, dtype=torch.int64)
    start_T = torch.where(slot_T == SLOTS, positions_T, lengths[slot_T.clamp(max=SLOTS - 1)])
    T = len(slot)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(T, D, generator=g).to(dtype)
    ring = torch.randn(SLOTS + 1, W, D, generator=g).to(dtype)
    sink = torch.randn(H, generator=g)
    args = [q, kv, fp8_rows(ring) if official else ring, slot_T, positions_T, start_T, sink]
    args += [W, official, False]
    if compressed:
        entries = torch.randn(SLOTS + 1, C, D, generator=g).to(dtype)
        idx = torch.argsort(torch.rand(T, C, generator=g), dim=1)[:, :K]  # distinct picks
        picked = torch.rand(T, K, generator=g) > 0.3
        args += [fp4_rows(entries) if official else entries, idx, picked, official]
    return args


def rewritten(args, rows=10**6):
    """The op alone, rewritten as a compile whose workload states `rows` rows per step (a
    prefill's by default: the caches as they are; a decode's: each query's keys gathered)."""
    token = npu_passes._LOWERED.set(npu_passes.Lowered("npugraph_ex", "950dt", rows))
    try:
        gm, tensors = rewritten_for_graph_mode(
            SPARSE_ATTENTION, *args, rewrites=DeepseekV41Adapter.graph_mode_rewrites
        )
    finally:
        npu_passes._LOWERED.reset(token)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return gm(*tensors), ops


REQUESTS = {
    # a request continuing from its ring, one longer than its ring (its early rows read from
    # this call), one at position 0 (window keys before it invisible)
    "prefill": [(0, 3, 5), (2, 10, 11), (1, 0, 4)],
    "decode": [(2, 17, 1)],
    "verify": [(0, 9, 3), (1, 30, 3)],
}


@pytest.mark.parametrize("compressed", [False, True], ids=["window", "window+compressed"])
@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_the_fused_attention_computes_the_models_attention(name, compressed):
    args = batch(REQUESTS[name], pad=2 if name == "prefill" else 0, compressed=compressed)
    for rows, gathered in ((10**6, False), (1, True)):
        got, ops = rewritten(args, rows)
        torch.testing.assert_close(got, sparse_attention_aten(*args), atol=2e-6, rtol=1e-5)
        assert ops.count(SFA) == 1
        # the caches as they are: no row of them gathered (the only gathers are of indices)
        assert (torch.ops.aten.index.Tensor in ops) == gathered


def test_the_source_is_the_caches_where_the_lists_name_more_rows_than_they_hold():
    # 4 slots of 8 ring rows and 6 entries: 56 rows; 12 keys a query
    assert _sfa_source(5, 12, 4, 8, 6)[0] and not _sfa_source(4, 12, 4, 8, 6)[0]
    assert "60 rows listed; the caches hold 56" in _sfa_source(5, 12, 4, 8, 6)[1]


@pytest.mark.parametrize("rows", [10**6, 1])
def test_no_tokens_and_one_token(rows):
    for requests in ([], [(0, 5, 1)]):
        args = batch(requests)
        got, _ = rewritten(args, rows)
        assert got.shape == (len(requests), H, D)
        torch.testing.assert_close(got, sparse_attention_aten(*args), atol=2e-6, rtol=1e-5)


def test_the_official_cache_formats_are_decoded_as_the_model_decodes_them():
    """FP8 window rows and FP4 compressed rows, bf16 queries: with the probabilities unrounded
    the same values up to the bf16 output's rounding; with the official blockwise rounding
    (which the kernel does not do) within it, not equal."""
    args = batch(REQUESTS["prefill"], pad=1, official=True)
    args[9] = False  # unrounded probabilities
    for rows in (10**6, 1):
        got, _ = rewritten(args, rows)
        torch.testing.assert_close(got, sparse_attention_aten(*args), atol=1e-2, rtol=1e-2)
    args[9] = True  # the official kernel's rounding
    got, _ = rewritten(args)
    want = sparse_attention_aten(*args)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    assert not torch.equal(got, want)


def golden(query, key, indices, scale, sinks):
    """op-plugin's golden loop, read for one batch, one KV head (`cpu_sparse_flash_attention`
    with `sparse_mode=0`, blocks of one row): per query, the rows up to the first -1,
    softmax with the sinks in the denominator, times the rows."""
    out = torch.zeros(query.shape[1:], dtype=torch.float32)
    for s in range(query.shape[1]):
        rows = []
        for i in indices[0, s, 0].tolist():
            if i == -1:
                break
            rows.append(i)
        k = key[0, rows, 0].float()
        logits = query[0, s].float() @ k.T * scale  # [N1, n]
        top = torch.maximum(logits.amax(-1) if rows else sinks, sinks)
        weights = torch.exp(logits - top[:, None])
        total = weights.sum(-1) + torch.exp(sinks - top)
        out[s] = weights @ k / total[:, None]
    return out


def test_the_stand_in_is_the_goldens_reading():
    """Rows stop at the first -1 (a valid index after it is not read), the sink takes its share
    of the softmax, and a query whose list starts with -1 gets zeros."""
    g = torch.Generator().manual_seed(1)
    query, key = torch.randn(1, 4, 3, 16, generator=g), torch.randn(1, 10, 1, 16, generator=g)
    indices = torch.tensor(
        [[2, 5, 7, -1, 1], [0, 1, 2, 3, 4], [-1, 3, 3, 3, 3], [9, 9, -1, -1, -1]]
    )
    indices = indices.to(torch.int32).view(1, 4, 1, 5)
    sinks = torch.randn(3, generator=g)
    out = SFA(query, key, key, indices, 0.25, sparse_mode=0, attention_mode=0, sinks=sinks)[0]
    torch.testing.assert_close(out[0], golden(query, key, indices, 0.25, sinks))
    assert torch.equal(out[0, 2], torch.zeros(3, 16))


def test_a_form_the_stand_in_does_not_implement_is_an_error():
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="sparse_mode"):
        SFA(q, k, k, torch.zeros(1, 2, 1, 3, dtype=torch.int32), 1.0, sparse_mode=3)


def test_a_perturbed_stand_in_fails_the_comparison(monkeypatch):
    """The comparison above tells the sink's reading apart: a kernel without the sinks is
    off by more than the tolerance."""
    monkeypatch.setattr(torchair_standin, "SFA_SINKS", False)
    args = batch(REQUESTS["verify"])
    got, _ = rewritten(args)
    assert (got - sparse_attention_aten(*args)).abs().max() > 1e-3
