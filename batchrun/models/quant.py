"""Weight-only quantization of the linear layers (W8A16, W4A16): a transform applied to a loaded model.

quantize_model() replaces each projection's weight (and the logits weight when asked) by a
QuantizedWeight; cpu_linear.linear() hands such a weight its own product, so llama.py's math is unchanged.
Embeddings and norms stay in the model's dtype; activations stay in it too (bf16 or fp32).

The weights themselves (formats, products, the CPU kernels' row limits, BATCHRUN_QUANT_KERNELS) are
models/quant_weights.py's, re-exported here; gguf_quant.py builds them from a GGUF file's codes. Imports run
one way: quant -> gguf_quant -> quant_weights.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from batchrun.kernels import quant_matmul as qmm
from batchrun.kernels.quant_matmul import INT4_ROW_BLOCK   # N padded to it (torch's CPU int4 packing)
from batchrun.models.quant_weights import (INT4_KERNEL_ROWS, INT8_KERNEL_ROWS, QUANT_KERNELS_ENV,  # noqa: F401
                                           Int4Weight, Int8Weight, QuantizedWeight, kernels_enabled, linear_layers,
                                           quantize_int4, quantize_int8, quantize_weight, set_weight)

MODES = ("int8", "int4", "gguf", "w8a8")     # w8a8: models/w8a8.py, applied by models/smoothquant.py
GROUP_SIZES = (32, 64, 128)


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
    key): a group that does not divide a layer, "gguf" for a model that is not a GGUF file, or a device with
    no weight-only kernels (CPU: torch's; CUDA: batchrun's Triton ones, so Triton must be installed)."""
    if mode is None:
        return
    if device.type != "cpu" and not (device.type == "cuda" and qmm.HAS_TRITON):
        raise ValueError(f"quantization: {mode!r} runs on CPU, or on CUDA with Triton installed "
                         f"(device {device.type}{', Triton missing' if device.type == 'cuda' else ''})")
    if mode == "gguf" and info.format != "gguf":
        raise ValueError(f"quantization: 'gguf' keeps a GGUF file's quantized weights; {info.path} is not GGUF")
    if mode == "int4":
        check_group_size(info.config, group)
    if mode == "w8a8" and device.type != "cpu":
        raise ValueError(f"quantization: 'w8a8' runs on CPU (device {device.type})")


def quantized_nbytes(kind: str, n: int, k: int, group: int, dtype: torch.dtype) -> int:
    """Bytes of an [n, k] weight as Int8Weight ("int8") or Int4Weight ("int4", `group`) in `dtype`."""
    elem = torch.empty((), dtype=dtype).element_size()
    if kind == "int8":
        return n * k + n * elem                                   # codes, one scale per output channel
    if kind == "w8a8":                      # codes, a float32 scale per output channel and group (w8a8.group_for)
        from batchrun.models.w8a8 import group_for
        return n * k + 4 * n * (k // group_for(k, group))
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
        if kind == "w8a8" and name.endswith(("o_proj.weight", "down_proj.weight")):
            from batchrun.models.smoothquant import UNFOLDED      # their run-time 1/s, float32 [k]
            quant += 4 * k if UNFOLDED == "runtime" else 0
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
