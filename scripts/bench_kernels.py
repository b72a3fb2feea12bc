"""batchrun's CPU kernels on SmolLM2-135M's layer shapes, beside torch's ops on the same inputs, in one run:
the bf16 projection (`kernels/cpu_gemm.py`) against torch's bf16 and float32 F.linear at 1-256 rows (GB/s
of weights at one row, GFLOP/s from there), and paged attention (`kernels/cpu_attention.py`) per layer for
decode batches and a prefill chunk, against torch's SDPA on the same K/V already gathered (a lower bound for
any torch path: the gather is not timed). Each case cycles through 30 copies (one per layer) so that weights
and K/V come from memory, as in a real step; best of 5.

    python scripts/bench_kernels.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu_attention, cpu_gemm

LAYERS = 30
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 576, 9, 3, 64, 16
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_of(fn, n: int, reps: int = 5) -> float:
    """Seconds per call: the best of `reps` passes of fn over its n copies."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def projections() -> None:
    print(f"{'shape':8s} {'rows':>5s} {'batchrun':>10s} {'torch bf16':>11s} {'torch f32':>10s}")
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k).mul_(0.05).bfloat16() for _ in range(LAYERS)]
        packed = [cpu_gemm.pack(w) for w in ws]
        w32 = [w.float() for w in ws]
        for rows in (1, 16, 64, 256):
            x = torch.randn(rows, k).bfloat16()
            x32 = x.float()
            t = [best_of(lambda: [cpu_gemm.linear(x, p, n) for p in packed], LAYERS),
                 best_of(lambda: [F.linear(x, w) for w in ws], LAYERS),
                 best_of(lambda: [F.linear(x32, w) for w in w32], LAYERS)]
            if rows == 1:   # bytes of bf16 weights read per second
                cells = [f"{n * k * 2 / s / 1e9:7.1f} GB/s" for s in t]
            else:
                cells = [f"{2 * rows * n * k / s / 1e9:6.1f} GF/s" for s in t]
            print(f"{name:8s} {rows:5d} " + " ".join(cells))


def attention_case(label: str, qlens: list[int], ctxs: list[int]) -> None:
    nbs = [c // BLOCK + 1 for c in ctxs]
    caches = [(torch.randn(sum(nbs), BLOCK, KV_HEADS, HEAD_DIM).bfloat16(),
               torch.randn(sum(nbs), BLOCK, KV_HEADS, HEAD_DIM).bfloat16()) for _ in range(LAYERS)]
    q = torch.randn(sum(qlens), HEADS, HEAD_DIM).bfloat16()
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(ctxs, dtype=torch.int32)
    tables = torch.zeros(len(ctxs), max(nbs), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = torch.arange(start, start + nb)
        start += nb
    ours = best_of(lambda: [cpu_attention.paged_attention(q, k, v, qsl, lens, tables, HEAD_DIM ** -0.5)
                            for k, v in caches], LAYERS)
    # torch: SDPA per sequence on K/V already laid out contiguously, GQA by repeat (not timed: the gather)
    seqs = []
    for i, (ql, c) in enumerate(zip(qlens, ctxs)):
        blocks = tables[i, :nbs[i]].long()
        k, v = (x[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:c] for x in caches[0])
        rep = lambda t: t.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)[None]  # noqa: E731
        mask = torch.ones(ql, c, dtype=torch.bool).tril(c - ql)
        seqs.append((q[qsl[i]:qsl[i + 1]].transpose(0, 1)[None], rep(k), rep(v), mask))
    ref = best_of(lambda: [F.scaled_dot_product_attention(a, b, c, attn_mask=m) for a, b, c, m in seqs], 1, 3)
    kv_bytes = sum(ctxs) * KV_HEADS * HEAD_DIM * 2 * 2
    # q.k and p @ v over the keys each query sees (causal): decode is memory-bound, prefill compute-bound
    flop = sum(ql * (c - ql) + ql * (ql + 1) / 2 for ql, c in zip(qlens, ctxs)) * HEADS * HEAD_DIM * 4
    line = (f"{label:22s} {ours * 1e3:8.3f} ms {kv_bytes / ours / 1e9:6.1f} GB/s {flop / ours / 1e9:6.1f} GFLOP/s"
            f"   torch SDPA {ref * 1e3:8.3f} ms")
    if cpu_attention.attention_isa() == "avx512_bf16":   # the generic loops beside the VDPBF16PS path
        gen = best_of(lambda: [cpu_attention.paged_attention(q, k, v, qsl, lens, tables, HEAD_DIM ** -0.5,
                                                             isa="avx512") for k, v in caches], LAYERS)
        line += f"   generic loops {gen * 1e3:8.3f} ms ({gen / ours:.2f}x)"
    print(line)


def main() -> None:
    if not cpu_gemm.supported():
        raise SystemExit("batchrun's CPU kernels are not available on this machine")
    print(f"threads {torch.get_num_threads()}, projection ISA {cpu_gemm.isa()}, attention ISA "
          f"{cpu_attention.attention_isa()}; {LAYERS} copies per case\n")
    projections()
    print(f"\npaged attention per layer (9 query / 3 KV heads of 64, bf16)")
    attention_case("decode B=1 ctx 160", [1], [160])
    attention_case("decode B=32 ctx 300", [1] * 32, [300] * 32)
    attention_case("decode B=64 ctx 160", [1] * 64, [160] * 64)
    attention_case("prefill 9 x 230", [230] * 9, [230] * 9)


if __name__ == "__main__":
    main()
