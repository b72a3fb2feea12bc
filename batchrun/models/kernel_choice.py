"""Which implementation runs each bf16 projection, chosen by timing the candidates on this machine.

No CPU flag decides it. At engine start each form of models/cpu_linear.py that can run here (own, onednn,
plain) is timed on the loaded model's own weights, for each row-count bucket a step can have, and each
weight shape gets the fastest form per bucket. Small buckets are memory-bound, so they stream enough layers
to leave the last-level cache (as a decode step does); large ones are compute-bound and time one or a few
layers. Each candidate's reps alternate with the others' and the best rep counts (the host may be shared).
A form that is within TOLERANCE of the best in every bucket of a shape is used alone (one copy of the
weights); otherwise the shape keeps each winning form (the memory ledger counts the copy).

The result is cached per CPU signature (CPU model, ISA flags, threads, torch, the own kernel's build, the
model's shapes) in $BATCHRUN_KERNEL_CACHE (default ~/.cache/batchrun/kernel_choice; "0": no cache), so a
second start measures nothing. `cpu_gemm` (EngineConfig) or $BATCHRUN_CPU_GEMM forces one form
("own", "onednn", "plain") where it can hold the weight; "auto" (default) measures.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from itertools import combinations
from pathlib import Path
from typing import Optional

import torch

from batchrun.models import cpu_info, cpu_linear

log = logging.getLogger("batchrun")

GEMM_ENV = "BATCHRUN_CPU_GEMM"
CACHE_ENV = "BATCHRUN_KERNEL_CACHE"
MODES = ("auto",) + cpu_linear.FORMS
# row-count buckets: a product of T rows takes the choice of the first bucket whose bound is >= T
BOUNDS = (2, 8, 32, 128, 512, None)
ROWS = (1, 4, 16, 64, 256, 1024)        # the row count timed for each bucket
TOLERANCE = 1.05
REPS = 3
FLOPS_PER_PASS = 1.5e9                  # a compute-bound bucket times about this much work per candidate
HEAD_ROWS = 8192                        # outputs of the logits weight timed
VERSION = 2                             # of the measuring method: a new one invalidates the cache


def bucket_of(rows: int) -> int:
    return min(bisect.bisect_left(BOUNDS[:-1], rows), len(BOUNDS) - 1)


def bucket_names() -> list[str]:
    lows = (1,) + tuple(b + 1 for b in BOUNDS[:-1])
    return [f"{lo}-{hi}" if hi else f"{lo}+" for lo, hi in zip(lows, BOUNDS)]


def resolve_knob(knob: Optional[str], name: str, env: str, modes: tuple) -> str:
    """A kernel knob's mode: the knob, or $env where the knob is left at auto; a one-line error naming
    whichever gave an unknown name."""
    mode, where = (knob or "auto"), name
    if mode == "auto" and os.environ.get(env):
        mode, where = os.environ[env], env
    if mode not in modes:
        raise ValueError(f"{where} must be one of {', '.join(modes)}, got {mode!r}")
    return mode


def resolve_mode(knob: Optional[str]) -> str:
    """The cpu_gemm knob, or $BATCHRUN_CPU_GEMM where the knob is left at auto."""
    return resolve_knob(knob, "cpu_gemm", GEMM_ENV, MODES)


def read_cache(path: Optional[Path]) -> Optional[dict]:
    """A cached choice's JSON, or None when there is none or it is unreadable (then it is measured again)."""
    try:
        return json.loads(path.read_text()) if path is not None and path.exists() else None
    except (OSError, ValueError):
        return None


