"""The machine's own limits, measured in a child process on 2 threads: the best bf16 and int8 GEMM rates any
implementation here reaches (each of batchrun's forms: its own kernel, oneDNN, torch's F.linear; int8:
torch._int_mm and oneDNN's qlinear, through models/w8a8.py), on a compute-bound product of SmolLM2's MLP
shape. With the read bandwidth (children.child_bandwidth) they make each workload's floors (floors.py)."""
from __future__ import annotations

import time

M, N, K = 1024, 3072, 576       # rows x gate_up's [3072, 576]: 3.6 GFLOP per product
REPS = 5


def _best(fn) -> float:
    fn()
    best = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def child_peaks(spec: dict) -> dict:
    """{"machine_kind", "bf16_gflops": {form: x}, "int8_gops": {kernel: x}, "bf16_peak", "int8_peak",
    "shape"}: each implementation's best of REPS products of [M, K] x [K, N]."""
    import torch
    from batchrun.models import cpu_info, cpu_linear
    from batchrun.models.w8a8 import W8A8Weight, _candidates, quantize_rows, quantize_w8
    from .children import _setup_child_torch
    _setup_child_torch()
    m = spec.get("rows", M)
    flop = 2 * m * N * K
    x = torch.randn(m, K, dtype=torch.bfloat16)
    w = torch.randn(N, K, dtype=torch.bfloat16) / K ** 0.5
    bf16 = {}
    for form in cpu_linear.forms_for((N, K)):
        p = cpu_linear.pack(w, form, m)
        bf16[form] = flop / _best(lambda: cpu_linear.linear(x, p)) / 1e9
    wq = W8A8Weight(*quantize_w8(w.float()))
    qx, sx = quantize_rows(x.float())
    int8 = {}
    for kernel in [k for k in _candidates() if k != "float"]:
        int8[kernel] = flop / _best(lambda: wq.product(qx, sx, kernel)) / 1e9
    return {"machine_kind": cpu_info.machine_kind(), "shape": [m, N, K], "bf16_gflops": bf16,
            "int8_gops": int8, "bf16_peak": max(bf16.values()), "int8_peak": max(int8.values(), default=None)}
