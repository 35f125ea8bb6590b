"""Which ops of our rewritten per-rank graphs torchair can lower: a static check against
torchair's own source.

torchair ships inside the `torch_npu` wheel, which must never be installed here (without the
Ascend CANN toolkit it makes `import torch` fail). So this tool downloads the wheel
(`pip download --no-deps`, cached under ~/.cache/dsv41_compile), unpacks only
`torch_npu/dynamo/torchair/`, and reads, without importing anything from it:

- every `register_fx_node_ge_converter(op)` registration, classified as a real converter or a
  stub (a body that only raises "not implemented" / "not supported");
- the decomposition table torchair's own AOT step applies (`get_npu_default_decompositions`:
  e.g. `_c10d_functional.all_to_all_single` -> `npu_define.all_to_all_single_npu`, which has a
  converter) -- this holds when the graph reaches torchair through `get_npu_backend`.

It then plans the graphs `lowering="torchair"` hands over (`planning.plan_rank`: meta tensors,
a fake world of 8, tp=4; both layouts; ep=8 with the padded EP lowering, and ep=1), rewritten
for graph mode (`targets/npu_passes.py`), runs torchair's AOT step on each the way
`get_npu_backend` does (`testing.torchair_standin.aot_graph`: every CompositeImplicit op
decomposed), and lists every op of the result without a real converter (and not decomposed by
torchair's table; `operator.getitem` is the FX interpreter's own). Exit status 1 when any graph
has one. The exact EP lowering is not checked: it reads sizes on the host, and
`lowering="torchair"` refuses it (`BackendOptions`).

With `--released`, the models are as released: FP8 / FP4 weights with their scales and the
official numerics (graph mode maps them to torch_npu's MX ops; tiny then quantises its indexer
in blocks of 32 and splits wo_a over tp=4 in whole 32-row blocks: index_head_dim and
o_lora_rank 32).

    .venv/bin/python tools/torchair_coverage.py --preset tiny
    .venv/bin/python tools/torchair_coverage.py --preset tiny --released
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv41_compile.report.cli import run, tool_parser

TORCH_NPU = "torch-npu==2.13.0"
CACHE = Path.home() / ".cache" / "dsv41_compile" / "torch_npu-2.13.0"
TORCHAIR = "torch_npu/dynamo/torchair/"
KERNELS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
"""torch_npu's registration of its NPU kernels (generated from its op plugin's yaml)."""
STRUCTURAL = {"operator.getitem"}  # tuple unpacking: the FX interpreter's, not an op


class RegistryUnreachable(RuntimeError):
    """The wheel could not be downloaded (no package registry)."""


def fetch_torchair(cache: Path = CACHE) -> Path:
    """torchair's source directory, downloading and unpacking the wheel once (with the
    registration of torch_npu's kernels, `KERNELS`, beside it)."""
    root = cache / TORCHAIR
    if root.is_dir() and (cache / KERNELS).is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", TORCH_NPU, "-d", tmp, "-q"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("torch_npu-*.whl"))
        if result.returncode or not wheels:
            raise RegistryUnreachable(
                f"`pip download --no-deps {TORCH_NPU}` failed: {result.stderr.strip()[-500:]}"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith(TORCHAIR) and m.endswith(".py")]
            wheel.extractall(cache, [*members, KERNELS])
    return root


@dataclass(frozen=True)
class Registry:
    converters: dict[str, bool]
    """op name -> True for a real converter, False for a stub that only raises."""
    decomposed: dict[str, str]
    """op name -> what torchair's AOT decomposition table maps it to."""
    where: dict[str, str]
    """op name -> file:line of its (first) converter registration."""

    def status(self, op: str) -> str | None:
        """None when torchair can lower `op`, else why not."""
        if op in STRUCTURAL or self.converters.get(op) or op in self.decomposed:
            return None
        if op in self.converters:
            return f"stub converter ({self.where[op]})"
        return "no converter"


