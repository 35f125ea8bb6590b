"""Tests for `validate_batch`: one per error, plus valid ragged and padded batches.

The cache is a stand-in with the three attributes `validate_batch` reads, so these tests do not
depend on the model.
"""

from types import SimpleNamespace

import pytest
import torch

from dsv41_compile.deepseek_v41.model.validate import validate_batch

VOCAB = 1024


def make_cache(lengths: list[int], max_len: int = 16) -> SimpleNamespace:
    return SimpleNamespace(
        num_slots=len(lengths),
        max_len=max_len,
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )


def check(ids: list[int], positions: list[int], slots: list[int], cache: SimpleNamespace) -> None:
    validate_batch(
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
        cache,
        vocab_size=VOCAB,
    )


def test_ragged_prefill_and_decode_continuing_the_cache_pass() -> None:
    cache = make_cache([0, 0, 7])
    # slots 0 and 1 prefill 3 and 2 tokens; slot 2 decodes one token after the 7 it holds.
    check([1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 7], [0, 0, 0, 1, 1, 2], cache)
    # multi-token decode (k = 2) on slot 2, slots in any order
    check([7, 8, 9], [7, 8, 0], [2, 2, 0], cache)


def test_padding_rows_are_accepted() -> None:
    cache = make_cache([4, 0])
    check([10, 11, 12, 0, 0, 0], [4, 0, 1, 0, 0, 3], [0, 1, 1, -1, -1, -1], cache)
    check([0, 0], [0, 0], [-1, -1], cache)


def test_empty_batch_passes() -> None:
    check([], [], [], make_cache([0]))


def test_not_1d() -> None:
    ids = torch.zeros(2, 3, dtype=torch.int64)
    flat = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"input_ids must be a 1-D tensor \[T\].*\(2, 3\)"):
        validate_batch(ids, flat, flat, make_cache([0]), vocab_size=VOCAB)


def test_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="same length T, got input_ids=3, positions=3, slots=2"):
        check([1, 2, 3], [0, 1, 2], [0, 0], make_cache([0]))


def test_dtype_not_int64() -> None:
    ids = torch.tensor([1, 2], dtype=torch.int64)
    pos = torch.tensor([0, 1], dtype=torch.int32)
    slots = torch.tensor([0, 0], dtype=torch.int64)
    with pytest.raises(ValueError, match="positions must be int64, got torch.int32"):
        validate_batch(ids, pos, slots, make_cache([0]), vocab_size=VOCAB)


def test_id_out_of_vocab() -> None:
    with pytest.raises(ValueError, match=r"token 5: input id 70000 is out of vocab \[0, 1024\)"):
        check([1, 2, 3, 4, 5, 70000], [0, 1, 2, 3, 4, 5], [0] * 6, make_cache([0]))


def test_negative_id_out_of_vocab() -> None:
    with pytest.raises(ValueError, match=r"token 0: input id -1 is out of vocab"):
        check([-1], [0], [0], make_cache([0]))


def test_padding_id_out_of_vocab() -> None:
    with pytest.raises(ValueError, match=r"token 1: input id 5000 is out of vocab"):
        check([1, 5000], [0, 0], [0, -1], make_cache([0]))


@pytest.mark.parametrize("slot", [3, -2])
def test_slot_out_of_range(slot: int) -> None:
    with pytest.raises(ValueError, match=rf"token 1: slot {slot} is out of range; use 0..2 "):
        check([1, 2], [0, 0], [0, slot], make_cache([0, 0, 0]))


def test_negative_position() -> None:
    with pytest.raises(ValueError, match="token 0: position -1 is negative"):
        check([1], [-1], [0], make_cache([0]))


def test_position_beyond_max_len() -> None:
    with pytest.raises(ValueError, match="token 1: position 16 is beyond max_len 16"):
        check([1, 2], [15, 16], [0, 0], make_cache([15]))


def test_padding_position_beyond_max_len() -> None:
    with pytest.raises(ValueError, match="token 0: position 99 is beyond max_len 16"):
        check([0], [99], [-1], make_cache([0]))


