"""Ranks on one host compile once.

Every rank of a world compiles the same per-rank graph: the rank enters as the `tp_rank` input,
the TP group is named alike on every rank (`core.mesh`), parameter shards are sliced by the
runtime. So the first rank of a host to reach a graph compiles it -- AOTAutograd, the pipeline,
and for inductor its compile -- and saves the result; the others wait for it, then load it
side by side, skipping everything after Dynamo's trace. Inductor's own compile runs under a
host-wide lock (`host_lock`), so that no two ranks write the same kernel at once, and its
caches then serve the loading ranks.

The key is Dynamo's graph as traced (a loading rank skips the front porch's trace too),
its inputs' dtypes and shapes (symbols numbered by first appearance, not by the rank's compile
history), the options that change the program, the mesh's shape, the target, the installed hook
passes, the op rules and transitions in force (those registered at run time by their code:
`core.registry.code_fingerprint`), and the versions of torch and of this package's source. The cache lives beside inductor's
(`TORCHINDUCTOR_CACHE_DIR` moves both), so it also serves the next start of the same job (a warm
start).

Programs are kept per node (`node_id`: the host's name, and under torchrun the node's rank in the
job, `GROUP_RANK`): on several nodes, each node's first rank compiles for that node's ranks, and
no rank waits on a lock held by another node, even where the nodes share the cache's filesystem
(file locks over a network filesystem are not to be relied on). Inductor's kernels stay in its
own cache, shared by whatever shares its directory.

A compile that makes Dynamo restart its trace (AOTAutograd's scalar tensorification under
`dynamic=True`) is saved as such: the other ranks restart the same way without compiling.

With torchair, the ranks share everything before torchair: its own compile (GE) happens on
every rank's device.

Backed symbols among the inputs (`dynamic=True` makes every size of the cache one): what
AOTAutograd and the pipeline assumed about them became guards of the compiling rank's Dynamo
frame. They are saved with the program, in the inputs' canonical symbols, and a loading rank
adds them to its own shape env, so that every rank's Dynamo reuses and recompiles the program
under the same conditions.

Not shared: compiles whose hooks watch the pipeline or add passes without a cache tag, and
`dump_after` (its graphs exist only where the passes ran). Those compile on every rank, as
with `share_compile=False`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pickle
import socket
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, cast

import sympy
import torch
from filelock import FileLock
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dsv41_compile.core.errors import InternalError
from dsv41_compile.core.torch_private import (
    FakeTensorMode,
    GraphPickler,
    GraphPicklerOptions,
    TensorifyScalarRestartAnalysis,
    TensorifyState,
    TracingContext,
    add_guard,
    inductor_cache_dir,
    shape_env_guards,
    sym_expr,
)

__all__ = [
    "STATS",
    "Artifact",
    "add_guards",
    "cache_dir",
    "canonical_symbols",
    "Claim",
    "claim",
    "host_lock",
    "load_graph",
    "node_id",
    "program_key",
    "restart_like",
    "restart_requested",
    "save_graph",
    "saved_guards",
    "shared",
]

STATS: Counter[str] = Counter()
"""This process's shared compiles: "compiled" (saved for the host) and "loaded"."""


def cache_dir() -> Path:
    """`<inductor's cache directory>/dsv41_compile` (TORCHINDUCTOR_CACHE_DIR moves both)."""
    path = Path(inductor_cache_dir()) / "dsv41_compile"
    path.mkdir(parents=True, exist_ok=True)
    return path


def node_id() -> str:
    """This process's node: the host's name, with torchrun's node rank (`GROUP_RANK`) where it
    is set, so that two nodes started on one host (or sharing the cache's filesystem) are two."""
    group = os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return host if group is None else f"{host}.node{group}"


def _programs(folder: str) -> Path:
    """This node's entries of `folder` in the cache."""
    path = cache_dir() / folder / node_id()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def host_lock(name: str) -> Iterator[None]:
    """Hold the host-wide lock `name` (one process of the host at a time)."""
    with FileLock(str(cache_dir() / f"{name}.lock")):
        yield


