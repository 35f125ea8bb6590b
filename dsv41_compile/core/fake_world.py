"""A world of ranks in one process, for planning: the `fake` process group (every collective is
a no-op), registered here so that library code does not import torch's test helpers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from dsv41_compile.core.torch_private import register_fake_backend

__all__ = ["fake_world"]


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A `fake` default process group of `world_size` ranks, this process being `rank`;
    destroyed on exit."""
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
