"""Where CPU weight-only products (int8, int4, GGUF codes kept: models/quant_weights.py) change method,
measured at engine start on the loaded model's own quantized weights instead of fixed row limits.

int8: torch's kernel (aten._weight_int8pack_mm, which reads the int8 weight) against a cast of the weight and
a dense matmul, at each of ROWS; the kernel runs products of up to kernel_rows rows, the largest count timed
up to which it won at every count. int4: torch's kernel in chunks of rows (its cost per row jumps past a
size); each chunk size of INT4_CHUNKS is timed on a CHUNK_PROBE-row product and the fastest is kept. Each
shape's time is weighted by how many layers have it. Cached like the other choices (models/kernel_choice.py:
$BATCHRUN_KERNEL_CACHE, per CPU signature and weight shapes); BATCHRUN_QUANT_KERNELS=0 (the reference path)
measures nothing.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from batchrun.models import kernel_choice
from batchrun.models.quant_weights import INT4_KERNEL_ROWS, INT8_KERNEL_ROWS, Int4Weight, Int8Weight

log = logging.getLogger("batchrun")

ROWS = (1, 4, 8, 16, 32, 64, 128)
INT4_CHUNKS = (4, 8, 16, 32, 64)
CHUNK_PROBE = 128
REPS = 3
VERSION = 1


def _weights(model) -> list:
    """The CPU quantized weights of the model's layers and logits, each once."""
    ws = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), (Int8Weight, Int4Weight))]
    lw = getattr(model, "logits_weight", None)
    out = ws + ([lw] if isinstance(lw, (Int8Weight, Int4Weight)) else [])
    return [w for w in dict((id(w), w) for w in out).values() if w.use_kernel and w._has_kernel(torch.device("cpu"))
            and not (isinstance(w, Int4Weight) and w.layout != "cpu")]


def _by_shape(ws: list) -> dict:
    out: dict = {}
    for w in ws:
        out.setdefault(w.shape, []).append(w)
    return out


def _cost(groups: dict, rows: int, dtype, fns: dict) -> dict:
    """{name: seconds}: for each shape, the best of REPS of fn(weight, x) times the layers with that shape."""
    cost = dict.fromkeys(fns, 0.0)
    for shape, ws in groups.items():
        x = torch.randn(rows, shape[1]).to(dtype)
        for name, fn in fns.items():
            fn(ws[0], x)
            best = float("inf")
            for _ in range(REPS):
                t0 = time.perf_counter()
                fn(ws[0], x)
                best = min(best, time.perf_counter() - t0)
            cost[name] += len(ws) * best
    return cost


def measure(int8: list, int4: list, dtype) -> dict:
    """{"int8": {rows: {"kernel": s, "dense": s}}, "int4": {chunk: s}} (empty where there are none)."""
    out: dict = {"int8": {}, "int4": {}}
    g8, g4 = _by_shape(int8), _by_shape(int4)
    if g8:
        for rows in ROWS:              # up to the first count where the kernel loses: decide() stops there
            t = out["int8"][rows] = _cost(g8, rows, dtype, {"kernel": lambda w, x: w._kernel(x),
                                                            "dense": lambda w, x: w._dense(x)})
            if t["kernel"] > t["dense"]:
                break
    if g4:
        fns = {c: (lambda w, x, c=c: [w._kernel(p) for p in x.split(c)]) for c in INT4_CHUNKS}
        out["int4"] = _cost(g4, CHUNK_PROBE, dtype, fns)
    return out


def decide(times: dict) -> dict:
    """{"int8_kernel_rows": r, "int4_chunk_rows": c}: the largest timed count up to which the int8 kernel won
    at every count (0: dense from one row), and the fastest int4 chunk."""
    rows = 0
    for r in sorted(times["int8"]):
        t = times["int8"][r]
        if t["kernel"] > t["dense"]:
            break
        rows = r
    chunk = min(times["int4"], key=times["int4"].get) if times["int4"] else INT4_KERNEL_ROWS
    return {"int8_kernel_rows": rows if times["int8"] else INT8_KERNEL_ROWS, "int4_chunk_rows": int(chunk)}


def _apply(int8: list, int4: list, choice: dict) -> None:
    for w in int8:
        w.kernel_rows = choice["int8_kernel_rows"]
    for w in int4:
        w.chunk_rows = choice["int4_chunk_rows"]


def choose(model, dtype, threads: int) -> Optional[dict]:
    """Measure (or read the cache), set every CPU quantized weight's limits, and return the ledger's report;
    None when the model has no such weights."""
    ws = _weights(model)
    int8 = [w for w in ws if isinstance(w, Int8Weight)]
    int4 = [w for w in ws if isinstance(w, Int4Weight)]
    if not ws:
        return None
    shapes = sorted({(w.kind, *w.shape, getattr(w, "group", 0)) for w in ws})
    sig = {**kernel_choice.signature([], threads), "quant": VERSION, "dtype": str(dtype),
           "weights": [list(s) for s in shapes], "rows": list(ROWS), "chunks": list(INT4_CHUNKS)}
    path = kernel_choice.cache_file(sig, "quant")
    saved = kernel_choice.read_cache(path)
    try:
        _apply(int8, int4, saved["choice"])
        return {**saved["choice"], "cached": True, "measure_s": 0.0, "times_us": saved["times_us"]}
    except (TypeError, KeyError):
        pass                                       # none, or unreadable: measure again and rewrite it
    t0 = time.perf_counter()
    times = measure(int8, int4, dtype)
    choice = decide(times)
    took = time.perf_counter() - t0
    _apply(int8, int4, choice)
    named = {"int8": {str(r): {k: round(v * 1e6, 1) for k, v in t.items()} for r, t in times["int8"].items()},
             "int4": {str(c): round(v * 1e6, 1) for c, v in times["int4"].items()}}
    kernel_choice.write_cache(path, {"signature": sig, "choice": choice, "times_us": named}, "quantized kernel choice")
    log.info("batchrun: quantized products measured in %.2f s: %s", took, choice)
    return {**choice, "cached": False, "measure_s": round(took, 3), "times_us": named}
