"""Which implementation runs CPU attention, chosen by timing the candidates on this machine at engine start.

Prefill: a fresh prompt chunk (its queries are its whole context) can run on batchrun's own kernel or on
torch's scaled_dot_product_attention (its CPU flash kernel runs on oneDNN brgemm, AMX tiles where the CPU
has them; kernels/csrc/cpu_attention_sdpa.cpp). Both are timed through the op itself on the model's head
shapes at QUERY_LENS tokens; sdpa_from is the length from which SDPA won at every longer length timed (None:
the own kernel everywhere). Chunks with a cached prefix, sliding windows and float8 caches stay on the own
kernel. Decode: the own kernel against the torch reference path (gather, matmuls), at DECODE_SHAPE; the
loser is never run. Float32 keeps its fixed path (own kernel, the HF parity tests' path).

Cached like the projections' choice (models/kernel_choice.py: $BATCHRUN_KERNEL_CACHE, per CPU signature and
head shapes). `cpu_attention` (EngineConfig) or $BATCHRUN_CPU_ATTENTION forces "own", "sdpa" (SDPA for every
fresh chunk) or "torch" (the reference path throughout); "auto" (default) measures.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from batchrun.models import kernel_choice

log = logging.getLogger("batchrun")

ATTENTION_ENV = "BATCHRUN_CPU_ATTENTION"
MODES = ("auto", "own", "sdpa", "torch")
QUERY_LENS = (32, 128, 512, 2048)      # fresh prompt chunk lengths timed (those the job can have)
DECODE_SHAPE = (16, 256)               # sequences, context tokens
BLOCK = 16
REPS = 3
VERSION = 1


def resolve_mode(knob: Optional[str]) -> str:
    """The cpu_attention knob, or $BATCHRUN_CPU_ATTENTION where the knob is auto."""
    return kernel_choice.resolve_knob(knob, "cpu_attention", ATTENTION_ENV, MODES)


def best_of(fns: dict, reps: int = REPS) -> dict:
    """{name: best seconds over reps}, the candidates' reps alternating (after one warm-up call each)."""
    best = {n: float("inf") for n in fns}
    for r in range(reps + 1):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            if r:
                best[n] = min(best[n], time.perf_counter() - t0)
    return best


def _caches(n_blocks: int, hkv: int, d: int, dtype) -> tuple:
    k = torch.randn(n_blocks, BLOCK, hkv, d).to(dtype)
    return k, torch.randn_like(k)