def test_request_split_into_two_runs() -> None:
    with pytest.raises(ValueError, match=r"token 3: slot 0 starts a second run .*tokens 0\.\.1"):
        check([1, 2, 3, 4], [0, 1, 0, 2], [0, 0, 1, 0], make_cache([0, 0]))


def test_request_split_by_padding() -> None:
    with pytest.raises(ValueError, match="token 2: slot 0 starts a second run"):
        check([1, 0, 2], [0, 0, 1], [0, -1, 0], make_cache([0]))


def test_positions_inside_a_run_must_step_by_one() -> None:
    with pytest.raises(
        ValueError, match="token 2: position 3 of slot 0 does not follow position 1 of token 1"
    ):
        check([1, 2, 3], [0, 1, 3], [0, 0, 0], make_cache([0]))


def test_repeated_position_inside_a_run() -> None:
    with pytest.raises(ValueError, match="token 1: position 0 of slot 0 does not follow"):
        check([1, 2], [0, 0], [0, 0], make_cache([0]))


def test_first_position_must_continue_the_cache() -> None:
    with pytest.raises(
        ValueError,
        match=(
            "token 1: position 9 does not continue the cache: slot 2 holds 7 tokens, "
            "so the next position must be 7, got 9"
        ),
    ):
        check([1, 2], [0, 9], [0, 2], make_cache([0, 0, 7]))


def test_the_call_refuses_a_batch_of_unequal_lengths() -> None:
    """The forward checks its batch's shapes and dtypes on one device: a batch whose positions
    are one short is a ValueError naming the lengths (it ran silently)."""
    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny-swa", n_layers=1))
    cache = model.new_cache(2, 16)
    ids, slots = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 1])
    with pytest.raises(
        ValueError,
        match=r"input_ids, positions and slots must have the same length T, got input_ids=4, "
        r"positions=3, slots=4",
    ):
        model(ids, torch.tensor([0, 1, 0]), slots, cache)
    with pytest.raises(ValueError, match="positions must be an integer tensor, got torch.float32"):
        model(ids, torch.tensor([0.0, 1.0, 0.0, 1.0]), slots, cache)


def test_a_marked_compile_refuses_a_batch_of_unequal_lengths() -> None:
    """Compiled, the forward's check stands aside (Dynamo traces it); with `mark_token_dim` the
    backend checks the token inputs' lengths it is called with
    (tiny-swa, one layer, rank 1 of a fake world, tp=2): Dynamo traces the unequal batch again
    and the backend refuses it."""
    from dsv41_compile import mark_token_dim
    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
    from dsv41_compile.testing.torch_shims import fake_process_group

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny-swa", n_layers=1))
    cache = model.new_cache(2, 16)
    ids, positions, slots = (
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 1, 0]),
        torch.tensor([0, 0, 1]),
    )
    torch.compiler.reset()
    with fake_process_group(world_size=2, rank=1):
        mark_token_dim(ids, positions, slots)
        compiled = torch.compile(
            model, backend="dsv41_sp", options={"tp": 2, "lowering": "eager"}, fullgraph=True
        )
        compiled(ids, positions, slots, cache)  # compiles
        longer_ids, longer_slots = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 0, 1, 1])
        mark_token_dim(longer_ids, positions, longer_slots)  # before each call, as documented
        with pytest.raises(Exception) as info:  # the backend's error, in Dynamo's wrapper
            compiled(longer_ids, positions, longer_slots, cache)
    error = info.value
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    assert type(error) is ValueError
    assert str(error) == (
        "input_ids, positions and slots must have the same length T, got input_ids=4, positions=3, "
        "slots=4"
    )
    torch.compiler.reset()


