"""CPU attention on SmolLM2-135M's heads (9 query / 3 KV heads of 64, bf16) on each implementation, beside
what the measured choice (models/attention_choice.py, cpu_attention=auto) runs: fresh prompt chunks on the
own kernel vs torch's SDPA (CPU flash attention, oneDNN brgemm: AMX where present) per chunk length, and a
decode step on the own kernel vs the torch reference path per batch and context. Prints each one's ms, the
choice, and chosen / best (the target is <= 1.05 at every size); also how long the start's measuring took.

    python scripts/bench_attention_forms.py [--lens 32,128,512,2048] [--decode 1x256,16x256,64x256,64x1024]
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
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    assert cpu_attention.load(), cpu_attention.status()["error"]
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


if __name__ == "__main__":
    main()
