"""Float8 KV cache conventions (kv_cache_dtype fp8_e4m3 / fp8_e5m2), shared by every backend and reference.

A cache of float8 holds x * (1 / scale) rounded to nearest (even), saturated to the format's largest finite
value (448 for e4m3fn, 57344 for e5m2; NaN stays NaN), with one k_scale and one v_scale per layer (1.0 unless
calibrated). The reciprocal is rounded to float32 once and multiplied, so the compiled CPU op (which
multiplies too) writes the same bytes. Reading gives float(code) * scale. Block copies (swap, prefix reuse)
move the raw bytes.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for an EngineConfig.kv_cache_dtype ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x (any float dtype) as float8 `dtype`: x * (1 / scale) in float32, saturated, rounded to nearest."""
    mx = torch.finfo(dtype).max
    inv = torch.tensor(1.0 / scale, dtype=torch.float32).item()     # the float32 reciprocal, as the op uses
    return (x.float() * inv).clamp(-mx, mx).to(dtype)


def dequantize(c: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float8 tensor's values, float(c) * scale, in `dtype`; a non-float8 tensor comes back as it is
    (cast to `dtype`)."""
    if not is_fp8(c.dtype):
        return c.to(dtype)
    x = c.float()
    return (x if scale == 1.0 else x * scale).to(dtype)


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 (same storage), for the copies torch's CPU kernels lack for float8
    (index_copy_); any other tensor unchanged."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
