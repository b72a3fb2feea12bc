"""Weight-only quantization of the linear layers (W8A16, W4A16): a transform applied to a loaded model.

quantize_model() replaces each projection's weight (and the logits weight when asked) by a
QuantizedWeight; cpu_linear.linear() hands such a weight its own product, so llama.py's math is unchanged.
Embeddings and norms stay in the model's dtype; activations stay in it too (bf16 or fp32).

- int8: per-output-channel symmetric, w = q * s, q in [-127, 127].
- int4: group-wise asymmetric along the input dim, w = (q - 8) * s + z with q in [0, 15] (torch's CPU
  int4 layout; z = group min + 8 s). Groups of 32, 64 or 128; the group must divide every layer's input.

The products on CPU are torch's weight-only kernels (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu),
which read the packed weight directly and win at a decode step's few rows but lose badly at many (measured
on SmolLM2-135M's shapes x 30 layers, 2 AVX-512-BF16 cores, bf16 packed linear = 1.0: int8 1.75x faster at
1 row, even at 4, 2x slower at 16, 2.5x at 64; int4 3.9x faster at 1, 1.9x at 4, 1.3x slower at 16, 7x at
64). So int8 products of more than INT8_KERNEL_ROWS rows cast the weight for the call and run a dense
matmul (the scales applied to the output); int4 products run the kernel in chunks of INT4_KERNEL_ROWS rows,
where its cost per row is lowest. BATCHRUN_QUANT_KERNELS=0 makes every product dequantise-then-F.linear:
the reference the kernels are tested against.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

QUANT_KERNELS_ENV = "BATCHRUN_QUANT_KERNELS"
MODES = ("int8", "int4", "gguf")
GROUP_SIZES = (32, 64, 128)
INT4_ROW_BLOCK = 64         # torch's CPU int4 packing interleaves rows in blocks of 64: N is padded to it
# int8: products of up to this many rows use torch's kernel, more a cast of the weight and a dense matmul:
# the cast of SmolLM2's projections costs ~30 ms a step, the kernel's lead over bf16 is gone by 16 rows
# (32.7 vs 16.3 ms) and 2.5x behind at 64 (103 vs 42), so the crossing is near 32 rows.
# int4: torch's kernel always, in chunks of this many rows (its cost per row jumps past them: 21 ms at 16
# rows, 309 at 64; dequantising int4 with torch ops costs more). Figures: scripts/bench_quant.py --rows.
INT8_KERNEL_ROWS = 32
INT4_KERNEL_ROWS = 16


def kernels_enabled() -> bool:
    return os.environ.get(QUANT_KERNELS_ENV, "1") != "0"


class QuantizedWeight:
    """A linear layer's weight [N, K] kept quantized. linear(x, b) is x @ w.T + b in x's dtype."""

    kind = ""
    shape: tuple[int, int]

    def __init__(self, use_kernel: bool):
        self.use_kernel = use_kernel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (contiguous) @ w.T on CPU, the fast way for M rows."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.use_kernel or x.device.type != "cpu":
            y = nn.functional.linear(x, self.dequantize(x.dtype))      # the reference
        else:
            y = self._product(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], self.shape[0])
        return y if b is None else y + b

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


class Int8Weight(QuantizedWeight):
    """q int8 [N, K], scales [N] in the activation dtype: w = q * scales[:, None]."""

    kind = "int8"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, use_kernel: bool = True):
        super().__init__(use_kernel)
        self.q, self.scales = q.contiguous(), scales.to(dtype).contiguous()
        self.shape = tuple(q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scales.float()[:, None]).to(dtype)

    def _kernel(self, x):
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)

    def _dense(self, x):
        # the per-channel scale factors out of the K-sum: a cast of q, then the scales on the output
        return nn.functional.linear(x, self.q.to(x.dtype)) * self.scales

    def _product(self, x):
        return self._kernel(x) if x.shape[0] <= INT8_KERNEL_ROWS else self._dense(x)

    def tensors(self):
        return [self.q, self.scales]


class Int4Weight(QuantizedWeight):
    """Codes in torch's CPU int4 layout (packed uint8 [Np, K/2], N padded to a multiple of 64) and
    scales_and_zeros [K/group, Np, 2] in the activation dtype: w = (q - 8) * scale + zero per group."""

    kind = "int4"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 dtype: torch.dtype, use_kernel: bool = True):
        """codes [N, K] integers 0..15; scales, zeros [N, K/group] (any float dtype)."""
        super().__init__(use_kernel)
        N, K = codes.shape
        if K % group or scales.shape != (N, K // group) or zeros.shape != scales.shape:
            raise ValueError(f"int4: codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, group {group}")
        pad = -N % INT4_ROW_BLOCK            # padded rows: code 8, scale 0, zero 0 -> weight 0, sliced off
        codes = nn.functional.pad(codes.to(torch.int32), (0, 0, 0, pad), value=8)
        sz = torch.stack([scales, zeros], dim=-1).to(dtype)
        sz = nn.functional.pad(sz, (0, 0, 0, 0, 0, pad))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        self.scales_and_zeros = sz.transpose(0, 1).contiguous()       # [K/group, Np, 2]
        self.group, self.shape = group, (N, K)

    def codes(self) -> torch.Tensor:
        """The codes [N, K] (int32 0..15) back from the packed layout: per block of 64 rows, a byte at
        [k, j] holds row j (low nibble) and row j + 32 (high nibble) of column k."""
        N, K = self.shape
        b = self.packed.view(-1, K, INT4_ROW_BLOCK // 2)
        q = torch.cat([b & 15, b >> 4], dim=-1)                       # [Np/64, K, 64]
        return q.transpose(1, 2).reshape(-1, K)[:N].to(torch.int32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        N, K = self.shape
        sz = self.scales_and_zeros[:, :N].float()                     # [K/g, N, 2]
        s, z = sz[..., 0].T[..., None], sz[..., 1].T[..., None]       # [N, K/g, 1]
        q = self.codes().view(N, K // self.group, self.group).float()
        return ((q - 8) * s + z).view(N, K).to(dtype)

    def _kernel(self, x):
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)
        return y if y.shape[1] == self.shape[0] else y[:, :self.shape[0]]

    def _product(self, x):
        if x.shape[0] <= INT4_KERNEL_ROWS:
            return self._kernel(x)
        return torch.cat([self._kernel(c) for c in x.split(INT4_KERNEL_ROWS)])

    def tensors(self):
        return [self.packed, self.scales_and_zeros]


def quantize_int8(w: torch.Tensor, dtype: torch.dtype, use_kernel: bool = True) -> Int8Weight:
    """Per-output-channel symmetric int8 of w [N, K] (rounded to nearest; scale = max |w| / 127)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = scale.to(dtype).float()          # quantize against the scale the kernel will use
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scale, dtype, use_kernel)


