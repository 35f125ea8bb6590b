"""A batch the model refuses, compiled on 4 gloo ranks (tp=1, ep=4): every check the
single-device model makes of its inputs -- each token input 1-D and int64, the three of one
length, `logit_rows` 1-D, integer and at most T rows -- gives, on every rank, the
single-device model's `ValueError` with its message, under `mark_token_dim` (ranks 0 and 3), a
plain compile (Dynamo's static trace, then its dynamic one: rank 1) and `dynamic=True` (rank
2): each rank is a DP group of its own, compiled in its mode, the EP all-to-alls over all four.
No rank hangs (each raises before any collective), and the good step after the bad ones
matches the single-device model, logits and cache.

Where each check runs: a dim or a dtype in the forward itself, while Dynamo traces (a guard
on the input, no graph input), and so are lengths Dynamo traces as numbers or backed symbols;
lengths `mark_token_dim` leaves unknown are checked by the backend on the batch it compiles
for, and by the program before every call (`ModelAdapter.check_inputs`). A refused batch is
one of Dynamo's compiles of the model (the guards it failed); this test refuses eight per
model, with Dynamo's recompile limit raised to 16.
"""

from __future__ import annotations

import pytest
import torch

from dsv41_compile import mark_token_dim
from dsv41_compile.core.torch_private import dynamo_config
from dsv41_compile.deepseek_v41.model import DeepseekV41
from dsv41_compile.deepseek_v41.testing.batches import Request, pack
from dsv41_compile.deepseek_v41.testing.presets import compile_config
from dsv41_compile.testing.multirank import RankPool

WORLD = 4
MODES = ("marked", "unmarked", "dynamic")
MODE_OF_RANK = ("marked", "unmarked", "dynamic", "marked")


def _batch(dp_rank: int, start: int) -> tuple[torch.Tensor, ...]:
    """Two requests of this DP group: 3 and 2 tokens from position `start`."""
    ids = [11 + 7 * dp_rank + i for i in range(5)]
    return pack([Request(0, ids[:3], start), Request(1, ids[3:], start)])


def _bad_batches(ids, positions, slots) -> dict[str, tuple[tuple, dict]]:
    """Each check the model makes, broken once: (args, kwargs) of the call."""
    return {
        "input_ids 2-D": ((ids[None], positions, slots), {}),
        "positions float": ((ids, positions.float(), slots), {}),
        "slots bool": ((ids, positions, slots >= 0), {}),
        "input_ids int32": ((ids.int(), positions, slots), {}),
        "lengths": ((torch.cat([ids, ids[:1]]), positions, slots), {}),
        "logit_rows 2-D": ((ids, positions, slots), {"logit_rows": torch.tensor([[0]])}),
        "logit_rows float": ((ids, positions, slots), {"logit_rows": torch.tensor([0.0])}),
        "logit_rows > T": ((ids, positions, slots), {"logit_rows": torch.arange(6) % 5}),
    }


def _outcome(call) -> str:
    """The error's type and message, or "ok"."""
    try:
        call()
    except Exception as error:  # Dynamo wraps a backend's error: the user's is inside
        while getattr(error, "inner_exception", None) is not None:
            error = error.inner_exception
        return f"{type(error).__name__}: {error}"
    return "ok"


def _run(rank: int, world_size: int) -> dict:
    # each refused batch is a compile of Dynamo's (its guards, the trace up to the refusal):
    # eight of them and the good steps' exceed its default limit of 8 per model
    with dynamo_config(recompile_limit=16):
        return _refusals(rank)


def _refusals(rank: int) -> dict:
    dp_rank = rank
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", (("n_layers", 1),)))
    out: dict = {"single": {}, "modes": {}}
    cache = model.new_cache(4, 32)
    first, second = _batch(dp_rank, 0), _batch(dp_rank, 3)
    for name, (args, kwargs) in _bad_batches(*first).items():
        out["single"][name] = _outcome(lambda a=args, k=kwargs: model(*a, cache, **k))
    reference = [model(*first, cache), model(*second, cache)]
    for mode in MODE_OF_RANK[rank : rank + 1]:
        torch.compiler.reset()
        dynamic = True if mode == "dynamic" else None
        compiled = torch.compile(
            model, backend="dsv41_sp", options={"tp": 1, "ep": 4, "lowering": "eager"},
            dynamic=dynamic,
        )  # fmt: skip
        own = model.new_cache(4, 32)

        def call(args, kwargs, own=own, compiled=compiled, mode=mode):
            args = tuple(a.clone() for a in args)
            if mode == "marked":
                mark_token_dim(*(a for a in args if a.dim() == 1))
            return compiled(*args, own, **kwargs)

        logits = [call(first, {})]
        errors = {
            name: _outcome(lambda args=args, kwargs=kwargs: call(args, kwargs))
            for name, (args, kwargs) in _bad_batches(*first).items()
        }
        logits.append(call(second, {}))
        diff = max(float((a - b).abs().max()) for a, b in zip(logits, reference))
        cache_diff = max(
            float((a.double() - b.double()).abs().max())
            for a, b in zip(own.tensors(), cache.tensors())
        )
        out["modes"][mode] = {"errors": errors, "diff": diff, "cache_diff": cache_diff}
    return out


_RESULTS: list = []


def _results() -> list:
    if not _RESULTS:
        _RESULTS.extend(RankPool.shared(WORLD).run(_run))
    return _RESULTS


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "check",
    [
        "input_ids 2-D",
        "positions float",
        "slots bool",
        "input_ids int32",
        "lengths",
        "logit_rows 2-D",
        "logit_rows float",
        "logit_rows > T",
    ],
)
def test_a_refused_batch_gets_the_models_message_on_every_rank(check, mode):
    ranks = [r for r, m in enumerate(MODE_OF_RANK) if m == mode]
    for rank in ranks:
        result = _results()[rank]
        single = result["single"][check]
        assert single.startswith("ValueError: "), single
        assert result["modes"][mode]["errors"][check] == single, (rank, mode)


@pytest.mark.slow
def test_the_single_device_model_refuses_what_it_should():
    """The messages compared above are the model's: they name the input and the fix."""
    single = _results()[0]["single"]
    assert single["input_ids 2-D"] == (
        "ValueError: input_ids must be a 1-D tensor [T] of packed tokens, got shape (1, 5)"
    )
    assert single["positions float"] == (
        "ValueError: positions must be an integer tensor, got torch.float32; convert it with "
        ".long()"
    )
    assert single["lengths"] == (
        "ValueError: input_ids, positions and slots must have the same length T, got "
        "input_ids=6, positions=5, slots=5"
    )
    assert single["logit_rows > T"].startswith("ValueError: logit_rows asks for 6 rows of a batch")
    assert single["input_ids int32"] == (
        "ValueError: input_ids must be int64, got torch.int32; convert it with .long()"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_the_good_step_after_the_refused_ones_is_right(mode):
    for rank, result in enumerate(_results()):
        if MODE_OF_RANK[rank] != mode:
            continue
        assert result["modes"][mode]["diff"] <= 1e-5, (rank, mode)
        assert result["modes"][mode]["cache_diff"] <= 1e-5, (rank, mode)
