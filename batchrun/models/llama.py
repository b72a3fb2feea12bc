"""One decoder for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm), driven by ModelArgs.

Shapes: T tokens in the flat batch, H hidden, Hq/Hkv query/KV heads, D head_dim, I intermediate.
Weights are fused at load time: qkv_proj = [q; k; v], gate_up_proj = [gate; up].
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import nn

from batchrun.models.args import ModelArgs
from batchrun.models.attention import AttentionMetadata
from batchrun.models.cpu_linear import linear
from batchrun.models.rope import cos_sin_cache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, round to the input dtype, then scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, 1, D/2] — rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_tables(cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) [T, 1, D/2] each, in the activations' dtype, from the float32 table [P, D] (cos | sin)."""
    return cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)


# The dense parts of a layer as free functions of tensors: one compiled graph serves every layer (a
# compiled nn.Module method would be guarded on each module and recompiled per layer). The paged
# attention between them stays eager: it reads host-side metadata and is its own kernel.
def pre_attention(h: torch.Tensor, ln_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor],
                  q_norm_w: Optional[torch.Tensor], k_norm_w: Optional[torch.Tensor], rope: tuple,
                  eps: float, num_heads: int, num_kv_heads: int, head_dim: int):
    """input norm -> fused qkv projection -> (Qwen3 q/k norm) -> RoPE; returns q [T, Hq, D], k, v [T, Hkv, D].
    rope: (cos, sin) from rope_tables."""
    T = h.shape[0]
    x = rms_norm(h, ln_w, eps)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = linear(x, qkv_w, qkv_b).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(T, num_heads, head_dim)
    k = k.view(T, num_kv_heads, head_dim)
    v = v.view(T, num_kv_heads, head_dim)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    cos, sin = rope
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def post_attention(o: torch.Tensor, h: torch.Tensor, o_w: torch.Tensor, ln_w: torch.Tensor,
                   gate_up_w: torch.Tensor, down_w: torch.Tensor, eps: float) -> torch.Tensor:
    """o_proj + residual -> post-attention norm -> SwiGLU MLP + residual; returns the layer's output."""
    h = h + linear(o.flatten(1), o_w)
    gate, up = linear(rms_norm(h, ln_w, eps), gate_up_w).chunk(2, dim=-1)
    return h + linear(nn.functional.silu(gate) * up, down_w)


class DenseFns(NamedTuple):
    """The dense parts of a layer: the torch math above, or an equivalent a transform installs
    (compile_dense; models/cpu_fused.py)."""
    rope_inputs: Callable      # (cos_sin [P, D] float32, positions [T], dtype) -> pre's `rope`
    pre: Callable              # pre_attention's signature
    post: Callable             # post_attention's signature
    # every layer at once, attention included: LlamaModel.run_layers' signature (None: run_layers itself)
    layers: Optional[Callable] = None
    norm: Callable = rms_norm  # the final norm: (x [T, H], w [H], eps) -> [T, H]


TORCH_DENSE = DenseFns(rope_tables, pre_attention, post_attention)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.q_size, a.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=False)
        self.qk_norm = a.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, a.rms_norm_eps)
        self.sliding_window: Optional[int] = a.sliding_window
        # a float8 KV cache holds k / k_scale and v / v_scale (kernels/kv_quant.py); 1.0 unless calibrated
        self.k_scale = self.v_scale = 1.0

    def qkv_args(self):
        return (self.qkv_proj.weight, self.qkv_proj.bias,
                self.q_norm.weight if self.qk_norm else None, self.k_norm.weight if self.qk_norm else None)

    def attend(self, q, k, v, kv: torch.Tensor, meta: AttentionMetadata, backend) -> torch.Tensor:
        k_cache, v_cache = kv[0], kv[1]                          # [N, bs, Hkv, D]
        backend.store_kv(k, v, k_cache, v_cache, meta, self.k_scale, self.v_scale)
        return backend.forward(q, k_cache, v_cache, meta, self.scale, self.sliding_window,  # [T, Hq, D]
                               self.k_scale, self.v_scale)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.intermediate = a.intermediate_size
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, a.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)        # [T, I] each
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = MLP(a)

    def forward(self, h, rope, kv, meta, backend, pre=pre_attention, post=post_attention):
        a = self.self_attn
        q, k, v = pre(h, self.input_layernorm.weight, *a.qkv_args(), rope, self.input_layernorm.eps,
                      a.num_heads, a.num_kv_heads, a.head_dim)
        o = a.attend(q, k, v, kv, meta, backend)
        return post(o, h, a.o_proj.weight, self.post_attention_layernorm.weight, self.mlp.gate_up_proj.weight,
                    self.mlp.down_proj.weight, self.post_attention_layernorm.eps)


