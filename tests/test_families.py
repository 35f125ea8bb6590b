"""Model families are plug-ins: a distribution declares its adapter in the entry-point group
`dsv41_compile.families` and the backend finds it, as it finds the built-in DeepSeek V4.1
family (this package's pyproject.toml). Here the toy family is installed from outside the
package -- a distribution of its own on the path, with its metadata and one module -- and a
fresh process lists it, compiles it on a fake rank and plans it, with nothing registered by
hand."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PLUGIN = """\
from dsv41_compile.testing.toy import ToyAdapter

TOY = ToyAdapter()
"""

CHECK = """\
import torch
from dsv41_compile.families import list_families
from dsv41_compile.planning import plan_rank
from dsv41_compile.testing.fake_rank import compile_model_on_fake_rank
from dsv41_compile.testing.toy import ToyConfig, ToyLM

print(list_families())
gm, ctx, out = compile_model_on_fake_rank(ToyLM(), (torch.arange(8),), {"tp": 4})
print(ctx.adapter.name, tuple(out.shape))
gm, ctx, _ = plan_rank(ToyConfig(), {"tp": 4}, world_size=8)
print(ctx.adapter.name, ctx.mesh.world_size)
"""


def test_a_family_installed_from_outside_is_found_through_its_entry_point(tmp_path):
    (tmp_path / "toy_plugin.py").write_text(PLUGIN)
    info = tmp_path / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [dsv41_compile.families]
            toy = toy_plugin:TOY
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-c", CHECK],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # the declared families, the latest first: the backend asks the toy before DeepSeek V4.1
    assert sorted(eval(lines[0])) == ["deepseek_v41", "toy_lm"]
    assert lines[1:] == ["toy_lm (8, 64)", "toy_lm 8"]


def test_the_built_in_family_is_declared_not_imported():
    """`import dsv41_compile` imports no family; the first question to the registry loads the
    declared ones."""
    code = (
        "import sys, dsv41_compile\n"
        "print('dsv41_compile.deepseek_v41' in sys.modules)\n"
        "from dsv41_compile.families import list_families\n"
        "print(list_families(), 'dsv41_compile.deepseek_v41' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["False", "['deepseek_v41'] True"]


def test_no_family_known_says_how_to_get_one(monkeypatch):
    """Without the package's entry points (a source tree on the path, never installed) and
    with nothing registered, the error says to install the package or register an adapter."""
    from dsv41_compile import families

    monkeypatch.setattr(families, "adapters", lambda: [])
    with pytest.raises(ValueError) as info:
        families.adapter_for(["w"], ["x"])
    assert str(info.value) == (
        "dsv41_sp knows no model family: no distribution declares one in the entry-point group "
        "'dsv41_compile.families' and none was registered. Install the package (`pip install "
        "-e .` in a source tree: its pyproject.toml declares DeepSeek V4.1) or register an "
        "adapter with dsv41_compile.families.register_adapter"
    )
