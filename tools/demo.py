"""Run the single-device DeepSeek V4.1 on a ragged prefill batch, then greedy decode steps.

Three requests with prompt lengths 5, 3 and 7 are packed into one prefill batch; each following
step decodes one token per request (the argmax of its last logits row). Every batch is checked
with `validate_batch` before the forward. Until the `dsv41_sp` backend exists this is the
single-device reference path.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import torch
from torch import Tensor

from dsv41_compile.model import DeepseekV41, ModelConfig
from dsv41_compile.model.cache import KVCache
from dsv41_compile.model.validate import validate_batch
from dsv41_compile.testing.batches import Request, pack

PROMPT_LENS = (5, 3, 7)
DECODE_STEPS = 3


def run_step(
    model: DeepseekV41,
    cache: KVCache,
    kind: str,
    ids_T: Tensor,
    positions_T: Tensor,
    slots_T: Tensor,
    last_rows: list[int],
    vocab_size: int,
) -> list[int]:
    """Validate and run one batch, print one report line, return each request's greedy token."""
    validate_batch(ids_T, positions_T, slots_T, cache, vocab_size=vocab_size)
    start = time.perf_counter()
    logits_TV = model(ids_T, positions_T, slots_T, cache)
    ms = (time.perf_counter() - start) * 1e3
    next_tokens = logits_TV[last_rows].argmax(dim=-1).tolist()
    print(
        f"{kind:<8} T={ids_T.shape[0]:<3} input_ids/positions/slots {str(list(ids_T.shape)):<5} "
        f"-> logits {str(list(logits_TV.shape)):<10} {logits_TV.dtype}  {ms:8.1f} ms  "
        f"next tokens {next_tokens}"
    )
    return next_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="ModelConfig preset (default: tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()

    cfg = dataclasses.replace(ModelConfig.from_name(args.preset), dtype=args.dtype)
    torch.manual_seed(0)
    model = DeepseekV41(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"config: preset={args.preset} dtype={cfg.dtype} vocab={cfg.vocab_size} dim={cfg.dim} "
        f"layers={cfg.n_layers} experts={cfg.n_routed_experts} (top-{cfg.n_activated_experts}) "
        f"params={n_params / 1e6:.2f}M"
    )

    num_requests = len(PROMPT_LENS)
    cache = model.new_cache(num_slots=num_requests, max_len=max(PROMPT_LENS) + DECODE_STEPS)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (sum(PROMPT_LENS),), generator=gen).split(
        PROMPT_LENS
    )
    ids_T, positions_T, slots_T = pack([Request(r, p.tolist()) for r, p in enumerate(prompts)])
    last_rows = [end - 1 for end in itertools.accumulate(PROMPT_LENS)]
    print(f"requests: prompt lengths {list(PROMPT_LENS)} in slots {list(range(num_requests))}")

    with torch.inference_mode():
        next_tokens = run_step(
            model, cache, "prefill", ids_T, positions_T, slots_T, last_rows, cfg.vocab_size
        )
        for step in range(DECODE_STEPS):
            ids_T, positions_T, slots_T = pack(
                [
                    Request(r, [tok], n + step)
                    for r, (tok, n) in enumerate(zip(next_tokens, PROMPT_LENS))
                ]
            )
            next_tokens = run_step(
                model,
                cache,
                "decode",
                ids_T,
                positions_T,
                slots_T,
                list(range(num_requests)),
                cfg.vocab_size,
            )


if __name__ == "__main__":
    main()