@dataclass(frozen=True)
class Artifact:
    """A compiled per-rank program as saved for the host's other ranks: the rewritten graph
    (`save_graph`), what the runtime needs to call it, and what the dumps show."""

    graph: bytes
    spec: Any
    """`runtime.program.ProgramSpec`: its inputs, EP layers and dumps."""
    guards: tuple[sympy.Expr, ...] = ()
    """The guards the compile added, over the inputs' canonical symbols (`canonical_symbols`)."""
    restart: tuple[str, ...] | None = None
    """Set when AOTAutograd asked Dynamo to trace the frame again with these float inputs
    specialised (`dynamic=True` makes module float attributes symbolic): there is no program,
    and every rank's Dynamo restarts alike (`restart_like`)."""


def save_graph(gm: GraphModule) -> bytes:
    """The graph's structure (nodes, targets, arguments, names), without node meta."""
    saved = {node: node.meta for node in gm.graph.nodes}
    try:
        for node in saved:
            node.meta = {}
        return GraphPickler.dumps(gm, GraphPicklerOptions(ops_filter=None))
    finally:
        for node, meta in saved.items():
            node.meta = meta


def load_graph(data: bytes) -> GraphModule:
    gm = cast(GraphModule, GraphPickler.loads(data, FakeTensorMode()))
    gm.recompile()
    return gm


@cache
def _source_version() -> str:
    """A hash of this package's source: a changed pass never loads an old program."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def canonical_symbols(fake_inputs: list[Any]) -> dict[sympy.Symbol, sympy.Symbol] | None:
    """The inputs' size symbols, renamed `s0, s1, ...` in order of first appearance: the same on
    every rank whatever names its compile history gave them. None when a size mixes two
    symbols seen nowhere else (no order to give them)."""
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    for x in fake_inputs:
        sizes = (
            x.shape if isinstance(x, torch.Tensor) else [x] if isinstance(x, torch.SymInt) else []
        )
        for size in sizes:
            if not isinstance(size, torch.SymInt):
                continue
            new = [s for s in sym_expr(size).free_symbols if s not in names]
            if len(new) > 1:
                return None
            for symbol in new:
                names[symbol] = sympy.Symbol(f"s{len(names)}", integer=True)
    return names


def _input_description(x: object, names: dict[sympy.Symbol, sympy.Symbol]) -> str:
    def size(s: object) -> str:
        return str(sym_expr(s).xreplace(names)) if isinstance(s, torch.SymInt) else str(s)

    if isinstance(x, torch.Tensor):
        return f"{x.dtype}[{','.join(size(s) for s in x.shape)}]{x.device.type}"
    if isinstance(x, torch.SymInt):
        return f"int:{size(x)}"
    return repr(x)


def program_key(gm: GraphModule, fake_inputs: list[Any], parts: tuple[Any, ...]) -> str | None:
    """The cache key of compiling `gm` on `fake_inputs` (Dynamo's fakes) with `parts` (options,
    mesh shape, target, hook tags, ...); None when its inputs' symbols have no canonical
    names."""
    names = canonical_symbols(fake_inputs)
    if names is None:
        return None
    digest = hashlib.sha256(_source_version().encode())
    for name, module in gm.named_modules():  # the graph and its regions' subgraphs
        if isinstance(module, GraphModule):
            digest.update(f"{name}\n{module.code}".encode())
    digest.update("\n".join(_input_description(x, names) for x in fake_inputs).encode())
    digest.update(repr(parts).encode())
    return digest.hexdigest()[:32]


def saved_guards(
    shape_env: ShapeEnv, since: int, names: dict[sympy.Symbol, sympy.Symbol]
) -> tuple[sympy.Expr, ...] | None:
    """The guards `shape_env` gained after its first `since`, over canonical symbols; None
    when one involves a symbol that is not an input's size (the program is then not shared)."""
    guards = []
    for guard in shape_env_guards(shape_env)[since:]:
        if not guard.expr.free_symbols <= set(names):
            return None
        guards.append(guard.expr.xreplace(names))
    return tuple(guards)


def add_guards(
    shape_env: ShapeEnv, guards: tuple[sympy.Expr, ...], names: dict[sympy.Symbol, sympy.Symbol]
) -> None:
    """Make `guards` (over canonical symbols) guards of this rank's frame."""
    local = {canonical: symbol for symbol, canonical in names.items()}
    for guard in guards:
        add_guard(shape_env, guard.xreplace(local))


