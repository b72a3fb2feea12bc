"""Projection weights held in the form of the implementation that runs them on CPU: a transform applied to a
loaded model.

A bf16 weight [out, in] can run on three implementations, each with its own form:
  own     batchrun's kernel (kernels/cpu_gemm.py: AVX-512 BF16 or AVX2 + FMA), its packed layout
  onednn  oneDNN's packed layout through torch.ops.mkldnn._linear_pointwise (AMX tiles where the CPU has them)
  plain   the weight as loaded, through torch's F.linear (the reference; float32 always runs it)
Which is fastest depends on the CPU and on the rows of the product (own at a decode step's few rows on every
CPU measured; oneDNN from 16 rows on an AMX Xeon, 3-11x ahead of own there), so models/kernel_choice.py times
them on the loaded model and pack_linear_weights() puts each weight in the form(s) chosen: one tensor where
one form wins every row count, else a ChosenWeight holding each winning form. linear() dispatches on the
weight's form, so the model's math reads the same either way.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from batchrun.kernels import cpu_gemm
from batchrun.models import huge_pages
from batchrun.models.huge_pages import Slab

FORMS = ("own", "onednn", "plain")


def linear(x: torch.Tensor, w, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, in] @ w[out, in].T + b -> [T, out]; w plain, packed by pack(), or an object with its own
    linear(x, b): a ChosenWeight, quantized (models/quant.py) or row-parallel (models/tp.py)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if w.dim() >= 4:               # cpu_gemm's layouts: [out/16, in/2, 16, 2] or [out/64, in/2, 4, 16, 2]
        y = cpu_gemm.linear(x if x.stride(-1) == 1 else x.contiguous(), w, cpu_gemm.packed_rows(w))
        return y if b is None else y.add_(b)
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return nn.functional.linear(x, w, b)


def onednn_bf16() -> bool:
    """oneDNN is built into torch and has bf16 kernels on this CPU."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_supported(dtype: torch.dtype) -> bool:
    """bf16 on a CPU where batchrun's kernel or oneDNN's bf16 kernels run: more than one form to choose from
    (float32 keeps torch's own GEMM: the parity tests' path)."""
    return dtype == torch.bfloat16 and (cpu_gemm.supported() or onednn_bf16())


def forms_for(shape: tuple) -> list[str]:
    """The forms that can hold a bf16 weight of `shape` [out, in] on this CPU, in FORMS' order."""
    out = []
    if shape[0] % 16 == 0 and shape[1] % 2 == 0 and cpu_gemm.supported():
        out.append("own")
    if onednn_bf16():
        out.append("onednn")
    return out + ["plain"]


def pack(w: torch.Tensor, form: str, batch_hint: int = 64, slab: Optional[Slab] = None) -> torch.Tensor:
    """w [out, in] in `form` (one of forms_for(w.shape)); own: into `slab` when given."""
    w = w.detach().contiguous()
    if form == "own":
        return cpu_gemm.pack(w, out=slab.take(cpu_gemm.packed_shape(*w.shape)) if slab is not None else None)
    if form == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    if form == "plain":
        return w
    raise ValueError(f"unknown weight form {form!r}; one of {', '.join(FORMS)}")


class ChosenWeight:
    """A weight kept in more than one form, each used for the row counts it was measured fastest at.

    forms: {form: tensor}; per_bucket: the form of each of kernel_choice.BUCKETS' row-count buckets."""

    def __init__(self, forms: dict, per_bucket: tuple, bucket_of):
        self.forms, self.per_bucket, self._bucket_of = forms, tuple(per_bucket), bucket_of

    def form_for(self, rows: int) -> torch.Tensor:
        return self.forms[self.per_bucket[self._bucket_of(rows)]]

    def linear(self, x: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        return linear(x, self.form_for(x.shape[0]), b)


def _placed(w: torch.Tensor, per_bucket: tuple, bucket_of, batch_hint: int, slab: Optional[Slab]):
    forms = {f: pack(w, f, batch_hint, slab) for f in dict.fromkeys(per_bucket)}
    return next(iter(forms.values())) if len(forms) == 1 else ChosenWeight(forms, per_bucket, bucket_of)


def _nbytes(t) -> int:
    if isinstance(t, ChosenWeight):
        return sum(_nbytes(f) for f in t.forms.values())
    if t.is_mkldnn:                # an opaque tensor: its reorder holds out x in bf16 values
        return t.shape[0] * t.shape[1] * t.element_size()
    return t.numel() * t.element_size()


def _all_plain(per_bucket: tuple) -> bool:
    return set(per_bucket) == {"plain"}


def pack_linear_weights(model: nn.Module, choice: dict, bucket_of, batch_hint: int) -> int:
    """Put each nn.Linear's bf16 weight (and the logits weight) in the forms `choice` gives its shape
    ({(out, in): per-bucket forms}, kernel_choice.choose()); a shape not in `choice` stays plain. The weight
    becomes a non-persistent buffer (the model is for inference only); a tied embedding gets a packed copy
    for the logits unless plain wins there (lookups read the embedding). The own layouts go into one slab
    of transparent huge pages where the OS has them (models/huge_pages.py: what a decode step streams is
    read faster), filled as the plain weights are let go. Returns the bytes the packed copies add to the
    loaded weights (a second form, a tied embedding's copy)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor)]
    tied = getattr(model, "tie_word_embeddings", False) and not hasattr(model, "logits_weight")
    plain = [m.weight for m in linears] + ([model.embed_tokens.weight] if tied else [])
    if not plain:
        return 0
    forms = [tuple(choice.get(tuple(w.shape), ("plain",))) for w in plain]
    own = [cpu_gemm.packed_shape(*w.shape) for w, f in zip(plain, forms) if "own" in f]
    slab = huge_pages.slab_or_none(own, plain[0].dtype) if own else None
    added = 0
    for mod, f in zip(linears, forms):
        if _all_plain(f):
            continue                       # as loaded: nothing to place
        w = mod.weight
        placed = _placed(w, f, bucket_of, batch_hint, slab)
        added += _nbytes(placed) - w.numel() * w.element_size()
        del mod._parameters["weight"]
        mod.register_buffer("weight", placed, persistent=False) if isinstance(placed, torch.Tensor) \
            else setattr(mod, "weight", placed)
    if tied and not _all_plain(forms[-1]):
        w = model.embed_tokens.weight
        model.logits_weight = _placed(w, forms[-1], bucket_of, batch_hint, slab)
        added += _nbytes(model.logits_weight) - (w.numel() * w.element_size() if "plain" in forms[-1] else 0)
    return added
