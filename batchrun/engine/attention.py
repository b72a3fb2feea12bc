"""Attention over a flat varlen batch whose K/V live in a paged cache.

The runner orders a batch decodes first (one query token each), then prefill chunks.
Every backend takes the same AttentionMetadata; the torch backend here is the CPU path
and the reference the Triton backend is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: where each new token's K/V goes; -1 = padding
    query_start_loc: torch.Tensor   # [B+1] int32
    seq_lens: torch.Tensor          # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor      # [B, max_blocks] int32
    num_decodes: int                # the first num_decodes sequences have one query token
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]


class TorchAttentionBackend:
    """Paged attention with torch ops: gathers each sequence's blocks, then SDPA with a causal offset mask."""

    name = "torch"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        nb, bs, hkv, d = k_cache.shape
        slots = meta.slot_mapping
        k_cache.view(nb * bs, hkv, d).index_copy_(0, slots, k)
        v_cache.view(nb * bs, hkv, d).index_copy_(0, slots, v)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: Optional[int]) -> torch.Tensor:
        # q: [T, Hq, D]; caches: [N, bs, Hkv, D]
        out = torch.empty_like(q)
        bs = k_cache.shape[1]
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in range(nd, len(lens)):
            start, end, ctx = qsl[i], qsl[i + 1], lens[i]
            ql = end - start
            nblk = -(-ctx // bs)
            bt = meta.block_tables[i, :nblk].long()
            k = k_cache[bt].flatten(0, 1)[:ctx].transpose(0, 1)[None]   # [1, Hkv, ctx, D]
            v = v_cache[bt].flatten(0, 1)[:ctx].transpose(0, 1)[None]
            qi = q[start:end].transpose(0, 1)[None]                    # [1, Hq, ql, D]
            if ql == ctx and sliding_window is None:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                qpos = torch.arange(ctx - ql, ctx)[:, None]
                kpos = torch.arange(ctx)[None, :]
                mask = kpos <= qpos
                if sliding_window is not None:
                    mask &= qpos - kpos < sliding_window
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: Optional[int]) -> torch.Tensor:
        # q: [B, Hq, D], one token per sequence. Explicit matmuls: CPU SDPA with a mask falls back to a
        # slow path in bf16, and grouping query heads by KV head avoids repeating K/V.
        B, Hq, D = q.shape
        bs, Hkv = k_cache.shape[1], k_cache.shape[2]
        lens = meta.seq_lens[:B]
        nblk = -(-max(meta.seq_lens_host[:B]) // bs)
        bt = meta.block_tables[:B, :nblk].long()
        k = k_cache[bt].flatten(1, 2)                          # [B, L, Hkv, D]
        v = v_cache[bt].flatten(1, 2)
        j = torch.arange(nblk * bs, device=q.device)
        masked = j[None, :] >= lens[:, None]                   # [B, L]
        if sliding_window is not None:
            masked |= j[None, :] <= (lens[:, None] - 1 - sliding_window)
        qg = q.view(B, Hkv, Hq // Hkv, D)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale     # [B, Hkv, G, L]
        scores.masked_fill_(masked[:, None, None, :], float("-inf"))
        p = scores.softmax(dim=-1).to(v.dtype)
        return torch.matmul(p, v.transpose(1, 2)).reshape(B, Hq, D)          # [B, Hkv, G, D] -> [B, Hq, D]


class TritonAttentionBackend:
    """Paged attention with batchrun.kernels' Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1).

    Decode rows go to the flash-decoding kernel, prefill chunks to the varlen prefill kernel; neither reads
    host values, so a decode step can be captured in a CUDA graph.
    """

    name = "triton"

    def __init__(self):
        from batchrun.kernels.kv_store import store_kv
        from batchrun.kernels.paged_decode import paged_decode_attention
        from batchrun.kernels.paged_prefill import paged_prefill_attention
        self._store, self._decode, self._prefill = store_kv, paged_decode_attention, paged_prefill_attention

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sliding_window: Optional[int]) -> torch.Tensor:
        nd = meta.num_decodes
        B = meta.seq_lens.shape[0]
        if nd == B:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                sliding_window=sliding_window, max_seq_len=meta.max_seq_len)
        return self._prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             scale, meta.max_query_len, sliding_window=sliding_window)
