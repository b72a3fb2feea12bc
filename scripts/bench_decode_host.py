"""A batch-1 decode step's host overhead and weight loads, A/B in one process, beside llama.cpp bf16.

bench_peers' workload (a) model (a random-init 50M Llama, bf16) or the real SmolLM2 (`--model smollm2`),
one engine at defaults. Its decode runs in turn, REPS times each:
  general inputs   the general StepInputs path, ordinary weight loads (what ran before the two changes)
  decode inputs    StepInputs' decode-only path, ordinary loads
  + nontemporal    the decode-only path, non-temporal weight loads
  default          what the engine chose at start (models/weight_loads.py)
Then llama-batched-bench at batch 1 on the same weights (bf16 GGUF), so every variant's ratio is taken in
the same window. Prints each variant's median decode tok/s, ms per step, host ms per step (llm.stats: the
step outside the forward and logits), and its ratio to llama.cpp per rep.

    python scripts/bench_decode_host.py [--model smollm2] [--reps 5] [--no-llamacpp]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llamacpp  # noqa: E402  scripts/llamacpp.py
from peers.children import _batchrun_run, _setup_child_torch  # noqa: E402
from peers.inputs import build_model_a, prepare_smollm2, random_prompts  # noqa: E402
from peers.processes import run_llamacpp  # noqa: E402

NPP, NTG = 128, 64
VARIANTS = ("general inputs", "decode inputs", "+ nontemporal", "default")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama50m", "smollm2"), default="llama50m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-llamacpp", action="store_true")
    a = ap.parse_args()
    _setup_child_torch()
    from batchrun import LLM, SamplingParams
    from batchrun.kernels import cpu_gemm
    if a.model == "smollm2":
        gguf_q, path = prepare_smollm2()
    else:
        path, _ = build_model_a(False)
    llm = LLM(path, dtype="bfloat16", max_num_seqs=1)
    engine = llm.engine
    chosen = engine.memory_ledger["cpu_gemm"]["weight_loads"]
    inputs = engine.runner.inputs
    fast = inputs._prepare_decodes
    vocab = engine.runner.model.args.vocab_size
    gguf = None
    if not a.no_llamacpp:
        llamacpp.ensure_built()
        gguf = llamacpp.convert_hf_to_gguf(path, path.rstrip("/") + "-bf16.gguf", "bf16")
    sp = SamplingParams(max_tokens=NTG + 1, temperature=0.0, ignore_eos=True)
    _batchrun_run(llm, random_prompts(2, 16, vocab, 7), SamplingParams(max_tokens=4, temperature=0.0,
                                                                       ignore_eos=True))
    res: dict = {v: [] for v in VARIANTS}
    peer: list = []
    work = tempfile.mkdtemp(prefix="bench_decode_host-")
    for rep in range(a.reps):
        for v in VARIANTS:
            inputs._prepare_decodes = inputs._prepare_mixed if v == "general inputs" else fast
            cpu_gemm.set_weight_loads({"general inputs": "cached", "decode inputs": "cached",
                                       "+ nontemporal": "nontemporal"}.get(v, chosen["choice"]))
            s0 = engine.stats
            r = _batchrun_run(llm, random_prompts(1, NPP, vocab, 100 * rep + VARIANTS.index(v)), sp)
            s1 = engine.stats
            steps = s1["steps"] - s0["steps"]
            res[v].append((r["decode_tok_s"], 1e3 * (s1["host_overhead_s"] - s0["host_overhead_s"]) / steps))
        if gguf:
            rows, _, _ = run_llamacpp(gguf, NPP, NTG, [1], work, 600, f"host{rep}")
            peer.append(rows[0]["speed_tg"])
    inputs._prepare_decodes = fast
    cpu_gemm.set_weight_loads(chosen["choice"])
    print(f"\n{a.model} bf16, batch 1, {NPP}-token prompts, {NTG} new tokens, {a.reps} reps alternated; "
          f"engine's weight loads: {chosen['choice']} (measured nontemporal / cached {chosen['ratio']}, "
          f"{'cached' if chosen['cached'] else 'measured in %.2f s' % chosen['measure_s']})")
    head = f"{'variant':<16} {'decode tok/s':>12} {'ms/step':>8} {'host ms':>8}"
    print(head + ("   vs llama.cpp bf16 (each rep)" if peer else ""))
    for v, rs in res.items():
        tok = statistics.median(t for t, _ in rs)
        host = statistics.median(h for _, h in rs)
        line = f"{v:<16} {tok:>12.1f} {1e3 / tok:>8.3f} {host:>8.3f}"
        if peer:
            ratios = [t / p for (t, _), p in zip(rs, peer)]
            line += f"   {statistics.median(ratios):.2f}x ({'/'.join(f'{x:.2f}' for x in ratios)})"
        print(line)
    if peer:
        print(f"{'llama.cpp bf16':<16} {statistics.median(peer):>12.1f} {1e3 / statistics.median(peer):>8.3f}")


if __name__ == "__main__":
    main()
