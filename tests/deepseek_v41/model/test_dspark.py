"""The DSpark drafter (`model.dspark`) against facts of the official inference code, on
hand-made inputs: what a block row sees (its whole block, not causally; the ring of the last
`window_size` context positions, in ring order), what the backbone hands it (the stream mean of
the residual entering the target layers, 37-39 in flash), and the Markov bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv41_compile.core.adapter import WeightInput
from dsv41_compile.deepseek_v41.model import PRESETS, DeepseekV41, ModelConfig
from dsv41_compile.deepseek_v41.model.batches import Request, pack
from dsv41_compile.deepseek_v41.serving import propose

CFG = ModelConfig.from_name("tiny-dspark", hc_sinkhorn_iters=3)
NOISE = CFG.dspark_noise_token_id
B = CFG.dspark_block_size


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return DeepseekV41(CFG)


def context(model, n: int, seed: int = 1):
    """The backbone's captures of an n-token prompt: (hidden, positions, slots)."""
    ids = torch.randint(0, CFG.vocab_size - 1, (n,), generator=torch.Generator().manual_seed(seed))
    batch = pack([Request(0, ids.tolist(), 0)])
    _, hidden = model(*batch, model.new_cache(1, 64), hidden=True)
    return hidden, batch[1], batch[2]


def draft(model, block_ids, hidden, positions, slots):
    """The drafter's logits for one request's block after the context `hidden`."""
    start = int(positions[-1]) + 1
    ids, block_positions, block_slots = pack([Request(0, block_ids, start)])
    logits, _ = model.mtp(
        ids, block_positions, block_slots, model.mtp.new_cache(1), hidden, positions, slots
    )
    return logits


def test_flash_reads_layers_37_to_39_and_projects_them_back():
    flash = PRESETS["flash-dspark"]
    assert flash.dspark_target_layer_ids == (37, 38, 39)
    assert (flash.num_nextn_predict_layers, flash.dspark_block_size) == (3, 5)
    assert flash.dspark_noise_token_id == 128799
    with torch.device("meta"):
        model = DeepseekV41(flash)
    assert tuple(model.mtp.main_proj.weight.shape) == (5120, 15360)
    assert [s.ffn.experts.w1.shape[0] for s in model.mtp.layers] == [128] * 3
    assert all(s.attn.role.mode == "swa" for s in model.mtp.layers)


def test_the_capture_is_the_stream_mean_entering_the_target_layers(model):
    seen = {}

    def grab(module, args):
        seen[module.layer_id] = args[0].mean(1)

    hooks = [layer.register_forward_pre_hook(grab) for layer in model.layers]
    try:
        batch = pack([Request(0, [3, 1, 4, 1, 5], 0), Request(1, [9, 2], 0)])
        _, hidden = model(*batch, model.new_cache(2, 16), hidden=True)
    finally:
        for hook in hooks:
            hook.remove()
    want = torch.cat([seen[i] for i in CFG.dspark_target_layer_ids], dim=-1)
    assert torch.equal(hidden, want)
    assert hidden.shape == (7, 3 * CFG.dim)


def test_a_block_row_sees_its_whole_block(model):
    hidden, positions, slots = context(model, 6)
    base = draft(model, [7] + [NOISE] * (B - 1), hidden, positions, slots)
    for changed in range(B):
        ids = [7] + [NOISE] * (B - 1)
        ids[changed] = 42
        logits = draft(model, ids, hidden, positions, slots)
        # every row moves, the rows before the changed one too: not causal
        assert ((logits - base).abs().amax(-1) > 1e-3).all(), changed


def test_a_block_row_sees_the_last_window_of_context_and_no_other_request(model):
    W = CFG.window_size
    hidden, positions, slots = context(model, W + 3)
    ids = [7] + [NOISE] * (B - 1)
    base = draft(model, ids, hidden, positions, slots)
    for p in range(W + 3):
        moved = hidden.clone()
        moved[p] += 1.0
        delta = (draft(model, ids, moved, positions, slots) - base).abs().max()
        if p < 3:  # older than the window: overwritten in the ring
            assert delta == 0, p
        else:
            assert delta > 1e-3, p
    # a second request in the same call changes nothing of the first's rows
    ids2, pos2, slots2 = pack([Request(0, ids, W + 3), Request(1, [9] + [NOISE] * (B - 1), 2)])
    two_hidden = torch.cat((hidden, hidden[:2] * 2))
    two_positions = torch.cat((positions, torch.arange(2)))
    two_slots = torch.cat((slots, torch.ones(2, dtype=torch.int64)))
    both, _ = model.mtp(
        ids2, pos2, slots2, model.mtp.new_cache(2), two_hidden, two_positions, two_slots
    )
    torch.testing.assert_close(both[:B], base, rtol=0, atol=1e-5)


