"""One decoder for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), driven by config.json.

Shapes: T tokens in the flat batch, H hidden, Hq/Hkv query/KV heads, D head_dim, I intermediate.
Weights are fused at load time: qkv_proj = [q; k; v], gate_up_proj = [gate; up].
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from batchrun.engine.attention import AttentionMetadata
from batchrun.models.rope import cos_sin_cache, rope_params


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, 1, D/2] — rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any], arch: str):
        super().__init__()
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        bias = arch == "qwen2" or bool(cfg.get("attention_bias", False))
        self.qkv_proj = nn.Linear(cfg["hidden_size"], self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg["hidden_size"], bias=False)
        self.qk_norm = arch == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, cfg["rms_norm_eps"])
        window = cfg.get("sliding_window")
        uses_window = arch == "mistral" or bool(cfg.get("use_sliding_window", False))
        self.sliding_window: Optional[int] = window if uses_window and window else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, backend) -> torch.Tensor:
        T = h.shape[0]
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)             # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)          # [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv[0], kv[1]                          # [N, bs, Hkv, D]
        backend.store_kv(k, v, k_cache, v_cache, meta)
        o = backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        self.intermediate = cfg["intermediate_size"]
        self.gate_up_proj = nn.Linear(cfg["hidden_size"], 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, cfg["hidden_size"], bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)        # [T, I] each
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], arch: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg, arch)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, kv, meta, backend):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Decoder-only transformer: embed -> N x (attn + MLP, pre-norm residual) -> norm -> lm_head."""

    def __init__(self, cfg: dict[str, Any], arch: str, max_positions: int):
        super().__init__()
        self.config = cfg
        cfg.setdefault("rms_norm_eps", 1e-6)
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(cfg, arch) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        attn = self.layers[0].self_attn
        self.register_buffer("cos_sin", cos_sin_cache(attn.head_dim, rope_params(cfg), max_positions),
                             persistent=False)

    def shard_range(self, name: str, shard: int) -> tuple[int, int]:
        """(start, length) of shard `shard` along dim 0 of a fused parameter."""
        if ".qkv_proj." in name:
            a = self.layers[0].self_attn
            sizes = [a.q_size, a.kv_size, a.kv_size]
        else:
            sizes = [self.layers[0].mlp.intermediate] * 2
        return sum(sizes[:shard]), sizes[shard]

    @staticmethod
    def num_shards(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, backend) -> torch.Tensor:
        # input_ids, positions: [T]; kv_caches: [L, 2, N, bs, Hkv, D] -> hidden [T, H]
        h = self.embed_tokens(input_ids)
        cos, sin = self.cos_sin[positions].to(h.dtype).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_caches[i], meta, backend)
        return self.norm(h)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [S, H] -> [S, V] float32
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(h, w).float()
