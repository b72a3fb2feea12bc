"""W8A8 products with batchrun's own AVX-512 VNNI kernel (csrc/cpu_w8a8.cpp, built into cpu_attention.py's
library): models/w8a8.py's "own" kernel, timed against torch's (_int_mm, oneDNN qlinear) like every other.

pack(q [N, K] int8, scales [N] or [N, G]) -> Packed: the codes as [ceil(N/16), K/4, 16, 4] (K a multiple of 4),
-128 x their per-output sums per group of K / G columns (the activations are stored shifted to uint8; the
kernel's int32 sums start at this offset, which takes the shift off) and the scales, both [blocks, G, 16]
(N padded to whole blocks; one tile's groups contiguous); Packed.codes() and .row_scales() give back what was
packed. linear(x, packed, inv_smooth, rotate) quantizes x per row (G = 1) or per group of each row (rotated per
block of 64 first with rotate) and multiplies, in one pass each. With one group: the same codes, sums and float32 roundings as models/w8a8.py's
quantize_rows + torch._int_mm path, so equal to it bit for bit; with groups: its codes, and each group's sum
folded in by a multiply and an FMA. product() takes that path's codes (tests, the candidate check).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import cpu_attention


class Packed(NamedTuple):
    wp: torch.Tensor        # int8 [blocks, K/4, 16, 4]
    offset: torch.Tensor    # int32 [blocks, G, 16]: -128 * the codes' sum per output and group
    scales: torch.Tensor    # float32 [blocks, G, 16]
    n: int

    @property
    def group(self) -> int:
        """Columns per group along K."""
        return self.wp.shape[1] * 4 // self.scales.shape[1]

    def codes(self) -> torch.Tensor:
        """The packed codes back as int8 [N, K]."""
        return self.wp.permute(0, 2, 1, 3).reshape(-1, self.wp.shape[1] * 4)[: self.n]

    def row_scales(self) -> torch.Tensor:
        """The packed scales back as float32 [N] (one group) or [N, G], contiguous."""
        s = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])[: self.n]
        return (s.reshape(-1) if s.shape[1] == 1 else s).contiguous()


def supported() -> bool:
    """The library builds here and the CPU has AVX-512 VNNI."""
    return cpu_attention.load() and bool(torch.ops.batchrun_cpu.w8a8_supported())


def pack(q: torch.Tensor, scales: torch.Tensor) -> Packed:
    if not supported():
        raise RuntimeError("cpu_w8a8: the library is not built here or the CPU has no AVX-512 VNNI")
    n, k = q.shape
    scales = scales.float().reshape(n, -1)
    ng = scales.shape[1]
    if k % 4 or k % ng or (ng > 1 and (k // ng) % 16):
        raise ValueError(f"cpu_w8a8.pack: K={k} in {ng} groups does not fit (K a multiple of 4, groups of 16s)")
    pad = -n % 16
    qp = torch.nn.functional.pad(q, (0, 0, 0, pad))
    wp = qp.view(-1, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    offset = qp.view(n + pad, ng, k // ng).to(torch.int32).sum(2, dtype=torch.int32).mul_(-128)
    sp = torch.nn.functional.pad(scales, (0, 0, 0, pad))
    return Packed(wp, *(t.view(-1, 16, ng).transpose(1, 2).contiguous() for t in (offset, sp)), n)


def linear(x: torch.Tensor, p: Packed, inv_smooth: Optional[torch.Tensor] = None, rotate: bool = False) -> torch.Tensor:
    """x [M, K] (bfloat16 or float32, contiguous rows) -> [M, N] in x's dtype; rotate: x * inv_smooth is rotated
    per block of 64 columns before its quantization (models/w8a8.py rotate_blocks, the same floats)."""
    inv = inv_smooth if inv_smooth is not None else x.new_empty(0, dtype=torch.float32)
    u8, sx = torch.ops.batchrun_cpu.w8a8_quantize(x, inv, p.group, rotate)
    return torch.ops.batchrun_cpu.w8a8_gemm(u8, sx, p.wp, p.offset, p.scales, p.n, x.dtype == torch.bfloat16)


def product(qx: torch.Tensor, sx: torch.Tensor, p: Packed) -> torch.Tensor:
    """qx int8 [M, K], sx [M, G] (quantize_rows') -> float32 [M, N] = sum over groups of sx * scales * (qx @ q.T)."""
    u8 = (qx.to(torch.int16) + 128).to(torch.uint8)
    return torch.ops.batchrun_cpu.w8a8_gemm(u8, sx.reshape(-1).float().contiguous(), p.wp, p.offset, p.scales, p.n,
                                            False)