def test_a_block_row_at_the_start_sees_only_the_filled_ring_rows(model):
    # two context positions: ring rows 2 .. W-1 are empty and must not take attention mass
    hidden, positions, slots = context(model, 2)
    ids = [7] + [NOISE] * (B - 1)
    cache = model.mtp.new_cache(1)
    cache.window[0][0, 2:] = 100.0  # garbage in the unfilled rows
    block = pack([Request(0, ids, 2)])
    garbage, _ = model.mtp(*block, cache, hidden, positions, slots)
    torch.testing.assert_close(garbage, draft(model, ids, hidden, positions, slots))


def test_the_markov_bias_is_the_previous_tokens_embedding_times_the_head(model):
    head = model.mtp.markov_head
    tokens = torch.tensor([5, 17, 5])
    bias, embed = head(tokens)
    want = F.linear(head.embed.weight[tokens].float(), head.head.weight)
    torch.testing.assert_close(bias, want, rtol=0, atol=0)
    assert torch.equal(bias[0], bias[2]) and bias.dtype == torch.float32


def test_each_draft_is_biased_by_the_one_before(model):
    """Flat logits: the greedy drafts follow the Markov chain of the bias alone."""
    head = model.mtp.markov_head
    V = CFG.vocab_size
    chain = {7: 40, 40: 41, 41: 42, 42: 43, 43: 44}
    with torch.no_grad():
        saved = head.head.weight.clone(), head.embed.weight.clone()
        head.embed.weight.zero_()
        head.head.weight.zero_()
        for i, (a, b) in enumerate(chain.items()):
            head.embed.weight[a, i] = 1.0
            head.head.weight[b, i] = 5.0
        try:
            drafts, q = propose(model, torch.zeros(B, V), 7, B, 0.0, None)
        finally:
            head.head.weight.copy_(saved[0])
            head.embed.weight.copy_(saved[1])
    assert drafts == [40, 41, 42, 43, 44] and q is None


def test_what_a_dspark_config_refuses():
    with pytest.raises(ValueError, match=r"dspark_target_layer_ids \[1\] are Engram layers"):
        CFG.replace(dspark_target_layer_ids=(1, 5))
    with pytest.raises(ValueError, match="must be sorted, unique layer ids of the 8 layers"):
        CFG.replace(dspark_target_layer_ids=(5, 9))
    with pytest.raises(ValueError, match="dspark_noise_token_id 512 is not a token id"):
        CFG.replace(dspark_noise_token_id=512)
    with pytest.raises(ValueError, match="hidden=True returns what the DSpark drafter reads"):
        torch.manual_seed(0)
        swa = DeepseekV41(ModelConfig.from_name("tiny-swa"))
        swa(*pack([Request(0, [1], 0)]), swa.new_cache(1, 4), hidden=True)


def test_the_checkpoint_names_the_stages_as_released(tmp_path):
    from dsv41_compile.deepseek_v41.adapter import DEEPSEEK_V41
    from dsv41_compile.deepseek_v41.model.checkpoint import checkpoint_layout

    with torch.device("meta"):
        layout = checkpoint_layout(DeepseekV41(CFG.replace(weight_format="released")))
    names = {n for n in layout if n.startswith("mtp.")}
    for name in (
        "mtp.0.main_proj.weight",  # FP8 (its scale beside it)
        "mtp.0.main_norm.weight",
        "mtp.1.attn.wq_a.weight",
        "mtp.1.hc_attn_fn",
        "mtp.2.ffn.experts.15.w3.weight",  # FP4 codes, one tensor per expert
        "mtp.2.ffn.shared_experts.w1.weight",
        "mtp.2.norm.weight",
        "mtp.2.markov_head.embed.weight",
        "mtp.2.markov_head.head.weight",
        "mtp.2.confidence_head.proj.weight",
    ):
        assert name in names, name
    assert not any(".embed." in n and "markov" not in n or n.startswith("mtp.head") for n in names)
    assert layout["mtp.0.main_proj.weight"].fmt == "e4m3"
    # compiled on its own, the drafter's program is not read per rank from a checkpoint
    with pytest.raises(NotImplementedError, match="load the model with load_checkpoint"):
        DEEPSEEK_V41.read_weights(
            str(tmp_path),
            [WeightInput("main_proj.weight", (64, 192), torch.float32, None)],
            skip_unimplemented_parts=False,
        )