def _rows_batch():
    ids = torch.tensor([1, 2, 3], dtype=torch.int64)
    return ids, torch.tensor([0, 1, 2], dtype=torch.int64), torch.zeros(3, dtype=torch.int64)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (torch.tensor([0, 3]), r"logit_rows\[1\] = 3 is not a row of the batch: rows are 0..2"),
        (torch.tensor([-1]), r"logit_rows\[0\] = -1 is not a row of the batch"),
        (torch.tensor([0, 1, 2, 2]), "logit_rows asks for 4 rows of a batch of T=3"),
        (torch.tensor([[0]]), r"logit_rows must be a 1-D tensor \[R\] of row indices"),
        (torch.tensor([0.0]), "logit_rows must be an integer tensor, got torch.float32"),
    ],
)
def test_logit_rows_outside_the_batch(rows, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_batch(*_rows_batch(), make_cache([0]), vocab_size=VOCAB, logit_rows=rows)


def test_the_call_refuses_logit_rows_it_cannot_take() -> None:
    """The forward checks what metadata says (more rows than the batch, not 1-D, not integer)."""
    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig

    model = DeepseekV41(ModelConfig.from_name("tiny-swa", n_layers=1))
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="logit_rows asks for 4 rows of a batch of T=3"):
        model(*_rows_batch(), cache, logit_rows=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="logit_rows must be an integer tensor"):
        model(*_rows_batch(), cache, logit_rows=torch.zeros(1))


def test_the_program_checks_each_call_dynamo_does_not_trace_again() -> None:
    """With `mark_token_dim`, one program serves every T: a later call whose `logit_rows` ask
    for more rows than its T passes Dynamo's guards (R is 2 both times, T unknown), and the
    program's own check before the call refuses it with the model's message (rank 1 of a fake
    world, tp=2)."""
    from dsv41_compile import mark_token_dim
    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
    from dsv41_compile.testing.observe import capture_lowered
    from dsv41_compile.testing.torch_shims import fake_process_group

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny-swa", n_layers=1))
    rows = torch.tensor([0, 2])
    torch.compiler.reset()
    with fake_process_group(world_size=2, rank=1), capture_lowered() as programs:
        compiled = torch.compile(
            model, backend="dsv41_sp", options={"tp": 2, "lowering": "eager"}, fullgraph=True
        )
        batch = _rows_batch()
        mark_token_dim(*batch)
        compiled(*batch, model.new_cache(1, 8), logit_rows=rows)
        one = (torch.tensor([5]), torch.tensor([0]), torch.tensor([0]))
        mark_token_dim(*one)
        with pytest.raises(ValueError, match="logit_rows asks for 2 rows of a batch of T=1"):
            compiled(*one, model.new_cache(1, 8), logit_rows=rows)
    assert len(programs) == 1  # no second compile: the program refused the call
    torch.compiler.reset()


def test_a_refused_call_leaves_the_compiled_model_compiled() -> None:
    """The forward refuses a call (here `hidden=True` on a model without DSpark stages) without
    a `raise` in the code Dynamo traces (`validate.refuse`): Dynamo would otherwise run the
    forward eagerly from then on. The next calls, at new token counts, run programs of the
    backend (rank 1 of a fake world, tp=2; before the fix they ran eagerly and the backend was
    handed the storage helper's frame on its own)."""
    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
    from dsv41_compile.testing.observe import capture_lowered
    from dsv41_compile.testing.torch_shims import fake_process_group

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny-swa", n_layers=1))

    def batch(n):
        return torch.arange(n) + 11, torch.arange(n), torch.zeros(n, dtype=torch.int64)

    torch.compiler.reset()
    with fake_process_group(world_size=2, rank=1), capture_lowered() as programs:
        compiled = torch.compile(model, backend="dsv41_sp", options={"tp": 2, "lowering": "eager"})
        compiled(*batch(5), model.new_cache(1, 16))
        with pytest.raises(ValueError, match="hidden=True returns what the DSpark drafter reads"):
            compiled(*batch(5), model.new_cache(1, 16), hidden=True)
        for n in (7, 3):
            before = [p.calls for p in programs]
            compiled(*batch(n), model.new_cache(1, 16))
            assert sum(p.calls for p in programs) == sum(before) + 1, n  # a program ran it
    torch.compiler.reset()
