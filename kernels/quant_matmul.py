"""Weight-only int8 / int4 matmuls (W8A16, W4A16) for CUDA, each beside its torch reference.

- int8_matmul(x [M, K], q int8 [N, K], scales [N]) = (x @ q.T) * scales: per-output-channel symmetric codes,
  the scales applied to the float32 accumulator.
- int4_matmul(x [M, K], packed uint8 [Np, K/2], scales_and_zeros [K/group, Np, 2], group, n): group-wise
  asymmetric codes, w = (code - 8) * scale + zero per (row, group), in the nibble layout of pack_int4: byte
  [row, k // 2] holds code k, even k in the low nibble, odd k in the high one. Np is N padded to a multiple
  of 64 (padded rows: code 8, scale 0, zero 0), and scales_and_zeros has the layout of torch's CPU int4
  kernel, so models/quant.py's Int4Weight takes the same bytes on either device; only n rows are computed.

Both kernels tile M x N x K and accumulate tl.dot in float32: int8 codes become the activation dtype exactly
(|q| <= 127); int4 tiles are dequantised in float32 and rounded to the activation dtype like the reference
model's dequantised weight (models/quant.py with BATCHRUN_QUANT_KERNELS=0). An int4 K-tile lies inside one
group (its scale and zero are one [BLOCK_N] vector) and splits into the even and odd inputs, the low and
high nibbles of a byte tile, so each byte is loaded once. Nothing reads device values on the host (CUDA
graphs can capture a call). The *_reference functions dequantise in float32 and run F.linear.
"""
from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check, check_shape, is_interpreted, next_pow2, ready_to_launch

