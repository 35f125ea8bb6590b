"""The one place the tests import torch's private test helpers from."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["FakeStore", "fake_process_group"]


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A `fake` default process group (collectives are no-ops) for single-process graph and
    rule tests; destroyed on exit."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
