"""DeepSeek V4.1's own options (`FamilyOptions`), given to `torch.compile(..., options={...})`
beside the generic ones: where its attention's entry gather and exit cut run, how its
embedding, its head and its shared expert are held, and where its Engram tables live. Each
`"auto"` is decided for the model's sizes when it compiles (`DeepseekV41Adapter.resolve`), and
the choice with its figures is in `graph.py`, `comm.json` and `tools/explain.py`."""

from __future__ import annotations

from dataclasses import dataclass

from dsv41_compile.options import FamilyOptions, check_choice
from dsv41_compile.spmd.vocab import VOCAB_HOLDINGS

__all__ = ["DeepseekV41Options"]

_ATTN_ENTRIES = ("auto", "input")
_ATTN_EXITS = ("auto", "reduce_scatter", "all_to_all")
_EMBEDDINGS = VOCAB_HOLDINGS
_HEADS = ("auto", *VOCAB_HOLDINGS)
_ENGRAM = ("auto", "replicated", "sharded", "host")
_SHARED_EXPERTS = ("auto", "whole", "split")
_NPU_ATTENTIONS = ("sparse_flash", "gathered")


@dataclass(frozen=True, kw_only=True)
class DeepseekV41Options(FamilyOptions):
    attn_entry: str = "auto"
    """What attention's entry AllGather moves in the sp layout: "input" (the normed `[Tl, D]`
    input: the seed's layout, which gathers after attention's norm) or "auto" (per layer, the
    cheapest cut between the input and the ops that need all tokens: the per-token ops before
    it -- projections with replicated weights, norms, rope -- run on the token shard and their
    narrower outputs are gathered; the input itself when nothing is cheaper)."""
    attn_exit: str = "auto"
    """How attention's output leaves the TP group in the sp layout: "reduce_scatter" (the
    row-parallel `wo_b`'s fp32 partial sum, reduce-scattered to token shards: the seed's layout)
    or "all_to_all" (`wo_b`'s input moves to the token shards in the activation dtype and each
    rank runs the whole `wo_b` on its tokens: no cross-rank sum, exact, but `wo_b` is
    replicated on every TP rank). "auto": the one with fewer bytes, unless the replicated
    weights exceed `extra_weight_bytes`."""
    embedding: str = "replicated"
    """"replicated" (each rank looks up its token shard) or "vocab_sharded" (rows sharded over
    tp; the partial lookups are reduce-scattered to the token shards)."""
    head: str = "auto"
    """How the fp32 output head `[V, D]` is held: "replicated" (whole on every rank; each
    multiplies the gathered hidden rows by all V rows), "vocab_sharded" (its V rows split over
    tp: each rank reads 1/tp of the head and computes its V/tp logits, which one AllGather over
    tp assembles at the graph's output) or "auto": the one with the shorter time on the device
    model (`device`) at `rows_per_step` rows -- reading the head and its matmul against the
    sharded read plus the gather's latency and bytes -- unless tp does not divide V."""
    engram: str = "auto"
    """Where the Engram tables live: "replicated" (whole on every rank), "sharded" (split by
    their hash columns over the world, ep = world: each rank holds about 1/world of the rows,
    and each Engram layer sends every token's row ids to the ranks holding their columns and
    gets the rows back in FP8 with their scales, two all-to-alls), "host" (sharded, each
    rank's rows in host memory, looked up there), or "auto": sharded when ep is the world and
    replicating the tables would hold more than 1 GiB per rank (or more than
    `extra_weight_bytes`), else replicated."""
    shared_expert: str = "auto"
    """How the MoE's shared expert is held in the sp layout: "whole" (its three weights on every
    rank; each rank runs it on its own token shard) or "split" (`w1` / `w3` split on their
    hidden columns and `w2` on its rows over tp, as attention's heads are: each rank reads 1/tp
    of the weights, the expert's input is gathered over tp and its output's partial sum
    reduce-scattered back to the token shards, two collectives per layer). "auto": the one
    with the shorter time on the device model (`device`) at `rows_per_step` rows -- the reads
    and matmuls of the whole expert against 1/tp of them and the two collectives. "split"
    needs fp32 activations: a partial sum rounded to bf16 on each rank is not the
    single-device rounding."""

    npu_attention: str = "sparse_flash"
    """How the NPU lowerings (npugraph_ex, torchair) compute attention: "sparse_flash" (torch_npu's
    `npu_sparse_flash_attention`: each query's window and compressed picks as one list of
    indices into the layer's KV rows, read where they are; its softmax is the kernel's own,
    within a bf16 rounding of the official numerics' blockwise one, not bit for bit) or
    "gathered" (the model's own computation: each query's keys gathered, then two batched
    matmuls; under the official numerics the official kernel's rounding, exactly). The other
    lowerings always compute the model's own."""

    def __post_init__(self) -> None:
        check_choice("attn_entry", self.attn_entry, _ATTN_ENTRIES)
        check_choice("attn_exit", self.attn_exit, _ATTN_EXITS)
        check_choice("embedding", self.embedding, _EMBEDDINGS)
        check_choice("engram", self.engram, _ENGRAM)
        check_choice("head", self.head, _HEADS)
        check_choice("shared_expert", self.shared_expert, _SHARED_EXPERTS)
        check_choice("npu_attention", self.npu_attention, _NPU_ATTENTIONS)
