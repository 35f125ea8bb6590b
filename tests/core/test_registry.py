"""Registries of extensions refuse a second entry under a key instead of replacing the first."""

from __future__ import annotations

import pytest
import torch

from dsv41_compile import families
from dsv41_compile.core.registry import Registry
from dsv41_compile.spmd import rules, transitions
from dsv41_compile.testing.toy import ToyAdapter


def test_a_second_entry_under_a_key_is_refused_and_restored_blocks_undo():
    registry: Registry[int] = Registry("thing")
    registry.add("a", 1)
    with pytest.raises(ValueError) as info:
        registry.add("a", 2)
    assert str(info.value) == (
        "a thing is registered for 'a' already; remove it first (a second registration would "
        "replace it for every later compile)"
    )
    with registry.restored():
        registry.remove("a")
        registry.add("b", 3)
    assert registry.values() == [1] and registry.get("a") == 1


def test_model_families_rules_and_transitions_are_registered_once():
    with families.REGISTRY.restored():
        families.register_adapter(ToyAdapter())
        with pytest.raises(ValueError, match="a model family is registered for 'toy_lm'"):
            families.register_adapter(ToyAdapter())
    with pytest.raises(ValueError, match="a sharding rule is registered for"):
        rules.rule(torch.ops.aten.embedding.default)(lambda node, given: None)
    emit = transitions.TRANSITIONS.values()[0][1]
    with pytest.raises(ValueError, match="a transition is registered for"):
        transitions.transition(lambda src, dst: False)(emit)
