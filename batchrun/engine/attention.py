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
            lens = meta.seq_lens[:nd]
            max_len = max(meta.seq_lens_host[:nd])
            nblk = -(-max_len // bs)
            bt = meta.block_tables[:nd, :nblk].long()
            k = k_cache[bt].flatten(1, 2).transpose(1, 2)       # [nd, Hkv, L, D]
            v = v_cache[bt].flatten(1, 2).transpose(1, 2)
            j = torch.arange(nblk * bs)
            mask = j[None, :] < lens[:, None]                    # [nd, L]
            if sliding_window is not None:
                mask &= j[None, :] > (lens[:, None] - 1 - sliding_window)
            o = F.scaled_dot_product_attention(q[:nd, :, None, :], k, v, attn_mask=mask[:, None, None, :],
                                               scale=scale, enable_gqa=True)
            out[:nd] = o[:, :, 0, :]
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
