"""Swap against recompute preemption under memory pressure, side by side in one run.

A KV budget far below the working set forces preemption; both modes run the same prompts on the same
weights. In float32 their greedy tokens are identical (tests/test_features.py proves it); in bf16 a
recomputed prefill rounds differently from the decode steps that first built the KV, so a few random-init
sequences can diverge at near-ties: the script reports how many. Also measures the break-even sequence length between
recomputing a preempted sequence (a prefill) and swapping it (two block copies), which sets the
default `swap_min_tokens`.

    python scripts/bench_swap.py [--num-prompts 48] [--kv-fraction 0.2]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from bench_common import build_model, timed_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[256, 768])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--kv-fraction", type=float, default=0.2, help="KV budget / working set")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from batchrun import LLM, SamplingParams
    from batchrun.models.loader import inspect_model
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(*args.prompt_len))]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        path = args.model or build_model(d, args.dtype)
        per_token = inspect_model(path).kv_bytes_per_token(getattr(torch, args.dtype))
        working_set = sum(len(p) + args.max_tokens for p in prompts) * per_token
        budget = int(working_set * args.kv_fraction)
        rows, tokens = {}, {}
        for mode in ("swap", "recompute"):
            llm = LLM(path, dtype=args.dtype, kv_cache_memory=budget, preemption_mode=mode, swap_min_tokens=0,
                      max_num_seqs=args.num_prompts, max_num_batched_tokens=2048,
                      enable_prefix_caching=False)   # recompute means recompute: no reuse of its own cached blocks
            secs, outs = timed_generate(llm, prompts, params)
            st = llm.stats
            tokens[mode] = [o.token_ids for o in outs]
            rows[mode] = {"seconds": round(secs, 2),
                          "output_tok_s": round(sum(len(t) for t in tokens[mode]) / secs, 1),
                          "preemptions": st["preemptions"], "swapped_out_blocks": st["swapped_out_blocks"],
                          "swapped_in_blocks": st["swapped_in_blocks"], "recomputed_tokens": st["recomputed_tokens"],
                          "steps": st["steps"]}
        # break-even: seconds per token to recompute (prefill) against to swap out and back in
        runner = llm.engine.runner
        n = 512
        kv = runner.kv_caches
        blocks = torch.arange(min(n // runner.block_size, runner.num_blocks))
        host = torch.empty_like(kv.index_select(2, blocks))
        t = time.perf_counter()
        for _ in range(5):
            host.copy_(kv.index_select(2, blocks))
            kv.index_copy_(2, blocks, host)
        swap_per_token = (time.perf_counter() - t) / 5 / (len(blocks) * runner.block_size)
        t = time.perf_counter()
        timed_generate(llm, [prompts[0][:n]], SamplingParams(max_tokens=1, temperature=0.0))
        prefill_per_token = (time.perf_counter() - t) / n
    result = {"kv_budget_bytes": budget, "working_set_bytes": working_set, "swap": rows["swap"],
              "recompute": rows["recompute"], "differing_sequences": sum(a != b for a, b in zip(tokens["swap"], tokens["recompute"])),
              "swap_speedup": round(rows["recompute"]["seconds"] / rows["swap"]["seconds"], 2),
              "prefill_s_per_token": prefill_per_token, "swap_s_per_token": swap_per_token,
              "recompute_to_swap_cost_ratio": round(prefill_per_token / swap_per_token, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
