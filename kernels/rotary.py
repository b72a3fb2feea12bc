"""Rotary position embedding, rotate-half (NeoX / HF Llama) style, plus inverse-frequency helpers.

For a head vector x with rotary dims split in halves (x1, x2) and angle f = position * inv_freq:
    (x1, x2) -> (x1 cos f - x2 sin f, x2 cos f + x1 sin f); dims past the rotary dim pass through.
The cos/sin cache is either one [max_pos, rot_dim] tensor (cos in the first half, sin in the second, the
layout the engine's model builds) or a pair (cos, sin) of [max_pos, rot_dim / 2] tensors.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check, check_range_on_host, check_shape, next_pow2, ready_to_launch

CosSin = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotary_kernel(x_ptr, out_ptr, pos_ptr, cos_ptr, sin_ptr,
                       stride_xt, stride_xh, stride_ot, stride_oh, stride_cos, stride_sin,
                       H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, TAIL_PAD: tl.constexpr,
                       COPY_TAIL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        h = tl.arange(0, H_PAD)[:, None]
        i = tl.arange(0, HALF_PAD)[None, :]
        ok = (h < H) & (i < HALF)
        c = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_sin + i, mask=i < HALF, other=0.0).to(tl.float32)
        base = x_ptr + t * stride_xt + h * stride_xh
        x1 = tl.load(base + i, mask=ok, other=0.0)
        x2 = tl.load(base + HALF + i, mask=ok, other=0.0)
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        obase = out_ptr + t * stride_ot + h * stride_oh
        tl.store(obase + i, (x1f * c - x2f * s).to(x1.dtype), mask=ok)
        tl.store(obase + HALF + i, (x2f * c + x1f * s).to(x1.dtype), mask=ok)
        if COPY_TAIL:  # out of place with partial rotary: carry the unrotated dims over
            j = 2 * HALF + tl.arange(0, TAIL_PAD)[None, :]
            tok = (h < H) & (j < D)
            tl.store(obase + j, tl.load(base + j, mask=tok), mask=tok)
else:
    _rotary_kernel = None  # launchers raise before touching them


def _split_cache(op: str, cos_sin_cache: CosSin, device) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(cos_sin_cache, (tuple, list)):
        if len(cos_sin_cache) != 2:
            raise ValueError(f"{op}: cos_sin_cache as a tuple must be (cos, sin), got {len(cos_sin_cache)} items")
        cos, sin = cos_sin_cache
        check(op, "cos", cos, dim=2, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=True)
        check(op, "sin", sin, dim=2, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=True)
        check_shape(op, "sin", sin, tuple(cos.shape))
        return cos, sin
    check(op, "cos_sin_cache", cos_sin_cache, dim=2, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=True)
    if cos_sin_cache.shape[1] % 2:
        raise ValueError(f"{op}: cos_sin_cache [max_pos, rot_dim] needs an even rot_dim, got {cos_sin_cache.shape[1]}")
    return cos_sin_cache.chunk(2, dim=1)


def _validate(op, q, k, positions, cos_sin_cache):
    check(op, "q", q, dim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, _, D = q.shape
    if k is not None:
        check(op, "k", k, dim=3, dtypes=(q.dtype,), device=q.device, last_dim_contiguous=True)
        check_shape(op, "k", k, (T, None, D))
    check(op, "positions", positions, dim=1, dtypes=(torch.int64, torch.int32), device=q.device)
    check_shape(op, "positions", positions, (T,))
    cos, sin = _split_cache(op, cos_sin_cache, q.device)
    half = cos.shape[1]
    if 2 * half > D or half == 0:
        raise ValueError(f"{op}: rotary dim {2 * half} (from the cos/sin cache) must be in [2, head_dim={D}]")
    check_range_on_host(op, "positions", positions, 0, cos.shape[0])
    return cos, sin


def rotary_embedding(q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor, cos_sin_cache: CosSin,
                     inplace: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (k may be None) at positions [T] (int64/int32).

    cos_sin_cache: [max_pos, rot_dim] (cos | sin halves) or a (cos, sin) pair of [max_pos, rot_dim / 2];
    rot_dim <= D, the remaining dims are left as they are. Math in fp32, results in q's dtype.
    Returns (q_rot, k_rot): q and k themselves when inplace, else new tensors.
    """
    op = "rotary_embedding"
    cos, sin = _validate(op, q, k, positions, cos_sin_cache)
    outs = []
    for x in (q, k):
        if x is None:
            outs.append(None)
            continue
        out = x if inplace else torch.empty_like(x)
        T, H, D = x.shape
        if T and H:
            ready_to_launch(op, _rotary_kernel, x.device)
            half = cos.shape[1]
            _rotary_kernel[(T,)](
                x, out, positions, cos, sin,
                x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
                H=H, D=D, HALF=half, H_PAD=next_pow2(H), HALF_PAD=next_pow2(half),
                TAIL_PAD=next_pow2(max(1, D - 2 * half)), COPY_TAIL=(not inplace) and 2 * half < D,
                num_warps=4 if H * D >= 2048 else 1)
        outs.append(out)
    return outs[0], outs[1]


def rotary_embedding_ref(q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor,
                         cos_sin_cache: CosSin, inplace: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Torch reference of rotary_embedding (same arguments and results)."""
    cos, sin = _validate("rotary_embedding_ref", q, k, positions, cos_sin_cache)
    half = cos.shape[1]
    c = cos[positions.long()].float()[:, None, :]
    s = sin[positions.long()].float()[:, None, :]
    outs = []
    for x in (q, k):
        if x is None:
            outs.append(None)
            continue
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xf[..., 2 * half:]], dim=-1).to(x.dtype)
        if inplace:
            x.copy_(rot)
            rot = x
        outs.append(rot)
    return outs[0], outs[1]


def rope_inv_freq(rotary_dim: int, base: float, scaling: Optional[Mapping[str, Any]] = None) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies base^(-2i / rotary_dim), with optional scaling.

    scaling (HF's rope_scaling / rope_parameters dict): None or rope_type "default"; "linear" with `factor`
    (frequencies divided by factor); "llama3" with `factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings` (Llama 3.1: wavelengths above original_len / low_freq_factor are
    slowed by factor, those below original_len / high_freq_factor kept, the band between interpolated).
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rope_inv_freq: rotary_dim must be a positive even int, got {rotary_dim}")
    inv_freq = 1.0 / (float(base) ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type") or scaling.get("type") or "default"

    def need(key):
        if key not in scaling:
            raise ValueError(f"rope_inv_freq: rope_type {kind!r} needs key {key!r} in the scaling dict")
        return float(scaling[key])

    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / need("factor")
    if kind == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        old_len = need("original_max_position_embeddings")
        if high <= low:
            raise ValueError(f"rope_inv_freq: llama3 needs high_freq_factor > low_freq_factor, got {high} <= {low}")
        wavelen = 2 * math.pi / inv_freq
        long_wave = wavelen > old_len / low
        short_wave = wavelen < old_len / high
        slowed = torch.where(long_wave, inv_freq / factor, inv_freq)
        # between the two bounds blend slowed/factor and slowed by how far the wavelength sits in the band
        t = (old_len / wavelen - low) / (high - low)
        blended = (1 - t) * slowed / factor + t * slowed
        return torch.where(~long_wave & ~short_wave, blended, slowed)
    raise ValueError(f"rope_inv_freq: rope_type {kind!r} is not supported (default, linear, llama3)")


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, 2 * len(inv_freq)] float32: cos(p * inv_freq) then sin(p * inv_freq)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
