"""bfloat16 projections on x86-64 CPUs from a weight packed once at load: a compiled op.

oneDNN's bf16 GEMM (what torch runs, with or without its packed layout) reads a decode step's weights at
about half this machine kind's memory bandwidth when the step has one or a few rows, and on CPUs without
native bf16 arithmetic (AVX2 only) torch's bf16 F.linear runs several times slower than float32. This op
reads the weights at close to memory speed on AVX-512 BF16 (VDPBF16PS) and on AVX2 + FMA (the bf16 pairs
widened to float in registers), and matches oneDNN from tens of rows up (csrc/cpu_gemm.cpp says how).
pack(w [n, K]) pairs each 16 output rows' K values: [ceil(n/16), K/2, 16, 2], or on AVX-512 BF16 with n a
multiple of 64 [n/64, K/2, 4, 16, 2] (four such blocks side by side: one sequential stream per thread, what a
one-row product reads fastest); linear(x, wp, n) = x @ w.T.
Float accumulation, one rounding at the end: the reference is torch's F.linear on the unpacked weight
(results differ only in the order of the float sums). Built into cpu_attention.py's library.
"""
from __future__ import annotations

from typing import Optional

import torch

from batchrun.kernels import cpu_attention


ISAS = {1: "avx2", 2: "avx512_bf16"}


def supported() -> bool:
    """The op is built and this CPU has AVX-512 BF16 or AVX2 with FMA."""
    return cpu_attention.load() and bool(torch.ops.batchrun_cpu.bf16_linear_supported())


def isa() -> str:
    """The instruction set the op runs with here ("avx512_bf16", "avx2"); "none" if it cannot run."""
    return ISAS.get(int(torch.ops.batchrun_cpu.gemm_isa()), "none") if cpu_attention.load() else "none"


def set_isa(name: str) -> str:
    """Cap the instruction set ("avx2", "avx512_bf16"; never above the machine's), for tests of the AVX2 path
    on an AVX-512 machine; returns the previous cap."""
    levels = {v: k for k, v in ISAS.items()}
    return ISAS[int(torch.ops.batchrun_cpu.set_gemm_isa(levels[name]))]


def packed_shape(n: int, k: int, grouped: Optional[bool] = None) -> tuple:
    """The shape pack() gives a [n, k] weight (grouped=None: the layout this CPU reads fastest)."""
    if grouped is None:
        grouped = n % 64 == 0 and isa() == "avx512_bf16"
    return (n // 64, k // 2, 4, 16, 2) if grouped else (-(-n // 16), k // 2, 16, 2)


def pack(w: torch.Tensor, grouped: Optional[bool] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """w [n, K] bfloat16, K even -> the layout the op reads fastest here (grouped=None) or the one asked for:
    blocks [ceil(n/16), K/2, 16, 2], wp[b, p, j, t] = w[16 b + j, 2 p + t], rows past n zero; grouped
    [n/64, K/2, 4, 16, 2], wp[g, p, b, j, t] = w[64 g + 16 b + j, 2 p + t] (AVX-512 BF16 only, n % 64 == 0).
    out: a contiguous tensor of packed_shape() to write it into (returned)."""
    n, k = w.shape
    if k % 2:
        raise ValueError(f"cpu_gemm.pack: K={k} must be even")
    if grouped and n % 64:
        raise ValueError(f"cpu_gemm.pack: the grouped layout needs n a multiple of 64, got {n}")
    shape = packed_shape(n, k, grouped)
    if out is None:
        out = torch.empty(shape, dtype=w.dtype)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"cpu_gemm.pack: out must be a contiguous {shape}, got {tuple(out.shape)}")
    if len(shape) == 5:
        return out.copy_(w.reshape(n // 64, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4))
    if n % 16:
        w = torch.cat([w, w.new_zeros(shape[0] * 16 - n, k)])
    return out.copy_(w.reshape(shape[0], 16, k // 2, 2).permute(0, 2, 1, 3))


def packed_rows(wp: torch.Tensor) -> int:
    """The output rows a packed weight holds (n rounded up to its blocks of 16)."""
    return wp.shape[0] * (64 if wp.dim() == 5 else 16)


def unpack(wp: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack: [n, K]."""
    kp = wp.shape[1]
    if wp.dim() == 5:
        return wp.permute(0, 2, 3, 1, 4).reshape(-1, 2 * kp)[:n]
    return wp.permute(0, 2, 1, 3).reshape(wp.shape[0] * 16, 2 * kp)[:n]


def linear(x: torch.Tensor, wp: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bfloat16 (contiguous rows) @ w.T -> [M, n], wp = pack(w)."""
    return torch.ops.batchrun_cpu.bf16_linear(x, wp, n)


WEIGHT_LOADS = ("cached", "nontemporal")


def set_weight_loads(mode: str) -> str:
    """How a product of a few rows (one register tile: each weight read once) loads the weights: "cached"
    (ordinary loads) or "nontemporal" (64-byte aligned weights only; a hint the CPU may ignore), process-wide;
    returns the previous mode. models/weight_loads.py measures which is faster here."""
    if mode not in WEIGHT_LOADS:
        raise ValueError(f"weight loads must be one of {', '.join(WEIGHT_LOADS)}, got {mode!r}")
    return WEIGHT_LOADS[int(torch.ops.batchrun_cpu.set_weight_loads(WEIGHT_LOADS.index(mode)))]


def weight_loads() -> str:
    """The mode set_weight_loads() set ("cached" until it is called)."""
    return WEIGHT_LOADS[int(torch.ops.batchrun_cpu.weight_loads())]
