"""Fixtures shared across test modules."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

# A cold compile cache per session (inductor's and the host program cache beside it), shared by
# the ranks the session starts: the tests see what a fresh machine sees.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsv41_test_cache_")
# Inductor compiles its kernels in the process that compiles, not in a pool of one worker per
# core: every process that compiles or loads an inductor graph would start that pool (8 ranks,
# 2 workers each), and the suite already keeps both cores busy. Measured on the 8-rank inductor
# run: 145 -> 119 s of CPU.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
# Inductor's C++ kernels built at -O0 (with debug symbols), by this session and the ranks it
# starts: the suite checks inductor's lowering of each op and what the kernels compute, not
# gcc's optimiser; `tools/demo.py --lowering inductor` and users build at -O3. The plain-inductor
# compile of every attention mode (tests/deepseek_v41/model/test_model.py), alone: 65 s -> 40 s.
os.environ["TORCHINDUCTOR_DEBUG_COMPILE"] = "1"
# One intra-op thread per worker, as in the ranks (`testing.multirank`), and in the processes
# tests start (OMP_NUM_THREADS): with two workers on two cores, an op of tiny shapes split over
# two OpenMP threads spins while its other thread waits for a core taken by the other worker --
# index_add_ of 10 rows of 64 floats took 40 ms of CPU instead of 3 us.
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

from dsv41_compile.deepseek_v41.model import ModelConfig  # noqa: E402
from dsv41_compile.planning import plan_rank  # noqa: E402

torch.set_num_threads(1)  # torch may have been imported before OMP_NUM_THREADS was set

# `make test` runs the suite on two workers with `--dist loadfile`: the tests of a file run on one
# worker, in order. Files that compile the same graphs form one unit, so the worker's memo of
# those compiles (`plan_once`, `testing.fake_rank`) serves them all.
SHARED_COMPILES = {
    "tests/report/test_accounting.py": "tiny-swa-planned",
    "tests/tools/test_comm_report.py": "tiny-swa-planned",
    "tests/tools/test_memory_plan.py": "tiny-swa-planned",
    "tests/moe/test_expert_parallel.py": "tiny-swa-ep8-fake-rank",
    "tests/test_verify.py": "tiny-swa-ep8-fake-rank",
    "tests/report/test_graph_text.py": "tiny-swa-ep8-fake-rank",  # tiny-swa, 3 layers, exact EP
    # the runs on real gloo ranks, one after another on one worker: two pools of 8 ranks at
    # once on two cores switch between 16 processes (measured, the whole suite: 658 s with the
    # files apart, 629 s grouped)
    "tests/distributed/test_numerics.py": "gloo-ranks",
    "tests/distributed/test_edits.py": "gloo-ranks",
    "tests/distributed/test_selections.py": "gloo-ranks",
    "tests/distributed/test_bad_batches.py": "gloo-ranks",
    "tests/distributed/test_front_door.py": "gloo-ranks",
    "tests/distributed/test_dspark.py": "gloo-ranks",
    "tests/distributed/test_failures.py": "gloo-ranks",
    "tests/distributed/test_nodes.py": "gloo-ranks",
    "tests/distributed/test_split.py": "gloo-ranks",
    "tests/distributed/test_wide.py": "gloo-ranks",
}


# The units that take longest, longest first (measured with `--durations=0`, 2 workers): they
# are handed out first, so that the last unit a worker starts is a short one. xdist's own order
# (most tests first) started the 8-rank files last, and one worker ran them alone at the end
# (the whole suite: 673 s in that order, 658 s in this one).
LONGEST_FIRST = (
    "gloo-ranks",
    "tests/deepseek_v41/model/test_model.py",
    "tiny-swa-planned",
    "tests/test_backend.py",
    "tiny-swa-ep8-fake-rank",
)


def _unit(path: str) -> str:
    return SHARED_COMPILES.get(path, path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the files of `SHARED_COMPILES` grouped, handed out in the order
    of the collection (`pytest_collection_modifyitems`: `LONGEST_FIRST`)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class SharedCompiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return _unit(path)

    return SharedCompiles(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--wide", action="store_true", help="run the tests marked wide (16 ranks and more)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked `wide` (16 gloo ranks and more: minutes on two cores) is skipped unless
    pytest runs with `--wide`. A test that reads torchair's source needs the package registry (`torchair_registry`
    downloads the torch_npu wheel once): marked `registry`, and skipped, with pip's reason,
    where the registry cannot be reached. The items are ordered by unit, `LONGEST_FIRST` first
    (a stable sort: within a unit, and among the other units, the collection's order)."""
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid.split("::")[0]), len(rank)))
    for item in items:
        if "torchair_registry" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.registry)
        if "wide" in item.keywords and not config.getoption("--wide"):
            item.add_marker(pytest.mark.skip(reason="16 ranks and more: `make test-wide`"))


def _load_tool(name: str) -> Any:
    """`tools/{name}.py` as a module (the tools are scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[name] = tool  # dataclasses look their module up
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="session")
def load_tool():
    """`load_tool(name)`: `tools/{name}.py` as a module."""
    return _load_tool


@functools.cache
def _plan(cfg: ModelConfig, options: tuple, world_size: int, rank: int, max_len: int) -> Any:
    return plan_rank(cfg, dict(options), world_size=world_size, rank=rank, max_len=max_len)


@pytest.fixture(scope="session")
def plan_once():
    """`planning.plan_rank`, memoised for the session on (config, options, world, rank,
    max_len): planning the same graph twice costs seconds and proves nothing new. The plan is
    shared: a test that changes it must restore it."""

    def plan(
        cfg: ModelConfig,
        options: dict,
        *,
        world_size: int,
        rank: int = 0,
        max_len: int = 64,
        progress: str | None = None,  # a tool's bar: none here
    ) -> Any:
        return _plan(cfg, tuple(sorted(options.items())), world_size, rank, max_len)

    return plan


@pytest.fixture(scope="session")
def torchair_registry():
    """tools/torchair_coverage.py and the converter registry it reads from torch-npu 2.13.0's
    torchair source (the wheel downloaded once into ~/.cache, never installed). Tests using it
    are skipped, with pip's reason, when the package registry cannot be reached."""
    tool = _load_tool("torchair_coverage")
    try:
        root = tool.fetch_torchair()
    except tool.RegistryUnreachable as error:
        pytest.skip(f"torchair's source is not reachable: {error}")
    return tool, tool.scan(root)
