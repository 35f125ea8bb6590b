"""DeepSeek V4.1's sharding plan: which parameters are sharded, and the placement activations
have where they enter and leave its modules (the rest is propagated by the op rules)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from dsv41_compile.core.placements import ColumnShard, ExpertShard
from dsv41_compile.core.plan import Entry, ShardingPlan, colwise, rowwise, with_scales
from dsv41_compile.spmd.vocab import vocab_entries

__all__ = ["deepseek_v41_plan"]


def deepseek_v41_plan(
    *,
    embedding: str = "replicated",
    ep: int = 1,
    layout: str = "sp",
    attn_exit: str = "reduce_scatter",
    attn_entry: str = "input",
    engram: str = "replicated",
    head: str = "replicated",
    shared_expert: str = "whole",
) -> ShardingPlan:
    """`layout="sp"` (docs/backend.md, "The layout"): heads and output groups sharded over tp, latents /
    compressor / indexer replicated, row-parallel `wo_b` (a partial sum, reduce-scattered),
    everything per-token sharded by token; with ep > 1 the routed experts' weights are sharded
    on the expert dim over the world.

    `layout="replicated"` (the baseline): the same parameter placements, but every
    activation outside attention is replicated over the TP group: the `wo_b` partial is
    all-reduced, mHC / norms / gate / shared expert run on all T tokens. With ep > 1 each token
    is dispatched by exactly one TP rank (the routed-experts rule takes token shards) and the
    MoE's output leaves the MoE replicated (one AllGather).

    `attn_exit="all_to_all"` (sp only): `wo_b` replicated and its input token-sharded where it
    enters `wo_b`: the `[T, G/tp*o_lora]` output groups of `wo_a` move to their tokens' ranks
    (all-to-all over tp, in the activation dtype) and each rank projects its own tokens with the
    whole `wo_b`: no partial sum, no ReduceScatter.

    `attn_entry="auto"` (sp only): attention's entry AllGather moves to the cheapest cut of the
    per-token ops that read the normed input (`spmd.entry_cut`).

    `head="vocab_sharded"`: the fp32 head's V rows sharded over tp (its logits, `[R, V/tp]`
    per rank, gathered at the graph's output); the hidden it reads stays replicated.

    `engram="sharded"` / `"host"` (sp, ep = world): the Engram tables split by their hash
    columns over the world (`placements.ColumnShard`), in device or host memory; each rank
    looks up its token shard's rows through an exchange (`tables.exchange`).

    `shared_expert="split"` (sp only): the shared expert's `w1` / `w3` column-parallel and `w2`
    row-parallel over tp; its input gathered where it enters (Replicate-anchored) and its
    output's partial sum reduce-scattered to the token shards."""
    # (an FP8 weight held as released, `weight_format="released"`: its block scales with it)
    params: list[Entry] = [
        *colwise("layers.*.attn.wq_b", scales=True),  # [H*d, q_lora]: heads
        Entry("layers.*.attn.attn_sink", Shard(0)),  # [H]
        *colwise("layers.*.attn.wo_a", scales=True),  # [G*o_lora, H/G*d]: output groups
    ]
    exit_all_to_all = layout == "sp" and attn_exit == "all_to_all"
    if not exit_all_to_all:
        params += rowwise("layers.*.attn.wo_b", scales=True)  # [D, G*o_lora]: row-parallel
    params += vocab_entries("embed.weight", embedding)  # [V, D]: vocab rows
    params += vocab_entries("head.weight", head)
    split_shared = layout == "sp" and shared_expert == "split"
    if split_shared:
        shared = "layers.*.ffn.shared_expert"
        params += [
            *colwise(f"{shared}.w1", scales=True),  # [I, D]: hidden columns
            *colwise(f"{shared}.w3", scales=True),
            *rowwise(f"{shared}.w2", scales=True),  # [D, I]: a partial sum over tp
        ]
    if ep > 1:
        # the stacked expert weights; held as released, FP4 codes with their scales (`w1_scale`)
        for w in ("w1", "w2", "w3"):
            experts = "layers.*.ffn.experts"
            params += with_scales(f"{experts}.{w}", ExpertShard(0), f"{experts}.{w}_scale")
    if engram in ("sharded", "host"):  # the tables split by their hash columns over the world
        table = ColumnShard(host=engram == "host")
        params += [Entry(f"layers.*.engram.embed.{t}", table) for t in ("weight", "scale")]
    if layout == "replicated":
        return ShardingPlan(
            params=tuple(params),
            # Every anchor replicated; they still name the regions (attention / MoE half).
            anchors=tuple(
                Entry(path, Replicate())
                for path in ("layers.*", "layers.*.attn", "layers.*.ffn", "head")
            ),
            exits=(Entry("layers.*.ffn", Replicate()),),
            partial_to=Replicate(),
        )
    if layout != "sp":
        raise ValueError(f"layout={layout!r}: the plans are 'sp' and 'replicated'")
    anchors: tuple[Entry, ...] = (
        Entry("layers.*", Shard(0)),
        Entry("layers.*.attn", Replicate()),
        Entry("layers.*.ffn", Shard(0)),
        Entry("head", Replicate()),
    )
    if exit_all_to_all:
        anchors += (Entry("layers.*.attn.wo_b", Shard(0)),)
    if split_shared:
        anchors += (Entry("layers.*.ffn.shared_expert", Replicate()),)
    entry_cuts = ("layers.*.attn",) if attn_entry == "auto" else ()
    return ShardingPlan(
        params=tuple(params),
        anchors=anchors,
        entry_cuts=entry_cuts,
        entry_cut_reason=f"attn_entry={attn_entry!r}",
    )
