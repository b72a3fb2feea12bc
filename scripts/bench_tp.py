"""Tensor parallelism on CPU: decode step time at tensor_parallel_size 2 vs 1, and what its all-reduces cost.

    python scripts/bench_tp.py [--batches 1,64] [--tokens 32]

The model is bench_peers' workload (a) Llama (hidden 512, 8 layers, 8 query / 2 KV heads, vocab 32,000,
bf16; SmolLM2-135M's 9 heads do not split over 2 ranks). Each batch decodes --tokens tokens after 128-token
prompts; TP=1 runs with all the cores, TP=2 with half of them per rank. The all-reduce line times gloo
all-reduces of one step's [B, hidden] bf16 output, two per layer, between two processes on loopback: the
communication a TP=2 step adds. On one machine's cores TP only re-divides the same memory bandwidth, so the
ratio here says what the collectives and the second process cost, not what TP buys on GPUs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers.inputs import MODEL_A, build_model_a   # noqa: E402


def decode_ms(path: str, tp: int, batch: int, tokens: int) -> float:
    from batchrun import LLM, SamplingParams
    prompts = [{"prompt_token_ids": [(7 * i + j) % 31000 + 3 for j in range(128)]} for i in range(batch)]
    with LLM(path, dtype="bfloat16", max_num_seqs=batch, tensor_parallel_size=tp,
             enable_prefix_caching=False) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)   # warm
        s0 = llm.stats["steps"]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        dt = time.perf_counter() - t
        steps = llm.stats["steps"] - s0 - 1            # less the prefill step
    return 1000 * dt / max(steps, 1)


def _allreduce_rank(rank: int, port: int, batch: int, hidden: int, calls: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    x = torch.randn(batch, hidden, dtype=torch.bfloat16)
    for _ in range(20):
        dist.all_reduce(x)
    t = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t) / calls)
    dist.destroy_process_group()


def allreduce_ms_per_step(batch: int, hidden: int, layers: int) -> float:
    from batchrun.engine.tp_group import _free_port
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, batch, hidden, 200, q)) for r in range(2)]
    for p in procs:
        p.start()
    per_call = q.get(timeout=300)
    for p in procs:
        p.join()
    return 1000 * per_call * 2 * layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    path, _ = build_model_a(quick=False)      # cached with bench_peers' inputs
    print(f"{'batch':>5}  {'TP=1 ms/step':>12}  {'TP=2 ms/step':>12}  {'TP2/TP1':>7}  {'all-reduce ms/step':>18}  "
          f"{'share of TP=2 step':>18}")
    for b in (int(x) for x in args.batches.split(",")):
        one = decode_ms(path, 1, b, args.tokens)
        two = decode_ms(path, 2, b, args.tokens)
        ar = allreduce_ms_per_step(b, MODEL_A["hidden_size"], MODEL_A["num_hidden_layers"])
        print(f"{b:>5}  {one:>12.2f}  {two:>12.2f}  {two / one:>7.2f}  {ar:>18.2f}  {100 * ar / two:>17.0f}%")


if __name__ == "__main__":
    main()
