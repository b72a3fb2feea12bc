"""GGUF weights kept quantized (quantization="gguf"): the linear layers take the file's own codes.

- Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m), blocks of 32 along the input dim, map exactly onto the
  group-32 int4 format of models/quant_weights.py (w = (q - 8) s + z): s = d, z = 0 (Q4_0) or m + 8 d (Q4_1).
  The codes are the file's; d and m are fp16, so in a float32 model the weights equal gguf's dequantised
  values (m + 8 d is exact in float32 for the fp16 pairs a block holds); a bfloat16 model rounds s and z
  to bfloat16, since the kernels take them in the activation dtype.
- Q8_0 (w = d q, blocks of 32): torch's int8 kernel takes one scale per output channel, so these are
  requantised per channel from the dequantised values (lossy: at most half a per-channel step per weight).
- Any other type (F16/F32, the K-quants) stays as loaded, dense in the model's dtype.
A fused layer (qkv, gate_up) is kept quantized when all its parts are of one family (Q4_x, or Q8_0).
"""
from __future__ import annotations

import numpy as np
import torch

from batchrun.models.gguf import hf_name, open_reader, unpermute
from batchrun.models.model_info import ModelInfo, fused_name
from batchrun.models.quant_weights import Int4Weight, kernels_enabled, linear_layers, quantize_int8, set_weight

BLOCK = 32
INT4_TYPES = ("Q4_0", "Q4_1")


def q4_blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]):
    """The file's Q4_0/Q4_1 bytes of a [N, K] tensor -> (codes [N, K] uint8 0..15, scales [N, K/32],
    zeros [N, K/32] float32) with w = (codes - 8) * scale + zero. Block layout (ggml): fp16 d, (Q4_1: fp16
    m), 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31."""
    N, K = shape
    head = 2 if kind == "Q4_0" else 4
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(N, K // BLOCK, head + BLOCK // 2)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else None
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(N, K)
    zero = np.zeros_like(d) if m is None else m + np.float32(8) * d
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero)


def _file_int4_parts(info: ModelInfo) -> dict[str, tuple]:
    """HF name -> (codes, scales, zeros) of every Q4_0/Q4_1 tensor, llama's Q/K row permutation undone."""
    reader = open_reader(info.path)
    cfg = info.config
    permuted = cfg["model_type"] == "llama"
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name not in INT4_TYPES:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        parts = q4_blocks(t.data, t.tensor_type.name, shape)
        heads = {".attn_q.": cfg["num_attention_heads"], ".attn_k.": cfg["num_key_value_heads"]}
        n_head = next((h for key, h in heads.items() if key in t.name), None)
        if permuted and n_head:     # rows only: blocks run along the input dim and stay whole
            parts = tuple(unpermute(p, n_head) for p in parts)
        out[hf_name(t.name)] = parts
    return out


def _file_types(info: ModelInfo) -> dict[str, str]:
    return {hf_name(t.name): t.tensor_type.name for t in open_reader(info.path).tensors}


def _family(kinds: set[str]) -> str:
    """How a layer whose file tensors have these types is kept: "int4" (all Q4_0/Q4_1), "int8" (all Q8_0)
    or "dense"."""
    if kinds and kinds <= set(INT4_TYPES):
        return "int4"
    return "int8" if kinds == {"Q8_0"} else "dense"


def layer_families(info: ModelInfo) -> dict[str, str]:
    """Our (fused) weight name -> _family of its file tensors; the header alone is read."""
    groups: dict[str, set[str]] = {}
    for hf, kind in _file_types(info).items():
        groups.setdefault(fused_name(hf)[0], set()).add(kind)
    return {name: _family(kinds) for name, kinds in groups.items()}


def keep_gguf_quantized(model: torch.nn.Module, info: ModelInfo, lm_head: bool, dtype: torch.dtype) -> dict:
    """Replace the loaded (dequantised) linear weights of a GGUF model by the file's quantized codes, as
    the module docstring says. Returns {"bytes": quantized bytes, "int4": layers, "int8": layers,
    "dense": layers left dense}."""
    types = _file_types(info)
    groups: dict[str, list[str]] = {}
    for hf in types:
        name, _ = fused_name(hf)
        groups.setdefault(name, []).append(hf)
    int4 = _file_int4_parts(info)
    use_kernel = kernels_enabled()
    report = {"bytes": 0, "int4": 0, "int8": 0, "dense": 0}
    layers = linear_layers(model, lm_head)
    tied = lm_head and getattr(model, "tie_word_embeddings", False)
    for name, mod in layers + ([("embed_tokens", None)] if tied else []):
        srcs = sorted(groups.get(f"{name}.weight", []), key=lambda hf: fused_name(hf)[1] or 0)
        family = _family({types[s] for s in srcs})
        if family == "int4":
            # the file's codes are read on the host: on the model's device Int4Weight takes that device's layout
            codes, scales, zeros = (torch.cat(p).to(model.embed_tokens.weight.device)
                                    for p in zip(*(int4[s] for s in srcs)))
            qw = Int4Weight(codes, scales, zeros, BLOCK, dtype, use_kernel)
            report["int4"] += 1
        elif family == "int8":
            dense = model.embed_tokens.weight if mod is None else mod.weight
            qw = quantize_int8(dense.detach(), dtype, use_kernel)
            report["int8"] += 1
        else:
            report["dense"] += 1
            continue
        if mod is None:
            model.logits_weight = qw
        else:
            set_weight(mod, qw)
        report["bytes"] += qw.nbytes
    return report
