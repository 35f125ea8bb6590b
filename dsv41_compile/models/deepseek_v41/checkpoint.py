"""The released checkpoint's tensors and this model's parameters, both ways.

`checkpoint_layout(model)` names every tensor a checkpoint of `model` holds, in the released
layout (the official inference names, no `model.` prefix), with the parameter it fills and its
format:

- `"fp8"`: `X.weight` float8_e4m3fn plus `X.scale` (the attention projections `wq_a`, `wq_b`,
  `wkv`, `wo_a`, `wo_b`, the indexer's `wq_b`, the shared expert, there `shared_experts`);
- `"fp4"`: the routed experts, one `ffn.experts.{e}.w{1,2,3}.weight` + `.scale` per expert,
  stacked here into `ffn.experts.w{1,2,3}[e]`;
- `"fp32"`: the mHC parameters (`hc_attn_fn` is this model's `hc_attn.fn`), the sink, the
  gate's selection bias;
- `"bf16"`: the rest (embedding, head, norms, gate, compressors, the indexer's other weights).

`load_checkpoint(model, path)` fills a single-device model from a checkpoint directory
(`model.safetensors.index.json` and its shards), decoding FP8 / FP4 to each parameter's dtype;
`write_checkpoint(model, path)` writes one (tools/make_checkpoint.py). Loading is strict: a
missing tensor, a wrong dtype or shape, a scale that does not fit its weight or a NaN scale is
an error naming the tensor and its file; tensors of the parts this model lacks (Engram, the
DSpark draft blocks, the vision tower) are refused unless `skip_unimplemented_parts=True`, and
any other tensor the model does not know is an error.

Not here yet: each rank reading only its own slices (the backend's `checkpoint` option).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dsv41_compile.models.deepseek_v41.quant import CODECS

__all__ = [
    "INDEX",
    "CheckpointEntry",
    "checkpoint_layout",
    "load_checkpoint",
    "write_checkpoint",
]

INDEX = "model.safetensors.index.json"

_FP8 = re.compile(
    r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_expert\.w[123])"
    r"\.weight"
)
_FP32 = re.compile(r"layers\.\d+\.(hc_(attn|ffn)\.(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias)")
_EXPERTS = re.compile(r"(layers\.\d+\.ffn\.experts)\.(w[123])")
_UNIMPLEMENTED = re.compile(r"^(mtp\.|vision\.|aligner\.|image_)|\.engram\.|\.ffn\.gate\.bias_vl$")
_STORED = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8, "fp32": torch.float32}


@dataclass(frozen=True)
class CheckpointEntry:
    """One weight of the checkpoint: the parameter it fills (`expert`: its row of a stacked
    expert parameter) and how it is stored."""

    param: str
    fmt: str
    """"fp8", "fp4" (each with a `.scale` sibling), "fp32" or "bf16"."""
    expert: int | None = None

    @property
    def stored_dtype(self) -> torch.dtype:
        return _STORED.get(self.fmt, torch.bfloat16)

    @property
    def quantized(self) -> bool:
        """Stored in a `quant.CODECS` format, with an `X.scale` sibling."""
        return self.fmt in CODECS

    def part_of(self, value: torch.Tensor) -> torch.Tensor:
        """The part of the parameter `value` this weight is (its expert's row, or all of it)."""
        return value if self.expert is None else value[self.expert]


def _checkpoint_name(param: str) -> str:
    name = re.sub(r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2", param)
    return name.replace(".ffn.shared_expert.", ".ffn.shared_experts.")


def checkpoint_layout(model: nn.Module) -> dict[str, CheckpointEntry]:
    """Checkpoint weight name -> entry, for every parameter of `model` (scales not listed:
    each fp8 / fp4 `X.weight` has one, `X.scale`)."""
    layout: dict[str, CheckpointEntry] = {}
    for param, value in model.state_dict().items():
        if match := _EXPERTS.fullmatch(param):
            for e in range(value.shape[0]):
                name = f"{match[1]}.{e}.{match[2]}.weight"
                layout[name] = CheckpointEntry(param, "fp4", e)
        elif _FP8.fullmatch(param):
            layout[_checkpoint_name(param)] = CheckpointEntry(param, "fp8")
        elif _FP32.fullmatch(param):
            layout[_checkpoint_name(param)] = CheckpointEntry(param, "fp32")
        else:
            layout[_checkpoint_name(param)] = CheckpointEntry(param, "bf16")
    return layout


def _scale_name(name: str) -> str:
    return name.removesuffix(".weight") + ".scale"


def write_checkpoint(model: nn.Module, path: str | Path, *, files: int = 3) -> list[Path]:
    """`model`'s weights in the released format under `path` (created): FP8 / FP4 with their
    scales, the rest bf16 or fp32, spread over `files` shards `model-000NN-of-000MM.safetensors`
    and indexed by `model.safetensors.index.json`. The config is not written
    (`hf_config.config_to_hf`). Returns the shard paths."""
    from safetensors.torch import save_file

    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in checkpoint_layout(model).items():
        value = entry.part_of(state[entry.param])
        if entry.quantized:
            tensors[name], tensors[_scale_name(name)] = CODECS[entry.fmt].quantize(value)
        else:
            tensors[name] = value.to(entry.stored_dtype).contiguous()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    shards, weight_map, total = [], {}, 0
    for i in range(files):
        shard = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {
            n: tensors[n] for n in names[i * len(names) // files : (i + 1) * len(names) // files]
        }
        save_file(part, str(shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard.name)
        total += sum(t.numel() * t.element_size() for t in part.values())
        shards.append(shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX).write_text(json.dumps(index, indent=2))
    return shards


def _index(root: Path) -> dict[str, str]:
    index = root / INDEX
    if not index.exists():
        raise FileNotFoundError(
            f"{root}: no {INDEX}; a checkpoint directory holds the released index and its "
            "model-000NN-of-000MM.safetensors shards"
        )
    return json.loads(index.read_text())["weight_map"]


def load_checkpoint(
    model: nn.Module, path: str | Path, *, skip_unimplemented_parts: bool = False
) -> dict[str, int]:
    """Fill every parameter of the single-device `model` from the checkpoint directory `path`;
    returns the bytes read per file."""
    from safetensors import safe_open

    root = Path(path)
    weight_map = _index(root)
    layout = checkpoint_layout(model)
    expected = set(layout) | {_scale_name(n) for n, e in layout.items() if e.quantized}
    unknown = sorted(set(weight_map) - expected)
    parts = [n for n in unknown if _UNIMPLEMENTED.search(n)]
    others = [n for n in unknown if not _UNIMPLEMENTED.search(n)]
    if others:
        raise ValueError(
            f"{root / INDEX}: {len(others)} tensors this model does not have, e.g. "
            f"{others[:3]}: a checkpoint of another configuration?"
        )
    if parts and not skip_unimplemented_parts:
        raise ValueError(
            f"{root / INDEX}: {len(parts)} tensors of parts this model does not implement "
            f"(Engram, DSpark draft blocks, vision), e.g. {parts[:3]}. Its outputs would "
            "differ from the released model's. Pass skip_unimplemented_parts=True to load "
            "without them"
        )
    missing = sorted(expected - set(weight_map))
    if missing:
        raise ValueError(f"{root / INDEX}: missing {len(missing)} tensors, e.g. {missing[:3]}")

    params = model.state_dict(keep_vars=True)
    if any(p.is_meta for p in params.values()):
        raise ValueError(
            "load_checkpoint fills a model whose parameters exist (built on a real device); "
            "for a model on the meta device, each rank loading its own shards is the backend's "
            "job, which is not written yet"
        )
    filled: dict[str, int] = {}
    read: dict[str, int] = {}
    handles: dict[str, Any] = {}

    def tensor(name: str) -> torch.Tensor:
        shard = weight_map[name]
        if shard not in handles:
            handles[shard] = safe_open(str(root / shard), "pt")
        value = handles[shard].get_tensor(name)
        read[shard] = read.get(shard, 0) + value.numel() * value.element_size()
        return value

    with torch.no_grad():
        for name in sorted(layout, key=lambda n: weight_map[n]):  # one shard after another
            entry = layout[name]
            target = entry.part_of(params[entry.param])
            where = f"{name} ({weight_map[name]})"
            if entry.quantized and weight_map[_scale_name(name)] != weight_map[name]:
                where += f", its scale in {weight_map[_scale_name(name)]}"
            value = tensor(name)
            want = list(target.shape)
            if entry.fmt == "fp4":  # two inputs per byte
                want[1] //= 2
            if value.dtype != entry.stored_dtype or list(value.shape) != want:
                raise ValueError(
                    f"{where}: {value.dtype} {list(value.shape)}, expected "
                    f"{entry.stored_dtype} {want}"
                )
            if entry.quantized:
                dequantize = CODECS[entry.fmt].dequantize
                value = dequantize(value, tensor(_scale_name(name)), target.dtype, where)
            target.copy_(value)
            filled[entry.param] = filled.get(entry.param, 0) + 1
    unfilled = sorted(set(params) - set(filled))
    if unfilled:  # a parameter no checkpoint name maps to: a bug of the layout
        raise AssertionError(f"checkpoint_layout left parameters unfilled: {unfilled}")
    return read
