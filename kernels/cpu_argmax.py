"""Greedy sampling's argmax over a step's logits on CPU: a compiled op.

argmax(logits [T, V]) -> [T] int64 equals torch.max(logits, dim=-1).indices (its reference): the first
maximal index of each row, the first NaN where a row holds one. torch's CPU max over bfloat16 rows is one
scalar pass on one thread (~1.3 ms for 64 rows of a 32,000-token vocabulary on Zen 1, ~1.5% of a decode
step); this one is vectorised and spreads the rows over the threads. float32 and bfloat16, rows contiguous;
anything else takes the torch reference. Built into cpu_attention.py's library (csrc/cpu_argmax.cpp).
"""
from __future__ import annotations

import torch

from batchrun.kernels import cpu_attention

DTYPES = (torch.float32, torch.bfloat16)


def argmax(logits: torch.Tensor, isa: str | None = None) -> torch.Tensor:
    """torch.max(logits, dim=-1).indices of a [T, V] tensor, by the op where it applies; isa ("baseline",
    "avx2") caps its code path, for tests."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in DTYPES and logits.shape[1] > 0
            and logits.stride(1) == 1 and cpu_attention.load()):
        level = -1 if isa is None else {v: k for k, v in cpu_attention.ISAS.items()}[isa]
        return torch.ops.batchrun_cpu.argmax_rows(logits, level)
    return logits.max(dim=-1).indices
