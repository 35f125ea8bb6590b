"""What the passes share about one graph being compiled: the mesh, the options, the plan, what
each placeholder is, and what the passes found (communication records, parameter shards)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Shard

from dsv41_compile.mesh import Mesh
from dsv41_compile.propagation.plan import ShardingPlan

if TYPE_CHECKING:
    from dsv41_compile.backend import BackendOptions

__all__ = ["CompileContext"]


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
    param_shards: dict[int, tuple[str, Shard]] = field(default_factory=dict)
    """Placeholder index -> (FQN, placement) for parameters held as local shards."""
