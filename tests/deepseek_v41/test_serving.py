"""`serving.generate` on one device, tiny-dspark read from a synthetic checkpoint: speculative
greedy decoding gives exactly the tokens of plain greedy decoding; a cache cut back after rejected drafts is that of a run that never saw
them; rejection sampling keeps the backbone's distribution."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41 import serving
from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig, load_checkpoint
from dsv41_compile.deepseek_v41.model.batches import Request, pack
from dsv41_compile.deepseek_v41.serving import accept_sampled, generate
from dsv41_compile.deepseek_v41.testing.checkpoints import synthetic_checkpoint

CFG = ModelConfig.from_name("tiny-dspark", hc_sinkhorn_iters=3)
PROMPT_LENGTHS = (3, 11, 6)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny-dspark from a synthetic checkpoint in the released layout, read in fp32."""
    root = tmp_path_factory.mktemp("tiny_dspark")
    synthetic_checkpoint(CFG, root)
    cfg = ModelConfig.from_hf(root, dtype="float32", numerics="bf16", weight_format="dequantized")
    assert cfg == CFG
    loaded = DeepseekV41.without_weights(cfg)
    load_checkpoint(loaded, root)
    return loaded


def prompts(lengths=PROMPT_LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size - 1, (n,), generator=g).tolist() for n in lengths]


def test_speculative_greedy_is_greedy(model):
    plain = generate(model, prompts(), 40, speculative=False)
    spec = generate(model, prompts(), 40)
    assert [len(t) for t in plain.tokens] == [40, 40, 40]
    assert spec.tokens == plain.tokens
    assert sum(spec.step_tokens) == sum(plain.step_tokens) == 120
    # random weights: few proposals are kept, but some are, so both paths of a step run
    assert 0 < sum(spec.step_accepted) < sum(spec.step_proposed)


def test_proposals_kept_in_any_number_give_the_same_tokens(model, monkeypatch):
    """An oracle drafter proposing the greedy tokens with one wrong at index j = 0 .. 4, or none
    (j = 5), in turn: every count of kept proposals, cuts at odd and even lengths, whole blocks
    kept. The tokens are plain decoding's."""
    plain = generate(model, prompts(), 30, speculative=False)
    planned = []

    def oracle(model_, drafter, batch, draft_cache, verified, temperature, generator, out, limit):
        for r in batch:
            if r.generated >= limit:
                continue
            count = min(limit - r.generated - 1, CFG.dspark_block_size)
            r.drafts = list(plain.tokens[r.slot][r.generated : r.generated + count])
            j = len(planned) % 6
            if j < count:
                r.drafts[j] = (r.drafts[j] + 1) % CFG.vocab_size
            planned.append(min(j, count))

    monkeypatch.setattr(serving, "_draft", oracle)
    spec = generate(model, prompts(), 30)
    assert spec.tokens == plain.tokens
    assert set(planned) == set(range(CFG.dspark_block_size + 1))
    assert sum(spec.step_accepted) == sum(planned)  # each kept as planned
    assert spec.tokens_per_step > 2


