"""A quantized linear weight and its product (W8A16, W4A16), whatever the weights came from: quant.py
quantizes a loaded model's weights into these, gguf_quant.py builds them from a GGUF file's own codes.

- int8: per-output-channel symmetric, w = q * s, q in [-127, 127]; the same tensors on CPU and CUDA.
- int4: group-wise asymmetric along the input dim, w = (q - 8) * s + z with q in [0, 15] (z = group min +
  8 s). Groups of 32, 64 or 128; the group must divide every layer's input. The codes' layout follows the
  device they are built on: torch's CPU int4 packing on CPU, the nibble layout of kernels/quant_matmul.py
  on CUDA; both pad N to 64 and share scales_and_zeros [K/group, Np, 2], so their bytes are equal.

On CUDA the products are batchrun's Triton kernels (kernels/quant_matmul.py). On CPU they are torch's
weight-only kernels (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu), which read the packed weight
directly and win at a decode step's few rows but lose badly at many (SmolLM2-135M's shapes x 30 layers, 2
AVX-512-BF16 cores, bf16 packed linear = 1.0: int8 1.75x faster at 1 row, even at 4, 2x slower at 16, 2.5x
at 64; int4 3.9x faster at 1, 1.9x at 4, 1.3x slower at 16, 7x at 64). So on CPU int8 products of more than
INT8_KERNEL_ROWS rows cast the weight for the call and run a dense matmul (the scales on the output); int4
products run the kernel in chunks of INT4_KERNEL_ROWS rows, where its cost per row is lowest. These are the
defaults: at engine start models/quant_kernel_choice.py measures both limits on the loaded model's weights.
BATCHRUN_QUANT_KERNELS=0 makes every product dequantise-then-F.linear on either device: the reference.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from batchrun.kernels import quant_matmul as qmm
from batchrun.kernels.quant_matmul import INT4_ROW_BLOCK   # N padded to it (torch's CPU int4 packing)

QUANT_KERNELS_ENV = "BATCHRUN_QUANT_KERNELS"
# int8: products of up to this many rows use torch's kernel, more a cast of the weight and a dense matmul:
# the cast of SmolLM2's projections costs ~30 ms a step, the kernel's lead over bf16 is gone by 16 rows
# (32.7 vs 16.3 ms) and 2.5x behind at 64 (103 vs 42), so the crossing is near 32 rows.
# int4: torch's kernel always, in chunks of this many rows (its cost per row jumps past them: 21 ms at 16
# rows, 309 at 64; dequantising int4 with torch ops costs more). Figures: scripts/bench_quant.py --rows.
INT8_KERNEL_ROWS = 32
INT4_KERNEL_ROWS = 16


def kernels_enabled() -> bool:
    return os.environ.get(QUANT_KERNELS_ENV, "1") != "0"


class QuantizedWeight:
    """A linear layer's weight [N, K] kept quantized. linear(x, b) is x @ w.T + b in x's dtype."""

    kind = ""
    shape: tuple[int, int]

    def __init__(self, use_kernel: bool):
        self.use_kernel = use_kernel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (contiguous) @ w.T by x's device's kernel (where _has_kernel(device)), the fast way."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not (self.use_kernel and self._has_kernel(x.device)):
            y = nn.functional.linear(x, self.dequantize(x.dtype))      # the reference
        else:
            y = self._product(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], self.shape[0])
        return y if b is None else y + b

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


class Int8Weight(QuantizedWeight):
    """q int8 [N, K], scales [N] in the activation dtype: w = q * scales[:, None]."""

    kind = "int8"
    kernel_rows = INT8_KERNEL_ROWS       # CPU: torch's kernel up to this many rows (quant_kernel_choice.py sets it)

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, use_kernel: bool = True):
        super().__init__(use_kernel)
        self.q, self.scales = q.contiguous(), scales.to(dtype).contiguous()
        self.shape = tuple(q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scales.float()[:, None]).to(dtype)

    def _kernel(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)

    def _dense(self, x):
        # the per-channel scale factors out of the K-sum: a cast of q, then the scales on the output
        return nn.functional.linear(x, self.q.to(x.dtype)) * self.scales

    def _has_kernel(self, device):
        return device.type == "cpu" or (device.type == "cuda" and qmm.HAS_TRITON)

    def _product(self, x):
        if x.device.type != "cpu":
            return qmm.int8_matmul(x, self.q, self.scales)
        return self._kernel(x) if x.shape[0] <= self.kernel_rows else self._dense(x)

    def tensors(self):
        return [self.q, self.scales]


class Int4Weight(QuantizedWeight):
    """Codes packed uint8 [Np, K/2] (N padded to a multiple of 64) and scales_and_zeros [K/group, Np, 2] in
    the activation dtype: w = (q - 8) * scale + zero per group. layout "cpu": torch's CPU int4 packing (its
    kernel's); "nibbles": kernels/quant_matmul.py's (the Triton kernel's). By default the codes' device picks."""

    kind = "int4"
    chunk_rows = INT4_KERNEL_ROWS        # CPU: the kernel's products in chunks of this many rows (measured)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 dtype: torch.dtype, use_kernel: bool = True, layout: Optional[str] = None):
        """codes [N, K] integers 0..15; scales, zeros [N, K/group] (any float dtype)."""
        super().__init__(use_kernel)
        N, K = codes.shape
        if K % group or scales.shape != (N, K // group) or zeros.shape != scales.shape:
            raise ValueError(f"int4: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, group {group}")
        self.layout = layout or ("cpu" if codes.device.type == "cpu" else "nibbles")
        pad = -N % INT4_ROW_BLOCK            # padded rows: code 8, scale 0, zero 0 -> weight 0, sliced off
        codes = nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad), value=8).contiguous()
        sz = torch.stack([scales, zeros], dim=-1).to(dtype)
        sz = nn.functional.pad(sz, (0, 0, 0, 0, 0, pad))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1) if self.layout == "cpu" \
            else qmm.pack_int4(codes)
        self.scales_and_zeros = sz.transpose(0, 1).contiguous()       # [K/group, Np, 2]
        self.group, self.shape = group, (N, K)

    def codes(self) -> torch.Tensor:
        """The codes [N, K] (int32 0..15) back from the packed layout. "nibbles": pack_int4's; "cpu": per
        block of B rows (64 on AVX-512 CPUs, else 32) and column k, B/2 bytes whose byte j holds rows j and
        j + B/2 (AVX-512, AVX2; other CPUs: rows 2j and 2j + 1) in its low and high nibbles."""
        N, K = self.shape
        if self.layout == "nibbles":
            return qmm.unpack_int4(self.packed[:N])
        cap = torch.backends.cpu.get_cpu_capability()       # torch's packing follows the kernel it runs
        b = self.packed.view(-1, K, (64 if cap.startswith("AVX512") else 32) // 2)
        q = torch.cat([b & 15, b >> 4], -1) if cap.startswith("AVX") else torch.stack([b & 15, b >> 4], -1)
        return q.reshape(b.shape[0], K, -1).transpose(1, 2).reshape(-1, K)[:N].to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.shape
        sz = self.scales_and_zeros[:, :N].float()                     # [K/g, N, 2]
        s, z = sz[..., 0].T[..., None], sz[..., 1].T[..., None]       # [N, K/g, 1]
        q = self.codes().view(N, K // self.group, self.group).float()
        return ((q - 8) * s + z).view(N, K).to(dtype)

    def _has_kernel(self, device):
        if self.layout == "cpu":
            return device.type == "cpu"
        return qmm.HAS_TRITON and (device.type == "cuda" or qmm.is_interpreted(qmm._int4_kernel))

    def _kernel(self, x):
        if self.layout == "nibbles":
            return qmm.int4_matmul(x, self.packed, self.scales_and_zeros, self.group, self.shape[0])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)
        return y if y.shape[1] == self.shape[0] else y[:, :self.shape[0]]

    def _product(self, x):
        if x.shape[0] <= self.chunk_rows or self.layout == "nibbles":
            return self._kernel(x)
        return torch.cat([self._kernel(c) for c in x.split(self.chunk_rows)])

    def tensors(self):
        return [self.packed, self.scales_and_zeros]


def quantize_int8(w: torch.Tensor, dtype: torch.dtype, use_kernel: bool = True) -> Int8Weight:
    """Per-output-channel symmetric int8 of w [N, K] (rounded to nearest; scale = max |w| / 127)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(dtype).float()          # quantize against the scale the kernel will use
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scale, dtype, use_kernel)


def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype, use_kernel: bool = True) -> Int4Weight:
    """Group-wise asymmetric int4 of w [N, K]: per group of `group` inputs, 16 levels from min to max."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"int4 group size {group} does not divide the layer's {K} inputs")
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).to(dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (lo + 8 * scale).to(dtype).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    return Int4Weight(q.view(N, K), scale, zero, group, dtype, use_kernel)


def quantize_weight(w: torch.Tensor, mode: str, group: int, dtype: torch.dtype, use_kernel: bool = True):
    return quantize_int8(w, dtype, use_kernel) if mode == "int8" else quantize_int4(w, group, dtype, use_kernel)


def linear_layers(model: nn.Module, lm_head: bool) -> list[tuple[str, nn.Module]]:
    """(name, module) of every nn.Linear quantization applies to: the projections, and lm_head if asked."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (lm_head or n != "lm_head")]


def set_weight(mod: nn.Module, w: QuantizedWeight) -> None:
    """Replace a Linear's weight parameter by a quantized weight (a plain attribute: inference only)."""
    del mod._parameters["weight"]
    mod.weight = w
