"""What the passes share about one graph being compiled: the mesh, the options, the model
adapter and its plan, what each placeholder is, the program's signature, and what the passes
found -- each package's findings as objects of its own types (`put` / `get`), so that this
module knows none of them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.mesh import Mesh
from dsv41_compile.core.meta import EP_TOKENS, GLOBAL_VAL, OUT, REASON, SYMBOL
from dsv41_compile.core.plan import ShardingPlan, pattern_matches
from dsv41_compile.core.signature import ProgramSignature
from dsv41_compile.core.torch_private import FakeTensorMode, new_input_size
from dsv41_compile.options import BackendOptions

__all__ = ["CompileContext"]

R = TypeVar("R")
_NONE: Any = object()


@dataclass
class CompileContext:
    mesh: Mesh
    options: BackendOptions
    adapter: ModelAdapter
    plan: ShardingPlan
    target: str
    """The resolved lowering: "eager", "inductor", "npugraph_ex" or "torchair"."""
    param_fqns: dict[str, str]
    """Placeholder name -> parameter or buffer FQN (`layers.0.attn.wq_b.weight`)."""
    buffers: frozenset[str]
    """The placeholder names among `param_fqns` that are buffers, not parameters."""
    input_sources: dict[str, str]
    """Placeholder name -> the model input it is (`input_ids`, `cache.window_kv[0]`, ...)."""
    token_input: str
    """Placeholder name of the first token input: its length is the token count T."""
    fake_mode: FakeTensorMode
    choices: dict[str, str] = field(default_factory=dict)
    """The cuts decided for this model: module FQN pattern of the consumer region where the
    cut's collective runs -> the choice and its alternatives' bytes (appended to the
    collective's reason). From the adapter (`ModelAdapter.resolve`: the attention exit) and
    the entry_cut pass (one entry per region it cut)."""
    signature: ProgramSignature | None = None
    """The per-rank program's inputs: written by localize (and expert_parallel's `ep_tokens`)."""
    comm: list[dict[str, Any]] = field(default_factory=list)
    """One record per collective (`report.comm.comm_records`), filled once, by verify."""
    results: dict[type, Any] = field(default_factory=dict)
    """What the passes found, one object per type, each type its package's (`put`, `get`)."""
    pass_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each pass (`core.passes.PassManager`)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent in the backend before the passes: `generalize` (the token count made
    symbolic), `kinds` (each layer kind's ATen traced once, `regions.trace_kinds_once`),
    `aot` (AOTAutograd's trace of the model with each kind's calls as one operator). Dynamo's
    own time is the caller's to measure: it ends where the backend starts."""
    kinds_traced: int = 0
    """How many layer kinds `regions.trace_kinds_once` traced (each once, whatever the
    number of layers of the kind)."""

    def local_inputs(self, gm: GraphModule) -> list[Any]:
        """Fake values of the inputs of `gm`, the per-rank graph being compiled (after
        `localize`): `signature.local_fakes` of its placeholders' global values."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        model = [n.meta.get(GLOBAL_VAL, n.meta.get("val")) for n in placeholders]
        ep_tokens = next((n.meta["val"] for n in placeholders if n.name == EP_TOKENS), None)
        loaded = self.options.checkpoint is not None
        return self.signature.local_fakes(model, self.fake_mode, loaded=loaded, ep_tokens=ep_tokens)

    def ep_tokens_input(self, gm: GraphModule) -> Node:
        """The graph's `ep_tokens` input (made on first use, after the last placeholder, and
        added to the signature): the largest token-shard length over the EP group (Tl_max),
        which the runtime agrees on before each call -- what sizes a static exchange between
        DP groups whose token counts differ."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        found = next((n for n in placeholders if n.name == EP_TOKENS), None)
        if found is not None:
            return found
        with gm.graph.inserting_after(placeholders[-1]):
            node = gm.graph.placeholder(EP_TOKENS)
        # A size only the runtime knows: a fresh unbacked symbol (>= 1) for fake propagation.
        if self.fake_mode.shape_env is None:
            raise InternalError("the compile's fake mode has no shape env")
        value = new_input_size(self.fake_mode.shape_env)
        torch._check(value >= 1)
        node.meta.update({"val": value, OUT: None, SYMBOL: "Tl_max"})
        node.meta[REASON] = "max token-shard length over the EP group (agreed before the call)"
        self.signature = self.signature.with_ep_tokens()
        return node

    def choice_for(self, paths: Iterable[str]) -> str | None:
        """The reason of the adapter's (or a pass's) choice, in `choices`, whose pattern matches
        one of the module `paths` (outermost first), the innermost that has one: a layer's
        Engram table takes `layers.*.engram`'s choice, not `layers.*`'s; None when no choice
        covers them."""
        for path in reversed(tuple(paths)):
            for pattern, why in self.choices.items():
                if pattern_matches(pattern, path):
                    return why
        return None

    def put(self, result: object) -> None:
        """Keep a pass's finding, by its type (one per type: a later `put` replaces it)."""
        self.results[type(result)] = result

    def get(self, kind: type[R], default: R = _NONE) -> R:
        """The finding of type `kind` a pass kept; `default` when no pass did (an
        `InternalError` without one: the pass that makes it has not run)."""
        if kind in self.results:
            return self.results[kind]
        if default is _NONE:
            raise InternalError(f"no pass has kept a {kind.__name__} for this compile")
        return default
