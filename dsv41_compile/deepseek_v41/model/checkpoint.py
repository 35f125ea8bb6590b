"""The released checkpoint's tensors and this model's parameters, both ways.

`checkpoint_layout(model)` names every tensor a checkpoint of `model` holds, in the released
layout (the official inference names, no `model.` prefix), with the parameter it fills and its
format:

- `"fp8"`: `X.weight` float8_e4m3fn plus `X.scale` (the attention projections `wq_a`, `wq_b`,
  `wkv`, `wo_a`, `wo_b`, the indexer's `wq_b`, the shared expert, there `shared_experts`,
  Engram's `wkv`); a model holding them as released (`weight_format="released"`) keeps both as
  stored (`"e4m3"` into `X.weight`, `"e8m0"` into `X.scale`);
- `"e4m3"` / `"e8m0"`: an Engram table's rows and their scales, kept as stored;
- `"fp4"`: the routed experts, one `ffn.experts.{e}.w{1,2,3}.weight` + `.scale` per expert,
  stacked here into `ffn.experts.w{1,2,3}[e]`; a model holding them as released
  (`weight_format="released"`) keeps the codes (`"fp4_codes"`, into `ffn.experts.w1[e]`) and
  the scales (`"e8m0"`, into `ffn.experts.w1_scale[e]`) as stored;
- `"fp32"`: the mHC parameters (`hc_attn_fn` is this model's `hc_attn.fn`), the sink, the
  gate's selection bias;
- `"bf16"`: the rest (embedding, head, norms, gate, compressors, the indexer's other weights).

`load_checkpoint(model, path)` fills a single-device model from a checkpoint directory
(`model.safetensors.index.json` and its shards), decoding FP8 / FP4 to each parameter's dtype;
`write_checkpoint(model, path)` writes one (tools/make_checkpoint.py). Loading is strict: a
missing tensor, a wrong dtype or shape, a scale that does not fit its weight or a NaN scale is
an error naming the tensor and its file; tensors of the parts this model lacks (the vision
tower; the DSpark draft blocks of a model built without them) are refused unless
`skip_unimplemented_parts=True`, and any other tensor the model does not know is an error. The
DSpark stages (`model.mtp.layers.i`) are the checkpoint's `mtp.i`; the drafter's `main_proj`
/ `main_norm` are stored under `mtp.0`, its `norm` and heads under the last stage, and its
embedding and head are the backbone's. Engram's token map is read from the checkpoint's
`tokenizer.json` (`token_map`).

`read_weights(path, weights)` reads only the given slices of the given parameters (what the
backend's `checkpoint` option reads on each rank).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from dsv41_compile.deepseek_v41.model.ngram import compressed_token_map
from dsv41_compile.deepseek_v41.model.quant import BLOCK, CODECS
from dsv41_compile.storage import has_no_weights

__all__ = [
    "INDEX",
    "CheckpointEntry",
    "TensorSlice",
    "WantedWeight",
    "checkpoint_layout",
    "load_checkpoint",
    "read_weights",
    "write_checkpoint",
]

INDEX = "model.safetensors.index.json"


class TensorSlice(Protocol):
    """A part of dim `dim` of a parameter: `bounds(size)` are its first and past-the-end
    indices (a rank's tp shard; the experts an EP rank holds)."""

    @property
    def dim(self) -> int: ...

    def bounds(self, size: int) -> tuple[int, int]: ...


class WantedWeight(NamedTuple):
    """A parameter `read_weights` reads: its FQN, global shape, dtype, and the slice of it to
    read (None: all of it). The backend's `core.adapter.WeightInput` has these fields."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    slice: TensorSlice | None = None


class _Wanted(Protocol):
    """What `read_weights` reads of a weight: `WantedWeight`'s fields (the backend's
    `core.adapter.WeightInput` has them too)."""

    @property
    def fqn(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def slice(self) -> TensorSlice | None: ...


_FP8 = re.compile(
    r"((?:mtp\.)?layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
    r"|ffn\.shared_expert\.w[123]|engram\.wkv)|mtp\.main_proj)\.(weight|scale)"
)
_FP32 = re.compile(
    r"(?:mtp\.)?layers\.\d+\.(hc_(attn|ffn)\.(fn|base|scale)|attn\.attn_sink|ffn\.gate\.bias)"
)
_EXPERTS = re.compile(r"((?:mtp\.)?layers\.\d+\.ffn\.experts)\.(w[123])(_scale)?")
_SHARED = re.compile(r"mtp\.(embed|head)\.weight")
"""The drafter's views of the backbone's embedding and head: stored once, as the backbone's."""
_STAGE = re.compile(r"mtp\.layers\.(\d+)\.")
_TABLE = re.compile(r"layers\.\d+\.engram\.embed\.(weight|scale)")
_UNIMPLEMENTED = re.compile(r"^(vision\.|aligner\.|image_)|\.ffn\.gate\.bias_vl$")
_DRAFTER = re.compile(r"^mtp\.")
_STORED = {
    "fp8": torch.float8_e4m3fn,
    "fp4": torch.int8,
    "fp4_codes": torch.int8,
    "fp32": torch.float32,
    "e4m3": torch.float8_e4m3fn,
    "e8m0": torch.float8_e8m0fnu,
}
TOKEN_MAP = "engram_hash.token_map"
"""The parameter read from the checkpoint's tokenizer, not from its tensors."""
TOKENIZER = "tokenizer.json"


