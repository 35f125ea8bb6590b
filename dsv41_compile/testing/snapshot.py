"""A model's rewritten per-rank program as text to pin in a test: a researcher's snapshot.

    from dsv41_compile.testing.snapshot import rewritten_program

    text = rewritten_program(model, (ids, positions, slots, cache), {"tp": 4, "ep": 8},
                             regions=["layers.1"], token_inputs=(ids, positions, slots))
    self.assertExpectedInline(text, '''...''')     # expecttest; EXPECTTEST_ACCEPT=1 fills it

The model (any registered family's, edited or not) is compiled with `dsv41_sp` as one rank of
a fake world in this process, and the compile stops after the pipeline: nothing runs, so the
model may hold seeded weights or none (built on the meta device, with meta inputs). No
process group, no device.

The text of each region asked for (a module path: `"layers.1"`, `"layers.1.ffn"`, `"head"`;
None: the whole program) is one line per op: its stable name (`v0, v1, ...` in the region's
order; `in0, in1, ...` for values made outside it; names the passes give, such as `ep_rows`),
the op and its arguments, the value's placement (`S(0)`, `R`, `P`) and local shape with sizes
in the graph's named symbols (`T`, `Tl`, `Tl_max`), and for each collective its mesh axis and
the reason it is there (the placements it converts and the op that needs them, or the cut
that chose it). Nothing depends on the run or the machine: node counters, data-dependent size
symbols (`u7`) and backed ones (`s3`) are renumbered by first appearance in each region, the
nodes named in runtime assertions are left out, and no path, address or time measured
appears. A reason of a cut chosen by time quotes the device model's prediction (docs/
devices.md), not a measurement: it changes with the `device` option or the device table.

An edit of one region changes that region's text only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from dsv41_compile.planning import plan_model
from dsv41_compile.report.dump import graph_labels
from dsv41_compile.report.graph_printer import format_graph
from dsv41_compile.testing.fake_rank import collective_windows

__all__ = ["rewritten_program"]

_SYMBOLS = (re.compile(r"\bu\d+\b"), re.compile(r"\bs\d+\b"))
_ASSERTED_NODE = re.compile(r" on node '[^']*'")


def rewritten_program(
    model: torch.nn.Module,
    args: Sequence[Any],
    options: dict[str, Any],
    *,
    regions: Sequence[str] | None = None,
    world_size: int = 8,
    rank: int = 0,
    token_inputs: Sequence[torch.Tensor] = (),
    kwargs: dict[str, Any] | None = None,
    around_collectives: int | None = None,
) -> str:
    """Rank `rank`'s rewritten program of `model(*args, **kwargs)` compiled with `options` in
    a fake world of `world_size` ranks, as stable text (the module docstring): the `regions`
    asked for, each headed `# <region>`, or the whole program. `token_inputs` are marked with
    `mark_token_dim` (one program for every T, as a serving loop compiles it). With
    `around_collectives=n`, only the lines within n of a collective (`...` between): where a
    region talks and what it hands over."""
    with torch.no_grad():  # an inference program, whatever a new module's parameters say
        gm, ctx = plan_model(
            model, args, options, world_size=world_size, rank=rank, token_inputs=token_inputs,
            kwargs=kwargs,
        )  # fmt: skip
    labels, groups = graph_labels(ctx)
    texts = []
    for region in regions if regions is not None else [None]:
        text = format_graph(gm, labels=labels, groups=groups, region=region, stable_names=True)
        if not text:
            raise ValueError(
                f"the rewritten program has no op in region {region!r}: name a module of the "
                "model (e.g. 'layers.1', 'layers.1.ffn', 'head')"
            )
        text = _stable(text)
        if around_collectives is not None:
            text = collective_windows(text, around_collectives)
        texts.append(text if region is None else f"# {region}\n{text}")
    return "\n\n".join(texts)


def _stable(text: str) -> str:
    """`text` without what a run or an earlier region decides: the size symbols renumbered by
    first appearance, the nodes a runtime assertion names left out."""
    text = _ASSERTED_NODE.sub("", text)
    for pattern in _SYMBOLS:
        text = _renumbered(pattern, text)
    return text


def _renumbered(pattern: re.Pattern[str], text: str) -> str:
    """`text` with the symbols `pattern` matches (`u7`) named by first appearance (`u0`)."""
    names: dict[str, str] = {}
    prefix = pattern.pattern[2]
    return pattern.sub(lambda m: names.setdefault(m.group(), f"{prefix}{len(names)}"), text)