INT4_ROW_BLOCK = 64        # N is padded to a multiple of this (torch's CPU int4 packing interleaves 64 rows)
INT4_GROUP_MULTIPLE = 32   # an int4 K-tile (>= 32: two tl.dot halves of K >= 16 on GPUs) must divide the group

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])
    def _int8_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        q_cols = q_ptr + rn.to(tl.int64)[None, :] * stride_qn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            q = tl.load(q_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)     # [BLOCK_K, BLOCK_N]
            if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot; fp32 operands are exact
                x = x.to(tl.float32)
            acc += tl.dot(x, q.to(x.dtype), input_precision=PRECISION)      # codes are exact in any float
        s = tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        y = acc * s[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit(do_not_specialize=["M"])
    def _int4_kernel(x_ptr, p_ptr, sz_ptr, y_ptr, M, N, K, NP, stride_xm, stride_ym,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rh = tl.arange(0, BLOCK_K // 2)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
        p_cols = p_ptr + rn.to(tl.int64)[None, :] * (K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = k0 // 2 + rh                               # byte columns of this tile
            h_ok = h < K // 2
            x_mask = m_ok[:, None] & h_ok[None, :]
            x_even = tl.load(x_rows + 2 * h[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_rows + 2 * h[None, :] + 1, mask=x_mask, other=0.0)
            b = tl.load(p_cols + h[:, None], mask=h_ok[:, None] & n_ok[None, :], other=0x88)  # [BLOCK_K/2, N]
            g = k0 // GROUP                                # the tile lies inside one group
            sz = sz_ptr + (g * NP + rn) * 2
            s = tl.load(sz, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            z = tl.load(sz + 1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            w_lo = (((b & 15).to(tl.float32) - 8.0) * s + z).to(x_ptr.dtype.element_ty)
            w_hi = (((b >> 4).to(tl.float32) - 8.0) * s + z).to(x_ptr.dtype.element_ty)
            if UPCAST:  # see _int8_kernel; the weights were rounded to bf16 above, as on a GPU
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
                w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
            acc += tl.dot(x_even, w_lo, input_precision=PRECISION)
            acc += tl.dot(x_odd, w_hi, input_precision=PRECISION)
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
else:
    _int8_kernel = _int4_kernel = None  # launchers raise before touching them


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (integers 0..15, K even) -> uint8 [N, K/2]: byte [r, j] = code[r, 2j] | code[r, 2j+1] << 4."""
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(f"pack_int4: codes must be [N, K] with K even, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: uint8 [N, K/2] -> int32 codes [N, K]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1).to(torch.int32)


def dequantize_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """The first n rows of the weight in float32: (code - 8) * scale + zero per (row, group)."""
    q = unpack_int4(packed[:n]).float()
    K = q.shape[1]
    sz = scales_and_zeros[:, :n].float()                            # [K/group, n, 2]
    s, z = sz[..., 0].T[..., None], sz[..., 1].T[..., None]         # [n, K/group, 1]
    return ((q.view(n, K // group, group) - 8) * s + z).view(n, K)


def _validate_int8(op, x, q, scales):
    check(op, "x", x, dim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check(op, "q", q, dim=2, dtypes=(torch.int8,), device=x.device, contiguous=True)
    check_shape(op, "q", q, (None, x.shape[1]))
    check(op, "scales", scales, dim=1, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_shape(op, "scales", scales, (q.shape[0],))


def _validate_int4(op, x, packed, scales_and_zeros, group, n):
    check(op, "x", x, dim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check(op, "packed", packed, dim=2, dtypes=(torch.uint8,), device=x.device, contiguous=True)
    K, np_ = x.shape[1], packed.shape[0]
    if K % 2:
        raise ValueError(f"{op}: x's K ({K}) must be even (two int4 codes a byte)")
    check_shape(op, "packed", packed, (None, K // 2))
    if not isinstance(group, int) or group <= 0 or group % INT4_GROUP_MULTIPLE or K % group:
        raise ValueError(f"{op}: group must be a positive multiple of {INT4_GROUP_MULTIPLE} dividing K ({K}), "
                         f"got {group!r}")
    check(op, "scales_and_zeros", scales_and_zeros, dim=3, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    check_shape(op, "scales_and_zeros", scales_and_zeros, (K // group, np_, 2))
    if not isinstance(n, int) or not 0 < n <= np_:
        raise ValueError(f"{op}: n (output features) must lie in [1, {np_}] (packed rows), got {n!r}")


def _blocks(M: int, interp: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): tl.dot needs M >= 16 on GPUs; few rows (decode) get narrower N tiles, more
    programs to spread the weight read over. The interpreter takes the largest tiles (fewer numpy calls)."""
    if interp:
        return min(64, next_pow2(M)), 64
    return min(64, max(16, next_pow2(M))), (32 if M <= 16 else 64)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float, last dim contiguous) @ (q int8 [N, K] * scales [N, 1]).T -> [M, N] in x's dtype."""
    op = "int8_matmul"
    _validate_int8(op, x, q, scales)
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    ready_to_launch(op, _int8_kernel, x.device)
    interp = is_interpreted(_int8_kernel)
    bm, bn = _blocks(M, interp)
    bk = min(128, max(16, next_pow2(K))) if interp else (128 if M <= 16 else 64)
    _int8_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, q, scales, y, M, N, K, x.stride(0), q.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=interp and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return y


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                n: int) -> torch.Tensor:
    """x [M, K] @ w[:n].T -> [M, n] in x's dtype, w the int4 weight of pack_int4's layout (module docstring).
    group: a multiple of 32 dividing K."""
    op = "int4_matmul"
    _validate_int4(op, x, packed, scales_and_zeros, group, n)
    M, K = x.shape
    y = torch.empty(M, n, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    ready_to_launch(op, _int4_kernel, x.device)
    interp = is_interpreted(_int4_kernel)
    bm, bn = _blocks(M, interp)
    bk = next(b for b in (128, 64, 32) if group % b == 0)           # a tile never straddles two groups
    _int4_kernel[(triton.cdiv(M, bm), triton.cdiv(n, bn))](
        x, packed, scales_and_zeros, y, M, n, K, packed.shape[0], x.stride(0), y.stride(0),
        GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, UPCAST=interp and x.dtype == torch.bfloat16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return y


def int8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_matmul in torch: the weight dequantised in float32, F.linear in float32, cast to x's dtype."""
    _validate_int8("int8_matmul_reference", x, q, scales)
    w = q.float() * scales.float()[:, None]
    return torch.nn.functional.linear(x.float(), w).to(x.dtype)


def int4_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                          n: int) -> torch.Tensor:
    """int4_matmul in torch: the weight dequantised in float32, F.linear in float32, cast to x's dtype."""
    _validate_int4("int4_matmul_reference", x, packed, scales_and_zeros, group, n)
    w = dequantize_int4(packed, scales_and_zeros, group, n)
    return torch.nn.functional.linear(x.float(), w).to(x.dtype)
