"""`ModelConfig`: every size and constant of the single-device DeepSeek V4.1 model, with presets.

Field names follow the released V4.1 text config (`config.json`'s `text_config`) where one
exists. Presets:

- ``"tiny"``: small enough for CPU tests, same structure as the real model.
- ``"flash"``: the released V4.1-Flash sizes (build it on the meta device).
- ``"tiny-dspark"``, ``"flash-dspark"``: the same with the DSpark draft blocks (`model.dspark`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsv41_compile.deepseek_v41.model.hf_config import fields_from_hf
from dsv41_compile.deepseek_v41.model.ngram import hash_primes
from dsv41_compile.deepseek_v41.model.quant import BLOCK

NUMERICS = ("bf16", "official")
"""The values of `ModelConfig.numerics`."""

WEIGHT_FORMATS = ("dequantized", "released")
"""The values of `ModelConfig.weight_format`."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    """Rows of the embedding and of the (untied) output head."""
    dim: int
    """Hidden size D."""
    n_layers: int
    """Decoder layers."""
    n_heads: int
    """Query heads H; keys and values are one shared latent (MQA)."""
    head_dim: int
    """Width d of a query head and of the shared KV latent (keys == values)."""
    rope_head_dim: int
    """RoPE is applied, interleaved, to the last `rope_head_dim` dims of each head and latent."""
    q_lora_rank: int
    """Rank of the low-rank query path: `wq_a: D -> q_lora_rank`, `wq_b: q_lora_rank -> H*d`."""
    o_groups: int
    """Output groups G: consecutive heads `[g*H/G, (g+1)*H/G)` share one `wo_a` block."""
    o_lora_rank: int
    """Per-group output rank of `wo_a`; `wo_b` maps `G*o_lora_rank -> D`."""
    window_size: int
    """Sliding window W: token at position p attends to positions `(p-W, p]` of its request."""
    n_routed_experts: int
    """Routed experts E."""
    n_activated_experts: int
    """Top-k routed experts per token."""
    moe_inter_dim: int
    """Intermediate width of every expert (routed and the one shared expert)."""
    routed_scaling_factor: float
    """Multiplies the normalised top-k routing weights."""
    swiglu_limit: float
    """SwiGLU clamp L: up in [-L, L], gate <= L; 0 disables the clamp."""
    hc_mult: int = 4
    """mHC residual streams n."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn iterations normalising the mHC comb matrix."""
    hc_eps: float = 1e-6
    """mHC epsilon (added to pre and to the comb before normalisation)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (also used by the mHC projection's RMS)."""
    rope_theta: float = 10000.0
    """RoPE base of the sliding-window-only layers (no YaRN)."""
    dtype: str = "float32"
    """Weights and activations: "float32" or "bfloat16". mHC, router, norms, sink and head stay
    fp32."""
    numerics: str = "bf16"
    """How activations are rounded. "bf16": computed in `dtype` from the dequantised weights.
    "official": rounded as the official inference code rounds them (`Rounding`; docs/model.md,
    "Numerics"): FP8 activations into the FP8 / FP4 GEMMs, FP8 window KV, FP4 compressed KV and
    index queries and keys, bf16 index scores and attention probabilities; it needs `dtype`
    "bfloat16"."""
    numerics_off: tuple[str, ...] = ()
    """Steps of "official" left out (`Rounding` field names), to measure what each one does: the
    result is then no longer the official numerics."""
    weight_format: str = "dequantized"
    """How the checkpoint's quantised weights are held. "dequantized": in `dtype`, decoded when
    loaded. "released": as the checkpoint stores them, decoded where they are used to the
    same values (the logits are the same bit for bit): the FP8 linears (`released.Fp8Linear`:
    e4m3 codes and an e8m0 scale per 32 x 32 block, `ops.fp8_weight`) and the routed experts
    (e2m1 codes packed two per byte and an e8m0 scale per 32 inputs,
    `ops.routed_experts_fp4`), a half and about a quarter of their bytes in bf16. Split over
    tensor parallelism, an FP8 weight must split in whole blocks."""

    # --- compressed attention (see `layer_plan`) ---------------------------------------------
    compress_ratios: tuple[int, ...] = ()
    """Per layer: 0 = sliding window only, 1 or 2 = window + compressed entries of that many
    tokens each. Empty means every layer is window-only."""
    kv_source_layer_ids: tuple[int, ...] = ()
    """Layers that own a compressor (and its cache); later layers of the same ratio share it."""
    index_source_layer_ids: tuple[int, ...] = ()
    """Layers that run an indexer top-k; later layers of the same ratio reuse the latest one.
    Every kv source is also an index source."""
    candidate_source_layer_id: int = -1
    """Layer whose index scores pick candidate blocks that later index sources of the same
    ratio must select inside; -1 for none."""
    candidate_block_size: int = 8
    """Compressed entries per candidate block."""
    candidate_topk_blocks: int = 2048
    """Candidate blocks kept per query (the block of its last visible entry always is)."""
    index_n_heads: int = 32
    """Indexer heads."""
    index_head_dim: int = 128
    """Indexer query/key width; RoPE on its last `rope_head_dim` dims."""
    index_topk: int = 512
    """Compressed entries each query attends to (at most)."""
    compress_rope_theta: float = 160000.0
    """RoPE base of every compressed layer (window, queries, compressed and index keys)."""
    rope_factor: float = 16.0
    """YaRN scaling factor of the compressed layers."""
    original_max_position_embeddings: int = 65536
    """YaRN original context length."""
    beta_fast: float = 32.0
    """YaRN correction range: rotations at the high-frequency end."""
    beta_slow: float = 1.0
    """YaRN correction range: rotations at the low-frequency end."""

    # --- Engram (see `model.engram`, `model.ngram`) ------------------------------------------
    engram_layer_ids: tuple[int, ...] = ()
    """Layers whose residual streams get an n-gram memory lookup (Engram) before the block."""
    engram_vocab_size: int = 0
    """Each hash column's table range is the next unused prime above `engram_vocab_size - 1`."""
    engram_num_embeddings: tuple[int, ...] = ()
    """Rows of each Engram layer's table: the sum of its columns' primes (checked)."""
    engram_max_ngram_size: int = 4
    """N-grams of orders 2 .. this are hashed (the token and up to this many minus one before
    it, of the same request)."""
    engram_n_heads: int = 8
    """Hash heads per n-gram order: one table column each."""
    engram_head_dim: int = 256
    """Width of one table row (FP8, one e8m0 scale per 32)."""
    engram_pad_id: int = 2
    """The token whose compressed id stands in where an n-gram reaches before the request."""
    engram_compressed_vocab_size: int = 0
    """Classes of the compressed token map (the tokenizer's ids that normalise alike share one):
    the hash multipliers' bound; a tokenizer that gives another count is refused."""

    # --- DSpark draft blocks (see `model.dspark`) ---------------------------------------------
    num_nextn_predict_layers: int = 0
    """DSpark stages (`mtp.0` ..): 0 = no drafter. Each is a window-only V4.1 block with its own
    weights and experts; the embedding and the head are the backbone's."""
    dspark_block_size: int = 5
    """Rows of a draft block: the next token, then `dspark_block_size - 1` noise tokens; it
    proposes `dspark_block_size` tokens."""
    dspark_noise_token_id: int = 128799
    """The token that fills a draft block after its first row."""
    dspark_target_layer_ids: tuple[int, ...] = ()
    """Layers whose input residual (the mean over the mHC streams, after Engram) the drafter
    reads: concatenated, projected by `main_proj` back to `dim`."""
    dspark_markov_rank: int = 256
    """Width of the Markov head: an embedding of the previous token whose product with a
    `[vocab, rank]` head biases the draft logits."""
    dspark_n_routed_experts: int = 0
    """Routed experts of a DSpark stage's MoE."""
    dspark_n_activated_experts: int = 0
    """Top-k routed experts per token in a DSpark stage."""

    def __post_init__(self) -> None:
        positive = (
            "vocab_size dim n_layers n_heads head_dim rope_head_dim q_lora_rank o_groups "
            "o_lora_rank window_size n_routed_experts n_activated_experts moe_inter_dim hc_mult "
            "hc_sinkhorn_iters candidate_block_size candidate_topk_blocks index_n_heads "
            "index_head_dim index_topk"
        )
        for name in positive.split():
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPES:
            raise ValueError(
                f"ModelConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.rope_head_dim % 2 or self.rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"rope_head_dim ({self.rope_head_dim}) must be even and <= head_dim "
                f"({self.head_dim}) and index_head_dim ({self.index_head_dim})"
            )
        if self.n_heads % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide n_heads ({self.n_heads})")
        if self.n_activated_experts > self.n_routed_experts:
            raise ValueError(
                f"n_activated_experts ({self.n_activated_experts}) must be <= "
                f"n_routed_experts ({self.n_routed_experts})"
            )
        if self.swiglu_limit < 0:
            raise ValueError(f"swiglu_limit must be >= 0 (0 disables it), got {self.swiglu_limit}")
        layer_plan(self)  # raises ValueError on an inconsistent compressed-attention schedule
        if self.engram_layer_ids:
            self._check_engram()
        if self.num_nextn_predict_layers:
            self._check_dspark()
        self._check_numerics()
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(
                f"ModelConfig.weight_format must be one of {list(WEIGHT_FORMATS)}, got "
                f"{self.weight_format!r}"
            )
        if self.weight_format == "released" and (self.dim % BLOCK or self.moe_inter_dim % BLOCK):
            raise ValueError(
                f"weight_format='released' holds the experts' FP4 weights with one scale per "
                f"{BLOCK} inputs: dim ({self.dim}) and moe_inter_dim ({self.moe_inter_dim}) must "
                f"be multiples of {BLOCK}, or use weight_format='dequantized'"
            )

    def _check_engram(self) -> None:
        ids = self.engram_layer_ids
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < self.n_layers for i in ids):
            raise ValueError(f"engram_layer_ids must be sorted, unique layer ids, got {ids}")
        for name in ("engram_vocab_size", "engram_n_heads", "engram_compressed_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive with Engram layers")
        if self.engram_max_ngram_size < 2:
            raise ValueError("engram_max_ngram_size must be >= 2 (orders 2 .. it are hashed)")
        if self.engram_head_dim <= 0 or self.engram_head_dim % 32:
            raise ValueError(
                f"engram_head_dim must be a multiple of 32 (one scale per 32), got "
                f"{self.engram_head_dim}"
            )
        if not 0 <= self.engram_pad_id < self.vocab_size:
            raise ValueError(f"engram_pad_id {self.engram_pad_id} is not a token id")
        rows = tuple(sum(p) for p in self.engram_primes)
        if self.engram_num_embeddings != rows:
            raise ValueError(
                f"engram_num_embeddings {self.engram_num_embeddings} do not match the tables "
                f"the hash primes make, {rows} (engram_vocab_size {self.engram_vocab_size}, "
                f"{self.engram_n_heads} heads, orders 2..{self.engram_max_ngram_size})"
            )

    def _check_dspark(self) -> None:
        ids = self.dspark_target_layer_ids
        if not ids or list(ids) != sorted(set(ids)) or any(not 0 <= i < self.n_layers for i in ids):
            raise ValueError(
                f"dspark_target_layer_ids must be sorted, unique layer ids of the {self.n_layers} "
                f"layers, at least one, got {ids}"
            )
        for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive with DSpark stages")
        if not 0 < self.dspark_n_activated_experts <= self.dspark_n_routed_experts:
            raise ValueError(
                f"dspark_n_activated_experts ({self.dspark_n_activated_experts}) must be in 1 .. "
                f"dspark_n_routed_experts ({self.dspark_n_routed_experts})"
            )
        if both := sorted(set(ids) & set(self.engram_layer_ids)):
            raise ValueError(
                f"dspark_target_layer_ids {both} are Engram layers: the drafter reads a "
                "layer's input after its Engram lookup, which this model makes inside the "
                "block; choose target layers without Engram"
            )
        if not 0 <= self.dspark_noise_token_id < self.vocab_size:
            raise ValueError(
                f"dspark_noise_token_id {self.dspark_noise_token_id} is not a token id"
            )

    @property
    def dspark_stage(self) -> ModelConfig:
        """The config of a DSpark stage's block: window-only, no Engram, its own expert count."""
        return dataclasses.replace(
            self,
            n_routed_experts=self.dspark_n_routed_experts,
            n_activated_experts=self.dspark_n_activated_experts,
            compress_ratios=(),
            kv_source_layer_ids=(),
            index_source_layer_ids=(),
            candidate_source_layer_id=-1,
            engram_layer_ids=(),
            engram_num_embeddings=(),
            num_nextn_predict_layers=0,
            dspark_target_layer_ids=(),
        )

    @property
    def engram_columns(self) -> int:
        """Table columns (rows looked up per token) of an Engram layer."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def engram_primes(self) -> tuple[tuple[int, ...], ...]:
        """Per Engram layer, its columns' primes (`model.ngram.hash_primes`)."""
        return hash_primes(
            self.engram_layer_ids,
            self.engram_max_ngram_size,
            self.engram_n_heads,
            self.engram_vocab_size,
        )

    def _check_numerics(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(
                f"ModelConfig.numerics must be one of {list(NUMERICS)}, got {self.numerics!r}"
            )
        steps = [f.name for f in dataclasses.fields(Rounding)]
        if self.numerics_off and self.numerics != "official":
            raise ValueError(
                f"numerics_off {self.numerics_off} leaves out steps of numerics='official'; "
                f"numerics is {self.numerics!r}"
            )
        if unknown := sorted(set(self.numerics_off) - set(steps)):
            raise ValueError(f"numerics_off names unknown steps {unknown}; the steps are {steps}")
        if self.numerics != "official":
            return
        if self.dtype != "bfloat16":
            raise ValueError(
                f"numerics='official' computes in bfloat16, as the official code does: use "
                f"dtype='bfloat16' (got {self.dtype!r}), or numerics='bf16'"
            )
        rounding, compressed = self.rounding, any(self.ratios)
        widths = (  # what each rounding quantises, in blocks of 32 along it
            ("dim", self.dim, rounding.gemm_inputs or rounding.expert_inputs),
            ("q_lora_rank", self.q_lora_rank, rounding.gemm_inputs),
            ("o_groups * o_lora_rank", self.o_groups * self.o_lora_rank, rounding.gemm_inputs),
            ("moe_inter_dim", self.moe_inter_dim, rounding.expert_hidden),
            ("head_dim", self.head_dim, rounding.window_kv or rounding.compressed_kv),
            (
                "index_head_dim",
                self.index_head_dim,
                compressed and (rounding.index_q or rounding.index_k),
            ),
        )
        for name, width, quantised in widths:
            if quantised and width % BLOCK:
                raise ValueError(
                    f"numerics='official' quantises in blocks of {BLOCK}: {name} ({width}) "
                    f"must be a multiple of {BLOCK}, or use numerics='bf16'"
                )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def rounding(self) -> Rounding:
        """The roundings the model makes (`numerics` without `numerics_off`)."""
        return Rounding.of(self.numerics, self.numerics_off)

    @property
    def hc_mix_dim(self) -> int:
        """Width of the mHC projection: n pre + n post + n*n comb coefficients."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def ratios(self) -> tuple[int, ...]:
        """`compress_ratios`, with the empty default spelled out as all zeros."""
        return self.compress_ratios or (0,) * self.n_layers

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_name(name: str, **overrides: Any) -> ModelConfig:
        """A preset by name, optionally with some fields replaced."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; presets are: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    @staticmethod
    def from_hf(
        source: str | Path | dict[str, Any],
        *,
        skip_unimplemented_parts: bool = False,
        **overrides: Any,
    ) -> ModelConfig:
        """The config of a released checkpoint: `source` is its directory, its `config.json`,
        or that file's contents. Every key is read, checked or knowingly ignored
        (`model.hf_config`); the DSpark draft blocks and the vision tower, which this model
        lacks, are refused unless `skip_unimplemented_parts=True`. The model computes in
        bfloat16 with the official numerics and holds its routed experts as released
        (`weight_format`) unless `overrides` say otherwise."""
        defaults = {
            f.name
            for f in dataclasses.fields(ModelConfig)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }
        fields = fields_from_hf(
            source, defaults=defaults, skip_unimplemented_parts=skip_unimplemented_parts
        )
        return ModelConfig(**(fields | overrides))


@dataclass(frozen=True)
class Rounding:
    """The official inference code's roundings (`model.numerics`), each on or off: all on for
    `ModelConfig.numerics` "official", all off for "bf16" (the model computes in its dtype from
    the dequantised weights, with fp32 where it says so). A field's name is the step's name in
    `ModelConfig.numerics_off`. Each is per token (and per head after the heads)."""

    gemm_inputs: bool
    """FP8 quantise-dequantise (`numerics.act_quant`) of the input of the attention's FP8 GEMMs: `wq_a`
    and `wkv` (their common input), `wq_b` and the indexer's `wq_b` (theirs), `wo_b`; and of
    Engram's `wkv` (its looked-up rows). Not of
    `wo_a`, the compressor's `wkv` / `wgate`, the indexer's `wk` / `weights_proj`, the router or
    the head, which are not FP8 GEMMs there."""
    expert_inputs: bool
    """FP8 quantise-dequantise of the experts' input, before `w1` / `w3` of the routed and the
    shared experts (once, before the routed-experts op)."""
    expert_hidden: bool
    """FP8 quantise-dequantise of each expert's hidden activation (SwiGLU times the routing
    weight, cast to bf16) before `w2`: inside the routed-experts op."""
    wo_b_output: bool
    """`wo_b`'s output in bf16, as the FP8 GEMM returns it (fp32 otherwise)."""
    window_kv: bool
    """FP8 quantise-dequantise of the window KV after RoPE, over all `head_dim` values; the ring
    holds FP8 rows (`numerics.fp8_rows`)."""
    compressed_kv: bool
    """FP4 quantise-dequantise, e4m3 scale per 16, of a compressed entry after RoPE; the cache
    holds FP4 rows (`numerics.fp4_rows`)."""
    index_q: bool
    """FP4 quantise-dequantise, e8m0 scale per 32, of the indexer's queries after RoPE."""
    index_k: bool
    """FP4 quantise-dequantise, e8m0 scale per 32, of the index keys after RoPE."""
    index_scores: bool
    """The index scores in bf16: `q . k` rounded, relu, times the bf16 head weights (rounded),
    summed over heads (rounded); fp32 otherwise."""
    probabilities: bool
    """Attention probabilities in bf16 before the value sum, as the official kernel rounds them:
    `exp(logit - running max)`, the max running over blocks of 64 keys in the kernel's order
    (`attention.blockwise_sink_attention`); the denominator stays fp32."""

    @staticmethod
    def of(numerics: str, off: tuple[str, ...] = ()) -> Rounding:
        """The roundings of `numerics` ("bf16" or "official") without the steps named in `off`."""
        on = numerics == "official"
        return Rounding(**{f.name: on and f.name not in off for f in dataclasses.fields(Rounding)})


ATTENTION_MODES = ("swa", "full", "reindex", "reuse")


@dataclass(frozen=True)
class LayerRole:
    """What one layer's attention does, resolved from the config's layer-id lists.

    - ``swa``: window only.
    - ``full``: owns a compressor (compressed KV + index keys) and an indexer.
    - ``reindex``: owns an indexer query only; scores the kv source's index keys.
    - ``reuse``: no compressor or indexer; attends over the kv source's compressed KV at the
      latest index source's top-k.
    """

    mode: str
    ratio: int
    kv_source: int = -1
    """Layer whose compressed KV and index keys this layer reads (-1: none)."""
    topk_source: int = -1
    """Layer whose top-k selects this layer's compressed entries (-1: none)."""
    candidate_filtered: bool = False
    """This layer's top-k is restricted to the candidate blocks of the candidate source."""
    makes_candidates: bool = False
    """This layer is the candidate source."""


def layer_plan(cfg: ModelConfig) -> tuple[LayerRole, ...]:
    """Each layer's role: the source a layer uses is the latest source at or before it with the
    same compress ratio."""
    ratios = cfg.ratios
    if len(ratios) != cfg.n_layers:
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; it needs one per layer ({cfg.n_layers})"
        )
    if any(r not in (0, 1, 2) for r in ratios):
        raise ValueError(f"compress_ratios must contain only 0, 1 or 2, got {ratios}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        ids = getattr(cfg, name)
        if list(ids) != sorted(set(ids)) or any(not 0 <= i < cfg.n_layers for i in ids):
            raise ValueError(f"{name} must be sorted, unique layer ids, got {ids}")
        if any(ratios[i] == 0 for i in ids):
            raise ValueError(f"{name} {ids} names a window-only layer (compress ratio 0)")
    kv_sources, index_sources = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    if not set(kv_sources) <= set(index_sources):
        raise ValueError(
            f"every kv source must also be an index source: add "
            f"{sorted(set(kv_sources) - set(index_sources))} to index_source_layer_ids"
        )
    candidate = cfg.candidate_source_layer_id
    if candidate != -1 and candidate not in kv_sources:
        raise ValueError(
            f"candidate_source_layer_id {candidate} must be one of kv_source_layer_ids {kv_sources}"
        )

    roles = []
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            roles.append(LayerRole(mode="swa", ratio=0))
            continue
        kv_source = max((s for s in kv_sources if s <= layer and ratios[s] == ratio), default=-1)
        if kv_source == -1:
            raise ValueError(
                f"layer {layer} has compress ratio {ratio} but no kv source of that ratio at or "
                f"before it: add a layer id to kv_source_layer_ids"
            )
        topk_source = max(s for s in index_sources if s <= layer and ratios[s] == ratio)
        mode = "full" if layer == kv_source else "reindex" if layer == topk_source else "reuse"
        filtered = (
            mode != "reuse" and candidate != -1 and candidate < layer and ratios[candidate] == ratio
        )
        roles.append(
            LayerRole(
                mode=mode,
                ratio=ratio,
                kv_source=kv_source,
                topk_source=topk_source,
                candidate_filtered=filtered,
                makes_candidates=layer == candidate,
            )
        )
    return tuple(roles)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512,
        dim=64,
        n_layers=8,
        n_heads=8,
        head_dim=32,
        rope_head_dim=8,
        q_lora_rank=32,
        o_groups=4,
        o_lora_rank=16,
        window_size=4,
        # 2 experts per rank at ep=8, top-k 6 as in the seed's example
        n_routed_experts=16,
        n_activated_experts=6,
        moe_inter_dim=32,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        # Every attention mode, with pruning that prunes at a few dozen tokens:
        # SWA 0-1, ratio-2 FULL 2 / REUSE 3, ratio-1 FULL + candidates 4 / REUSE 5 / REINDEX 6
        # / REUSE 7.
        compress_ratios=(0, 0, 2, 2, 1, 1, 1, 1),
        kv_source_layer_ids=(2, 4),
        index_source_layer_ids=(2, 4, 6),
        candidate_source_layer_id=4,
        candidate_block_size=2,
        candidate_topk_blocks=3,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        # Engram before layer 1: 6 columns (orders 2..4, 2 heads) of 32 wide rows, 384 in all
        engram_layer_ids=(1,),
        engram_vocab_size=50,
        engram_num_embeddings=(384,),
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=300,
    ),
    # DeepSeek-V4.1-Flash text config, as released (config.json text_config).
    "flash": ModelConfig(
        vocab_size=129280,
        dim=5120,
        n_layers=40,
        n_heads=64,
        head_dim=512,
        rope_head_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        window_size=128,
        n_routed_experts=384,
        n_activated_experts=6,
        moe_inter_dim=2304,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rms_norm_eps=1e-20,
        dtype="bfloat16",
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
        kv_source_layer_ids=(2, 8, 14, 20),
        index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer_id=20,
        candidate_block_size=8,
        candidate_topk_blocks=2048,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        engram_layer_ids=(1, 14),
        engram_vocab_size=16000000,
        engram_num_embeddings=(384006168, 384016682),
        engram_compressed_vocab_size=99092,
    ),
}
# The released V4.1-Flash with its three DSpark draft blocks (config.json's dspark_* keys).
_DSPARK = {"num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_n_activated_experts": 3}
PRESETS["flash-dspark"] = PRESETS["flash"].replace(
    **_DSPARK,
    dspark_noise_token_id=128799,
    dspark_target_layer_ids=(37, 38, 39),
    dspark_markov_rank=256,
    dspark_n_routed_experts=128,
)
# "tiny" with three DSpark stages reading its last three layers (as flash's read 37-39), two
# experts per rank at ep=8, top-3 as released; a window of 8, which holds a verify call's rows
# (`serving`: a cache is cut back only within its window).
PRESETS["tiny-dspark"] = PRESETS["tiny"].replace(
    **_DSPARK,
    window_size=8,
    dspark_noise_token_id=511,
    dspark_target_layer_ids=(5, 6, 7),
    dspark_markov_rank=16,
    dspark_n_routed_experts=16,
)
# Window-only variant of "tiny" for fast tests of everything that is not compressed attention.
PRESETS["tiny-swa"] = PRESETS["tiny"].replace(
    n_layers=2,
    compress_ratios=(),
    kv_source_layer_ids=(),
    index_source_layer_ids=(),
    candidate_source_layer_id=-1,
    engram_layer_ids=(),
    engram_num_embeddings=(),
)