@dataclass(frozen=True)
class CheckpointEntry:
    """One weight of the checkpoint: the parameter it fills (`expert`: its row of a stacked
    expert parameter) and how it is stored."""

    param: str
    fmt: str
    """"fp8", "fp4" (each with a `.scale` sibling: decoded to the parameter's dtype), "fp32",
    "bf16", or kept as stored: "e4m3" / "e8m0" (an Engram table's rows or an FP8 linear's
    weight, and their scales), "fp4_codes" / "e8m0" (a routed expert's packed FP4 weight and
    its scale)."""
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


def _checkpoint_name(param: str, last_stage: int = 0) -> str:
    """The checkpoint's name of `param`; a DSpark stage `mtp.layers.i` is `mtp.i`, the
    drafter's input projection belongs to the first stage and its heads to the last."""
    name = re.sub(r"\.hc_(attn|ffn)\.(fn|base|scale)$", r".hc_\1_\2", param)
    name = name.replace(".ffn.shared_expert.", ".ffn.shared_experts.")
    name = _STAGE.sub(r"mtp.\1.", name)
    name = re.sub(r"^mtp\.(main_proj|main_norm)\.", r"mtp.0.\1.", name)
    return re.sub(r"^mtp\.(norm|markov_head|confidence_head)\.", rf"mtp.{last_stage}.\1.", name)