def test_a_cache_cut_after_rejected_drafts_is_one_that_never_saw_them(model):
    prompt = prompts((9,))[0]
    held = len(prompt)

    def prefilled():
        cache = model.new_cache(1, 32)
        return cache, int(model(*pack([Request(0, prompt, 0)]), cache)[-1].argmax())

    def diff(a, b):  # the request's slot (the scratch slot holds garbage)
        return max((x[:1].float() - y[:1].float()).abs().max() for x, y in zip(a, b))

    # verify [next, 5 drafts] where only the first draft is right: 2 positions kept, cut to an
    # even length (the ratio-2 compressor)
    never, nxt = prefilled()
    right = int(model(*pack([Request(0, [nxt], held)]), never)[-1].argmax())
    fed = [nxt, right, 1, 2, 3, 4]
    keep = held + 2
    cut = model.cache_cut(keep)
    assert cut == keep - 1  # held is odd: the kept token at `cut` is dropped and fed again
    never, _ = prefilled()  # the run that never saw the drafts: the kept positions only
    model(*pack([Request(0, fed[: cut - held], held)]), never)

    cache, _ = prefilled()
    saved = model.save_rows(cache, 0, held, len(fed))
    model(*pack([Request(0, fed, held)]), cache)
    assert diff(cache.tensors(), never.tensors()) > 0.1  # the rejected rows were written
    model.cut_cache(cache, saved, cut, prompt + fed)
    assert diff(cache.tensors(), never.tensors()) <= 1e-5
    assert int(cache.lengths[0]) == cut


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts drawn from q, checked against p: the first token out is distributed as p0, the
    second (given the first draft kept) as p1. Pearson's chi-square over the V cells, fixed
    seed, compared with its 0.1 % critical value for V - 1 = 5 degrees of freedom (20.52)."""
    V, N = 6, 20000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    first = torch.zeros(V)
    second, kept_first = torch.zeros(V), 0
    for _ in range(N):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        kept, nxt = accept_sampled(drafts, q, p, g)
        out = drafts[:kept] + [nxt]
        first[out[0]] += 1
        if kept >= 1:
            kept_first += 1
            second[out[1]] += 1

    def chi2(counts, probs):
        expected = counts.sum() * probs
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(first, p[0]) < 20.52
    assert kept_first > 1000 and chi2(second, p[1]) < 20.52
    # and the test can fail: the drafts' own distribution is far from p0
    assert chi2(first, q[0]) > 100


def test_sampled_decoding_runs_and_repeats_with_its_seed(model):
    runs = [
        generate(
            model, prompts((4, 2)), 12, temperature=1.0, generator=torch.Generator().manual_seed(5)
        )
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert all(len(t) == 12 and all(0 <= x < CFG.vocab_size for x in t) for t in runs[0].tokens)


def test_what_generate_refuses(model):
    with pytest.raises(ValueError, match="config has none"):
        torch.manual_seed(0)
        generate(DeepseekV41(ModelConfig.from_name("tiny-swa")), [[1]], 2)
    with pytest.raises(ValueError, match="window of 4"):
        generate(DeepseekV41(CFG.replace(window_size=4)), [[1]], 2)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[]], 2)


def test_speculative_greedy_is_greedy_under_the_official_numerics():
    """bf16, the official FP8 / FP4 roundings and the weights as released, the drafter's ring
    in FP8 rows (tiny-swa with three DSpark stages: tiny's index heads are too narrow for the
    official FP4 index keys)."""
    dspark = {f: getattr(CFG, f) for f in CFG.__dataclass_fields__ if f.startswith("dspark_")}
    cfg = ModelConfig.from_name(
        "tiny-swa",
        **dspark | {"dspark_target_layer_ids": (0, 1)},
        num_nextn_predict_layers=3,
        hc_sinkhorn_iters=3,
        window_size=8,
        o_lora_rank=32,
        dtype="bfloat16",
        numerics="official",
        weight_format="released",
    )
    torch.manual_seed(0)
    model = DeepseekV41(cfg)
    assert model.mtp.new_cache(1).window[0].dtype == torch.uint8
    plain = generate(model, prompts(), 24, speculative=False)
    assert generate(model, prompts(), 24).tokens == plain.tokens


def test_generate_asks_for_the_rows_it_reads_and_decodes_as_with_every_row(model):
    """Plain decoding asks for each request's last row (`logit_rows`), and its tokens are
    those of greedy decoding by hand from the logits of every row."""
    asked = []

    def backbone(*args, **kwargs):
        asked.append(len(kwargs["logit_rows"]))
        return model(*args, **kwargs)

    out = generate(model, prompts(), 5, speculative=False, backbone=backbone)
    assert asked == [len(PROMPT_LENGTHS)] * 5
    tokens, held = prompts(), [0] * len(PROMPT_LENGTHS)
    cache = model.new_cache(len(tokens), 32)
    with torch.no_grad():
        for _ in range(5):
            batch = [Request(s, t[held[s] :], held[s]) for s, t in enumerate(tokens)]
            logits = model(*pack(batch), cache)  # [T, V]: every row
            end = 0
            for s, r in enumerate(batch):
                end += len(r.ids)
                held[s] = len(tokens[s])
                tokens[s].append(int(logits[end - 1].argmax()))
    assert out.tokens == [t[n:] for t, n in zip(tokens, PROMPT_LENGTHS)]