def scan(root: Path) -> Registry:
    converters: dict[str, bool] = {}
    where: dict[str, str] = {}
    decomposed: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        text = path.read_text(encoding="utf-8")
        if "register_fx_node_ge_converter" not in text and "default_decompositions" not in text:
            continue  # registers nothing: not worth parsing (most of torchair's files)
        with warnings.catch_warnings():  # its docstrings' invalid escapes are not ours
            warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
            tree = ast.parse(text, filename=str(path))
        functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(tree):
            registered: list[tuple[ast.expr, ast.FunctionDef | None, int]] = []
            if isinstance(node, ast.FunctionDef):
                registered += [
                    (d.args[0], node, d.lineno)
                    for d in node.decorator_list
                    if _calls(d, "register_fx_node_ge_converter") and d.args
                ]
            elif isinstance(node, ast.Call) and _calls(node.func, "register_fx_node_ge_converter"):
                # register_fx_node_ge_converter(op)(fn)
                if node.func.args and node.args and isinstance(node.args[0], ast.Name):
                    fn = functions.get(node.args[0].id)
                    registered.append((node.func.args[0], fn, node.lineno))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update"
                and ast.unparse(node.func.value) == "default_decompositions"
                and node.args
                and isinstance(node.args[0], ast.Dict)
            ):
                for key, value in zip(node.args[0].keys, node.args[0].values):
                    decomposed[_op_name(key)] = ast.unparse(value)
            for op_node, fn, line in registered:
                op = _op_name(op_node)
                if "{" in op:  # a code-generation template
                    continue
                real = fn is not None and not _is_stub(fn)
                converters[op] = converters.get(op, False) or real
                where.setdefault(op, f"{rel}:{line}")
    return Registry(converters, decomposed, where)


def _calls(node: ast.AST, name: str) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute) and func.attr == name
    )


def _op_name(node: ast.expr) -> str:
    # getattr(torch.ops.aten.zeros, "names", None) -> torch.ops.aten.zeros.names
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
    ):
        return f"{ast.unparse(node.args[0])}.{node.args[1].value}"
    return ast.unparse(node)


def _is_stub(fn: ast.FunctionDef) -> bool:
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    text = ast.unparse(body[0].exc)
    return "NotImplementedError" in text or "not implemented" in text or "not support" in text


@dataclass(frozen=True)
class NpuKernels:
    """The ops torch_npu has an NPU kernel of its own for (`KERNELS`), read without importing
    it: aten ops by name (a bare name stands for every overload) or name.overload, and torch_npu's
    own (`torch.ops.npu.*`). An op without one may still run on NPU tensors through a
    composite kernel: `targets.npugraph_ex.npu_kernel_gaps` follows those."""

    aten: frozenset[str]
    npu: frozenset[str]

    def has_kernel(self, op: Any) -> bool:
        """Whether torch_npu registers an NPU kernel of `op` (an `OpOverload`)."""
        names = (op.name().split("::")[-1], str(op).split(".")[1])  # name(.overload), name
        listed = {"aten": self.aten, "npu": self.npu}.get(op.namespace, frozenset())
        return any(name in listed for name in names)


def scan_kernels(path: Path) -> NpuKernels:
    """`NpuKernels` of torch_npu's registration file."""
    aten: set[str] = set()
    npu: set[str] = set()
    section = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith((" ", "-")):
            section = line.rstrip(":")
            continue
        found = re.match(r"^(?:- |  )(?:func: )?([A-Za-z_][\w.]*)(?:\(|$)", line)
        if found is None or (line.startswith("  ") and "func:" not in line):
            continue
        if section in ("supported", "autograd", "symint", "quant"):
            aten.add(found.group(1))
        elif section == "custom":
            npu.add(found.group(1))
    return NpuKernels(frozenset(aten), frozenset(npu))


def unsupported(ops: Counter[str], registry: Registry) -> dict[str, tuple[int, str]]:
    """The ops of `ops` (name -> count) torchair cannot lower: op -> (count, why)."""
    return {
        op: (count, why)
        for op, count in sorted(ops.items())
        if (why := registry.status(op)) is not None
    }


CONFIGS = {
    "sp ep=8 padded": {"layout": "sp", "ep": 8, "ep_dispatch": "padded"},
    "replicated ep=8 padded": {"layout": "replicated", "ep": 8, "ep_dispatch": "padded"},
    "sp ep=1": {"layout": "sp", "ep": 1},
    "replicated ep=1": {"layout": "replicated", "ep": 1},
}


