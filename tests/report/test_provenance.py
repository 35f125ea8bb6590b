"""The header the measuring tools print for docs/benchmarks.md: date, machine, command and the
commit the figures were measured at."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

from dsv41_compile.report.provenance import provenance

ROOT = Path(__file__).resolve().parents[2]


def test_the_header_names_the_date_machine_command_and_commit():
    lines = provenance([str(ROOT / "tools" / "memory_plan.py"), "--preset", "flash"]).splitlines()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    assert lines[0].startswith(f"- Measured: {datetime.date.today().isoformat()}, commit `{head}")
    assert lines[1].startswith("- Machine: ") and "-core CPU" in lines[1]
    assert lines[2] == "- Command: `.venv/bin/python tools/memory_plan.py --preset flash`"


def test_a_prediction_and_a_count_say_so():
    """The step-time model's figures are predictions, the planned graphs' bytes counts
    (docs/benchmarks.md's blocks say which)."""
    argv = [str(ROOT / "tools" / "step_time.py")]
    assert provenance(argv, kind="Predicted").startswith("- Predicted: ")
    assert provenance(argv, kind="Counted").startswith("- Counted: ")
