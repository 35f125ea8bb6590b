"""NPU smoke test on 8 Ascend NPUs. NEEDS 8 NPUs, torch_npu and the CANN toolkit; it has NOT
RUN on any machine yet (written on a CPU-only machine, where only the linter reads it).

    torchrun --nproc-per-node 8 tools/npu_smoke.py

1. HCCL collectives on the NPUs, against values computed on the host: all-gather,
   reduce-scatter (sum), all-to-all with equal splits and with uneven splits (functional
   collectives, eager).
2. torch_npu's `npu_grouped_matmul` in the one form graph mode uses for the routed experts
   (row groups given as counts, 3-D weight, one output; `targets/npu_passes.py`) against
   per-group matmuls on the host -- the assumption the CPU stand-in
   (`testing.torchair_standin.register_npu_ops`) encodes.
3. The tiny model compiled with `dsv41_sp` (tp=4, ep=8, padded EP dispatch) against the
   single-device model in eager on the same NPU, through the SP issue's serving steps
   (prefill, decode, multi-token decode, longer prefill), in each NPU lowering:
   `lowering="npugraph_ex"` (each step of at most `capture_tokens` tokens captured as an ACL
   graph; the steps run twice, the second time on a new cache, so that each size is captured
   and then replayed) and `lowering="torchair"` (GE graph mode).

Prints a pass / fail table on rank 0; exit status 1 when any check fails on any rank. What the
CPU already checks (tools/torchair_coverage.py: every op has a torchair converter, and with
`--lowering npugraph_ex` an NPU kernel in torch_npu's registration; the tests run the graphs
torchair and npugraph_ex would get on CPU) leaves what only hardware shows: GE conversion, ACL
graph capture and replay, HCCL, torch_npu's kernels, the symbolic token count under GE.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from dsv41_compile.report.cli import tool_parser

TP, EP = 4, 8
ATOL = RTOL = 1e-5  # fp32, as in the CPU numerics tests


def check_collectives(rank: int, world: int, device: torch.device) -> list[tuple[str, bool, str]]:
    results = []
    group = dist.group.WORLD

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        ok = torch.allclose(got.cpu(), want, atol=ATOL, rtol=RTOL)
        results.append((name, ok, f"max |diff| {float((got.cpu() - want).abs().max()):.2e}"))

    x = torch.arange(6.0).view(2, 3) + 10 * rank
    got = funcol.all_gather_tensor(x.to(device), 0, group)
    record(
        "all_gather", got, torch.cat([torch.arange(6.0).view(2, 3) + 10 * r for r in range(world)])
    )

    y = torch.arange(world * 2.0).view(world, 2) * (rank + 1)
    got = funcol.reduce_scatter_tensor(y.to(device), "sum", 0, group)
    total = sum(r + 1 for r in range(world))
    record("reduce_scatter", got, torch.arange(world * 2.0).view(world, 2)[rank : rank + 1] * total)

    # equal splits: rank r sends value 100 r + d to rank d
    z = torch.tensor([100.0 * rank + d for d in range(world)])
    got = funcol.all_to_all_single(z.to(device), None, None, group)
    record("all_to_all equal", got, torch.tensor([100.0 * s + rank for s in range(world)]))

    # uneven splits: rank r sends (r + d) % 3 rows of value 100 r + d to rank d
    def rows(src: int, dst: int) -> int:
        return (src + dst) % 3

    send = [rows(rank, d) for d in range(world)]
    recv = [rows(s, rank) for s in range(world)]
    u = torch.cat([torch.full((rows(rank, d),), 100.0 * rank + d) for d in range(world)])
    got = funcol.all_to_all_single(u.to(device), recv, send, group)
    want = torch.cat([torch.full((rows(s, rank),), 100.0 * s + rank) for s in range(world)])
    record("all_to_all uneven", got, want)
    return results


def check_grouped_matmul(device: torch.device) -> list[tuple[str, bool, str]]:
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])  # rows per group; the last 2 rows are in no group
    x = torch.randn(12, 16, generator=gen)
    w = torch.randn(4, 8, 16, generator=gen)  # [G, N, K], as the experts' weights
    got = torch.ops.npu.npu_grouped_matmul(
        [x.to(device)],
        [w.to(device).transpose(1, 2)],
        group_list=counts.to(device),
        split_item=3,
        group_type=0,
        group_list_type=1,
    )[0].cpu()[:10]
    want = torch.cat([x[s : s + c] @ w[g].T for g, (s, c) in enumerate(zip([0, 3, 3, 8], counts))])
    ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-3, rtol=1e-3)
    return [("npu_grouped_matmul (counts, 3-D weight)", ok, f"shape {tuple(got.shape)}")]


def check_model(rank: int, device: torch.device, lowering: str) -> list[tuple[str, bool, str]]:
    import copy

    import dsv41_compile
    from dsv41_compile.deepseek_v41.model import DeepseekV41, ModelConfig
    from dsv41_compile.deepseek_v41.testing.batches import pack
    from dsv41_compile.deepseek_v41.testing.cases import SERVING_STEP_NAMES, SERVING_STEPS

    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.from_name("tiny")).to(device)
    reference = copy.deepcopy(model)
    options = {"tp": TP, "ep": EP, "ep_dispatch": "padded", "lowering": lowering}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dsv41_sp", options=options, fullgraph=True)
    results = []
    for round in range(2 if lowering == "npugraph_ex" else 1):  # captures, then replays
        cache, ref_cache = model.new_cache(4, 32), reference.new_cache(4, 32)
        for name, step in zip(SERVING_STEP_NAMES, SERVING_STEPS):
            ids, positions, slots = (t.to(device) for t in pack(step[rank // TP]))
            dsv41_compile.mark_token_dim(ids, positions, slots)
            got = compiled(ids, positions, slots, cache)
            want = reference(ids, positions, slots, ref_cache)
            ok = torch.allclose(got, want, atol=ATOL, rtol=RTOL)
            diff = f"max |diff| {float((got - want).abs().max()):.2e}"
            results.append((f"tiny {lowering} {round}: {name}", ok, diff))
    return results


def main() -> None:
    tool_parser(__doc__).parse_args()  # --help, without torch_npu
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        sys.exit(
            "npu_smoke.py needs torch_npu and Ascend NPUs (run it under torchrun on an NPU machine)"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != TP * 2:
        sys.exit(f"run with 8 processes (torchrun --nproc-per-node 8), got {world}")
    device = torch.device("npu", int(os.environ.get("LOCAL_RANK", rank)))
    torch.npu.set_device(device)
    dist.init_process_group("hccl")
    stages = (
        ("collectives", lambda: check_collectives(rank, world, device)),
        ("grouped matmul", lambda: check_grouped_matmul(device)),
        ("tiny model npugraph_ex", lambda: check_model(rank, device, "npugraph_ex")),
        ("tiny model torchair", lambda: check_model(rank, device, "torchair")),
    )
    results = []
    for stage, check in stages:
        try:
            results += check()
        except Exception as error:  # a failing stage is a row of the table, not a crash
            results.append((stage, False, f"{type(error).__name__}: {error}"))
            traceback.print_exc()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    failed = any(not ok for per_rank in gathered for _, ok, _ in per_rank)
    if rank == 0:
        print(f"{'check':<40} {'rank':>4} {'result':<6} detail")
        for r, per_rank in enumerate(gathered):
            for name, ok, detail in per_rank:
                print(f"{name:<40} {r:>4} {'PASS' if ok else 'FAIL':<6} {detail[:120]}")
        print("\nFAILED" if failed else "\nall checks passed")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
