"""Projection weights packed once at load on CPU: a transform applied to a loaded model.

torch's plain bf16 `F.linear` on CPU is slow for the few-row products of a decode step (and at every size on
CPUs without native bf16 arithmetic). pack_linear_weights() reorders every projection weight (and the logits
weight) once at load: on an x86-64 CPU with AVX-512 BF16 or AVX2 into the layout of batchrun's own kernel
(kernels/cpu_gemm.py), which reads a decode step's weights at close to memory speed and keeps up with oneDNN
at many rows; elsewhere, where oneDNN has bf16 kernels, into oneDNN's packed layout (2.5x faster than
F.linear at one row, 1.2x at 64, bit-identical). linear() dispatches on the weight's form, so the model's math reads the
same either way. BATCHRUN_CPU_PACKED_LINEAR=0 keeps torch's plain F.linear (the reference);
BATCHRUN_CPU_GEMM=onednn uses oneDNN's layout even where the own kernel runs.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from batchrun.kernels import cpu_gemm
from batchrun.models import huge_pages
from batchrun.models.huge_pages import Slab

PACKED_LINEAR_ENV = "BATCHRUN_CPU_PACKED_LINEAR"
GEMM_ENV = "BATCHRUN_CPU_GEMM"      # "onednn": oneDNN's packed layout even where batchrun's own kernel runs


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, in] @ w[out, in].T + b -> [T, out]; w plain, packed by pack_linear_weights(), or an object with
    its own linear(x, b): quantized (models/quant.py) or row-parallel (models/tp.py)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if w.dim() >= 4:               # cpu_gemm's layouts: [out/16, in/2, 16, 2] or [out/64, in/2, 4, 16, 2]
        y = cpu_gemm.linear(x if x.stride(-1) == 1 else x.contiguous(), w, cpu_gemm.packed_rows(w))
        return y if b is None else y.add_(b)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
    return nn.functional.linear(x, w, b)


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_supported(dtype: torch.dtype) -> bool:
    """bf16 on a CPU where batchrun's kernel or oneDNN's bf16 kernels run (fp32 keeps torch's own GEMM: the
    parity tests' path)."""
    return dtype == torch.bfloat16 and (_own_gemm() or _onednn_bf16())


def pack(w: torch.Tensor, batch_hint: int, slab: Optional[Slab] = None) -> torch.Tensor:
    """w [out, in] in the fastest layout this CPU has: batchrun's own (kernels/cpu_gemm.py: AVX-512 BF16 or
    AVX2, out a multiple of 16; into `slab` when given) unless BATCHRUN_CPU_GEMM=onednn, else oneDNN's packed
    one where oneDNN has bf16 kernels, else as it is."""
    w = w.detach().contiguous()
    if _own_layout(w):
        return cpu_gemm.pack(w, out=slab.take(cpu_gemm.packed_shape(*w.shape)) if slab is not None else None)
    return torch.ops.mkldnn._reorder_linear_weight(w, batch_hint) if _onednn_bf16() else w


def _own_gemm() -> bool:
    return os.environ.get(GEMM_ENV, "own") != "onednn" and cpu_gemm.supported()


def _own_layout(w: torch.Tensor) -> bool:
    return w.shape[0] % 16 == 0 and w.shape[1] % 2 == 0 and _own_gemm()


def pack_linear_weights(model: nn.Module, batch_hint: int) -> int:
    """Replace each nn.Linear's weight by its packed form (a non-persistent buffer: the model is for
    inference only) and give the model a packed logits weight (a copy when it is tied to the embedding,
    which lookups still read). The own kernel's layouts go into one slab of transparent huge pages where the
    OS has them (models/huge_pages.py: what a decode step streams is read faster), filled as the plain
    weights are let go. Returns the bytes the packed copies add (0 unless the embedding is tied)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor)]
    tied = getattr(model, "tie_word_embeddings", False) and not hasattr(model, "logits_weight")
    plain = [m.weight for m in linears] + ([model.embed_tokens.weight] if tied else [])
    own = [cpu_gemm.packed_shape(*w.shape) for w in plain if _own_layout(w)]
    slab = huge_pages.slab_or_none(own, plain[0].dtype) if own else None
    for mod in linears:                         # not a quantized one
        packed = pack(mod.weight, batch_hint, slab)
        del mod._parameters["weight"]
        mod.register_buffer("weight", packed, persistent=False)
    added = 0
    if tied:
        w = model.embed_tokens.weight
        model.logits_weight = pack(w, batch_hint, slab)
        added = w.numel() * w.element_size()
    return added