def checkpoint_layout(
    model: nn.Module | Mapping[str, Sequence[int]],
) -> dict[str, CheckpointEntry]:
    """Checkpoint weight name -> entry, for every parameter of `model` (or of a model with
    these parameter shapes, FQN -> shape). Scales are not listed: each fp8 / fp4 `X.weight`
    has one, `X.scale`."""
    layout: dict[str, CheckpointEntry] = {}
    shapes = (
        {k: v.shape for k, v in model.state_dict().items()}
        if isinstance(model, nn.Module)
        else model
    )
    stages = [int(m[1]) for p in shapes if (m := _STAGE.match(p))]
    last = max(stages, default=0)
    for param, shape in shapes.items():
        if param == TOKEN_MAP or _SHARED.fullmatch(param):
            continue  # from the tokenizer (`token_map`); the backbone's
        if _TABLE.fullmatch(param):
            fmt = "e4m3" if param.endswith(".weight") else "e8m0"
            layout[param] = CheckpointEntry(param, fmt)
        elif match := _EXPERTS.fullmatch(param):
            released = f"{match[1]}.{match[2]}_scale" in shapes  # weight_format="released"
            fmt = "e8m0" if match[3] else "fp4_codes" if released else "fp4"
            suffix = "scale" if match[3] else "weight"
            for e in range(shape[0]):
                name = _checkpoint_name(f"{match[1]}.{e}.{match[2]}.{suffix}", last)
                layout[name] = CheckpointEntry(param, fmt, e)
        elif match := _FP8.fullmatch(param):
            # held as released (weight_format="released": a `.scale` parameter beside it), or
            # decoded
            released = f"{match[1]}.scale" in shapes
            fmt = "e8m0" if match[4] == "scale" else "e4m3" if released else "fp8"
            layout[_checkpoint_name(param, last)] = CheckpointEntry(param, fmt)
        elif _FP32.fullmatch(param):
            layout[_checkpoint_name(param, last)] = CheckpointEntry(param, "fp32")
        else:
            layout[_checkpoint_name(param, last)] = CheckpointEntry(param, "bf16")
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
    shards: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
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
    if TOKEN_MAP in state:
        write_tokenizer(state[TOKEN_MAP], root / TOKENIZER)
    return shards


def write_tokenizer(token_map: torch.Tensor, path: str | Path) -> None:
    """A `tokenizer.json` (a `tokenizers` word-level vocabulary) whose compressed token map
    (`model.ngram.compressed_token_map`) is `token_map`: class c's first id is the token
    `t{c}`, its later ids `t{c}` behind one, two, ... spaces, which normalise to it. The map
    must number its classes in order of first appearance, as a map read from a tokenizer does."""
    from tokenizers import Tokenizer, models

    classes = token_map.tolist()
    seen: dict[int, int] = {}
    vocab = {}
    for token_id, c in enumerate(classes):
        if c not in seen and c != len(seen):
            raise ValueError(
                f"token map: id {token_id} opens class {c} before class {len(seen)}: a map "
                "read from a tokenizer numbers its classes in order of first appearance"
            )
        vocab[" " * seen.get(c, 0) + f"t{c}"] = token_id
        seen[c] = seen.get(c, 0) + 1
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(path))


def token_map(path: str | Path, vocab_size: int, classes: int) -> torch.Tensor:
    """The compressed token map of the checkpoint at `path`, from its `tokenizer.json`
    (`model.ngram.compressed_token_map`), as int64 [vocab_size]: the tokenizer must have no more
    ids than the model and exactly `classes` classes (`engram_compressed_vocab_size`). Ids the
    tokenizer does not have (a vocabulary padded for the embedding) map to class 0: no text
    tokenizes to them."""
    file = Path(path) / TOKENIZER
    if not file.exists():
        raise FileNotFoundError(
            f"{file}: missing; the Engram layers hash token ids through the checkpoint's "
            "tokenizer (its compressed token map)"
        )
    mapped = compressed_token_map(file)
    if len(mapped) > vocab_size:
        raise ValueError(f"{file}: {len(mapped)} token ids, more than the model's {vocab_size}")
    found = max(mapped, default=-1) + 1
    if found != classes:
        raise ValueError(
            f"{file}: the tokenizer's compressed token map has {found} classes; the config's "
            f"engram_compressed_vocab_size is {classes}: another tokenizer than the model's"
        )
    out = torch.zeros(vocab_size, dtype=torch.int64)
    out[: len(mapped)] = torch.tensor(mapped, dtype=torch.int64)
    return out


def _config_classes(root: Path) -> int:
    """`engram_compressed_vocab_size` of the checkpoint's `config.json`."""
    file = root / "config.json"
    if not file.exists():
        raise FileNotFoundError(
            f"{file}: missing; reading the Engram token map checks its class count against "
            "the config's engram_compressed_vocab_size"
        )
    text = json.loads(file.read_text())
    text = text.get("text_config", text)
    if "engram_compressed_vocab_size" not in text:
        raise ValueError(
            f"{file}: no engram_compressed_vocab_size, which the Engram token map's class count "
            "is checked against; this checkpoint's model has Engram layers"
        )
    return int(text["engram_compressed_vocab_size"])


