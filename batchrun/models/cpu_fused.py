"""The dense parts of a layer through compiled CPU ops: a transform applied to a loaded model.

llama.py's pre_attention/post_attention are ~45 torch calls per layer (a norm is 8, RoPE of q and k 17);
at small batches each call's Python and dispatch cost is a large share of a decode step. These are the same
functions over batchrun.kernels.cpu_layer_ops (one call per norm, RoPE of q and k together, SwiGLU's
activation; the residual add fused into the post-attention norm), ~15 calls per layer. Results equal llama.py's math
but for a few float32 ulp (kernels/cpu_layer_ops.py says where). use_fused_layer_ops() installs them;
BATCHRUN_CPU_FUSED_OPS=0 keeps the torch math.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from batchrun.kernels import cpu_layer_ops as ops
from batchrun.models.cpu_linear import linear
from batchrun.models.llama import DenseFns

FUSED_OPS_ENV = "BATCHRUN_CPU_FUSED_OPS"


def pre_attention(h: torch.Tensor, ln_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],
                  q_norm_w: Optional[torch.Tensor], k_norm_w: Optional[torch.Tensor], rope: tuple,
                  eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
    """llama.pre_attention; rope: (cos_sin table [P, D] float32, positions [T]); q and k rotated in place."""
    T = h.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = linear(ops.rms_norm(h, ln_w, eps), qkv_w, qkv_b).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(T, num_heads, head_dim)
    k = k.view(T, num_kv_heads, head_dim)
    v = v.view(T, num_kv_heads, head_dim)
    if q_norm_w is not None:        # Qwen3: per-head norms over [T * heads, D] rows
        q = ops.rms_norm(q.reshape(-1, head_dim), q_norm_w, eps).view(T, num_heads, head_dim)
        k = ops.rms_norm(k.reshape(-1, head_dim), k_norm_w, eps).view(T, num_kv_heads, head_dim)
    ops.rope_(q, k, *rope)
    return q, k, v


def post_attention(o: torch.Tensor, h: torch.Tensor, o_w: torch.Tensor, ln_w: torch.Tensor,
                   gate_up_w: torch.Tensor, down_w: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.post_attention; adds the attention output into h in place (h is this step's residual stream)."""
    x = ops.add_rms_norm(linear(o.flatten(1), o_w), h, ln_w, eps)
    return h + linear(ops.silu_mul(linear(x, gate_up_w)), down_w)


def _rope_inputs(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
    return cos_sin, positions


FUSED_DENSE = DenseFns(_rope_inputs, pre_attention, post_attention)


def fused_ops_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU, float32 or bfloat16, not switched off by the environment, and the ops build here."""
    if device.type != "cpu" or dtype not in ops.DTYPES:
        return False
    if os.environ.get(FUSED_OPS_ENV, "1") == "0":
        return False
    return ops.available()


def use_fused_layer_ops(model) -> None:
    """Install the fused dense functions on a loaded LlamaModel (its cos_sin table must be float32)."""
    model.cos_sin = model.cos_sin.float().contiguous()
    model._dense_fns = FUSED_DENSE
