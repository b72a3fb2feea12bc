"""The elementwise parts of a decoder layer as compiled CPU ops; their reference is the model's torch math.

A decode step at batch 1 spends more time between the projections than in them once the weights stream
at memory speed: the torch reference of one layer is ~45 small ops (a norm is 8, RoPE of q and k 17), each
a Python call and a dispatch. These fuse them into one call each:

  rms_norm(x [T, H], w [H], eps) -> [T, H]
  add_rms_norm(x, residual, w, eps) -> [T, H]   residual += x (in place), then its norm
  rope_(q [T, Hq, D], k [T, Hkv, D], cos_sin [P, D] float32, positions [T] int64)   in place, rotate-half
  silu_mul(gate_up [T, 2I]) -> [T, I]            silu(gate) * up

The reference is the model's own torch math (batchrun/models/llama.py: rms_norm, apply_rope, and
silu(gate) * up), which tests/test_cpu_layer_ops.py compares each op against. Each op rounds to the
activation dtype where that math does; only the norm's float sum (another order) and exp differ, by a few
float32 ulp: float32 results are within ~1e-6 relative, bfloat16 ones bit-identical unless such a difference
meets a rounding boundary. float32 and bfloat16 on CPU; q/k may be strided views (of the fused qkv projection).
They live in the library cpu_attention.py builds (csrc/cpu_layer_ops.cpp);
available() is False, after that module's one warning, where it cannot be built.
"""
from __future__ import annotations

import torch

from batchrun.kernels import cpu_attention

DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """The ops are built and loaded (building them on first use)."""
    return cpu_attention.load()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.batchrun_cpu.rms_norm(x, w, float(eps))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.batchrun_cpu.add_rms_norm(x, residual, w, float(eps))


def rope_(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
    torch.ops.batchrun_cpu.rope_(q, k, cos_sin, positions)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.batchrun_cpu.silu_mul(gate_up)


def set_isa(isa: str) -> str:
    """Cap the instruction set these ops use ("baseline", "avx2", "avx512"; never above the machine's), for
    tests of the lower paths; returns the previous cap."""
    levels = {v: k for k, v in cpu_attention.ISAS.items()}
    return cpu_attention.ISAS[int(torch.ops.batchrun_cpu.set_layer_ops_isa(levels[isa]))]