class LlamaModel(nn.Module):
    """Decoder-only transformer: embed -> N x (attn + MLP, pre-norm residual) -> norm -> lm_head."""

    def __init__(self, args: ModelArgs, max_positions: int, device: Optional[torch.device] = None):
        super().__init__()
        self.args = args
        # Under torch.device("meta") (the runner: to_empty, then the checkpoint's weights) the embedding's random
        # init is never seen, and normal_ on a meta tensor imports torch._dynamo (~3 s of every engine start):
        # hand nn.Embedding its (uninitialised, meta) weight instead, as it would have allocated it.
        on_meta = torch.empty(0).is_meta                # the default device (a torch.device context)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=torch.empty(
            args.vocab_size, args.hidden_size) if on_meta else None)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.tie_word_embeddings = args.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # The RoPE table [P, D] float32, built here only, on the device the model runs on. A plain attribute,
        # not a buffer: the weights may be allocated on "meta" and materialised by to_empty(), which would
        # leave a buffer uninitialised.
        self.cos_sin = cos_sin_cache(args.head_dim, args.rope, max_positions, device=device)

    def to_empty(self, *, device, recurse: bool = True):
        """nn.Module.to_empty: uninitialised storage of each tensor's shape, strides and dtype on `device`. A meta
        tensor's is allocated with empty_strided, as empty_like would, but without the meta dispatch of
        empty_like, whose first use imports sympy (~0.6 s of every engine start)."""
        return self._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                           if t.is_meta else torch.empty_like(t, device=device), recurse=recurse)

    def shard_range(self, name: str, shard: int) -> tuple[int, int]:
        """(start, length) of shard `shard` along dim 0 of a fused parameter."""
        a = self.args
        sizes = [a.q_size, a.kv_size, a.kv_size] if ".qkv_proj." in name else [a.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    @staticmethod
    def num_shards(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                meta: AttentionMetadata, backend) -> torch.Tensor:
        # input_ids, positions: [T]; kv_caches: [L, 2, N, bs, Hkv, D] -> hidden [T, H]
        h = self.embed_tokens(input_ids)
        fns = self.dense_fns
        rope = fns.rope_inputs(self.cos_sin, positions, h.dtype)
        h = fns.layers(self, h, rope, kv_caches, meta, backend) if fns.layers else self.run_layers(
            h, rope, kv_caches, meta, backend)
        return fns.norm(h, self.norm.weight, self.norm.eps)

    def run_layers(self, h: torch.Tensor, rope: tuple, kv_caches: torch.Tensor, meta: AttentionMetadata,
                   backend) -> torch.Tensor:
        fns = self.dense_fns
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, kv_caches[i], meta, backend, fns.pre, fns.post)
        return h

    @property
    def dense_fns(self) -> DenseFns:
        return getattr(self, "_dense_fns", None) or TORCH_DENSE

    def compile_dense(self, **compile_kwargs) -> None:
        """torch.compile the dense parts of every layer (norms, projections, RoPE, MLP) with a dynamic token
        count. Compilation happens on first use; attention stays eager."""
        self._dense_fns = TORCH_DENSE._replace(pre=torch.compile(pre_attention, dynamic=True, **compile_kwargs),
                                               post=torch.compile(post_attention, dynamic=True, **compile_kwargs))

    def decode_read_bytes(self, weights_bytes: int) -> int:
        """Of weights_bytes (every weight the model holds), the bytes one decode step reads: all but the
        embedding table, of which a lookup reads a row per token, unless the logits are computed from it (tied
        embeddings; a packed copy is as large). A quantized logits copy is counted in weights_bytes apart."""
        emb = self.embed_tokens.weight
        tied_read = self.tie_word_embeddings and not hasattr(getattr(self, "logits_weight", None), "tensors")
        return weights_bytes if tied_read else weights_bytes - emb.numel() * emb.element_size()

    def compute_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        # h: [S, H] -> [S, V] float32 (the model's dtype with upcast=False: enough for an argmax)
        w = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = linear(h, getattr(self, "logits_weight", w))      # logits_weight: packed (cpu_linear)
        return logits.float() if upcast else logits
