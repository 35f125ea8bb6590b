"""A toy model family for pass tests on small graphs: an embedding, residual MLP blocks on
token-sharded residuals (the normed input gathered, `up` column-parallel, `down` row-parallel
and reduce-scattered), a head. About 80 nodes per graph, compiled in a second.

    with toy_family():
        gm, ctx, _ = compile_model_on_fake_rank(ToyLM(), (tokens,), {"tp": 4})
        gm, ctx, _ = plan_rank(ToyConfig(), {"tp": 4}, world_size=8)  # on meta tensors

docs/architecture.md builds the same family step by step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from dsv41_compile import models
from dsv41_compile.core.adapter import LayerCollectives, ModelAdapter, Site
from dsv41_compile.core.plan import ShardingPlan

__all__ = ["ToyAdapter", "ToyConfig", "ToyLM", "toy_family"]


@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 64
    dim: int = 16
    hidden: int = 32
    n_layers: int = 2


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.mlp = _MLP(dim, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class ToyLM(nn.Module):
    """tokens [T] int64 -> logits [T, vocab]."""

    def __init__(self, vocab: int = 64, dim: int = 16, hidden: int = 32, n_layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(n_layers))
        self.out = nn.Linear(dim, vocab, bias=False)
        self.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class ToyAdapter(ModelAdapter):
    name = "toy_lm"
    token_inputs = ("tokens",)
    whole_model_modules = ("tok", "out")

    def matches(self, param_fqns, inputs) -> bool:
        return "tok.weight" in param_fqns

    def plan(self, options) -> ShardingPlan:
        return ShardingPlan(
            params=(("blocks.*.mlp.up.weight", Shard(0)), ("blocks.*.mlp.down.weight", Shard(1))),
            anchors=(("blocks.*", Shard(0)), ("blocks.*.mlp", Replicate()), ("out", Replicate())),
        )

    def site(self, module_path: str) -> Site:
        top, *rest = module_path.split(".")
        if top == "blocks" and rest:
            return Site(int(rest[0]), "attention")
        return Site(None, {"tok": "entry", "out": "exit"}.get(top, ""))

    def expected_collectives(self, options) -> LayerCollectives:
        return LayerCollectives(("all_gather", "reduce_scatter"), ())

    def check(self, options, param_shapes) -> None:
        hidden = param_shapes["blocks.0.mlp.up.weight"][0]
        if hidden % options.tp:
            raise ValueError(f"tp={options.tp} does not divide the MLP's {hidden} hidden units")

    def planning_example(self, config: Any, *, tokens: int = 5) -> Any:
        if not isinstance(config, ToyConfig):
            return None
        with torch.device("meta"):
            model = ToyLM(config.vocab, config.dim, config.hidden, config.n_layers)
            ids = torch.zeros(tokens, dtype=torch.int64)
        return model, (ids,), (ids,)


@contextmanager
def toy_family() -> Iterator[ToyAdapter]:
    """The toy family registered for the duration of the block."""
    adapter = models.register_adapter(ToyAdapter())
    try:
        yield adapter
    finally:
        models.unregister_adapter(adapter)
