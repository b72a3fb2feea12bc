"""A whole decoder layer (bfloat16, packed projections, paged attention) as one compiled CPU op.

    decoder_layer(h [T, H], ln1_w, qkv_wp, o_wp, ln2_w, gate_up_wp, down_wp, kv_caches [L, 2, N, bs, Hkv, D],
                  layer, cos_sin, positions, slot_mapping, query_start_loc, seq_lens, block_tables,
                  num_heads, eps, scale, sliding_window, k_scale, v_scale, sdpa_from, w8a8, w8a8_rotate)
                  -> None   (h in place)

It runs the library's own ops (rms_norm, bf16_linear, rope_, store_kv, paged_attention, add_rms_norm,
silu_mul) in the order and with the arguments of models/cpu_fused.py's per-op path, so that path is its
reference and the two agree bit for bit (tests/test_cpu_decoder_layer.py); one call replaces ~15 Python-level
calls per layer. Llama and Mistral layers (no q/k/v bias, no q/k norms) whose projections are packed for
cpu_gemm, oneDNN-packed or plain bf16, or packed for cpu_w8a8 (int8; their offset, scales and inv_smooth in
w8a8, three per projection; w8a8_rotate: the inputs of those whose K 64 divides are rotated per block of 64,
models/w8a8.py rotates) (kernels/csrc/cpu_decoder_layer.cpp). Built into cpu_attention.py's library.
"""
from __future__ import annotations

import torch

from batchrun.kernels import cpu_attention, cpu_gemm


def available() -> bool:
    """The op is built and the bf16 projections it composes run on this CPU."""
    return cpu_gemm.supported() and cpu_attention.load()


def decoder_layer(h: torch.Tensor, weights: tuple, kv_caches: torch.Tensor, layer: int, cos_sin: torch.Tensor,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, num_heads: int, eps: float, scale: float,
                  sliding_window: int, k_scale: float = 1.0, v_scale: float = 1.0, sdpa_from: int = -1,
                  w8a8: list = (), w8a8_rotate: bool = False) -> None:
    """weights: (ln1_w, qkv_wp, o_wp, ln2_w, gate_up_wp, down_wp); sliding_window -1 for none; sdpa_from: as
    cpu_attention.paged_attention's; w8a8: (offset, scales, inv_smooth or empty) of qkv, o, gate_up, down where
    any of them is int8 (cpu_w8a8.Packed's), else empty."""
    torch.ops.batchrun_cpu.decoder_layer(h, *weights, kv_caches, layer, cos_sin, positions, slot_mapping,
                                         query_start_loc, seq_lens, block_tables, num_heads, float(eps),
                                         float(scale), int(sliding_window), float(k_scale), float(v_scale),
                                         int(sdpa_from), w8a8, bool(w8a8_rotate))
