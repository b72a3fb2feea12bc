"""The bf16 projections of the real SmolLM2-135M (30 layers: qkv 960x576, o 576x576, gate_up 3072x576,
down 576x1536) on each implementation that runs on this CPU (models/cpu_linear.py: own kernel, oneDNN packed,
plain F.linear), timed on the same weights per row count, beside what the measured choice
(models/kernel_choice.py, cpu_gemm=auto) runs: its time as a share of the fastest form per weight shape.
The target is chosen / best <= 1.05 at every row count.

    python scripts/bench_gemm_forms.py [--rows 1,4,16,64,256,2048] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("BATCHRUN_CPU_GEMM", "plain")   # load the weights as they are; each form is packed here

from batchrun import LLM  # noqa: E402
from batchrun.models import cpu_linear, kernel_choice  # noqa: E402
from batchrun.models.cpu_info import machine_kind  # noqa: E402
from batchrun.models.smollm2 import smollm2_gguf  # noqa: E402


def time_forms(layers: list[list[torch.Tensor]], packed: dict, rows: int, reps: int) -> dict:
    """{form: {shape: best seconds over reps of one pass over every layer}}; the forms' reps alternate."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=torch.bfloat16) for ws in layers for w in ws}
    best: dict = {f: {} for f in packed}
    for r in range(reps + 1):               # rep 0 warms (oneDNN builds a primitive per shape and rows)
        for f, ws_by_layer in packed.items():
            per: dict = {}
            for ws, plain in zip(ws_by_layer, layers):
                for w, p in zip(ws, plain):
                    t0 = time.perf_counter()
                    cpu_linear.linear(xs[p.shape[1]], w)
                    per[tuple(p.shape)] = per.get(tuple(p.shape), 0.0) + time.perf_counter() - t0
            if r:
                for s, t in per.items():
                    best[f][s] = min(best[f].get(s, float("inf")), t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64,256,2048")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    llm = LLM(smollm2_gguf(), dtype="bfloat16", max_num_seqs=64)
    model, threads = llm.engine.runner.model, llm.engine.runner.threads
    layers = kernel_choice._stream(model)[:-1]           # the decoder layers' projections (no logits)
    shapes = list(dict.fromkeys(tuple(w.shape) for ws in layers for w in ws))
    forms = [f for f in cpu_linear.FORMS if all(f in cpu_linear.forms_for(s) for s in shapes)]
    os.environ["BATCHRUN_KERNEL_CACHE"] = "0"            # measure now, as a first start would
    chosen = kernel_choice.choose(model, "auto", threads, 64)
    print(f"machine: {machine_kind()}; torch {torch.__version__}; {threads} threads")
    print(f"measured choice ({chosen['report']['measure_s']:.2f} s): {chosen['report']['choice']}")
    packed = {f: [[cpu_linear.pack(w, f, 64) for w in ws] for ws in layers] for f in forms}
    print(f"{'rows':>5} " + " ".join(f"{f + ' ms':>12} {'GFLOP/s':>8}" for f in forms)
          + f" {'chosen ms':>10} {'chosen/best':>11}")
    for rows in [int(r) for r in a.rows.split(",")]:
        best = time_forms(layers, packed, rows, a.reps)
        flops = 2 * rows * sum(w.numel() for ws in layers for w in ws)
        totals = {f: sum(best[f].values()) for f in forms}
        b = kernel_choice.bucket_of(rows)
        picked = sum(best[chosen["choice"][s][b]][s] for s in shapes)
        fastest = sum(min(best[f][s] for f in forms) for s in shapes)
        print(f"{rows:>5} " + " ".join(f"{totals[f] * 1e3:>12.2f} {flops / totals[f] / 1e9:>8.0f}" for f in forms)
              + f" {picked * 1e3:>10.2f} {picked / fastest:>11.3f}")


if __name__ == "__main__":
    main()
