"""`testing.snapshot.rewritten_program`, a researcher's snapshot of their rewritten program, and
the README's "Pin your rewritten graph" example, copied from the README: pinned with
`EXPECTTEST_ACCEPT`, then checked in another process."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41_compile.deepseek_v41 import DeepseekV41
from dsv41_compile.deepseek_v41.testing.presets import compile_config
from dsv41_compile.testing.snapshot import rewritten_program

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_example() -> str:
    section = README.read_text().split("## Pin your rewritten graph", 1)[1]
    (code,) = re.findall(r"```python\n(# test_my_model\.py.*?)```", section, re.S)
    return code


def _snapshot(edit: bool) -> dict[str, str]:
    """The README's call of its model with two layers (3 Sinkhorn iterations: shorter to
    trace), both whole, by region; `edit`: the README's edit, in layer 1 (its FFN norm a
    LayerNorm)."""
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", (("n_layers", 2),)))
    if edit:
        model.layers[1].ffn_norm = torch.nn.LayerNorm(64)
    batch = (torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]),
             torch.tensor([0, 0, 0, 1, 1]))  # fmt: skip
    text = rewritten_program(
        model, (*batch, model.new_cache(4, 32)), {"tp": 4, "ep": 8}, world_size=8,
        regions=["layers.0", "layers.1"], token_inputs=batch,
    )  # fmt: skip
    return dict(
        (region, f"# {region}\n{body}")
        for region, body in re.findall(r"# (layers\.\d)\n(.*?)(?=\n\n# layers|\Z)", text, re.S)
    )


_TEXTS: dict[bool, dict[str, str]] = {}


def _texts(edit: bool) -> dict[str, str]:
    if edit not in _TEXTS:
        _TEXTS[edit] = _snapshot(edit)
    return _TEXTS[edit]


def test_an_edit_changes_its_layers_lines_only():
    """The LayerNorm in layer 1's FFN changes layer 1's text and not a character of layer 0's.
    In layer 1, names are positions, so the lines after the norm are renumbered; with the
    names set aside, what changed is the norm's ops alone (RMSNorm's five for LayerNorm's
    two), nothing of a collective."""
    plain, edited = _texts(False), _texts(True)
    assert sorted(plain) == sorted(edited) == ["layers.0", "layers.1"]
    assert edited["layers.0"] == plain["layers.0"]
    assert edited["layers.1"] != plain["layers.1"]

    def unnamed(text: str) -> list[str]:
        return [re.sub(r"\b(v|in)\d+\b", "v", line) for line in text.splitlines()]

    changed = [
        line[2:]
        for line in difflib.ndiff(unnamed(plain["layers.1"]), unnamed(edited["layers.1"]))
        if line[:2] in ("+ ", "- ")
    ]
    assert sorted(line.split(" = ")[1].split("(")[0] for line in changed) == sorted(
        ["pow", "mean", "add", "rsqrt", "mul", "mul", "native_layer_norm", "getitem"]
    ), changed
    for text in (*plain.values(), *edited.values()):
        assert not re.search(r"0x[0-9a-f]{6,}|/home/|/work/|/tmp/|\bu\d{2,}\b", text)


def test_the_text_names_placements_shapes_in_t_and_reasons():
    text = _texts(True)["layers.1"]
    assert re.search(r"all_gather_into_tensor\(.*'tp'\)  # f32\[4\*\(\(\(T\+3\)//4\)\), 64\]  <- "
                     r"S\(0\) -> R: ", text)  # fmt: skip
    assert "<- EP dispatch (padded, per rank)" in text and "8*Tl_max" in text
    assert " S(0) f32[((T+3)//4), 64]" in text


def test_a_region_the_program_lacks_is_an_error():
    torch.manual_seed(0)
    model = DeepseekV41(compile_config("tiny-swa", (("n_layers", 1),)))
    batch = (torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"no op in region 'layers\.7'"):
        rewritten_program(model, (*batch, model.new_cache(1, 8)), {"tp": 2}, world_size=2,
                          regions=["layers.7"])  # fmt: skip


@pytest.mark.slow
def test_the_readme_example_pins_the_program_and_another_process_checks_it(tmp_path, monkeypatch):
    """The README's example, copied from it: run once with EXPECTTEST_ACCEPT (here in this
    process), it writes the text -- the edited layer's lines next to its collectives -- into
    the test file; run again in a fresh process without it, it passes: the same text from
    another process."""
    path = tmp_path / "test_my_model.py"
    path.write_text(_readme_example())
    namespace = {"__name__": "test_my_model", "__file__": str(path)}
    monkeypatch.setenv("EXPECTTEST_ACCEPT", "1")  # expecttest reads it at each assertion
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    case = namespace["PinMyModel"]("test_my_layer_talks_where_i_expect")
    result = case.defaultTestResult()
    case.run(result)
    assert result.wasSuccessful(), result.errors + result.failures
    monkeypatch.delenv("EXPECTTEST_ACCEPT")
    pinned = path.read_text()
    written = pinned.split('self.assertExpectedInline(text, """', 1)[1].split('""")')[0]
    assert written.lstrip("\\\n").startswith("# layers.0\n"), written[:80]
    assert "_c10d_functional.all_gather_into_tensor" in written and "\n...\n" in written
    # the README shows a line of that text: it is one
    section = README.read_text().split("## Pin your rewritten graph", 1)[1]
    (shown,) = re.findall(r"```\n(v\d+ = _c10d.*?), \.\.\.\n```", section)
    assert any(line.startswith(shown) for line in written.splitlines()), shown
    env = {k: v for k, v in os.environ.items() if k != "EXPECTTEST_ACCEPT"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert path.read_text() == pinned
