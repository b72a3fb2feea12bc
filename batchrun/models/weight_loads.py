"""How a decode step's bf16 projections load their weights (ordinary or non-temporal loads), chosen by timing
both on this machine.

At a few rows, the own kernel (kernels/cpu_gemm.py) reads every weight byte once. With ordinary loads, those
bytes are left in every cache level, so the step ends with the caches full of the last layers' weights. The
host work before the next step (the scheduler, the step's inputs, the Python between the ops) then misses
on nearly everything it touches. On Zen 4, for a 50M Llama at batch 1, preparing a step's inputs took
0.20 ms after a step and 0.03 ms hot. Non-temporal loads mark the weights for early eviction instead.

Whether that is faster depends on the CPU. AMD honours the hint on ordinary memory; Intel documents that it
may ignore it there. So the engine times both on the loaded model at start:
- one-row products over the weights a decode step reads (the layers', then the logits weight; at most
  eight times the last-level cache), in the forms the kernel choice put them in;
- then a re-read of a 1 MiB buffer that was read just before them: a stand-in for the host's working set.
The two modes alternate, best of REPS each. Non-temporal loads are used where they are at least MARGIN
faster. The result is cached per CPU signature, as the kernel choice is.

$BATCHRUN_CPU_WEIGHT_LOADS forces "cached" (ordinary loads) or "nontemporal"; "auto" (the default) measures.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from torch import nn

from batchrun.kernels import cpu_gemm
from batchrun.models import cpu_info, cpu_linear, kernel_choice

log = logging.getLogger("batchrun")

ENV = "BATCHRUN_CPU_WEIGHT_LOADS"
MODES = ("auto",) + cpu_gemm.WEIGHT_LOADS
REPS = 5
MARGIN = 0.98            # non-temporal must be at least 2% faster: otherwise ordinary loads, the CPU's default
PROBE_BYTES = 1 << 20
VERSION = 1              # of the measuring method: a new one invalidates the cache


def resolve_mode() -> str:
    """$BATCHRUN_CPU_WEIGHT_LOADS, or "auto"; a one-line error naming it for an unknown mode."""
    return kernel_choice.resolve_knob(None, ENV, ENV, MODES)


def layer_shapes(model: nn.Module) -> list[tuple]:
    """The [out, in] shapes of the decoder layers' projections, in order (the cache key's; a meta model will do)."""
    return [(m.out_features, m.in_features) for layer in model.layers for m in layer.modules()
            if isinstance(m, nn.Linear)]


def _own_at_one_row(w) -> Optional[torch.Tensor]:
    """The own kernel's packed tensor a one-row product of w runs on, or None (another form runs it)."""
    if isinstance(w, cpu_linear.ChosenWeight):
        w = w.form_for(1)
    return w if isinstance(w, torch.Tensor) and w.dim() >= 4 else None


def _timed_weights(model: nn.Module, l3: int) -> list:
    """The packed weights a decode step's one-row products read with the own kernel, in order (the layers',
    then the logits weight), cut once they hold 8 x l3 bytes: a pass over less than the whole stream would
    find part of it still in the cache from the pass before, which a step does not."""
    mods = [m.weight for layer in model.layers for m in layer.modules() if isinstance(m, nn.Linear)]
    head = getattr(model, "logits_weight", None)
    if head is None and not getattr(model, "tie_word_embeddings", False):
        head = model.lm_head.weight
    out, total = [], 0
    for w in mods + [head]:
        w = _own_at_one_row(w)
        if w is not None and total < 8 * l3:
            out.append(w)
            total += w.numel() * w.element_size()
    return out


def measure(weights: list) -> dict:
    """{mode: best seconds} of one-row products over `weights` (packed), then the probe's re-read."""
    xs = {w.shape[1] * 2: torch.randn(1, w.shape[1] * 2, dtype=w.dtype) for w in weights}
    probe = torch.ones(PROBE_BYTES // 4)
    best = dict.fromkeys(cpu_gemm.WEIGHT_LOADS, float("inf"))
    previous = cpu_gemm.weight_loads()
    try:
        for rep in range(REPS + 1):                 # rep 0 warms
            for mode in cpu_gemm.WEIGHT_LOADS:
                cpu_gemm.set_weight_loads(mode)
                probe.sum()
                t0 = time.perf_counter()
                for w in weights:
                    cpu_gemm.linear(xs[w.shape[1] * 2], w, cpu_gemm.packed_rows(w))
                probe.sum()
                if rep:
                    best[mode] = min(best[mode], time.perf_counter() - t0)
    finally:
        cpu_gemm.set_weight_loads(previous)
    return best


def decide(best: dict) -> str:
    return "nontemporal" if best["nontemporal"] <= MARGIN * best["cached"] else "cached"


def signature(model: nn.Module, threads: int) -> dict:
    return {**kernel_choice.signature(layer_shapes(model), threads), "weight_loads": VERSION,
            "probe": PROBE_BYTES, "reps": REPS}


def cached_mode(model: nn.Module, threads: int) -> Optional[str]:
    """The mode an earlier start measured for this model's shapes on this machine, or None (for validate)."""
    saved = kernel_choice.read_cache(kernel_choice.cache_file(signature(model, threads), "weight_loads"))
    mode = saved.get("choice") if isinstance(saved, dict) else None
    return mode if mode in cpu_gemm.WEIGHT_LOADS else None


def choose(model: nn.Module, threads: int, mode: str) -> dict:
    """Set how few-row products load the weights in this process (mode: resolve_mode()'s); returns what the
    ledger shows: {"mode", "choice", "cached", "measure_s", "times_us"}."""
    report = {"mode": mode, "choice": "cached", "cached": False, "measure_s": 0.0, "times_us": None}
    weights = _timed_weights(model, cpu_info.cpu_info()["l3_bytes"])
    if mode != "auto" or not weights:
        report["choice"] = mode if mode != "auto" else "cached"
        if not weights:
            report["note"] = "no projection runs on the own kernel at one row: nothing to choose"
        if cpu_gemm.supported():
            cpu_gemm.set_weight_loads(report["choice"])
        return report
    path = kernel_choice.cache_file(signature(model, threads), "weight_loads")
    saved = kernel_choice.read_cache(path)
    if isinstance(saved, dict) and saved.get("choice") in cpu_gemm.WEIGHT_LOADS:
        report.update(choice=saved["choice"], cached=True, times_us=saved.get("times_us"))
    else:
        t0 = time.perf_counter()
        best = measure(weights)
        times = {m: round(t * 1e6, 1) for m, t in best.items()}
        report.update(choice=decide(best), measure_s=round(time.perf_counter() - t0, 3), times_us=times)
        kernel_choice.write_cache(path, {"signature": signature(model, threads), "choice": report["choice"],
                                         "times_us": times}, "weight-load choice")
        log.info("batchrun: weight loads measured in %.2f s: %s (%s)", report["measure_s"], report["choice"], times)
    cpu_gemm.set_weight_loads(report["choice"])
    return report
