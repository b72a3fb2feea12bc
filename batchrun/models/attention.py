"""Attention over a flat varlen batch whose K/V live in a paged cache.

The runner orders a batch decodes first (one query token each), then prefill chunks.
Every backend takes the same AttentionMetadata; the torch backend here is the CPU path
and the reference the Triton backend is checked against. The caches may be float8 (kv_cache_dtype fp8,
batchrun.kernels.kv_quant): store_kv quantises with the layer's k_scale / v_scale, forward reads the codes
times the scales.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from batchrun.kernels.kv_quant import bytes_view, dequantize, encode, is_fp8


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


log = logging.getLogger(__name__)

# Torch path: query lengths up to this (decodes, speculative verification) share one batched matmul; longer
# prefill chunks run SDPA one sequence at a time.
SHORT_QUERY = 16

_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TorchAttentionBackend:
    """The CPU backend. By default (impl="op") CPU tensors go to batchrun.kernels.cpu_attention's compiled op,
    which reads each sequence's K/V blocks in place (one call per layer for the whole batch: decodes,
    verification queries and prefill chunks; cost follows the sum of the contexts); fresh prompt chunks of at
    least sdpa_from tokens run inside it on torch's SDPA (models/attention_choice.py measures where that
    wins). The torch path, which gathers each sequence's blocks then runs matmuls or SDPA with a causal offset
    mask, is the reference; it runs when impl="torch", for tensors not on the CPU, and wherever the op cannot
    be built (one warning, logged by cpu_attention.load).
    """

    name = "torch"

    def __init__(self, impl: str = "op", sdpa_from: Optional[int] = None):
        if impl not in ("op", "torch"):
            raise ValueError(f"impl must be 'op' or 'torch', got {impl!r}")
        self.requested = impl
        self.sdpa_from = -1 if sdpa_from is None else int(sdpa_from)     # the op's argument (-1: never)
        self._ops = None         # (attention, store) once loaded; False: unavailable, use the torch path

    @property
    def impl(self) -> str:
        """What CPU attention runs: "op", "torch", or "op?" before the first CPU call has loaded the op."""
        if self.requested == "torch" or self._ops is False:
            return "torch"
        return "op" if self._ops else "op?"

    def _cpu_ops(self, x: torch.Tensor):
        if self.requested == "torch" or x.device.type != "cpu" or x.dtype not in _OP_DTYPES:
            return None
        if self._ops is None:                 # first CPU call: build (once per machine) and load
            from batchrun.kernels import cpu_attention
            if cpu_attention.load():
                ops = torch.ops.batchrun_cpu
                self._ops = (ops.paged_attention.default, ops.store_kv.default)
                log.info("CPU attention: the compiled op (%s)", cpu_attention.attention_isa())
            else:
                self._ops = False
        return self._ops or None

    def op_ready(self, x: torch.Tensor) -> bool:
        """Attention on x's device and dtype runs the compiled op (loading it on the first call)."""
        return self._cpu_ops(x) is not None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        ops = self._cpu_ops(k) if k_cache.device.type == "cpu" else None
        if ops is not None:                   # both caches in one call, k and v read in place
            if is_fp8(k_cache.dtype):
                ops[1](k, v, k_cache, v_cache, meta.slot_mapping, float(k_scale), float(v_scale))
            else:
                ops[1](k, v, k_cache, v_cache, meta.slot_mapping)
            return
        nb, bs, hkv, d = k_cache.shape
        slots = meta.slot_mapping
        # float8 codes as bytes (torch has no float8 index_copy_), int8 rows with their scales
        k, v = encode(k, k_cache.dtype, k_scale), encode(v, v_cache.dtype, v_scale)
        bytes_view(k_cache).view(nb * bs, hkv, d).index_copy_(0, slots, k)
        bytes_view(v_cache).view(nb * bs, hkv, d).index_copy_(0, slots, v)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: Optional[int], k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        # q: [T, Hq, D]; caches: [N, bs, Hkv, D] (float8 ones are read as code x k_scale / v_scale)
        ops = self._cpu_ops(q)
        if ops is not None:
            if is_fp8(k_cache.dtype):
                return ops[0](q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              float(scale), -1 if sliding_window is None else int(sliding_window), -1,
                              float(k_scale), float(v_scale))
            return ops[0](q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, float(scale),
                          -1 if sliding_window is None else int(sliding_window), -1, 1.0, 1.0, self.sdpa_from)
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        B = len(lens)
        if meta.num_decodes == B:                      # a pure decode step: no index building
            return self._short(q[:, None], k_cache, v_cache, meta.block_tables, meta.seq_lens,
                               torch.ones_like(meta.seq_lens), scale, sliding_window, k_scale, v_scale)[:, 0]
        out = torch.empty_like(q)
        short = [i for i in range(B) if qsl[i + 1] - qsl[i] <= SHORT_QUERY]
        if short:
            qlen = [qsl[i + 1] - qsl[i] for i in short]
            Q = max(qlen)
            # [b, t] -> row of q; rows past a sequence's own query length repeat its last row (discarded)
            dev = q.device
            rows = torch.tensor([[qsl[i] + min(t, n - 1) for t in range(Q)] for i, n in zip(short, qlen)], device=dev)
            sel = torch.tensor(short, device=dev)
            qlen_t = torch.tensor(qlen, dtype=meta.seq_lens.dtype, device=q.device)
            o = self._short(q[rows], k_cache, v_cache, meta.block_tables[sel], meta.seq_lens[sel], qlen_t,
                            scale, sliding_window, k_scale, v_scale)                # [b, Q, Hq, D]
            valid = torch.arange(Q, device=dev)[None, :] < qlen_t[:, None]
            out[rows[valid]] = o[valid]
        bs = k_cache.shape[1]
        for i in range(B):
            start, end, ctx = qsl[i], qsl[i + 1], lens[i]
            ql = end - start
            if ql <= SHORT_QUERY:
                continue
            nblk = -(-ctx // bs)
            bt = meta.block_tables[i, :nblk].long()
            k = dequantize(k_cache[bt], k_scale, q.dtype).flatten(0, 1)[:ctx].transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            v = dequantize(v_cache[bt], v_scale, q.dtype).flatten(0, 1)[:ctx].transpose(0, 1)[None]
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
    def _short(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_lens: torch.Tensor, scale: float,
               sliding_window: Optional[int], k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        # q: [B, Q, Hq, D], the last query_lens[b] tokens of each sequence (decodes: Q = 1; speculative
        # verification: 1 + drafts). Explicit matmuls: CPU SDPA with a mask falls back to a slow path in
        # bf16, and grouping query heads by KV head avoids repeating K/V. Float8 blocks: dequantised here.
        B, Q, Hq, D = q.shape
        bs, Hkv = k_cache.shape[1], k_cache.shape[2]
        nblk = -(-int(seq_lens.max()) // bs)
        bt = block_tables[:, :nblk].long()
        k = dequantize(k_cache[bt], k_scale, q.dtype).flatten(1, 2)       # [B, L, Hkv, D]
        v = dequantize(v_cache[bt], v_scale, q.dtype).flatten(1, 2)
        j = torch.arange(nblk * bs, device=q.device)
        pos = (seq_lens - query_lens)[:, None] + torch.arange(Q, device=q.device)[None, :]     # [B, Q]
        masked = j[None, None, :] > pos[:, :, None]                       # [B, Q, L]: causal, and past ctx
        if sliding_window is not None:
            masked |= j[None, None, :] <= pos[:, :, None] - sliding_window
        qg = q.view(B, Q, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)       # [B, Hkv, G, Q, D]
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)[:, :, None]).float() * scale      # [B, Hkv, G, Q, L]
        scores.masked_fill_(masked[:, None, None], float("-inf"))
        p = scores.softmax(dim=-1).to(v.dtype)
        o = torch.matmul(p, v.transpose(1, 2)[:, :, None])                # [B, Hkv, G, Q, D]
        return o.permute(0, 3, 1, 2, 4).reshape(B, Q, Hq, D)


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

    def store_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        self._store(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sliding_window: Optional[int], k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        nd = meta.num_decodes
        B = meta.seq_lens.shape[0]
        if nd == B:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                sliding_window=sliding_window, max_seq_len=meta.max_seq_len,
                                k_scale=k_scale, v_scale=v_scale)
        return self._prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                             scale, meta.max_query_len, sliding_window=sliding_window, k_scale=k_scale,
                             v_scale=v_scale)
