"""CPU attention on SmolLM2-135M's heads (9 query / 3 KV heads of 64, bf16) on each implementation, beside
what the measured choice (models/attention_choice.py, cpu_attention=auto) runs: fresh prompt chunks on the
own kernel vs torch's SDPA (CPU flash attention, oneDNN brgemm: AMX where present) per chunk length, and a
decode step on the own kernel vs the torch reference path per batch and context. Prints each one's ms, the
choice, and chosen / best (the target is <= 1.05 at every size); also how long the start's measuring took.
--kv instead times the own kernel on a bf16, int8 and fp8_e4m3 cache (kv_cache_dtype) at each instruction
set it can run here (avx512_bf16: the VDPBF16PS paths; avx512, avx2: the generic loops), the same decode
steps and a 512-token prefill chunk on top of a 512-token prefix, as ms and as a share of the bf16 cache's.

    python scripts/bench_attention_forms.py [--lens 32,128,512,2048] [--decode 1x256,16x256,64x256,64x1024]
    python scripts/bench_attention_forms.py --kv [--decode ...]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from batchrun.kernels import cpu_attention
from batchrun.models import attention_choice as ac
from batchrun.models.attention import TorchAttentionBackend
from batchrun.models.cpu_info import machine_kind

HEADS = (9, 3, 64)          # SmolLM2-135M


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="32,128,512,2048")
    ap.add_argument("--decode", default="1x256,16x256,64x256,64x1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv", action="store_true", help="bf16 vs int8 vs fp8_e4m3 caches instead")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    assert cpu_attention.load(), cpu_attention.status()["error"]
    if args.kv:
        return kv_forms(args)
    hq, hkv, d = HEADS
    scale = d ** -0.5
    os.environ["BATCHRUN_KERNEL_CACHE"] = "0"       # measure afresh, as a first start does
    t0 = time.perf_counter()
    report = ac.choose(HEADS, torch.bfloat16, "auto", torch.get_num_threads(), 2048)
    took = time.perf_counter() - t0
    del os.environ["BATCHRUN_KERNEL_CACHE"]
    sdpa_from = report["sdpa_from"]
    print(f"machine: {machine_kind()}, {torch.get_num_threads()} threads; the start's measuring took {took:.2f} s")
    print(f"choice: prefill {report['prefill']}, decode {report['decode']}")
    print(f"{'fresh chunk':<14}{'own ms':>10}{'sdpa ms':>10}{'chosen':>8}{'chosen/best':>13}")
    for n in [int(x) for x in args.lens.split(",")]:
        nb = -(-n // ac.BLOCK)
        k, v = ac._caches(nb, hkv, d, torch.bfloat16)
        q = torch.randn(n, hq, d).to(torch.bfloat16)
        step = (torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                torch.arange(nb, dtype=torch.int32)[None])
        t = ac.best_of({"own": lambda: cpu_attention.paged_attention(q, k, v, *step, scale),
                     "sdpa": lambda: cpu_attention.paged_attention(q, k, v, *step, scale, sdpa_from=1)}, args.reps)
        chosen = "sdpa" if sdpa_from is not None and n >= sdpa_from else "own"
        print(f"{n:<14}{t['own'] * 1e3:>10.3f}{t['sdpa'] * 1e3:>10.3f}{chosen:>8}{t[chosen] / min(t.values()):>13.3f}")
    print(f"{'decode BxL':<14}{'own ms':>10}{'torch ms':>10}{'chosen':>8}{'chosen/best':>13}")
    for spec in args.decode.split(","):
        b, ctx = map(int, spec.split("x"))
        nb = ctx // ac.BLOCK
        k, v = ac._caches(b * nb, hkv, d, torch.bfloat16)
        q = torch.randn(b, hq, d).to(torch.bfloat16)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        bt = torch.arange(b * nb, dtype=torch.int32).view(b, nb)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        t = ac.best_of({"own": lambda: cpu_attention.paged_attention(q, k, v, qsl, lens, bt, scale),
                     "torch": lambda: TorchAttentionBackend._short(q[:, None], k, v, bt, lens, torch.ones_like(lens),
                                                                   scale, None)}, args.reps)
        chosen = report["decode"]
        print(f"{spec:<14}{t['own'] * 1e3:>10.3f}{t['torch'] * 1e3:>10.3f}{chosen:>8}"
              f"{t[chosen] / min(t.values()):>13.3f}")


def kv_forms(args) -> None:
    from batchrun.kernels import kv_quant
    hq, hkv, d = HEADS
    best = cpu_attention.attention_isa()
    isas = [i for i in ("avx512_bf16", "avx512", "avx2") if list(cpu_attention.ISAS.values()).index(i) <=
            list(cpu_attention.ISAS.values()).index(best)]
    print(f"machine: {machine_kind()}, {torch.get_num_threads()} threads; bf16 q; each cache's ms, and / bf16's")
    print(f"{'step':<22}{'isa':<13}" + "".join(f"{c:>16}" for c in ("bf16", "int8", "fp8_e4m3")))
    shapes = [(f"decode {s}", *map(int, s.split("x")), 1) for s in args.decode.split(",")] + [("prefill 512 on 512", 1, 1024, 512)]
    for label, b, ctx, qlen in shapes:
        nb = -(-ctx // ac.BLOCK)
        k, v = (torch.randn(b * nb, ac.BLOCK, hkv, d) for _ in range(2))
        caches = {"bf16": (k.bfloat16(), v.bfloat16()), "int8": (kv_quant.quantize_int8(k), kv_quant.quantize_int8(v)),
                  "fp8_e4m3": (k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn))}
        q = torch.randn(b * qlen, hq, d).to(torch.bfloat16)
        step = (torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32), torch.full((b,), ctx, dtype=torch.int32),
                torch.arange(b * nb, dtype=torch.int32).view(b, nb), d ** -0.5)
        for isa in isas:
            t = ac.best_of({c: (lambda kc=kc, vc=vc: cpu_attention.paged_attention(q, kc, vc, *step, isa=isa))
                            for c, (kc, vc) in caches.items()}, args.reps)
            print(f"{label:<22}{isa:<13}" + "".join(f"{t[c] * 1e3:>8.3f} ({t[c] / t['bf16']:.2f})" for c in caches))


if __name__ == "__main__":
    main()
