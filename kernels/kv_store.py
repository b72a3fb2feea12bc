"""Write this step's new K/V rows into the paged cache at their slots (slot = block * block_size + offset).

A float8 cache (kv_cache_dtype fp8) takes the rows quantised as kv_quant.quantize does: x * (1 / scale),
saturated, rounded to nearest (on CUDA Triton's cast is cvt.rn.satfinite; the interpreter's float8 cast rounds
differently, so its bytes are not the reference's)."""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check, check_range_on_host, check_shape, next_pow2, ready_to_launch
from .kv_quant import FP8_DTYPES, bytes_view, encode, is_fp8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cs, stride_ch, k_inv, v_inv,
                         H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                         FP8: tl.constexpr, FP8_MAX: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:  # -1 marks a padding token
            h = tl.arange(0, H_PAD)[:, None]
            d = tl.arange(0, D_PAD)[None, :]
            mask = (h < H) & (d < D)
            dst = slot * stride_cs + h * stride_ch + d
            k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
            if FP8:
                k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv, -FP8_MAX), FP8_MAX).to(kc_ptr.dtype.element_ty)
                v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv, -FP8_MAX), FP8_MAX).to(vc_ptr.dtype.element_ty)
            tl.store(kc_ptr + dst, k, mask=mask)
            tl.store(vc_ptr + dst, v, mask=mask)
else:
    _store_kv_kernel = None  # launchers raise before touching them


def _validate(k, v, k_cache, v_cache, slot_mapping):
    op = "store_kv"
    check(op, "k_cache", k_cache, dim=4, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    dev = k_cache.device
    nb, bs, hkv, d = k_cache.shape
    check(op, "v_cache", v_cache, dim=4, dtypes=(k_cache.dtype,), device=dev, contiguous=True)
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape))
    kv_dtypes = FLOAT_DTYPES if is_fp8(k_cache.dtype) else (k_cache.dtype,)
    check(op, "k", k, dim=3, dtypes=kv_dtypes, device=dev, last_dim_contiguous=True)
    T = k.shape[0]
    check_shape(op, "k", k, (T, hkv, d))
    check(op, "v", v, dim=3, dtypes=(k.dtype,), device=dev, last_dim_contiguous=True)
    check_shape(op, "v", v, (T, hkv, d))
    check(op, "slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,), device=dev, contiguous=True)
    check_shape(op, "slot_mapping", slot_mapping, (T,))
    check_range_on_host(op, "slot_mapping", slot_mapping, -1, nb * bs)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter k, v [T, num_kv_heads, head_dim] into k_cache, v_cache [num_blocks, block_size, num_kv_heads,
    head_dim] (contiguous) at slot_mapping [T] int64; slot -1 is padding and writes nothing.

    k and v may be strided views (e.g. slices of a fused QKV projection) as long as head_dim is contiguous.
    Float8 caches: k / k_scale and v / v_scale, quantised (module docstring); the scales apply to them only.
    """
    _validate(k, v, k_cache, v_cache, slot_mapping)
    fp8 = is_fp8(k_cache.dtype)
    T = k.shape[0]
    if T == 0:
        return
    ready_to_launch("store_kv", _store_kv_kernel, k.device)
    _, _, hkv, d = k_cache.shape
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), 1.0 / k_scale, 1.0 / v_scale,
        H=hkv, D=d, H_PAD=next_pow2(hkv), D_PAD=next_pow2(d),
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0, num_warps=4 if hkv * d >= 1024 else 1)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Torch reference of store_kv (same arguments, same in-place effect)."""
    _validate(k, v, k_cache, v_cache, slot_mapping)
    nb, bs, hkv, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    # float8 codes as bytes (torch has no float8 index_copy_), int8 rows with their scales
    k, v = encode(k, k_cache.dtype, k_scale), encode(v, v_cache.dtype, v_scale)
    bytes_view(k_cache).view(nb * bs, hkv, d).index_copy_(0, slots, k)
    bytes_view(v_cache).view(nb * bs, hkv, d).index_copy_(0, slots, v)
