"""What the passes share about one graph being compiled: the mesh, the options, the plan, what
each placeholder is, and what the passes found (communication records, parameter shards)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Placement

from dsv41_compile.mesh import Mesh
from dsv41_compile.propagation.plan import ShardingPlan

if TYPE_CHECKING:
    from dsv41_compile.backend import BackendOptions

__all__ = ["CompileContext", "ParamShard"]


@dataclass(frozen=True)
class ParamShard:
    """A parameter the graph receives as a local shard: chunk `index` of `parts` on `dim`."""

    fqn: str
    placement: Placement
    dim: int
    parts: int
    index: int

    def local_shape(self, shape: list[int]) -> list[int]:
        shape = list(shape)
        shape[self.dim] //= self.parts
        return shape


@dataclass
class CompileContext:
    mesh: Mesh
    options: BackendOptions
    plan: ShardingPlan
    param_fqns: dict[str, str]
    """Placeholder name -> parameter or buffer FQN (`layers.0.attn.wq_b.weight`)."""
    input_sources: dict[str, str]
    """Placeholder name -> the model input it is (`input_ids`, `cache.window_kv[0]`, ...)."""
    token_input: str
    """Placeholder name of `input_ids`: its length is the token count T."""
    fake_mode: Any = None
    comm: list[dict[str, Any]] = field(default_factory=list)
    """One record per inserted collective (DESIGN §5), filled by insert and validate."""
    sizes: Any = None
    """The token-size nodes (`collectives.transitions.TokenSizes`), created by insert."""
    param_shards: dict[int, ParamShard] = field(default_factory=dict)
    """Placeholder index -> shard, for parameters held as local shards."""
    ep_layers: list[Any] = field(default_factory=list)
    """One `collectives.expert_parallel.EpLayer` per rewritten routed-experts node, in graph
    order (the order of the graph's extra EP-statistics outputs)."""