def _index(root: Path) -> dict[str, str]:
    index = root / INDEX
    if not index.exists():
        raise FileNotFoundError(
            f"{root}: no {INDEX}; a checkpoint directory holds the released index and its "
            "model-000NN-of-000MM.safetensors shards"
        )
    return json.loads(index.read_text())["weight_map"]


_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}  # fmt: skip

_CHUNK = 1 << 18
"""Elements decoded at a time (at least 32 rows): the fp32 temporaries of a decode stay a few
MiB, however large the weight."""


class _Checkpoint:
    """A checkpoint directory, read tensor slice by tensor slice: the names checked against a
    layout, the bytes read counted per tensor."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path)
        self.weight_map = _index(self.root)
        self.read: dict[str, int] = {}
        """Bytes read per checkpoint tensor."""
        self._files: dict[str, Any] = {}

    def check_names(
        self,
        layout: dict[str, CheckpointEntry],
        skip_unimplemented_parts: bool,
        drafter_elsewhere: bool = False,
    ) -> None:
        """`drafter_elsewhere`: the DSpark drafter's tensors (`mtp.*`) belong to another
        program (the backend compiles the backbone and the drafter apart) when these weights
        hold none of them."""
        where = self.root / INDEX
        expected = set(layout) | {_scale_name(n) for n, e in layout.items() if e.quantized}
        unknown = sorted(set(self.weight_map) - expected)
        drafter = [n for n in unknown if _DRAFTER.search(n)]
        if drafter and not any(_DRAFTER.search(n) for n in expected):
            unknown = [n for n in unknown if not _DRAFTER.search(n)]
            if not drafter_elsewhere and not skip_unimplemented_parts:
                raise ValueError(
                    f"{where}: {len(drafter)} tensors of the DSpark draft blocks, e.g. "
                    f"{drafter[:3]}, which this model was built without: build it from a "
                    "config with them (ModelConfig.from_hf reads num_nextn_predict_layers), or "
                    "pass skip_unimplemented_parts=True to load the backbone alone"
                )
        parts = [n for n in unknown if _UNIMPLEMENTED.search(n)]
        others = [n for n in unknown if not _UNIMPLEMENTED.search(n)]
        if others:
            raise ValueError(
                f"{where}: {len(others)} tensors this model does not have, e.g. "
                f"{others[:3]}: a checkpoint of another configuration?"
            )
        if parts and not skip_unimplemented_parts:
            raise ValueError(
                f"{where}: {len(parts)} tensors of parts this model does not implement "
                f"(vision), e.g. {parts[:3]}. Its outputs would "
                "differ from the released model's. Pass skip_unimplemented_parts=True to load "
                "without them"
            )
        missing = sorted(expected - set(self.weight_map))
        if missing:
            raise ValueError(f"{where}: missing {len(missing)} tensors, e.g. {missing[:3]}")

    def where(self, name: str) -> str:
        where = f"{name} ({self.weight_map[name]})"
        scale = _scale_name(name)
        if scale in self.weight_map and self.weight_map[scale] != self.weight_map[name]:
            where += f", its scale in {self.weight_map[scale]}"
        return where

    def _slice(self, name: str) -> Any:
        from safetensors import safe_open

        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(str(self.root / file), "pt")
        return self._files[file].get_slice(name)

    def header(self, name: str) -> tuple[torch.dtype | str, list[int]]:
        """The stored dtype and shape of `name`, read from its file's header only."""
        part = self._slice(name)
        return _SAFETENSORS_DTYPES.get(part.get_dtype(), part.get_dtype()), part.get_shape()

    def get(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """`name[index]`: only those elements are read."""
        value = self._slice(name)[index]
        self.read[name] = self.read.get(name, 0) + value.numel() * value.element_size()
        return value

    def close(self) -> None:
        self._files.clear()

    def fill(
        self,
        name: str,
        entry: CheckpointEntry,
        target: torch.Tensor,
        shape: Sequence[int],
        part: TensorSlice | None,
    ) -> None:
        """Write weight `name` (of the parameter's part of global `shape`) into `target`:
        all of it, or `part` of it, decoded to `target`'s dtype."""
        where = self.where(name)
        want = list(shape)
        if entry.fmt == "fp4":  # two inputs per byte
            want[1] //= 2
        dtype, stored = self.header(name)
        if dtype != entry.stored_dtype or stored != want:
            raise ValueError(f"{where}: {dtype} {stored}, expected {entry.stored_dtype} {want}")
        bounds = [(0, n) for n in want]
        if part is not None:
            if entry.fmt == "fp4" and part.dim != 0:
                raise NotImplementedError(f"{where}: an FP4 weight is read in whole rows")
            bounds[part.dim] = part.bounds(shape[part.dim])
        if not entry.quantized:
            target.copy_(self.get(name, tuple(slice(a, b) for a, b in bounds)))
            return
        codec = CODECS[entry.fmt]
        scale = _scale_name(name)
        scale_dtype, scale_shape = self.header(scale)
        if scale_dtype != torch.float8_e8m0fnu:
            raise ValueError(f"{where}: scale {scale_dtype}, expected torch.float8_e8m0fnu")
        expected = codec.scale_shape(want)
        if list(scale_shape) != list(expected):
            raise ValueError(
                f"{where}: scale of shape {list(scale_shape)} does not match its weight "
                f"{entry.stored_dtype} {want}: expected {list(expected)} (one per "
                f"{BLOCK} elements, rounded up)"
            )
        (r0, r1), (c0, c1) = bounds
        rows = BLOCK * max(1, _CHUNK // (BLOCK * max(1, c1 - c0)))
        a = r0
        while a < r1:  # chunks end at multiples of `rows`: block boundaries
            b = min(r1, (a // rows + 1) * rows)
            weight = self.get(name, (slice(a, b), slice(c0, c1)))
            if entry.fmt == "fp8":
                blocks = (slice(a // BLOCK, -(-b // BLOCK)), slice(c0 // BLOCK, -(-c1 // BLOCK)))
            else:
                blocks = (slice(a, b), slice(None))
            decoded = codec.dequantize(
                weight, self.get(scale, blocks), target.dtype, where, (a, c0)
            )
            target[a - r0 : b - r0].copy_(decoded)
            a = b


def read_weights(
    path: str | Path,
    weights: Sequence[_Wanted],
    *,
    skip_unimplemented_parts: bool = False,
    into: Sequence[torch.Tensor] | None = None,
    token_classes: int | None = None,
) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Each of `weights` read from the checkpoint directory `path`: only its slice (a tp shard
    reads those rows or columns, an EP rank the files of its experts), decoded block by block
    to its dtype, into a new CPU tensor (or into `into`, of the same shapes). Returns them and
    the bytes read per checkpoint tensor.

    The checkpoint must hold exactly the tensors of a model with these parameters (see
    `load_checkpoint` for what is refused), and every weight is checked against its file's
    header before a byte of it is read. The Engram token map comes from its tokenizer, its
    class count checked against `token_classes` (default: the checkpoint's `config.json`)."""
    checkpoint = _Checkpoint(path)
    local = _read(checkpoint, weights, skip_unimplemented_parts, into, token_classes, True)
    return local, checkpoint.read


def _read(
    checkpoint: _Checkpoint,
    weights: Sequence[_Wanted],
    skip_unimplemented_parts: bool,
    into: Sequence[torch.Tensor] | None,
    token_classes: int | None = None,
    drafter_elsewhere: bool = False,
) -> list[torch.Tensor]:
    shapes = {w.fqn: w.shape for w in weights}
    layout = checkpoint_layout(shapes)
    checkpoint.check_names(layout, skip_unimplemented_parts, drafter_elsewhere)
    local = list(into) if into is not None else []
    by_fqn: dict[str, int] = {}
    shape: list[int] | tuple[int, ...]
    for i, w in enumerate(weights):
        shape = list(w.shape)
        if w.slice is not None:
            start, stop = w.slice.bounds(shape[w.slice.dim])
            shape[w.slice.dim] = stop - start
        if into is None:
            local.append(torch.empty(shape, dtype=w.dtype))
        elif list(local[i].shape) != shape:
            raise ValueError(f"{w.fqn}: {list(local[i].shape)} given for its slice {shape}")
        by_fqn[w.fqn] = i
    filled = dict.fromkeys(by_fqn, 0)
    with torch.no_grad():
        for name in sorted(layout, key=lambda n: checkpoint.weight_map[n]):  # file by file
            entry = layout[name]
            w = weights[by_fqn[entry.param]]
            target, part = local[by_fqn[entry.param]], w.slice
            shape = w.shape
            if entry.expert is not None:  # one file tensor per expert: this rank's, or none
                first, stop = (0, shape[0]) if part is None else part.bounds(shape[0])
                if not first <= entry.expert < stop:
                    continue
                target, shape, part = target[entry.expert - first], shape[1:], None
            elif part is not None and part.dim >= len(shape):
                raise ValueError(f"{w.fqn}: slice {part} of a {len(shape)}-d parameter")
            checkpoint.fill(name, entry, target, shape, part)
            filled[entry.param] += 1
    checkpoint.close()
    if TOKEN_MAP in by_fqn:
        classes = token_classes or _config_classes(checkpoint.root)
        w = weights[by_fqn[TOKEN_MAP]]
        local[by_fqn[TOKEN_MAP]].copy_(token_map(checkpoint.root, w.shape[0], classes))
        checkpoint.read[TOKENIZER] = (checkpoint.root / TOKENIZER).stat().st_size
        filled[TOKEN_MAP] += 1
    unfilled = sorted(fqn for fqn, n in filled.items() if not n)
    if unfilled:  # a parameter no checkpoint name maps to: a bug of the layout
        raise AssertionError(f"checkpoint_layout left parameters unfilled: {unfilled}")
    return local


def load_checkpoint(
    model: nn.Module, path: str | Path, *, skip_unimplemented_parts: bool = False
) -> dict[str, int]:
    """Fill every parameter of the single-device `model` from the checkpoint directory `path`;
    returns the bytes read per file.

    A model built on the meta device or by `DeepseekV41.without_weights` gets its parameters
    allocated here, on the CPU. Loading is strict: a missing tensor, a wrong dtype or shape, a
    scale that does not fit its weight or a NaN scale is an error naming the tensor and its
    file; tensors of the parts this model lacks (the vision tower; the DSpark draft blocks of a
    model built without them) are refused unless `skip_unimplemented_parts=True`, and any other tensor the model does not
    know is an error. The Engram token map is built from the checkpoint's `tokenizer.json`,
    its class count checked against the model's config."""
    params = dict(model.named_parameters())
    for fqn, param in params.items():
        if has_no_weights(param):
            module_name, _, attr = fqn.rpartition(".")
            value = torch.empty(param.shape, dtype=param.dtype)
            params[fqn] = nn.Parameter(value, requires_grad=param.requires_grad)
            setattr(model.get_submodule(module_name), attr, params[fqn])
    weights = [WantedWeight(fqn, tuple(p.shape), p.dtype) for fqn, p in params.items()]
    checkpoint = _Checkpoint(path)
    classes = getattr(getattr(model, "cfg", None), "engram_compressed_vocab_size", None)
    _read(checkpoint, weights, skip_unimplemented_parts, list(params.values()), classes)
    per_file: dict[str, int] = {}
    for name, n in checkpoint.read.items():
        file = checkpoint.weight_map.get(name, name)  # the tokenizer is a file of its own
        per_file[file] = per_file.get(file, 0) + n
    return per_file
