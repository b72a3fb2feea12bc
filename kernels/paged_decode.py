"""Paged decode attention (one query token per sequence), flash-decoding style.

One program serves all query heads of one KV head (GQA: K/V are read once per group) over one
partition of the context. A long context is split into partitions whose partial results (normalised
output and log-sum-exp) a second kernel combines; a short one is done in a single pass.
Nothing reads device values on the host, so a decode step can be captured in a CUDA graph. Float8 caches
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

DEFAULT_PARTITION_SIZE = 512   # keys per partition when the context is split
_LOG2E = 1.4426950408889634
_NO_WINDOW = 1 << 30   # a window wider than any context

if HAS_TRITON:
    import triton
    import triton.language as tl

    # window and group size stay runtime values: fewer compiled variants, no cost in the loop
    @triton.jit(do_not_specialize=["window", "G"])
    def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, po_ptr, plse_ptr,
                       qk_scale, v_scale, window, num_parts, G,
                       stride_qb, stride_qh, stride_ob, stride_oh,
                       stride_cn, stride_cb, stride_ch, stride_btb,
                       G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
                       SINGLE: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
                       PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_ok = g < G
        d_ok = d < D
        heads = kvh * G + g

        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter multiplies bf16 bit patterns in tl.dot; fp32 operands are exact
            q = q.to(tl.float32)

        lo = part * PARTITION
        # the last partition runs to the end: a max_seq_len hint below a real length costs speed, not keys
        hi = tl.where(part == num_parts - 1, seq_len, tl.minimum(lo + PARTITION, seq_len))
        lo = tl.maximum(lo, seq_len - window)   # the query at seq_len - 1 sees keys j > seq_len - 1 - window

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
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
            s = tl.where(n_ok[None, :], s, float("-inf"))
            # the loop starts at a visible key, so every tile has one and m_new is finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if KV_FP8:
            o = o * v_scale
        out_mask = g_ok[:, None] & d_ok[None, :]
        if SINGLE:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # scratch layout: po [B, Hq, num_parts, D_PAD], plse [B, Hq, num_parts] (log2 domain)
            row = (b * (tl.num_programs(1) * G) + heads) * num_parts + part
            tl.store(po_ptr + row[:, None] * D_PAD + d[None, :], o, mask=out_mask)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(plse_ptr + row, lse, mask=g_ok)

    @triton.jit
    def _reduce_kernel(po_ptr, plse_ptr, out_ptr, stride_ob, stride_oh, num_parts,
                       HQ: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, P_CHUNK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D_PAD)
        row = (b * HQ + h) * num_parts
        m_vec = tl.full([P_CHUNK], float("-inf"), tl.float32)
        for p0 in range(0, num_parts, P_CHUNK):
            p = p0 + tl.arange(0, P_CHUNK)
            m_vec = tl.maximum(m_vec, tl.load(plse_ptr + row + p, mask=p < num_parts, other=float("-inf")))
        m = tl.max(m_vec, 0)
        m = tl.where(m == float("-inf"), 0.0, m)   # an empty context: all weights 0, output 0
        w_vec = tl.zeros([P_CHUNK], tl.float32)
        acc = tl.zeros([P_CHUNK, D_PAD], tl.float32)
        for p0 in range(0, num_parts, P_CHUNK):
            p = p0 + tl.arange(0, P_CHUNK)
            p_ok = p < num_parts
            w = tl.exp2(tl.load(plse_ptr + row + p, mask=p_ok, other=float("-inf")) - m)
            o = tl.load(po_ptr + (row + p)[:, None] * D_PAD + d[None, :], mask=p_ok[:, None], other=0.0)
            acc += o * w[:, None]
            w_vec += w
        total = tl.sum(w_vec, 0)
        res = tl.sum(acc, 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < D)
else:
    _decode_kernel = _reduce_kernel = None  # launchers raise before touching them


def _validate(op, q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window):
    check(op, "k_cache", k_cache, dim=4, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    dev = k_cache.device
    nb, bs, hkv, d = k_cache.shape
    check(op, "v_cache", v_cache, dim=4, dtypes=(k_cache.dtype,), device=dev, contiguous=True)
    check_shape(op, "v_cache", v_cache, tuple(k_cache.shape))
    check(op, "q", q, dim=3, dtypes=FLOAT_DTYPES if is_fp8(k_cache.dtype) else (k_cache.dtype,), device=dev,
          last_dim_contiguous=True)
    B, hq = q.shape[0], q.shape[1]
    check_shape(op, "q", q, (B, None, d))
    if hq % hkv:
        raise ValueError(f"{op}: num query heads ({hq}) must be a multiple of num KV heads ({hkv})")
    check(op, "block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=dev, last_dim_contiguous=True)
    check_shape(op, "block_tables", block_tables, (B, None))
    check(op, "seq_lens", seq_lens, dim=1, dtypes=(torch.int32,), device=dev, contiguous=True)
    check_shape(op, "seq_lens", seq_lens, (B,))
    check_block_tables_on_host(op, block_tables, seq_lens, bs, nb)
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{op}: scale must be a positive float, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be None or a positive int, got {sliding_window!r}")


def num_partitions(max_seq_len: int, partition_size: int = DEFAULT_PARTITION_SIZE) -> int:
    """Context partitions for a batch whose longest context is max_seq_len: 1 (single pass) when it fits."""
    return max(1, -(-max_seq_len // partition_size))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sliding_window: Optional[int] = None, *, max_seq_len: Optional[int] = None,
                           partition_size: int = DEFAULT_PARTITION_SIZE, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous; block_tables [B, max_blocks]
    int32; seq_lens [B] int32 (context length including the query token, which sits at seq_lens[b] - 1).
    Returns [B, Hq, D] in q's dtype. max_seq_len, a host-side hint of the longest context (default: the
    block table width times block_size), sets the number of context partitions of partition_size keys;
    the last partition takes whatever lies past the hint, so a low hint is slower, never wrong.
    The caches may be float8 (any float q), read as code x k_scale / v_scale.
    """
    op = "paged_decode_attention"
    _validate(op, q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    B, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    out = torch.empty_like(q)
    if B == 0 or hq == 0:
        return out
    ready_to_launch(op, _decode_kernel, q.device)
    interp = is_interpreted(_decode_kernel)
    block_n = 32 if interp else (64 if d <= 128 else 32)
    if partition_size < block_n or partition_size % block_n:
        raise ValueError(f"{op}: partition_size must be a positive multiple of {block_n}, got {partition_size}")
    bound = block_tables.shape[1] * bs if max_seq_len is None else int(max_seq_len)
    parts = num_partitions(bound, partition_size)
    G = hq // hkv
    # tl.dot needs M >= 16 on GPUs: pad the head group
    g_pad = next_pow2(G) if interp else max(16, next_pow2(G))
    d_pad = max(16, next_pow2(d))                # tl.dot needs K >= 16
    if parts > 1:
        po = torch.empty(B, hq, parts, d_pad, dtype=torch.float32, device=q.device)
        plse = torch.empty(B, hq, parts, dtype=torch.float32, device=q.device)
    else:
        po = plse = out  # unused
    upcast = interp and q.dtype == torch.bfloat16
    fp8 = is_fp8(k_cache.dtype)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_kernel[(B, hkv, parts)](
        q, k_cache, v_cache, block_tables, seq_lens, out, po, plse,
        float(scale) * _LOG2E * (float(k_scale) if fp8 else 1.0), float(v_scale),
        _NO_WINDOW if sliding_window is None else sliding_window, parts, G,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_SIZE=bs, BLOCK_N=block_n, PARTITION=partition_size,
        SINGLE=parts == 1, UPCAST=upcast, KV_FP8=fp8, PRECISION=precision,
        num_warps=4)
    if parts > 1:
        _reduce_kernel[(B, hq)](po, plse, out, out.stride(0), out.stride(1), parts,
                                HQ=hq, D=d, D_PAD=d_pad, P_CHUNK=min(16, next_pow2(parts)),
                                num_warps=4)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               sliding_window: Optional[int] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                               **_ignored) -> torch.Tensor:
    """Torch reference of paged_decode_attention: gathers every sequence's blocks (float8 ones dequantised),
    masks, fp32 softmax."""
    _validate("paged_decode_attention_ref", q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)
    B, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    L = block_tables.shape[1] * bs
    j = torch.arange(L, device=q.device)[None, :]
    lens = seq_lens.long()[:, None]
    used = torch.arange(block_tables.shape[1], device=q.device)[None, :] < (lens + bs - 1) // bs
    bt = torch.where(used, block_tables.long(), 0)        # padding entries may hold anything
    k = dequantize(k_cache[bt].flatten(1, 2), k_scale)     # [B, L, Hkv, D] float32
    v = dequantize(v_cache[bt].flatten(1, 2), v_scale)
    visible = j < lens
    if sliding_window is not None:
        visible &= (lens - 1) - j < sliding_window
    qg = q.float().view(B, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)      # an empty context gives zeros, not NaN
    out = torch.einsum("bhgl,blhd->bhgd", p, v)
    return out.reshape(B, hq, d).to(q.dtype)
