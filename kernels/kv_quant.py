"""Quantized KV cache conventions (kv_cache_dtype fp8_e4m3 / fp8_e5m2 / int8), shared by every backend and
reference.

A cache of float8 holds x * (1 / scale) rounded to nearest (even), saturated to the format's largest finite
value (448 for e4m3fn, 57344 for e5m2; NaN stays NaN), with one k_scale and one v_scale per layer (1.0 unless
calibrated). The reciprocal is rounded to float32 once and multiplied, so the compiled CPU op (which
multiplies too) writes the same bytes. Reading gives float(code) * scale. Block copies (swap, prefix reuse)
move the raw bytes.

An int8 cache (llama.cpp's q8_0 cache, laid out per head row) keeps its scales inline: each head's row of D
values is D int8 codes then one float16 scale per group of 32 values (the last group may be shorter), so a
row is D + 2 * ceil(D / 32) bytes and blocks still copy as raw bytes. A group's scale s is
float16(min(max|x| / 127, 65504)); its codes are x * (1 / float(s)) (the reciprocal in float32; 0 where s is
0), rounded to nearest even and clamped to +-127. Reading gives float(code) * float(s), exactly.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                   "int8": torch.int8}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_GROUP = 32          # values per float16 scale in an int8 cache row


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_int8(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one head's row in a cache of `dtype`: head_dim, or for int8 its codes and scales' bytes."""
    return head_dim + 2 * -(-head_dim // INT8_GROUP) if is_int8(dtype) else head_dim


def row_head_dim(dtype: torch.dtype, width: int) -> int:
    """The head_dim whose row_width is `width` (a group of up to 32 codes plus 2 bytes is at most 34 bytes)."""
    return width - 2 * -(-width // (INT8_GROUP + 2)) if is_int8(dtype) else width


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes of one head's K (or V) row of one token in a cache of `dtype`."""
    return row_width(dtype, head_dim) * torch.empty((), dtype=dtype).element_size()


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for an EngineConfig.kv_cache_dtype ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x (any float dtype) as float8 `dtype`: x * (1 / scale) in float32, saturated, rounded to nearest."""
    mx = torch.finfo(dtype).max
    inv = torch.tensor(1.0 / scale, dtype=torch.float32).item()     # the float32 reciprocal, as the op uses
    return (x.float() * inv).clamp(-mx, mx).to(dtype)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) as int8 cache rows [..., row_width(int8, D)]: codes, then the groups'
    float16 scales' bytes (module docstring)."""
    D = x.shape[-1]
    ng = -(-D // INT8_GROUP)
    xg = torch.nn.functional.pad(x.float(), (0, ng * INT8_GROUP - D)).unflatten(-1, (ng, INT8_GROUP))
    s = (xg.abs().amax(-1) / 127).clamp(max=65504.0).to(torch.float16)                    # [..., ng]
    sf = s.float()
    inv = torch.where(sf > 0, 1.0 / sf, 0.0)
    codes = (xg * inv[..., None]).round().clamp(-127, 127).to(torch.int8).flatten(-2)[..., :D]
    return torch.cat([codes, s.view(torch.int8)], dim=-1)


def dequantize_int8(c: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., W] as float32 [..., D]: float(code) * float(its group's scale)."""
    D = row_head_dim(torch.int8, c.shape[-1])
    scales = c[..., D:].contiguous().view(torch.float16).float()                          # [..., ng]
    return c[..., :D].float() * scales.repeat_interleave(INT8_GROUP, -1)[..., :D]


def dequantize(c: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A quantized cache's values in `dtype`: float8 float(c) * scale, int8 rows by their inline scales
    (scale unused); any other tensor comes back as it is (cast to `dtype`)."""
    if is_int8(c.dtype):
        return dequantize_int8(c).to(dtype)
    if not is_fp8(c.dtype):
        return c.to(dtype)
    x = c.float()
    return (x if scale == 1.0 else x * scale).to(dtype)


def encode(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Rows x [..., D] as a cache of `dtype` stores them, in a dtype index_copy_ takes: float8 codes' bytes,
    int8 rows with their scales, else x itself."""
    if is_int8(dtype):
        return quantize_int8(x)
    return bytes_view(quantize(x, dtype, scale)) if is_fp8(dtype) else x


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 (same storage), for the copies torch's CPU kernels lack for float8
    (index_copy_); any other tensor unchanged."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
