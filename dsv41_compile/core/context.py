"""What the passes share about one graph being compiled: the mesh, the options, the model
adapter and its plan, what each placeholder is, and what the passes found (the token-size
nodes, parameter shards, EP layers, communication records, time per pass)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Placement

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.mesh import Mesh

if TYPE_CHECKING:
    from dsv41_compile.moe.stats import EpLayer
    from dsv41_compile.options import BackendOptions
    from dsv41_compile.spmd.entry_cut import EntryCut
    from dsv41_compile.spmd.plan import ShardingPlan
    from dsv41_compile.spmd.transitions import TokenSizes

__all__ = ["CompileContext", "ParamShard"]


@dataclass(frozen=True)
class ParamShard:
    """A parameter the graph receives as a local shard: chunk `mesh.axis_rank(axis)` of `parts`
    on `dim` (a tp shard by `tp_rank`, an expert shard by the world rank)."""

    fqn: str
    placement: Placement
    dim: int
    parts: int
    axis: str

    def local_shape(self, shape: list[int]) -> list[int]:
        shape = list(shape)
        shape[self.dim] //= self.parts
        return shape


@dataclass
class CompileContext:
    mesh: Mesh
    options: BackendOptions
    adapter: ModelAdapter
    plan: ShardingPlan
    target: str
    """The resolved lowering: "eager", "inductor" or "torchair"."""
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
    entry_cuts: dict[str, EntryCut] = field(default_factory=dict)
    """Region -> the cut its entry AllGathers moved to (`spmd.entry_cut`)."""
    comm: list[dict[str, Any]] = field(default_factory=list)
    """One record per collective (`report.comm.comm_records`), filled by verify."""
    sizes: TokenSizes | None = None
    """The token-size nodes, created by insert."""
    param_shards: dict[int, ParamShard] = field(default_factory=dict)
    """Placeholder index -> shard, for parameters held as local shards."""
    ep_layers: list[EpLayer] = field(default_factory=list)
    """One `moe.stats.EpLayer` per rewritten routed-experts node, in graph order (the order of
    the graph's extra EP-statistics outputs)."""
    pass_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each pass (`core.passes.PassManager`)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent in the backend before the passes: `generalize` (the token count made
    symbolic), `kinds` (each layer kind's ATen traced once, `core.regions.trace_kinds_once`),
    `aot` (AOTAutograd's trace of the model with each kind's calls as one operator). Dynamo's
    own time is the caller's to measure: it ends where the backend starts."""
    kinds_traced: int = 0
    """How many layer kinds `core.regions.trace_kinds_once` traced (each once, whatever the
    number of layers of the kind)."""