def restart_requested() -> tuple[str, ...]:
    """The float inputs AOTAutograd asked Dynamo to specialise when it raised
    `TensorifyScalarRestartAnalysis` (Dynamo keeps them in `TensorifyState`)."""
    return tuple(sorted(TensorifyState.force_specializations))


def restart_like(specialized: tuple[str, ...]) -> None:
    """Make this rank's Dynamo restart its trace as the compiling rank's did."""
    for name in specialized:
        TensorifyState.specialize(name)
    raise TensorifyScalarRestartAnalysis


class _Slot:
    """One key's entry while its lock is held: the saved artifact, if any, and how to save."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.artifact: Any = None
        if path.exists():
            self.artifact = pickle.loads(path.read_bytes())

    def store(self, artifact: Any) -> None:
        buffer = io.BytesIO()
        pickle.dump(artifact, buffer)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name)
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
        os.replace(tmp, self.path)  # readers see the whole file or none


@contextmanager
def shared(key: str, folder: str = "programs") -> Iterator[_Slot]:
    """The entry of `key` in `folder` (programs: an `Artifact`; any picklable value elsewhere),
    with the key's host-wide lock held: a rank that finds no artifact makes and stores one
    before the next rank looks."""
    path = _programs(folder)
    with FileLock(str(path / f"{key}.lock")):
        yield _Slot(path / f"{key}.pkl")


class Claim:
    """A compile's place in the host's cache (`claim`): the artifact another rank saved
    (`loaded`), or the key's lock, held for this rank to compile and `save` under."""

    def __init__(
        self,
        names: dict[sympy.Symbol, sympy.Symbol] | None = None,
        *,
        loaded: Artifact | None = None,
        lock: Any = None,
        slot: _Slot | None = None,
        since: int = 0,
    ) -> None:
        self.names, self.loaded = names, loaded
        self._lock, self._slot, self._since = lock, slot, since
        self._saved: Artifact | None = None

    def save(self, artifact: Artifact) -> None:
        """What this rank compiled, for the host's other ranks (stored when the block ends)."""
        self._saved = artifact

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self._slot is None:
            return
        try:
            if kind is TensorifyScalarRestartAnalysis:
                self._slot.store(Artifact(b"", None, restart=restart_requested()))
            elif kind is None and self._saved is not None and self.names is not None:
                guards = saved_guards(_shape_env(), self._since, self.names)
                if guards is not None:  # else every rank compiles for itself
                    self._slot.store(dataclasses.replace(self._saved, guards=guards))
        finally:
            self._lock.release()


def _shape_env() -> ShapeEnv:
    """The shape env of the compile Dynamo is running (its tracing context's fake mode's)."""
    shape_env = TracingContext.get().fake_mode.shape_env
    if shape_env is None:
        raise InternalError("Dynamo's fake mode has no shape env")
    return shape_env


def claim(key: str | None, fakes: list[Any]) -> Claim:
    """The protocol, for a compile keyed `key` on Dynamo's `fakes`: the first rank of the host
    to claim a key compiles it, holding the key's lock until the block the claim opens ends
    (`with claim(...) as c: ... c.save(artifact)`); the others wait for the lock, then find the
    artifact (`loaded`) and load it side by side, the lock released. What the compile assumed
    of the inputs' backed symbols (its new guards) and a Dynamo restart it asked for are
    saved with it, and a rank that loads repeats them here (a restart raises, as Dynamo's
    own). With `key` None, or inputs whose symbols have no canonical names, nothing is shared:
    this rank compiles for itself."""
    names = canonical_symbols(fakes) if key is not None else None
    if key is None or names is None:
        return Claim()
    path = _programs("programs")
    lock = FileLock(str(path / f"{key}.lock"))
    lock.acquire()
    slot = _Slot(path / f"{key}.pkl")
    shape_env = _shape_env()
    if slot.artifact is None:
        STATS["compiled"] += 1
        return Claim(names, lock=lock, slot=slot, since=len(shape_env_guards(shape_env)))
    lock.release()  # the host's other ranks load the artifact at the same time
    STATS["loaded"] += 1
    artifact = slot.artifact
    if artifact.restart is not None:
        restart_like(artifact.restart)
    add_guards(shape_env, artifact.guards, names)
    return Claim(names, loaded=artifact)
