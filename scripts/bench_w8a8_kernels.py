"""W8A8's int8 products against the bf16 kernel on SmolLM2-135M's projection shapes (30 layers: qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536; random weights, since speed depends on shapes only), per row
count: one pass over every layer, ms (best of --reps), each W8A8 kernel as the whole product (x quantized per
row, the int32 sums scaled to bf16), and GOP/s. The measured choice (models/w8a8.choose_kernels) picks among
these per row bucket at quantize time; this prints what it picks from. "own gN": the own kernel with scales
per group of N columns along K (w8a8.GROUP: the default quantization_group_size; torch's int8 GEMMs take one
group only). "rot": the same with the activations rotated per block of 64 in the quantizing pass
(w8a8.rotate_blocks, the default where 64 divides K; every shape here).

    python scripts/bench_w8a8_kernels.py [--rows 1,16,64,256,2048] [--reps 3] [--layers 30] [--groups 64,32]
"""
from __future__ import annotations

import argparse
import time

import torch

from batchrun.kernels import cpu_gemm
from batchrun.models.cpu_info import machine_kind
from batchrun.models.w8a8 import GROUP, W8A8Weight, _candidates, quantize_w8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--groups", default=f"{GROUP},32", help="the own kernel's group sizes to time too")
    a = ap.parse_args()
    torch.manual_seed(0)
    layers = [[torch.randn(n, k) * 0.05 for n, k in SHAPES] for _ in range(a.layers)]
    forms = {}
    if cpu_gemm.supported():
        packed = [[(cpu_gemm.pack(w.bfloat16()), w.shape[0]) for w in ws] for ws in layers]
        forms["bf16 own"] = lambda x, i, j: cpu_gemm.linear(x, *packed[i][j])
    plain = [[w.bfloat16() for w in ws] for ws in layers]
    forms["bf16 F.linear"] = lambda x, i, j: torch.nn.functional.linear(x, plain[i][j])
    quant = [[W8A8Weight(*quantize_w8(w)) for w in ws] for ws in layers]
    for k in _candidates()[:-1]:                      # "float" is the reference, not a contender
        forms[f"w8a8 {k}"] = lambda x, i, j, k=k: quant[i][j].run(x, k)
    groups = [int(g) for g in a.groups.split(",") if g] if "own" in _candidates(True) else []
    rotated = ["one"] + groups if groups else []
    for g in groups:
        qg = [[W8A8Weight(*quantize_w8(w, g)) for w in ws] for ws in layers]
        forms[f"w8a8 own g{g}"] = lambda x, i, j, qg=qg: qg[i][j].run(x, "own")
    for g in rotated:
        qr = [[W8A8Weight(*quantize_w8(w, None if g == "one" else g), rotate=True) for w in ws] for ws in layers]
        forms[f"w8a8 own {'' if g == 'one' else f'g{g} '}rot"] = lambda x, i, j, qr=qr: qr[i][j].run(x, "own")
    print(f"machine: {machine_kind()}; threads {torch.get_num_threads()}; {a.layers} layers")
    labels = [f"g{g}" for g in groups] + [f"{'' if g == 'one' else f'g{g} '}rot" for g in rotated]
    print(f"{'rows':>6}" + "".join(f"{f:>22}" for f in forms) + "   best one-group int8 / best bf16"
          + "".join(f", {lb}" for lb in labels))
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for _, k in SHAPES}
        best = dict.fromkeys(forms, float("inf"))
        for rep in range(a.reps + 1):                 # rep 0 warms (oneDNN builds a primitive per shape)
            for f, fn in forms.items():
                t0 = time.perf_counter()
                for i in range(a.layers):
                    for j, (_, k) in enumerate(SHAPES):
                        fn(xs[k], i, j)
                if rep:
                    best[f] = min(best[f], time.perf_counter() - t0)
        ops = 2 * m * a.layers * sum(n * k for n, k in SHAPES)
        bf = min(t for f, t in best.items() if f.startswith("bf16"))
        i8 = min(t for f, t in best.items() if f.startswith("w8a8") and " g" not in f and "rot" not in f)
        print(f"{m:>6}" + "".join(f"{t * 1e3:>11.2f} ({ops / t / 1e9:>5.0f}/s)" for t in best.values())
              + f"   {bf / i8:.2f}x" + "".join(f", {bf / best[f'w8a8 own {lb}']:.2f}x" for lb in labels))


if __name__ == "__main__":
    main()
