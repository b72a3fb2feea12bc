"""Projection weights in oneDNN's packed layout on CPU: a transform applied to a loaded model.

torch's plain bf16 `F.linear` on CPU is slow for the few-row products of a decode step (measured on an
AVX-512 BF16 host: 2.5x slower than the same product through oneDNN with a pre-packed weight at one row,
2.2x at 4, 1.2x at 64, with bit-identical results). pack_linear_weights() reorders every projection
weight (and the logits weight) once at load into that layout; linear() is F.linear for plain weights and
oneDNN's linear for packed ones, so the model's math reads the same either way.
BATCHRUN_CPU_PACKED_LINEAR=0 keeps torch's plain F.linear (the reference).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

PACKED_LINEAR_ENV = "BATCHRUN_CPU_PACKED_LINEAR"


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, in] @ w[out, in].T + b -> [T, out]; w plain or packed by pack_linear_weights()."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
    return nn.functional.linear(x, w, b)


def packing_supported(dtype: torch.dtype) -> bool:
    """bf16 on a CPU whose oneDNN has bf16 kernels (fp32 keeps torch's own GEMM: the parity tests' path)."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(w: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), batch_hint)


def pack_linear_weights(model: nn.Module, batch_hint: int) -> int:
    """Replace each nn.Linear's weight by its packed form (a non-persistent buffer: the model is for
    inference only) and give the model a packed logits weight (a copy when it is tied to the embedding,
    which lookups still read). Returns the bytes the packed copies add (0 unless the embedding is tied)."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            packed = pack(mod.weight, batch_hint)
            del mod._parameters["weight"]
            mod.register_buffer("weight", packed, persistent=False)
    added = 0
    if getattr(model, "tie_word_embeddings", False):
        w = model.embed_tokens.weight
        model.logits_weight = pack(w, batch_hint)
        added = w.numel() * w.element_size()
    return added