def quantize_int4(w: torch.Tensor, group: int, dtype: torch.dtype, use_kernel: bool = True) -> Int4Weight:
    """Group-wise asymmetric int4 of w [N, K]: per group of `group` inputs, 16 levels from min to max."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"int4 group size {group} does not divide the layer's {K} inputs")
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).to(dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (lo + 8 * scale).to(dtype).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    return Int4Weight(q.view(N, K), scale, zero, group, dtype, use_kernel)


def quantize_weight(w: torch.Tensor, mode: str, group: int, dtype: torch.dtype, use_kernel: bool = True):
    return quantize_int8(w, dtype, use_kernel) if mode == "int8" else quantize_int4(w, group, dtype, use_kernel)


def linear_layers(model: nn.Module, lm_head: bool) -> list[tuple[str, nn.Module]]:
    """(name, module) of every nn.Linear quantization applies to: the projections, and lm_head if asked."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (lm_head or n != "lm_head")]


def set_weight(mod: nn.Module, w: QuantizedWeight) -> None:
    """Replace a Linear's weight parameter by a quantized weight (a plain attribute: inference only)."""
    del mod._parameters["weight"]
    mod.weight = w


def check_group_size(model_cfg: dict, group: int) -> None:
    """Every layer's input size (hidden, q heads x head_dim, intermediate) must be a multiple of the int4
    group. Raises ValueError naming quantization_group_size: a setting this model cannot take."""
    heads = model_cfg["num_attention_heads"]
    q_size = heads * (model_cfg.get("head_dim") or model_cfg["hidden_size"] // heads)
    bad = sorted({k for k in (model_cfg["hidden_size"], q_size, model_cfg["intermediate_size"]) if k % group})
    if bad:
        raise ValueError(f"quantization_group_size: {group} does not divide this model's layer input sizes "
                         f"{bad}; use one of {[g for g in GROUP_SIZES if not any(k % g for k in bad)]}")


def quantize_model(model: nn.Module, mode: str, group: int, lm_head: bool, dtype: torch.dtype) -> int:
    """Quantize the loaded model's linear layers in place ("int8" or "int4"); with lm_head, a tied model gets
    a quantized logits weight (the embedding stays, for lookups). Returns the quantized weights' bytes."""
    use_kernel = kernels_enabled()
    total = 0
    for _, mod in linear_layers(model, lm_head):
        qw = quantize_weight(mod.weight.detach(), mode, group, dtype, use_kernel)
        set_weight(mod, qw)
        total += qw.nbytes
    if lm_head and getattr(model, "tie_word_embeddings", False):
        model.logits_weight = quantize_weight(model.embed_tokens.weight.detach(), mode, group, dtype, use_kernel)
        total += model.logits_weight.nbytes
    return total


def check_quantization(mode: Optional[str], group: int, info, device: torch.device) -> None:
    """Settings this model or device cannot take, refused before any weight is read (ValueError naming the
    key): a group that does not divide a layer, "gguf" for a model that is not a GGUF file, or CUDA (the
    weight-only products here are torch's CPU kernels)."""
    if mode is None:
        return
    if device.type != "cpu":
        raise ValueError(f"quantization: {mode!r} runs on CPU only in this version (device {device.type})")
    if mode == "gguf" and info.format != "gguf":
        raise ValueError(f"quantization: 'gguf' keeps a GGUF file's quantized weights; {info.path} is not GGUF")
    if mode == "int4":
        check_group_size(info.config, group)


def quantized_nbytes(kind: str, n: int, k: int, group: int, dtype: torch.dtype) -> int:
    """Bytes of an [n, k] weight as Int8Weight ("int8") or Int4Weight ("int4", `group`) in `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    if kind == "int8":
        return n * k + n * elem                                   # codes, one scale per output channel
    npad = -(-n // INT4_ROW_BLOCK) * INT4_ROW_BLOCK
    return npad * k // 2 + (k // group) * npad * 2 * elem        # two codes a byte, (scale, zero) per group


def linear_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    """(weight name in models/llama.py, out, in) of every projection, from config.json."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    per_layer = [("self_attn.qkv_proj", (heads + 2 * kv_heads) * d, hidden), ("self_attn.o_proj", hidden, heads * d),
                 ("mlp.gate_up_proj", 2 * inter, hidden), ("mlp.down_proj", hidden, inter)]
    return [(f"layers.{i}.{name}.weight", n, k) for i in range(cfg["num_hidden_layers"]) for name, n, k in per_layer]