def measure(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_len: int) -> dict:
    """{"prefill": {L: {"own": s, "sdpa": s}}, "decode": {"own": s, "torch": s}} on random tensors of these
    shapes (lengths past max_len, which no chunk reaches, are not timed)."""
    from batchrun.kernels import cpu_attention
    from batchrun.models.attention import TorchAttentionBackend
    op = cpu_attention.paged_attention
    scale = head_dim ** -0.5
    out: dict = {"prefill": {}, "decode": {}}
    for n in [n for n in QUERY_LENS if n <= max_len] or [min(QUERY_LENS)]:
        nb = -(-n // BLOCK)
        kc, vc = _caches(nb, num_kv_heads, head_dim, dtype)
        q = torch.randn(n, num_heads, head_dim).to(dtype)
        step = (torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                torch.arange(nb, dtype=torch.int32)[None])
        out["prefill"][n] = best_of({"own": lambda: op(q, kc, vc, *step, scale),
                                   "sdpa": lambda: op(q, kc, vc, *step, scale, sdpa_from=1)})
    b, ctx = DECODE_SHAPE
    nb = ctx // BLOCK
    kc, vc = _caches(b * nb, num_kv_heads, head_dim, dtype)
    q = torch.randn(b, num_heads, head_dim).to(dtype)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    bt = torch.arange(b * nb, dtype=torch.int32).view(b, nb)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    out["decode"] = best_of({"own": lambda: op(q, kc, vc, qsl, lens, bt, scale),
                           "torch": lambda: TorchAttentionBackend._short(q[:, None], kc, vc, bt, lens,
                                                                         torch.ones_like(lens), scale, None)})
    return out


def decide(times: dict) -> tuple[Optional[int], str]:
    """(sdpa_from, decode impl): SDPA for fresh chunks from the shortest timed length at which it beats the
    own kernel at that length and every longer one (1 when that is the shortest timed; None when it never
    does); the decode impl is "torch" only where the reference path beat the own kernel."""
    lens = sorted(times["prefill"])
    wins = [times["prefill"][n]["sdpa"] < times["prefill"][n]["own"] for n in lens]
    sdpa_from = None
    for i in range(len(lens) - 1, -1, -1):
        if not wins[i]:
            break
        sdpa_from = 1 if i == 0 else lens[i]
    dec = times["decode"]
    return sdpa_from, ("torch" if dec["torch"] < dec["own"] else "own")


def _report(mode: str, sdpa_from, decode: str, times, took: float, cached: bool) -> dict:
    prefill = "own" if sdpa_from is None else "sdpa" if sdpa_from <= 1 else \
        f"own 1-{sdpa_from - 1}, sdpa {sdpa_from}+"
    if mode == "torch" or decode == "torch":        # the reference path runs the whole batch
        prefill = decode = "torch"
    return {"mode": mode, "cached": cached, "measure_s": round(took, 3), "prefill": prefill,
            "decode": decode, "sdpa_from": sdpa_from, "times_us": times}


def _named(times: dict) -> dict:
    return {"prefill": {str(n): {k: round(v * 1e6, 1) for k, v in t.items()} for n, t in times["prefill"].items()},
            "decode": {k: round(v * 1e6, 1) for k, v in times["decode"].items()}}


def _signature(heads: tuple, dtype: torch.dtype, threads: int, max_len: int) -> dict:
    return {**kernel_choice.signature([], threads), "attention": VERSION, "heads": list(heads),
            "dtype": str(dtype), "lens": [n for n in QUERY_LENS if n <= max_len], "decode": list(DECODE_SHAPE)}


def cached_choice(heads: tuple, dtype: torch.dtype, threads: int, max_len: int) -> Optional[dict]:
    """A previous start's report for these shapes on this machine, or None (for `validate`)."""
    saved = kernel_choice.read_cache(kernel_choice.cache_file(_signature(heads, dtype, threads, max_len), "attention"))
    return saved.get("report") if isinstance(saved, dict) else None


def choose(heads: tuple, dtype: torch.dtype, mode: str, threads: int, max_len: int) -> dict:
    """What runs CPU attention: a _report() dict (its sdpa_from and decode say it). heads: (num_heads,
    num_kv_heads, head_dim) of one rank; max_len: the longest fresh chunk a step can hold."""
    if mode == "sdpa":
        return _report(mode, 1, "own", None, 0.0, False)
    if mode != "auto" or dtype == torch.float32:     # forced, or float32's fixed reference path
        return _report("own" if mode == "auto" else mode, None, "own", None, 0.0, False)
    sig = _signature(heads, dtype, threads, max_len)
    path = kernel_choice.cache_file(sig, "attention")
    saved = kernel_choice.read_cache(path)
    if isinstance(saved, dict) and isinstance(saved.get("report"), dict):
        return {**saved["report"], "cached": True, "measure_s": 0.0}
    t0 = time.perf_counter()
    times = measure(*heads, dtype, max_len)
    sdpa_from, decode = decide(times)
    report = _report("auto", sdpa_from, decode, _named(times), time.perf_counter() - t0, False)
    kernel_choice.write_cache(path, {"signature": sig, "report": report}, "attention choice")
    log.info("batchrun: attention choice measured in %.2f s: prefill %s, decode %s", report["measure_s"],
             report["prefill"], decode)
    return report
