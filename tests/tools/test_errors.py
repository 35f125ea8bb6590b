"""An error met through a tool is the project's message and its fix, not Dynamo's traceback
(`report.cli.run`); `--traceback` raises it whole. Every tool ends through `run` and prints its
whole docstring for `--help` (`report.cli.tool_parser`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41_compile.report.cli import describe, run

TOOLS = Path(__file__).resolve().parents[2] / "tools"
TP3 = (
    "tp=3 does not divide this model's attention: it shards its 8 heads and 4 output groups "
    "over tp; choose tp in [1, 2, 4]"
)
HINT = "(run with --traceback for the whole traceback)"


def _run_tool(tool, argv, monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        run(tool.main)
    return exit_.value.code


def test_a_backend_error_through_explain_is_the_projects_message(load_tool, monkeypatch, capsys):
    tool = load_tool("explain")
    argv = ["explain.py", "--preset", "tiny-swa", "--tp", "3", "--ep", "1"]
    assert _run_tool(tool, argv, monkeypatch) == 1
    err = capsys.readouterr().err
    assert err == f"explain.py: error: {TP3}\n{HINT}\n"
    monkeypatch.setattr(sys, "argv", [*argv, "--traceback"])
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        run(tool.main)
    assert describe(info.value) == TP3


def test_another_error_is_named_with_its_type(load_tool, monkeypatch, capsys):
    """An error that is neither a user's mistake nor ours, met through decode.py: its type
    and message."""
    tool = load_tool("decode")
    assert _run_tool(tool, ["decode.py", "--checkpoint", "/nonexistent"], monkeypatch) == 1
    err = capsys.readouterr().err
    assert err.startswith("decode.py: error: FileNotFoundError: ") and "Traceback" not in err


@pytest.mark.slow
def test_every_rank_under_torchrun_prints_the_message(tmp_path):
    """verify_layout.py on 3 gloo ranks with tp=3: a rank that fails prints the message, its
    rank named, and exits 1 (torchrun ends the others when the first exits: some may not get
    to print); no Dynamo frame is printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--master-port", "29631", str(TOOLS / "verify_layout.py"), "--tp", "3", "--ep", "1",
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors and all(
        line in [f"verify_layout.py (rank {r}): error: {TP3}" for r in range(3)] for line in errors
    ), errors
    assert f"{errors[0]}\n{HINT}" in done.stderr
    assert "BackendCompilerFailed" not in done.stderr and "_dynamo" not in done.stderr


def test_every_tool_ends_through_run_and_helps_with_its_whole_docstring():
    for path in sorted(TOOLS.glob("*.py")):
        source = path.read_text()
        if path.name != "npu_smoke.py":  # its own table and exit status, on NPUs
            assert source.rstrip().endswith('if __name__ == "__main__":\n    run(main)'), path
        assert "tool_parser(__doc__)" in source, path
    done = subprocess.run(
        [sys.executable, str(TOOLS / "npu_smoke.py"), "--help"], capture_output=True, text=True
    )
    assert done.returncode == 0
    assert "the symbolic token count under GE." in done.stdout  # the docstring's last words