def check(
    models: dict[str, Any],
    registry: Registry | NpuKernels,
    configs: list[str] | None = None,
) -> dict[str, dict[str, tuple[int, str]]]:
    """Per graph ("model config"): unsupported op -> (count, why). `models`: name ->
    `ModelConfig`. The graphs are `lowering="torchair"`'s, or with `NpuKernels`
    `lowering="npugraph_ex"`'s."""
    from dsv41_compile.planning import plan_rank
    from dsv41_compile.targets.npugraph_ex import npu_kernel_gaps
    from dsv41_compile.testing.torchair_standin import aot_graph, graph_ops, register_npu_ops

    register_npu_ops()  # torch_npu's npu_grouped_matmul, which graph mode emits
    lowering = "npugraph_ex" if isinstance(registry, NpuKernels) else "torchair"
    report = {}
    for model, cfg in models.items():
        for name in configs or CONFIGS:
            options = {"tp": 4, "lowering": lowering, **CONFIGS[name]}
            gm, ctx, _ = plan_rank(cfg, options, world_size=8)
            aot = aot_graph(gm, ctx.local_inputs(gm))
            if isinstance(registry, NpuKernels):
                gaps = npu_kernel_gaps(aot, registry.has_kernel)
                why = "no NPU kernel in torch_npu"
                report[f"{model} {name}"] = {op: (len(n), why) for op, n in sorted(gaps.items())}
            else:
                report[f"{model} {name}"] = unsupported(graph_ops(aot), registry)
    return report


def model_config(preset: str, *, released: bool = False) -> Any:
    """The preset's config; `released`: its weights as released and the official numerics."""
    from dsv41_compile.deepseek_v41.model import ModelConfig
    from dsv41_compile.deepseek_v41.testing.presets import AS_RELEASED

    if not released:
        return ModelConfig.from_name(preset)
    overrides = dict(AS_RELEASED)
    if not preset.startswith("tiny"):  # flash's own widths split and quantise in whole blocks
        overrides = {k: overrides[k] for k in ("dtype", "numerics", "weight_format")}
    return ModelConfig.from_name(preset, **overrides)


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument(
        "--preset", action="append", choices=("tiny", "tiny-swa", "flash"), help="repeatable"
    )
    parser.add_argument("--config", action="append", choices=tuple(CONFIGS), help="repeatable")
    parser.add_argument("--torchair", type=Path, help="an unpacked torchair directory to read")
    parser.add_argument(
        "--lowering",
        choices=("torchair", "npugraph_ex"),
        default="torchair",
        help="torchair: GE converters; npugraph_ex: torch_npu's NPU kernels",
    )
    parser.add_argument(
        "--released",
        action="store_true",
        help="the models as released: FP8 / FP4 weights and the official numerics",
    )
    args = parser.parse_args()
    root = args.torchair or fetch_torchair()
    registry: Registry | NpuKernels
    if args.lowering == "npugraph_ex":
        path = root.parents[2] / KERNELS
        registry = scan_kernels(path)
        print(
            f"torch_npu's kernels at {path}: {len(registry.aten)} aten entries, "
            f"{len(registry.npu)} torch.ops.npu ops"
        )
    else:
        registry = scan(root)
        real = sum(registry.converters.values())
        print(
            f"torchair at {root}: {len(registry.converters)} ops registered, {real} with a "
            f"real converter; AOT decompositions: {', '.join(sorted(registry.decomposed))}"
        )
    print(f"not checked: ep_dispatch='exact' (host reads; lowering='{args.lowering}' refuses it)")
    missing = 0
    for preset in args.preset or ["tiny", "flash"]:
        for config in args.config or CONFIGS:  # one graph at a time: flash plans take minutes
            models = {preset: model_config(preset, released=args.released)}
            for graph, unsupported in check(models, registry, [config]).items():
                print(f"{graph}: " + ("all ops lowerable" if not unsupported else ""), flush=True)
                for op, (count, why) in unsupported.items():
                    print(f"  {op:<60} x{count:<4} {why}")
                missing += len(unsupported)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    run(main)
