"""RMSNorm and the fused residual-add + RMSNorm, with HF Llama's rounding points.

HF computes x / rms in fp32, rounds to the activation dtype, then multiplies by the weight in that dtype;
a residual add happens in the activation dtype before the norm. The kernels round at the same points, so
they agree with the unfused model to the last bit up to the rsqrt.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check, check_shape, next_pow2, ready_to_launch

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, eps,
                         stride_x, stride_r, stride_o, stride_nr,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RES:
            s = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
            x = s.to(x.dtype)                                  # the residual stream is kept in x's dtype
            tl.store(new_res_ptr + row * stride_nr + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
else:
    _rms_norm_kernel = None  # launchers raise before touching them


def _validate(op, x, residual, weight, eps):
    check(op, "x", x, dim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    T, H = x.shape
    if residual is not None:
        check(op, "residual", residual, dim=2, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
        check_shape(op, "residual", residual, (T, H))
    check(op, "weight", weight, dim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
    check_shape(op, "weight", weight, (H,))
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{op}: eps must be a positive float, got {eps!r}")


def _launch(op, x, residual, weight, eps, out, new_res):
    T, H = x.shape
    if T == 0:
        return
    ready_to_launch(op, _rms_norm_kernel, x.device)
    block = next_pow2(H)
    has_res = residual is not None
    _rms_norm_kernel[(T,)](
        x, residual if has_res else x, weight, out, new_res if has_res else out, float(eps),
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0), new_res.stride(0) if has_res else 0,
        N=H, BLOCK=block, HAS_RES=has_res, num_warps=min(16, max(1, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim of x [T, H]; weight [H], same dtype as x.

    out may be given (e.g. x itself for an in-place norm)."""
    _validate("rms_norm", x, None, weight, eps)
    if out is None:
        out = torch.empty_like(x)
    else:
        check("rms_norm", "out", out, dim=2, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
        check_shape("rms_norm", "out", out, tuple(x.shape))
    _launch("rms_norm", x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x, residual [T, H], weight [H], one dtype.

    With inplace=True the norm overwrites x and the new residual overwrites residual (no allocation)."""
    _validate("fused_add_rms_norm", x, residual, weight, eps)
    out, new_res = (x, residual) if inplace else (torch.empty_like(x), torch.empty_like(residual))
    _launch("fused_add_rms_norm", x, residual, weight, eps, out, new_res)
    return out, new_res


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of rms_norm (HF LlamaRMSNorm's arithmetic)."""
    _validate("rms_norm_ref", x, None, weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of fused_add_rms_norm (out of place)."""
    _validate("fused_add_rms_norm_ref", x, residual, weight, eps)
    new_res = x + residual
    return rms_norm_ref(new_res, weight, eps), new_res
