"""The generic vocabulary sharding a family opts into (`spmd.vocab`): the plan's entries and the
head's choice by time, with the option named by the family, on meta weights (nothing planned)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from dsv41_compile.core.plan import Entry
from dsv41_compile.options import BackendOptions
from dsv41_compile.spmd.vocab import head_choice, vocab_entries


def test_entries_name_the_families_weight():
    assert vocab_entries("lm.out.weight", "vocab_sharded") == (Entry("lm.out.weight", Shard(0)),)
    assert vocab_entries("lm.out.weight", "replicated") == ()
    with pytest.raises(ValueError, match=r"lm.out.weight: 'tied' is not one of"):
        vocab_entries("lm.out.weight", "tied")


def test_the_head_is_chosen_by_time_under_the_familys_option_name():
    """A big head split over tp at 8 rows, a small one kept whole (its AllGather's latency
    costs more than the rows it saves); the reason is keyed and worded by the family's option."""
    options = BackendOptions.from_dict({"tp": 4, "device": "950dt"})
    big = torch.empty(129_280, 7168, dtype=torch.float32, device="meta")
    chosen, why = head_choice("lm_head", "auto", big, options)
    assert chosen == "vocab_sharded"
    assert why["lm_head"].startswith("lm_head='auto': vocab_sharded, ")
    small = torch.empty(64, 32, device="meta")
    assert head_choice("lm_head", "auto", small, options)[0] == "replicated"
    # what the user gave is kept, with its time beside the other's
    chosen, why = head_choice("lm_head", "replicated", big, options)
    assert chosen == "replicated" and "against" in why["lm_head"]


def test_the_head_cannot_be_split_where_tp_does_not_divide_it():
    options = BackendOptions.from_dict({"tp": 3, "device": "950dt"})
    head = torch.empty(64, 32, device="meta")
    assert head_choice("lm_head", "auto", head, options) == (
        "replicated",
        {"lm_head": "lm_head='auto': replicated (tp=3 does not divide V=64)"},
    )
    with pytest.raises(ValueError, match=r"lm_head='vocab_sharded': tp=3 does not divide the voc"):
        head_choice("lm_head", "vocab_sharded", head, options)
    one = BackendOptions.from_dict({"tp": 1})
    assert head_choice("lm_head", "auto", head, one) == ("replicated", {})
    with pytest.raises(ValueError, match=r"with tp=1 use 'auto'"):
        head_choice("lm_head", "vocab_sharded", head, one)
