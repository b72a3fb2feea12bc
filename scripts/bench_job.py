"""Benchmark the job runner: a job over 20,000+ short prompts on a random-init demo model.

Each configuration runs as a real `batchrun submit --json` subprocess (so peak RSS is per run), with
`plan.order: length` and `plan.order: input` in the same invocation. Printed per run: rows/s, output
tokens/s, the engine-busy fraction (time inside LLMEngine.step over the engine loop's wall time; the
rest is the runner's overhead, target < 5%) and peak RSS. --baseline also times LLM.generate on the
same prompts in one call, the engine with no runner around it.

    python scripts/bench_job.py                      # 20,000 prompts, max_tokens 16
    python scripts/bench_job.py --rows 50000 --max-tokens 32 --hidden 256 --layers 4 --baseline
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import yaml


def write_inputs(d: str, rows: int, files: int, seed: int, long_frac: float, long_words: int) -> list[str]:
    """Short prompts (5..60 words, skewed short) from the demo generator, over `files` Parquet files;
    a `long_frac` share of them stretched to `long_words` words (a long tail, where order matters)."""
    import random

    from batchrun.demo import write_demo_prompts
    tmp = os.path.join(d, "all.parquet")
    write_demo_prompts(tmp, rows, seed=seed)
    t = pq.read_table(tmp)
    rng = random.Random(seed)
    words = []
    for x in t.column("text").to_pylist():
        w = x.split()
        if rng.random() < long_frac:
            w = (w * (long_words // len(w) + 1))[:long_words]
        else:
            w = w[:60]
        words.append(" ".join(w))
    t = t.set_column(1, "text", pa.array(words))
    os.remove(tmp)
    os.makedirs(os.path.join(d, "in"))
    per = -(-rows // files)
    for k in range(files):
        pq.write_table(t.slice(k * per, per), os.path.join(d, "in", f"p{k:02d}.parquet"), row_group_size=1024)
    return words


def run_job(d: str, model: str, order: str, args, k: int) -> dict:
    job = {"name": f"bench-{order}", "model": {"path": model, "dtype": "float32"},
           "input": {"uri": os.path.join(d, "in"), "id_column": "id", "prompt_column": "text",
                     "passthrough": ["topic"]},
           "output": {"uri": os.path.join(d, f"out-{k}-{order}")},
           "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
           "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
           "plan": {"unit_rows": args.unit_rows, "window_units": args.window_units, "order": order}}
    path = os.path.join(d, f"job-{k}-{order}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "batchrun.cli", "submit", path, "--json", "--no-progress"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"submit failed ({p.returncode}):\n{p.stderr[-4000:]}")
    s = json.loads(p.stdout.strip().splitlines()[-1])
    s["process_wall_s"] = time.perf_counter() - t0
    return s


def baseline(model: str, texts: list[str], args) -> dict:
    from batchrun.api import LLM
    from batchrun.outputs import SamplingParams
    llm = LLM(model=model, dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(texts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"rows_per_s": len(texts) / wall, "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--unit-rows", type=int, default=2048)
    ap.add_argument("--window-units", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--orders", default="length,input")
    ap.add_argument("--long-frac", type=float, default=0.0, help="share of prompts made long")
    ap.add_argument("--long-words", type=int, default=400)
    ap.add_argument("--baseline", action="store_true", help="also time LLM.generate on the same prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from batchrun.demo import write_demo_model
    with tempfile.TemporaryDirectory(prefix="bench-job-") as d:
        heads = max(1, args.hidden // 32)
        model = write_demo_model(os.path.join(d, "model"), hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=heads, num_kv_heads=max(1, heads // 2),
                                 intermediate_size=args.hidden * 11 // 4, vocab_size=args.vocab,
                                 max_position_embeddings=1024)
        texts = write_inputs(d, args.rows, args.files, args.seed, args.long_frac, args.long_words)
        print(f"model: random-init Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}; "
              f"{args.rows} prompts in {args.files} files ({100 * args.long_frac:.0f}% of {args.long_words} words); "
              f"max_tokens={args.max_tokens} "
              f"max_num_seqs={args.max_num_seqs} unit_rows={args.unit_rows} window_units={args.window_units}")
        print(f"{'run':<14}{'rows':>8}{'rows/s':>10}{'out tok/s':>11}{'engine busy':>13}{'overhead':>10}"
              f"{'loop s':>9}{'process s':>11}{'peak RSS':>11}{'steps':>8}{'tok/step':>10}")
        for k, order in enumerate(args.orders.split(",")):
            s = run_job(d, model, order, args, k)
            busy = s["engine_busy_fraction"] or 0.0
            loop = s["engine_loop_s"]
            print(f"{'order: ' + order:<14}{s['rows']:>8}{s['rows'] / loop:>10.1f}"
                  f"{s['output_tokens'] / loop:>11.1f}{100 * busy:>12.1f}%{100 * (1 - busy):>9.1f}%"
                  f"{loop:>9.2f}{s['process_wall_s']:>11.2f}{s['peak_rss_bytes'] / 2**20:>9.0f}MiB"
                  f"{s['engine']['steps']:>8}{s['engine']['tokens_per_step']:>10.1f}")
        if args.baseline:
            b = baseline(model, texts, args)
            print(f"{'LLM.generate':<14}{args.rows:>8}{b['rows_per_s']:>10.1f}{b['output_tokens_per_s']:>11.1f}"
                  f"{'':>13}{'':>10}{b['wall_s']:>9.2f}")
        print("rows/s and out tok/s are over the engine loop (weights loaded, input streaming); "
              "process s includes interpreter start, planning and weight load.")


if __name__ == "__main__":
    main()
