"""Causal varlen attention over a paged cache: one kernel for every mixed batch.

Each sequence b contributes q_len_b query tokens (a prefill chunk, or 1 for a decode row) at positions
seq_lens[b] - q_len_b ..., and attends to its keys 0..position in the paged cache (earlier chunks and
prefix-cache hits included; this step's K/V were stored before the call). A program takes a tile of
query tokens times all query heads of one KV head, so K/V tiles are read once per GQA group. Float8 caches
(kv_cache_dtype fp8) are converted to q's dtype as each tile loads, k_scale folded into the score scale and
v_scale applied to the normalised output.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._common import FLOAT_DTYPES, HAS_TRITON, check, check_block_tables_on_host, check_shape, is_interpreted, \
    next_pow2, ready_to_launch
from .kv_quant import FP8_DTYPES, dequantize, is_fp8

_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30   # a window wider than any context

if HAS_TRITON:
    import triton
    import triton.language as tl

    # the window stays a runtime value: fewer compiled variants, no cost in the loop
    @triton.jit(do_not_specialize=["window"])
    def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, qsl_ptr, lens_ptr, bt_ptr, out_ptr,
                        qk_scale, v_scale, window,
                        stride_qt, stride_qh, stride_ot, stride_oh,
                        stride_cn, stride_cb, stride_ch, stride_btb,
                        G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                        UPCAST: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr):
        BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
        b = tl.program_id(0)
        qt = tl.program_id(1)
        kvh = tl.program_id(2)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        tile0 = qt * BLOCK_Q
        if tile0 < q_len:
            seq_len = tl.load(lens_ptr + b)
            ctx0 = seq_len - q_len                     # position of this sequence's first query token
            r = tl.arange(0, BLOCK_M)
            qi = tile0 + r // G_PAD                    # rows: query token major, head of the group minor
            g = r % G_PAD
            d = tl.arange(0, D_PAD)
            d_ok = d < D
            row_ok = (qi < q_len) & (g < G)
            pos = ctx0 + qi
            heads = kvh * G + g
            io_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + (q_start + qi)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                        + d[None, :], mask=io_mask, other=0.0)
            if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot; fp32 operands are exact
                q = q.to(tl.float32)

            hi = ctx0 + tl.minimum(tile0 + BLOCK_Q, q_len)   # one past the tile's last position
            lo = tl.maximum(ctx0 + tile0 - window + 1, 0)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            head_off = kvh * stride_ch
            for start in range(lo, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                n_ok = n < hi
                blk = tl.load(bt_ptr + b * stride_btb + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
                kv_off = blk * stride_cn + (n % BLOCK_SIZE) * stride_cb + head_off
                kv_mask = n_ok[:, None] & d_ok[None, :]
                k = tl.load(kc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(vc_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if KV_FP8:  # float8 codes to q's dtype: exact (float8 values are bf16/fp16/fp32 values)
                    k = k.to(tl.float32).to(q.dtype)
                    v = v.to(tl.float32).to(q.dtype)
                elif UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale   # log2 domain
                visible = n_ok[None, :] & (n[None, :] <= pos[:, None]) & (pos[:, None] - n[None, :] < window)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # a row may see nothing yet (padding rows, window): keep it at exactly 0 instead of NaN
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_safe[:, None])
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new

            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            if KV_FP8:
                o = o * v_scale
            tl.store(out_ptr + (q_start + qi)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                     + d[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)
else:
    _prefill_kernel = None  # launchers raise before touching them


def _validate(op, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len,
              sliding_window):
    check(op, "k_cache", k_cache, dim=4, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    dev = k_cache.device
    nb, bs, hkv, d = k_cache.shape
    check(op, "v_cache", v_cache, dim=4, dtypes=(k_cache.dtype,), device=dev, contiguous=True)
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape))
    check(op, "q", q, dim=3, dtypes=FLOAT_DTYPES if is_fp8(k_cache.dtype) else (k_cache.dtype,), device=dev,
          last_dim_contiguous=True)
    T, hq = q.shape[0], q.shape[1]
    check_shape(op, "q", q, (T, None, d))
    if hq % hkv:
        raise ValueError(f"{op}: num query heads ({hq}) must be a multiple of num KV heads ({hkv})")
    check(op, "seq_lens", seq_lens, dim=1, dtypes=(torch.int32,), device=dev, contiguous=True)
    B = seq_lens.shape[0]
    check(op, "query_start_loc", query_start_loc, dim=1, dtypes=(torch.int32,), device=dev, contiguous=True)
    check_shape(op, "query_start_loc", query_start_loc, (B + 1,))
    check(op, "block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=dev, last_dim_contiguous=True)
    check_shape(op, "block_tables", block_tables, (B, None))
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{op}: scale must be a positive float, got {scale!r}")
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{op}: max_query_len must be a non-negative int, got {max_query_len!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be None or a positive int, got {sliding_window!r}")
    check_block_tables_on_host(op, block_tables, seq_lens, bs, nb)
    if dev.type == "cpu" and B:   # value checks only where they cost no device sync
        qsl = query_start_loc.long()
        qlen = qsl[1:] - qsl[:-1]
        if int(qsl[0]) != 0 or int(qsl[-1]) > T or int(qlen.min()) < 0:
            raise ValueError(f"{op}: query_start_loc must rise from 0 to at most T={T}, got {qsl.tolist()}")
        if int(qlen.max()) > max_query_len:
            raise ValueError(f"{op}: max_query_len={max_query_len} is below the longest query ({int(qlen.max())})")
        bad = (qlen > seq_lens.long()).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"{op}: sequence {i} has {int(qlen[i])} query tokens but seq_lens {int(seq_lens[i])}")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                            scale: float, max_query_len: int, sliding_window: Optional[int] = None,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of a flat varlen batch over its paged context.

    q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous; query_start_loc [B+1] int32;
    seq_lens [B] int32 (context including this step's tokens); block_tables [B, max_blocks] int32;
    max_query_len: host-side bound on the query lengths (sizes the grid). Query token i of sequence b is at
    position seq_lens[b] - q_len_b + i and sees keys j <= position (and position - j < sliding_window).
    Returns [T, Hq, D] in q's dtype; rows past query_start_loc[-1] are left zero. The caches may be float8
    (any float q), read as code x k_scale / v_scale.
    """
    op = "paged_prefill_attention"
    _validate(op, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len,
              sliding_window)
    T, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    out = torch.zeros_like(q)
    if T == 0 or B == 0 or max_query_len == 0:
        return out
    ready_to_launch(op, _prefill_kernel, q.device)
    interp = is_interpreted(_prefill_kernel)
    G = hq // hkv
    g_pad = next_pow2(G)
    block_m, block_n = (32, 32) if interp else (64, 64)
    block_q = max(1, block_m // g_pad)               # rows = block_q * g_pad >= 16, as tl.dot needs on GPUs
    grid = (B, -(-max_query_len // block_q), hkv)
    fp8 = is_fp8(k_cache.dtype)
    _prefill_kernel[grid](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out,
        float(scale) * _LOG2E * (float(k_scale) if fp8 else 1.0), float(v_scale),
        _NO_WINDOW if sliding_window is None else sliding_window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=G, G_PAD=g_pad, D=d, D_PAD=max(16, next_pow2(d)), BLOCK_SIZE=bs, BLOCK_Q=block_q, BLOCK_N=block_n,
        UPCAST=interp and q.dtype == torch.bfloat16, KV_FP8=fp8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                scale: float, max_query_len: int,
                                sliding_window: Optional[int] = None, k_scale: float = 1.0,
                                v_scale: float = 1.0) -> torch.Tensor:
    """Torch reference of paged_prefill_attention: per sequence, gather its blocks (float8 ones dequantised),
    mask, fp32 softmax."""
    _validate("paged_prefill_attention_ref", q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
              scale, max_query_len, sliding_window)
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    hq = q.shape[1]
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        nblk = -(-ctx // bs)
        ids = block_tables[b, :nblk].long()
        k = dequantize(k_cache[ids].flatten(0, 1)[:ctx], k_scale)   # [ctx, Hkv, D] float32
        v = dequantize(v_cache[ids].flatten(0, 1)[:ctx], v_scale)
        k = k.repeat_interleave(hq // hkv, dim=1)                   # [ctx, Hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        pos = torch.arange(ctx - (end - start), ctx, device=q.device)[:, None]
        j = torch.arange(ctx, device=q.device)[None, :]
        visible = j <= pos
        if sliding_window is not None:
            visible &= pos - j < sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out
