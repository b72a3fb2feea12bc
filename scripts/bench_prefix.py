"""Prefix caching on against off on a shared-system-prompt workload, side by side in one run.

Every prompt is the same system prompt (default 1,500 tokens) followed by its own question (200 tokens).

    python scripts/bench_prefix.py [--num-prompts 64] [--system-len 1500] [--question-len 200]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile

from bench_common import build_model, timed_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1500)
    ap.add_argument("--question-len", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    from batchrun import LLM, SamplingParams
    rng = random.Random(0)
    system = [rng.randrange(3, 32000) for _ in range(args.system_len)]
    prompts = [system + [rng.randrange(3, 32000) for _ in range(args.question_len)]
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        path = args.model or build_model(d, args.dtype)
        for on in (True, False):
            llm = LLM(path, dtype=args.dtype, enable_prefix_caching=on, max_num_batched_tokens=4096)
            secs, outs = timed_generate(llm, prompts, params)
            st = llm.stats
            rows["on" if on else "off"] = {
                "seconds": round(secs, 2), "prompt_tokens": st["prefix_cache_queries"] or st["prompt_tokens"],
                "prompt_tokens_from_cache": st["prefix_cache_hits"],
                "hit_rate": round(st["prefix_cache_hit_rate"], 4), "steps": st["steps"],
                "tokens": [o.token_ids for o in outs]}
    same = rows["on"].pop("tokens") == rows["off"].pop("tokens")
    print(json.dumps({"num_prompts": args.num_prompts, "system_len": args.system_len,
                      "question_len": args.question_len, "on": rows["on"], "off": rows["off"],
                      "identical_tokens": same,
                      "speedup": round(rows["off"]["seconds"] / rows["on"]["seconds"], 2)}))


if __name__ == "__main__":
    main()
