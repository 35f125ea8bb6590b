"""Two nodes as users launch them: two `torchrun` invocations of 4 ranks each (`--nnodes 2
--node-rank R`, a static rendezvous at node 0's address), here on one host, running
`tools/verify_layout.py` (tiny-swa, one layer, tp=1, dp=8, ep=8: attention data-parallel, the
EP all-to-alls across both nodes). Every rank's logits and cache match the single-device model's at
the fp32 bound through a prefill, an uneven decode and a step with DP group 0 idle, and each
node compiles its program once: one rank of each node compiles, its three others load
(`runtime.host_cache`, keyed by node)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 2, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_four_ranks_match_one_device_and_compile_once_per_node(tmp_path):
    port = _free_port()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    summary = tmp_path / "ranks.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    nodes = [
        subprocess.Popen(
            [
                *torchrun,
                f"--nnodes={NODES}",
                f"--node-rank={node}",
                f"--nproc-per-node={PER_NODE}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(ROOT / "tools" / "verify_layout.py"),
                "--tp=1",
                "--ep=8",
                f"--json={summary}",
                "--timeout=240",
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(NODES)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in nodes]
    for node, (p, out) in enumerate(zip(nodes, outputs)):
        assert p.returncode == 0, f"node {node}:\n{out[-4000:]}"
    assert "every rank matches the single-device model" in outputs[0]

    ranks = json.loads(summary.read_text())
    assert [r["rank"] for r in ranks] == list(range(NODES * PER_NODE))
    by_node: dict[str, list[dict]] = {}
    for r in ranks:
        by_node.setdefault(r["node"], []).append(r)
        assert r["steps"][2]["rows"] == (0 if r["rank"] == 0 else 1), r["rank"]  # group 0 idle
        assert all(s["ok"] for s in r["steps"]) and r["cache_ok"], r
        assert r["layer_collectives"] == {"0": ["all_to_all(ep)", "all_to_all(ep)"]}, r["rank"]
    # the torchrun node ranks name the nodes: ranks 0-3 on node 0, 4-7 on node 1
    assert [[r["rank"] for r in rs] for rs in by_node.values()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [name.rsplit(".", 1)[1] for name in by_node] == ["node0", "node1"]
    for name, rs in by_node.items():
        compiled = sorted(r["host_cache"].get("compiled", 0) for r in rs)
        loaded = sorted(r["host_cache"].get("loaded", 0) for r in rs)
        assert compiled == [0, 0, 0, 1] and loaded == [0, 1, 1, 1], (name, compiled, loaded)