def weight_bytes_after(info, mode: Optional[str], group: int, lm_head: bool, dtype: torch.dtype) -> tuple[int, int]:
    """(every weight's bytes in memory, the quantized layers' share) once apply_quantization has run: the
    engine's memory ledger, from config.json (and a GGUF file's header) alone, no weight read."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = info.num_params * elem
    if mode is None:
        return total, 0
    cfg = info.config
    shapes = linear_shapes(cfg)
    tied = bool(cfg.get("tie_word_embeddings", False))
    if lm_head:
        shapes.append(("embed_tokens.weight" if tied else "lm_head.weight", cfg["vocab_size"], cfg["hidden_size"]))
    families = None
    if mode == "gguf":
        from batchrun.models.gguf_quant import BLOCK, layer_families
        families, group = layer_families(info), BLOCK
    quant = 0
    for name, n, k in shapes:
        kind = mode if families is None else families.get(name, "dense")
        if kind == "dense":
            continue
        quant += quantized_nbytes(kind, n, k, group, dtype)
        if not (tied and name == "embed_tokens.weight"):      # a tied model keeps its embedding for lookups
            total -= n * k * elem
    return total + quant, quant


def apply_quantization(model: nn.Module, info, mode: str, group: int, lm_head: bool, dtype: torch.dtype) -> int:
    """The engine's entry, after load_weights: quantize (int8, int4) or take the GGUF file's codes (gguf).
    Returns the quantized weights' bytes."""
    if mode == "gguf":
        from batchrun.models.gguf_quant import keep_gguf_quantized
        return keep_gguf_quantized(model, info, lm_head, dtype)["bytes"]
    return quantize_model(model, mode, group, lm_head, dtype)
