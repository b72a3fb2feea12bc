"""How a decode step's bf16 projections load their weights (ordinary or non-temporal loads), chosen by timing
both on this machine.

At a few rows, the own kernel (kernels/cpu_gemm.py) reads every weight byte once. With ordinary loads, those
bytes are left in every cache level, so the step ends with the caches full of the last layers' weights. The
host work before the next step (the scheduler, the step's inputs, the Python between the ops) then misses
on nearly everything it touches. On Zen 4, for a 50M Llama at batch 1, preparing a step's inputs took
0.20 ms after a step and 0.03 ms hot. Non-temporal loads mark the weights for early eviction instead.

Whether that is faster depends on the CPU. AMD honours the hint on ordinary memory; Intel documents that it
may ignore it there. It also depends on the model: on Zen 4, timing the products alone put non-temporal loads
3% behind on SmolLM2's shapes, while whole decode steps ran 5% faster with them. So the engine times whole
steps: at start, real batch-1 decode steps of the loaded model (engine/probe_step.py: the step's inputs, the
forward, the logits and the argmax) alternate between the two modes, two adjacent steps a rep, their order
swapped every rep. Non-temporal loads are used where the median of the reps' time ratios is at most MARGIN.
The result is cached per CPU signature, as the kernel choice is.

$BATCHRUN_CPU_WEIGHT_LOADS forces "cached" (ordinary loads) or "nontemporal"; "auto" (the default) measures.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Optional

import torch
from torch import nn

from batchrun.kernels import cpu_gemm
from batchrun.models import cpu_linear, kernel_choice

log = logging.getLogger("batchrun")

ENV = "BATCHRUN_CPU_WEIGHT_LOADS"
MODES = ("auto",) + cpu_gemm.WEIGHT_LOADS
REPS = 9
MIN_REPS = 3
BUDGET_S = 0.3        # of measuring, past the two warm steps, unless MIN_REPS take longer
MARGIN = 0.98            # non-temporal must be at least 2% faster: otherwise ordinary loads, the CPU's default
VERSION = 2              # of the measuring method: a new one invalidates the cache


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


def runs_own_at_one_row(model: nn.Module) -> bool:
    """Some projection or the logits weight of a decode step at batch 1 runs on the own kernel."""
    head = getattr(model, "logits_weight", None)
    if head is None and getattr(model, "lm_head", None) is not None:
        head = model.lm_head.weight
    ws = [m.weight for layer in model.layers for m in layer.modules() if isinstance(m, nn.Linear)] + [head]
    return any(_own_at_one_row(w) is not None for w in ws if w is not None)


def reps_for(step_s: float) -> int:
    """REPS, fewer where a step is long (a large model): about BUDGET_S of measuring, MIN_REPS at least."""
    return max(MIN_REPS, min(REPS, int(BUDGET_S / (2 * max(step_s, 1e-9)))))


def measure(step: Callable[[], None]) -> dict:
    """{"cached": s, "nontemporal": s, "ratio": r, "reps": n}: the median seconds of each mode's step and the
    median of each rep's nontemporal / cached ratio. The two steps of a rep are adjacent in time and swap
    order every rep (a shared host drifts)."""
    times: dict = {m: [] for m in cpu_gemm.WEIGHT_LOADS}
    previous = cpu_gemm.weight_loads()
    try:
        t0 = time.perf_counter()
        for mode in cpu_gemm.WEIGHT_LOADS:             # warm: each mode once
            cpu_gemm.set_weight_loads(mode)
            step()
        reps = reps_for((time.perf_counter() - t0) / 2)
        for rep in range(reps):
            for mode in cpu_gemm.WEIGHT_LOADS[::1 if rep % 2 else -1]:
                cpu_gemm.set_weight_loads(mode)
                t0 = time.perf_counter()
                step()
                times[mode].append(time.perf_counter() - t0)
    finally:
        cpu_gemm.set_weight_loads(previous)
    ratios = [n / c for n, c in zip(times["nontemporal"], times["cached"])]
    return {**{m: statistics.median(ts) for m, ts in times.items()}, "ratio": statistics.median(ratios),
            "reps": reps}


def decide(measured: dict) -> str:
    return "nontemporal" if measured["ratio"] <= MARGIN else "cached"


def signature(model: nn.Module, threads: int) -> dict:
    return {**kernel_choice.signature(layer_shapes(model), threads), "weight_loads": VERSION}


def cached_mode(model: nn.Module, threads: int) -> Optional[str]:
    """The mode an earlier start measured for this model's shapes on this machine, or None (for validate)."""
    saved = kernel_choice.read_cache(kernel_choice.cache_file(signature(model, threads), "weight_loads"))
    mode = saved.get("choice") if isinstance(saved, dict) else None
    return mode if mode in cpu_gemm.WEIGHT_LOADS else None


def choose(model: nn.Module, step: Optional[Callable[[], None]], threads: int, mode: str) -> dict:
    """Set how few-row products load the weights in this process (mode: resolve_mode()'s), timing `step`
    (one decode step of the engine, engine/probe_step.py) where auto must measure; returns what the ledger
    shows: {"mode", "choice", "cached", "measure_s", "times_us" (median steps), "ratio" (nontemporal /
    cached, the median of the reps')}."""
    report = {"mode": mode, "choice": "cached", "cached": False, "measure_s": 0.0, "times_us": None, "ratio": None}
    own = runs_own_at_one_row(model)
    if mode != "auto" or not own or step is None:
        report["choice"] = mode if mode != "auto" else "cached"
        if mode == "auto":
            report["note"] = "no projection runs on the own kernel at one row: nothing to choose" if not own \
                else "no decode step to time here (tensor parallel, or a KV cache too small for one): ordinary loads"
        if cpu_gemm.supported():
            cpu_gemm.set_weight_loads(report["choice"])
        return report
    path = kernel_choice.cache_file(signature(model, threads), "weight_loads")
    saved = kernel_choice.read_cache(path)
    if isinstance(saved, dict) and saved.get("choice") in cpu_gemm.WEIGHT_LOADS:
        report.update(choice=saved["choice"], cached=True, times_us=saved.get("times_us"), ratio=saved.get("ratio"))
    else:
        t0 = time.perf_counter()
        measured = measure(step)
        times = {m: round(measured[m] * 1e6, 1) for m in cpu_gemm.WEIGHT_LOADS}
        report.update(choice=decide(measured), measure_s=round(time.perf_counter() - t0, 3), times_us=times,
                      ratio=round(measured["ratio"], 4))
        kernel_choice.write_cache(path, {"signature": signature(model, threads), "choice": report["choice"],
                                         "times_us": times, "ratio": report["ratio"], "reps": measured["reps"]},
                                  "weight-load choice")
        log.info("batchrun: weight loads measured in %.2f s: %s (nontemporal / cached %.3f)", report["measure_s"],
                 report["choice"], report["ratio"])
    cpu_gemm.set_weight_loads(report["choice"])
    return report
