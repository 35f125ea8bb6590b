"""The toy family as the compiler sees it: its adapter, with its own options (`ToyOptions`),
registered for a block by `toy_family`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from dsv41_compile import families
from dsv41_compile.core.adapter import LayerCollectives, ModelAdapter, Site
from dsv41_compile.core.plan import Entry, ShardingPlan, colwise, rowwise
from dsv41_compile.options import BackendOptions
from dsv41_compile.testing.toy.model import ToyConfig, ToyLM
from dsv41_compile.testing.toy.options import ToyOptions

__all__ = ["ToyAdapter", "toy_family"]


def _mlp(options: BackendOptions) -> str:
    """The `mlp` option (the backend made `options.family` the toy's, `families.options_for`)."""
    family = options.family
    if not isinstance(family, ToyOptions):
        raise TypeError(f"{type(family).__name__} where ToyOptions are needed")
    return family.mlp


class ToyAdapter(ModelAdapter):
    name = "toy_lm"
    options = ToyOptions
    token_inputs = ("tokens",)
    whole_model_modules = ("tok", "out")

    def matches(self, param_fqns, inputs) -> bool:
        return "tok.weight" in param_fqns

    def plan(self, options) -> ShardingPlan:
        split = _mlp(options) == "split"
        return ShardingPlan(
            params=(*colwise("blocks.*.mlp.up"), *rowwise("blocks.*.mlp.down")) if split else (),
            anchors=(
                Entry("blocks.*", Shard(0)),
                Entry("blocks.*.mlp", Replicate()),
                Entry("out", Replicate()),
            ),
        )

    def site(self, module_path: str) -> Site:
        top, *rest = module_path.split(".")
        if top == "blocks" and rest:
            return Site(int(rest[0]), "attention")
        return Site(None, {"tok": "entry", "out": "exit"}.get(top, ""))

    def expected_collectives(self, options) -> LayerCollectives:
        if _mlp(options) == "split":
            return LayerCollectives(("all_gather", "reduce_scatter"), ())
        return LayerCollectives(("all_gather",), ())

    def check(self, options, param_shapes) -> None:
        hidden = param_shapes["blocks.0.mlp.up.weight"][0]
        if _mlp(options) == "split" and hidden % options.tp:
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
    adapter = families.register_adapter(ToyAdapter())
    try:
        yield adapter
    finally:
        families.unregister_adapter(adapter)
