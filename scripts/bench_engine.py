"""Output tokens/s of batchrun's engine against HF transformers `generate` with static padded batches.

Same random-init weights (a small Llama shape), same prompts, same run. Prompt lengths and max_tokens
are mixed, as in a real batch; only requested tokens count as output for both.

    python scripts/bench_engine.py [--num-prompts 64] [--dtype bfloat16] [--hf-batch-size 16]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time

import torch

from bench_common import build_model, timed_generate


def workload(args):
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.num_prompts)]
    max_tokens = [rng.randint(args.min_tokens, args.max_tokens) for _ in prompts]
    return prompts, max_tokens


def run_batchrun(path, prompts, max_tokens, args):
    from batchrun import LLM, SamplingParams
    llm = LLM(path, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    timed_generate(llm, prompts[:4], params[:4])   # warm-up
    dt, outs = timed_generate(llm, prompts, params)
    return sum(len(o.token_ids) for o in outs) / dt, dt, llm.stats


def run_hf(path, prompts, max_tokens, args):
    import transformers as tf
    model = tf.LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    bs = args.hf_batch_size
    t = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), bs):
        batch, mt = prompts[i:i + bs], max_tokens[i:i + bs]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])        # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(mt), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        useful += sum(mt)
    dt = time.perf_counter() - t
    return useful / dt, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts, max_tokens = workload(args)
    with tempfile.TemporaryDirectory() as d:
        build_model(d, args.dtype)
        ours, ours_s, stats = run_batchrun(d, prompts, max_tokens, args)
        hf, hf_s = run_hf(d, prompts, max_tokens, args)
    result = {"num_prompts": len(prompts), "dtype": args.dtype, "output_tokens": sum(max_tokens),
              "batchrun_tok_s": round(ours, 1), "batchrun_s": round(ours_s, 2),
              "hf_static_tok_s": round(hf, 1), "hf_static_s": round(hf_s, 2),
              "hf_batch_size": args.hf_batch_size, "ratio": round(ours / hf, 2),
              "tokens_per_step": round(stats["tokens_per_step"], 1), "steps": stats["steps"]}
    print(json.dumps(result))
    print(f"batchrun {ours:.1f} tok/s vs HF static batches {hf:.1f} tok/s: {ours / hf:.2f}x", file=sys.stderr)


if __name__ == "__main__":
    main()
