"""SiLU-and-multiply of a fused gate/up projection: out = silu(x[:, :I]) * x[:, I:]."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._common import FLOAT_DTYPES, HAS_TRITON, check, check_shape, ready_to_launch

_BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        # HF rounds silu(gate) to the activation dtype before the product
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=ok)
else:
    _silu_and_mul_kernel = None  # launchers raise before touching them


def _validate(op, x):
    check(op, "x", x, dim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.shape[1] % 2:
        raise ValueError(f"{op}: x [T, 2 * intermediate] needs an even last dim, got {x.shape[1]}")


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> [T, I] = silu(gate) * up, in x's dtype (fp32 math)."""
    op = "silu_and_mul"
    _validate(op, x)
    T, two_i = x.shape
    inter = two_i // 2
    if out is None:
        out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    else:
        check(op, "out", out, dim=2, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
        check_shape(op, "out", out, (T, inter))
    if T and inter:
        ready_to_launch(op, _silu_and_mul_kernel, x.device)
        block = min(_BLOCK, 1 << (inter - 1).bit_length())
        _silu_and_mul_kernel[(T, -(-inter // block))](x, out, x.stride(0), out.stride(0), I=inter, BLOCK=block,
                                                        num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of silu_and_mul."""
    _validate("silu_and_mul_ref", x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
