"""Fixtures shared across test modules."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from dsv41_compile.model import ModelConfig
from dsv41_compile.planning import plan_rank


@functools.cache
def _plan(cfg: ModelConfig, options: tuple, world_size: int, max_len: int) -> Any:
    return plan_rank(cfg, dict(options), world_size=world_size, max_len=max_len)


@pytest.fixture(scope="session")
def plan_once():
    """`planning.plan_rank`, memoised for the session on (config, options, world, max_len):
    planning the same graph twice costs seconds and proves nothing new."""

    def plan(cfg: ModelConfig, options: dict, *, world_size: int, max_len: int = 64) -> Any:
        return _plan(cfg, tuple(sorted(options.items())), world_size, max_len)

    return plan