def write_cache(path: Optional[Path], saved: dict, what: str) -> None:
    """Store a measured choice atomically (a torn write cannot be read back); a failure only warns."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("batchrun: %s not cached (%s)", what, e)


def _stream(model) -> list[list[torch.Tensor]]:
    """The bf16 projection weights a forward reads, layer by layer in module order, the logits weight last."""
    def plain(ws):          # quantized weights (models/quant.py) have their own kernels: not chosen here
        return [w for w in ws if isinstance(w, torch.Tensor) and w.dim() == 2]
    layers = [plain(m.weight for m in layer.modules() if isinstance(m, torch.nn.Linear)) for layer in model.layers]
    if hasattr(model, "logits_weight"):
        head = []
    elif getattr(model, "tie_word_embeddings", False):
        head = plain([model.embed_tokens.weight])
    else:
        head = plain([model.lm_head.weight])
    return [ws for ws in layers if ws] + [head]


# what bounds the instruction set the kernels run below the CPU's flags (batchrun's test cap, torch's, oneDNN's):
# a choice measured under one is not the machine's under another
ISA_CAP_ENVS = ("BATCHRUN_TEST_MAX_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def signature(shapes: list, threads: int) -> dict:
    from batchrun.kernels import cpu_attention
    info = cpu_info.cpu_info()
    build = cpu_attention.build_dir().name       # names the own kernel's binary without building it
    return {"version": VERSION, "cpu": info["model"], "family": info["family"], "flags": info["flags"],
            "threads": threads, "torch": torch.__version__, "own_build": build, "shapes": [list(s) for s in shapes],
            "bounds": list(BOUNDS[:-1]), "isa_caps": {v: os.environ.get(v) for v in ISA_CAP_ENVS}}


def cache_file(sig: dict, sub: str = "") -> Optional[Path]:
    """Where the choice measured for `sig` is cached (sub: a folder of the cache for another op's choices);
    None when $BATCHRUN_KERNEL_CACHE is "0"."""
    root = os.environ.get(CACHE_ENV)
    if root == "0":
        return None
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "batchrun" / "kernel_choice"
    return base / sub / (hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def _time_all(layers: list, rows: int, packed: dict) -> dict:
    """{form: {shape: best seconds over REPS}} for one product of `rows` rows by each weight of `layers`
    ([[(shape, plain weight)]]: the model's shape each timed weight stands for) that the form holds (packed:
    {form: {id(plain weight): that weight in the form}}); the forms' reps alternate."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for ws in layers for _, w in ws}
    best: dict = {f: {} for f in packed}
    for r in range(REPS + 1):                # rep 0 warms: oneDNN builds a primitive per shape and row count
        for f, forms in packed.items():
            rep: dict = {}
            for ws in layers[:1] if r == 0 else layers:
                for s, p in ws:
                    w = forms.get(id(p))
                    if w is None:
                        continue
                    t0 = time.perf_counter()
                    cpu_linear.linear(xs[p.shape[1]], w)
                    rep[s] = rep.get(s, 0.0) + time.perf_counter() - t0
            if r:
                for s, t in rep.items():
                    best[f][s] = min(best[f].get(s, float("inf")), t)
    return best


def _sample(stream: list, rows: int, l3: int) -> list:
    """The layers timed at `rows`, as [[(shape, weight)]]: enough to leave the cache where the product is
    memory-bound, else about FLOPS_PER_PASS of work (at least one layer); the logits weight last, cut to
    HEAD_ROWS outputs (its form is decided per element of work, and the whole of it would dominate the
    measuring time)."""
    body, head = stream[:-1], stream[-1]
    nbytes = [sum(w.numel() * w.element_size() for w in ws) for ws in body]
    flops = [2 * rows * sum(w.numel() for w in ws) for ws in body]
    n, total_b, total_f = 0, 0, 0
    while n < len(body) and (total_b < 2 * l3 if rows <= 16 else total_f < FLOPS_PER_PASS):
        total_b, total_f, n = total_b + nbytes[n], total_f + flops[n], n + 1
    out = [[(tuple(w.shape), w) for w in ws] for ws in body[:max(n, 1)]]
    # the logits weight is timed where a step's sequences can need it (at most max_num_seqs rows)
    if head and rows <= 256:
        out.append([(tuple(w.shape), w[:HEAD_ROWS]) for w in head])
    return out


def measure(model, forms_by_shape: dict, batch_hint: int) -> dict:
    """{shape: [[seconds per form in forms_by_shape[shape]] per bucket]}; the logits shape past 256 rows
    repeats its 256-row figures. Each weight timed is put in each form once, for every bucket."""
    stream = _stream(model)
    l3 = cpu_info.cpu_info()["l3_bytes"]
    samples = [_sample(stream, rows, l3) for rows in ROWS]
    timed = {id(w): (s, w) for layers in samples for ws in layers for s, w in ws}
    forms = sorted({f for fs in forms_by_shape.values() for f in fs}, key=cpu_linear.FORMS.index)
    packed = {f: {i: cpu_linear.pack(w, f, batch_hint) for i, (s, w) in timed.items() if f in forms_by_shape[s]}
              for f in forms}
    out: dict = {s: [] for s in forms_by_shape}
    for rows, layers in zip(ROWS, samples):
        best = _time_all(layers, rows, packed)
        for s, fs in forms_by_shape.items():
            ts = [best[f].get(s) for f in fs]
            out[s].append(ts if all(t is not None for t in ts) else out[s][-1])
    return out


def decide(forms: list[str], times: list[list[float]]) -> tuple:
    """The per-bucket forms for one shape: the fewest forms whose best is within TOLERANCE of the fastest in
    every bucket (ties to the smaller total time)."""
    fastest = [min(ts) for ts in times]
    for k in range(1, len(forms) + 1):
        ok = []
        for subset in combinations(range(len(forms)), k):
            per = [min(subset, key=lambda i: ts[i]) for ts in times]
            if all(ts[i] <= TOLERANCE * f for ts, i, f in zip(times, per, fastest)):
                ok.append((sum(ts[i] for ts, i in zip(times, per)), per))
        if ok:
            return tuple(forms[i] for i in min(ok)[1])
    raise AssertionError("unreachable: every form set includes the fastest")


def projection_shapes(model) -> list[tuple]:
    """The distinct [out, in] shapes of the bf16 weights the choice covers (a meta-device model will do)."""
    return list(dict.fromkeys(tuple(w.shape) for ws in _stream(model) for w in ws))


def cached_choice(shapes: list, threads: int) -> Optional[dict]:
    """The per-shape summary a previous start measured and cached for these shapes on this machine, or None
    (for `validate`, which loads no weights)."""
    path = cache_file(signature(shapes, threads))
    try:
        saved = json.loads(path.read_text()) if path is not None and path.exists() else None
        return None if saved is None else _summary({tuple(s): tuple(c) for s, c in saved["choice"]})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def choose(model, mode: str, threads: int, batch_hint: int) -> dict:
    """{"choice": {shape: per-bucket forms}, "report": what the ledger shows}. mode: resolve_mode()'s."""
    shapes = projection_shapes(model)
    forms_by_shape = {s: cpu_linear.forms_for(s) for s in shapes}
    if mode != "auto":
        choice = {s: (mode if mode in fs else fs[0],) * len(ROWS) for s, fs in forms_by_shape.items()}
        return {"choice": choice, "report": _report(mode, choice, None, 0.0, False)}
    sig = signature(shapes, threads)
    path = cache_file(sig)
    saved = read_cache(path)
    if saved is not None:
        try:
            choice = {tuple(s): tuple(c) for s, c in saved["choice"]}
            if set(choice) == set(shapes) and all(set(c) <= set(forms_by_shape[s]) for s, c in choice.items()):
                return {"choice": choice, "report": _report("auto", choice, saved["times"], 0.0, True)}
        except (KeyError, TypeError):
            pass                          # unreadable: measure again and rewrite it
    t0 = time.perf_counter()
    times = measure(model, forms_by_shape, batch_hint)
    choice = {s: decide(forms_by_shape[s], times[s]) for s in shapes}
    took = time.perf_counter() - t0
    named = {f"{s[0]}x{s[1]}": {f: [round(ts[i] * 1e6, 1) for ts in times[s]]
                                for i, f in enumerate(forms_by_shape[s])} for s in shapes}
    write_cache(path, {"signature": sig, "choice": [[list(s), list(c)] for s, c in choice.items()],
                       "times": named}, "kernel choice")
    log.info("batchrun: kernel choice measured in %.2f s: %s", took, _summary(choice))
    return {"choice": choice, "report": _report("auto", choice, named, took, False)}


def _summary(choice: dict) -> dict:
    """{"960x576": "own 1-128, onednn 129+"}: each shape's forms over runs of consecutive buckets."""
    lows = (1,) + tuple(b + 1 for b in BOUNDS[:-1])
    out = {}
    for s, per in choice.items():
        runs: list = []
        for i, f in enumerate(per):
            if runs and runs[-1][0] == f:
                runs[-1][2] = i
            else:
                runs.append([f, i, i])
        out[f"{s[0]}x{s[1]}"] = ", ".join(f"{f} {lows[a]}-{BOUNDS[b]}" if BOUNDS[b] else f"{f} {lows[a]}+"
                                          for f, a, b in runs)
    return out


def _report(mode: str, choice: dict, times, took: float, cached: bool) -> dict:
    return {"mode": mode, "cached": cached, "measure_s": round(took, 3), "buckets": bucket_names(),
            "choice": _summary(choice), "times_us": times}
