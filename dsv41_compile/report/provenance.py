"""What a measurement ran on: the header of a docs/benchmarks.md block, printed by the tools
that measure (`tools/bench*.py`, `comm_report.py`, `memory_plan.py`) before their figures."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["provenance"]


def _commit(root: Path) -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown (not a git checkout)"
    return sha + (" with uncommitted changes" if git("status", "--porcelain", "--", ".") else "")


def _memory_gib() -> str:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return "? GiB"
    return f"{pages * size / 2**30:.0f} GiB"


def provenance(argv: list[str] | None = None, *, kind: str = "Measured") -> str:
    """`- Measured: <date>, commit <sha>` / `- Machine: ...` / `- Command: ...` for the running
    tool (`argv`: its command line, `sys.argv` by default). `kind` says what the figures are
    (docs/benchmarks.md): "Measured" (ran and timed here), "Counted" (bytes read from planned
    graphs), "Predicted" (the step-time model's price on a device not here)."""
    argv = list(sys.argv if argv is None else argv)
    root = Path(__file__).resolve().parents[2]
    script = Path(argv[0]).resolve()
    shown = str(script.relative_to(root)) if script.is_relative_to(root) else argv[0]
    gpu = "a GPU" if torch.cuda.is_available() else "no GPU"
    return "\n".join(
        [
            f"- {kind}: {datetime.date.today().isoformat()}, commit `{_commit(root)}`",
            f"- Machine: {os.cpu_count()}-core CPU, {_memory_gib()}, {gpu}, torch "
            f"{torch.__version__}",
            f"- Command: `.venv/bin/python {' '.join([shown, *argv[1:]])}`",
        ]
    )
