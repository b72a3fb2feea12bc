"""How a decode step's attention reads the KV cache on CPU: the own kernel on caches laid out as the engine
holds them (every layer's K and V in one lazily paged tensor of --blocks blocks, each sequence's blocks
scattered among twice as many), in 4 KiB pages (engine/kv_memory.py, the engine's) or transparent huge pages
(a models/huge_pages.py slab), prefetching a bfloat16 cache one or two 16-key tiles ahead
(cpu_attention.set_kv_prefetch). The four variants alternate rep by rep in one process (the order reversed
every other rep); each prints its median ms per layer, the KV read rate, and its time as a share of the old
default's (4 KiB pages, one tile ahead).

    python scripts/bench_kv_reads.py [--shapes 64x150:8/2/64,64x300:9/3/64,...] [--layers 8] [--blocks 8192]
                                     [--reps 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from batchrun.engine.kv_memory import lazy_zeros
from batchrun.kernels import cpu_attention
from batchrun.models import huge_pages
from batchrun.models.cpu_info import machine_kind

VARIANTS = [("4k", 1), ("4k", 2), ("huge", 1), ("huge", 2)]     # (pages, tiles ahead); the first is the base


def parse_shape(spec: str) -> tuple:
    """"BxCTX:HQ/HKV/D" -> (B, CTX, HQ, HKV, D)."""
    bc, heads = spec.split(":")
    return (*map(int, bc.split("x")), *map(int, heads.split("/")))


def run_shape(b: int, ctx: int, hq: int, hkv: int, d: int, layers: int, blocks: int, reps: int) -> dict:
    nb = -(-ctx // 16)
    used = 2 * b * nb                       # each sequence's blocks among twice as many written ones
    if used > blocks:
        raise SystemExit(f"--blocks {blocks} holds fewer than the {used} blocks of {b}x{ctx}")
    data = torch.randn(layers, 2, used, 16, hkv, d).to(torch.bfloat16)
    shape = (layers, 2, blocks, 16, hkv, d)
    caches = {"4k": lazy_zeros(shape, torch.bfloat16), "huge": huge_pages.Slab([shape], torch.bfloat16).take(shape)}
    for kv in caches.values():
        kv[:, :, :used].copy_(data)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    bt = torch.randperm(used, generator=g)[:b * nb].to(torch.int32).view(b, nb)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    times: dict = {v: [] for v in VARIANTS}
    outs = {}
    old = cpu_attention.set_kv_prefetch(2)
    try:
        for rep in range(reps + 2):                     # two warm-up reps
            for pages, tiles in (VARIANTS if rep % 2 else VARIANTS[::-1]):
                kv = caches[pages]
                cpu_attention.set_kv_prefetch(tiles)
                t0 = time.perf_counter()
                for layer in range(layers):
                    out = cpu_attention.paged_attention(q, kv[layer, 0], kv[layer, 1], qsl, lens, bt, d ** -0.5)
                if rep >= 2:
                    times[(pages, tiles)].append((time.perf_counter() - t0) / layers)
                outs[(pages, tiles)] = out
    finally:
        cpu_attention.set_kv_prefetch(old)
    assert all(torch.equal(outs[VARIANTS[0]], o) for o in outs.values()), "the variants' outputs differ"
    return {v: statistics.median(t) for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="64x150:8/2/64,64x300:9/3/64,16x300:9/3/64,1x2000:9/3/64,4x1000:32/8/128")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=8192, help="blocks per layer (the engine's default pool)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    assert cpu_attention.load(), cpu_attention.status()["error"]
    print(f"machine: {machine_kind()}, {torch.get_num_threads()} threads; huge pages here: {huge_pages.available()}")
    print(f"{'BxCTX:heads':<20}" + "".join(f"{p + ' ' + str(t) + ' ahead':>22}" for p, t in VARIANTS))
    for spec in args.shapes.split(","):
        b, ctx, hq, hkv, d = parse_shape(spec)
        t = run_shape(b, ctx, hq, hkv, d, args.layers, args.blocks, args.reps)
        gbs = {v: b * ctx * hkv * d * 4 / s / 1e9 for v, s in t.items()}
        base = t[VARIANTS[0]]
        print(f"{spec:<20}" + "".join(f"{t[v] * 1e3:>8.3f} ms {gbs[v]:>4.1f} GB/s {t[v] / base:.2f}" for v in VARIANTS))


if __name__ == "__main__":
    main()
