"""Throughput of batchrun on one GPU against ceilings measured in the same run.

A random-init model of about 1B parameters in Llama shape (bf16), 2,000 prompts of mixed length
(inputs 128..2,048 tokens, outputs 64..512, ignore_eos). Prints one JSON object: output and prefill
tokens/s, model FLOPs utilisation against a large bf16 matmul, memory-bandwidth utilisation against a
large device copy, and the paged decode attention kernel's achieved fraction of copy bandwidth.

    python scripts/gpu_bench.py [--out result.json]
    python scripts/gpu_bench.py --tiny       # a seconds-long run of the same code path (CPU too)

Without CUDA it refuses (exit 2) unless --tiny or an explicit --device cpu asks for the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

ONE_B = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
             vocab_size=32000, max_position_embeddings=4096)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
            vocab_size=512, max_position_embeddings=512)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, reps):
    fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


def matmul_ceiling(device, n, dtype):
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timeit(lambda: a @ b, device, 10)          # FLOP/s


def copy_ceiling(device, nbytes):
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * nbytes / timeit(lambda: dst.copy_(src), device, 10)  # bytes read + written per second


def decode_attention_fraction(device, dtype, copy_bw, tiny):
    """Paged decode kernel time against the K/V bytes it must read, as a fraction of copy bandwidth."""
    if device.type != "cuda":
        return None           # the Triton kernel runs on CUDA only (its CPU tests use the interpreter)
    from batchrun.kernels import paged_decode_attention
    B, Hq, Hkv, D, ctx, bs = (4, 4, 2, 64, 64, 16) if tiny else (64, 32, 8, 64, 2048, 16)
    nblk = B * ctx // bs
    k_cache = torch.randn(nblk, bs, Hkv, D, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, Hq, D, device=device, dtype=dtype)
    tables = torch.arange(nblk, device=device, dtype=torch.int32).view(B, ctx // bs)
    lens = torch.full((B,), ctx, device=device, dtype=torch.int32)
    secs = timeit(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5), device, 20)
    read = 2 * B * ctx * Hkv * D * k_cache.element_size()
    return {"seconds": secs, "bytes": read, "fraction_of_copy_bw": (read / secs) / (copy_bw / 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small model and workload: checks the code path")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--out", default=None, help="write the JSON here as well as to stdout")
    ap.add_argument("--device", default="auto", help="auto (CUDA), cuda or cpu (cpu: an explicit dry run)")
    args = ap.parse_args()
    if args.device == "auto" and not args.tiny and not torch.cuda.is_available():
        ap.exit(2, "gpu_bench.py: CUDA is not available here; run it on a GPU machine, or pass --tiny "
                   "(or --device cpu) for a CPU run\n")
    from batchrun import LLM, SamplingParams
    from batchrun.demo import write_demo_model
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = "bfloat16"
    shape = TINY if args.tiny else ONE_B
    n = args.num_prompts or (8 if args.tiny else 2000)
    lo_in, hi_in, lo_out, hi_out = (8, 64, 4, 16) if args.tiny else (128, 2048, 64, 512)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(rng.randint(lo_in, hi_in))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(lo_out, hi_out), temperature=0.0, ignore_eos=True)
              for _ in range(n)]
    flops_peak = matmul_ceiling(device, 256 if args.tiny else 8192, torch.bfloat16)
    copy_bw = copy_ceiling(device, (1 << 20) if args.tiny else (2 << 30))
    with tempfile.TemporaryDirectory() as d:
        write_demo_model(d, dtype=dtype, **shape)
        llm = LLM(d, dtype=dtype, device=str(device), max_num_seqs=256, max_num_batched_tokens=8192)
        params_count = sum(p.numel() for p in llm.engine.runner.model.parameters())
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        sync(device)
        secs = time.perf_counter() - t
    st = llm.stats
    out_tokens = sum(len(o.token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    # 2 FLOPs per parameter per token (matmuls); attention FLOPs left out, so MFU is a lower bound
    achieved = 2 * params_count * (in_tokens + out_tokens) / secs
    # each decode step reads the weights once: bandwidth lower bound from weight reads alone
    weight_bytes = params_count * 2
    mbu = (weight_bytes * st["steps"] / secs) / (copy_bw / 2)
    ttft = [o.metrics.first_token_s for o in outs if o.metrics.first_token_s is not None]
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "tiny": args.tiny, "params": params_count, "num_prompts": n,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens, "seconds": round(secs, 2),
        "output_tok_s": round(out_tokens / secs, 1), "prefill_tok_s": round(in_tokens / secs, 1),
        "total_tok_s": round((in_tokens + out_tokens) / secs, 1),
        "matmul_ceiling_tflops": round(flops_peak / 1e12, 2), "copy_ceiling_gb_s": round(copy_bw / 1e9, 1),
        "mfu": round(achieved / flops_peak, 4), "mbu_weights": round(mbu, 4),
        "steps": st["steps"], "tokens_per_step": round(st["tokens_per_step"], 1),
        "preemptions": st["preemptions"], "mean_ttft_s": round(sum(ttft) / len(ttft), 3) if ttft else None,
        "memory_ledger": llm.engine.memory_ledger,
        "decode_attention": decode_attention_fraction(device, torch.bfloat16, copy_bw, args.tiny),
    }
    text = json.dumps(result)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
