"""Selections by value whose scores tie within rounding (`testing.selections`), on one device.

Issue 64 reported two edits that select tokens by value -- the top-2 tokens by the L2 norm of
the normed attention input (`topk`), the top token by the same score (`argmax`) -- whose
compiled logits differed from the single-device model's by up to 0.25 at some meshes. Their
score is the norm of an RMSNorm output with unit weights: sqrt(D) for every row, up to
rounding. So the selection is decided by the scores' last bits: the single-device model
itself moves its logits by more than 1e-2 when its embedding is scaled by a few ulps, and a
sharded program, which sums in another order, picks other rows. The corpus's edits of the
class score tokens with a learned probe; they move by a few ulps under the same scaling, and
compile exactly (tests/distributed/test_selections.py).
"""

from __future__ import annotations

import pytest
import torch

from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.testing import edits
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.edits import EDITS
from dsv41_compile.deepseek_v41.testing.presets import compile_config
from dsv41_compile.testing.selections import watch_selections


def _norm_topk_mean(self, x_TD, cache_slot_T, valid_T):
    # issue 64's first edit, as reported
    score_T = x_TD.float().norm(dim=-1).masked_fill(~valid_T, -1.0)
    top_K = torch.topk(score_T, min(2, x_TD.shape[0]), dim=0).indices
    rows_KD, weight_K1 = x_TD[top_K], valid_T[top_K][:, None].to(x_TD.dtype)
    mean_D = (rows_KD * weight_K1).sum(0) / weight_K1.sum().clamp(min=1)
    return x_TD + 0.05 * mean_D * valid_T[:, None].to(x_TD.dtype)


def _norm_argmax_row(self, x_TD, cache_slot_T, valid_T):
    # issue 64's second edit: the README's tensor index for one token
    score_T = x_TD.float().norm(dim=-1).masked_fill(~valid_T, -1.0)
    top_1 = score_T.argmax(0, keepdim=True)
    return x_TD + 0.05 * x_TD[top_1] * valid_T[:, None].to(x_TD.dtype)


AS_REPORTED = {
    "norm_topk_mean": edits._mixing("attention", _norm_topk_mean),
    "norm_argmax_row": edits._mixing("attention", _norm_argmax_row),
}
BATCH = (Request(0, [98, 105, 112, 119], 0), Request(1, [129, 136], 0))


def _moves(patch_or_edit) -> tuple[float, list]:
    """How far the edited model's logits move, at most, when its embedding is scaled by
    1 + k ulps (k = 1 .. 8, 1 ulp = 2^-23), and the near ties of the unscaled run."""
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", (("n_layers", 2),)))
    if isinstance(patch_or_edit, str):
        EDITS[patch_or_edit].apply(model)
    elif patch_or_edit is not None:
        patch_or_edit(model, list(model.layers), torch.Generator())
    ids, positions, slots = pack(list(BATCH))
    with watch_selections() as ties:
        first = model(ids, positions, slots, model.new_cache(4, 32))
    weight = model.embed.weight.detach().clone()
    moved = 0.0
    for k in range(1, 9):
        with torch.no_grad():
            model.embed.weight.copy_(weight * (1 + k * 2**-23))
        logits = model(ids, positions, slots, model.new_cache(4, 32))
        moved = max(moved, float((logits - first).abs().max()))
    return moved, ties


@pytest.mark.parametrize("name", sorted(AS_REPORTED))
def test_the_reported_edits_select_by_rounding(name):
    """Scaled by a few ulps, the single-device model's logits move by more than 1e-2 (which
    scalings flip a selection depends on the summation order of the run: its thread count);
    the selections that tied are named at their line, within rounding."""
    moved, ties = _moves(AS_REPORTED[name])
    assert moved > 1e-2
    assert ties and {t.op for t in ties} == {"topk" if "topk" in name else "argmax"}
    assert all(__file__ in t.where and "score_T" in t.code for t in ties)
    assert all(t.gap <= 1e-5 * max(1.0, abs(t.kept)) for t in ties)
    assert "within rounding" in str(ties[0])


@pytest.mark.parametrize("name", [None, "top_tokens_mean", "top_token_row"])
def test_a_score_that_tells_tokens_apart_is_stable(name):
    """The stock model and the corpus's edits of the class (a learned probe as the score) move
    by a few ulps under the same scaling, and no selection of theirs ties."""
    moved, ties = _moves(name)
    assert moved < 1e-5
    assert ties == []


def _ties(fn, *args, **kwargs) -> list:
    with watch_selections() as ties:
        fn(*args, **kwargs)
    return ties


def test_which_pairs_tie():
    """The pair across what a selection keeps: topk's k-th and (k+1)-th, argmax's first and
    second, max / min along a dim, a sort's neighbours, kthvalue's k-th and its neighbours;
    exact ties of computed scores count, -inf padding and reductions without a dim do not."""
    x = torch.tensor([3.0, 2.0, 2.0 + 1e-6, 1.0])
    assert [t.op for t in _ties(torch.topk, x, 2)] == ["topk"]  # 2.000001 kept, 2.0 not
    assert _ties(torch.topk, x, 1) == [] and _ties(torch.topk, x, 3) == []
    assert _ties(torch.argmax, x) == [] and len(_ties(torch.argmin, -x)) == 0
    assert len(_ties(torch.argmax, torch.tensor([1.0, 1.0, 0.0]))) == 1  # an exact tie
    assert len(_ties(lambda: x.max(dim=0))) == 0 and _ties(lambda: x.max()) == []
    assert len(_ties(lambda: torch.stack([x, x]).min(dim=1))) == 0
    assert len(_ties(torch.sort, x)) == 1 and len(_ties(torch.argsort, x, descending=True)) == 1
    assert len(_ties(torch.kthvalue, x, 2)) == 1 and _ties(torch.kthvalue, x, 4) == []
    padded = torch.tensor([5.0, 1.0, float("-inf"), float("-inf")])
    assert _ties(torch.topk, padded, 3) == []
    (tie,) = _ties(lambda: torch.tensor([7.0, 7.0 + 2e-5, 1.0]).topk(1))  # 2e-5 < 1e-5 * 7
    assert tie.op == "topk" and tie.where.startswith(__file__) and "topk(1)" in tie.code
    assert _ties(lambda: torch.tensor([7.0, 7.0 + 1e-4, 1.0]).topk(1)) == []
