"""The host cache shares a compile that makes Dynamo trace again: the other ranks of the host
trace again the same way, without compiling (`runtime.host_cache`); and it never serves a
program planned under other op rules."""

from __future__ import annotations

import torch
import torch._dynamo

from dsv41_compile.core.strategy import Strategy
from dsv41_compile.runtime.host_cache import STATS
from dsv41_compile.spmd.rules import RULES
from dsv41_compile.testing.torch_shims import fake_process_group
from dsv41_compile.testing.toy import ToyLM, toy_family


def compile_and_call(
    rank: int, model: ToyLM, tokens: torch.Tensor, **options: object
) -> dict[str, int]:
    """`model` compiled with `dynamic=True` and called as rank `rank` of a fake world of 8;
    what this rank added to the host cache's statistics."""
    before = STATS.copy()
    torch._dynamo.reset()
    with fake_process_group(world_size=8, rank=rank):
        compiled = torch.compile(
            model,
            backend="dsv41_sp",
            options={"tp": 4, "lowering": "eager", **options},
            dynamic=True,
        )
        assert compiled(tokens).shape == (tokens.shape[0], 64)
    return dict(STATS - before)


def test_a_restarted_trace_is_shared(tmp_path, monkeypatch):
    """The toy's `nn.Embedding` forward reads its float `norm_type`: under `dynamic=True`
    Dynamo makes it a symbolic input, AOTAutograd cannot turn it into a tensor, and Dynamo
    traces again with it specialised. The first rank compiles both traces (the first one's
    entry records the restart); the second loads both: it restarts without AOTAutograd."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold host cache
    model = ToyLM()
    tokens = torch.arange(8)
    with toy_family():
        assert compile_and_call(1, model, tokens) == {"compiled": 2}
        assert compile_and_call(2, model, tokens) == {"loaded": 2}


def test_a_dump_is_not_loaded_from_a_program_compiled_without_one(tmp_path, monkeypatch):
    """A program holds its graph's text only when it was compiled with a dump (printing flash's
    graph takes seconds): a rank asked for a dump compiles rather than load a program compiled
    without one, and one compiled with a dump is shared with the host's other dumping ranks."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    model = ToyLM()
    tokens = torch.arange(8)
    dump = tmp_path / "dump"
    with toy_family():
        assert compile_and_call(1, model, tokens) == {"compiled": 2}
        assert compile_and_call(2, model, tokens, dump_dir=str(dump)) == {"compiled": 2}
        assert compile_and_call(3, model, tokens, dump_dir=str(dump)) == {"loaded": 2}
    for rank in (2, 3):
        assert "_c10d_functional" in (dump / f"rank{rank}" / "graph.py").read_text()


def test_a_rule_registered_at_run_time_is_not_served_a_program_planned_without_it(
    tmp_path, monkeypatch
):
    """The key holds the op rules in force (`core.registry.code_fingerprint`): a rank with a
    rule of its own for an op the toy uses (registered at run time, outside the package's
    source) compiles, and a later rank without it loads the program planned before it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = ToyLM()
    tokens = torch.arange(8)
    relu = torch.ops.aten.relu.default

    def elementwise(node, given):  # placed as DTensor would: the input's placement
        return Strategy(inputs=tuple(given), outputs=(given[0],))

    with toy_family():
        assert compile_and_call(1, model, tokens) == {"compiled": 2}
        with RULES.restored():
            RULES.add(relu, elementwise)
            assert compile_and_call(2, model, tokens) == {"compiled": 2}
            assert compile_and_call(3, model, tokens) == {"loaded": 2}
        assert compile_and_call(4, model, tokens) == {"loaded": 2}


def test_each_node_compiles_for_its_own_ranks(tmp_path, monkeypatch):
    """Programs are kept per node (torchrun's `GROUP_RANK`): a rank of node 1 compiles though
    node 0 compiled the same program in the same cache directory, and loads it once node 1
    has it (tests/distributed/test_nodes.py launches two nodes)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = ToyLM()
    tokens = torch.arange(8)
    with toy_family():
        monkeypatch.setenv("GROUP_RANK", "0")
        assert compile_and_call(1, model, tokens) == {"compiled": 2}
        monkeypatch.setenv("GROUP_RANK", "1")
        assert compile_and_call(5, model, tokens) == {"compiled": 2}
        assert compile_and_call(6, model, tokens) == {"loaded": 2}
