"""SmoothQuant channel balancing and the W8A8 transform of a loaded model, from calibration statistics.

Per input channel j of a projection, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (max|X_j| from the
calibration pass, models/calibration.py; max|W_j| over the output channels). x / s and W * s give the same
product, with the activation outliers moved into the weight, where per-output-channel int8 absorbs them.
- qkv_proj (after input_layernorm) and gate_up_proj (after post_attention_layernorm): 1/s folded into the
  norm's weight, free at run time. The norm weight keeps the model's dtype, so W is scaled by the factors
  the rounded norm weight actually carries (old / new), and the float model's output is unchanged.
- o_proj and down_proj have no norm before them: UNFOLDED "runtime" multiplies x by 1/s inside the W8A8
  product (one pass over x), "none" leaves them unsmoothed. scripts/bench_quant.py --smooth-unfolded measures
  both on the real SmolLM2; the default is the better one there.
Then each projection's smoothed weight is rotated per block of 64 columns (ROTATE; w8a8.rotate_blocks, a
Hadamard matrix: its inputs are rotated alike at run time, in the kernel's quantizing pass) and quantized.
The fp8 KV scales come from the same pass: k_scale = max|K| / the format's largest value, per layer.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from batchrun.models import gptq
from batchrun.models.w8a8 import GROUP, W8A8Weight, choose_kernels, group_for, quantize_w8, rotate_blocks, rotates

DEFAULT_ALPHA = 0.5
UNFOLDED = "runtime"        # o_proj / down_proj: "runtime" (x / s in the product) or "none"
FOLDED = {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"}
UNFOLDED_PROJS = ("self_attn.o_proj", "mlp.down_proj")
ROTATE = True               # rotate every projection whose K w8a8.ROTATION divides (scripts/bench_quant.py: both)
GPTQ = True                 # GPTQ's rounding (models/gptq.py) where the statistics hold the Hessian blocks, else nearest
EPS = 1e-5


def smoothing_factors(act_absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = max|X_j|^alpha / max|W_j|^(1-alpha), both floored at EPS (dead channels get s = 1-ish, finite)."""
    a = act_absmax.float().clamp(min=EPS)
    wm = w.detach().float().abs().amax(dim=0).clamp(min=EPS)
    return (a.pow(alpha) / wm.pow(1 - alpha)).clamp(min=EPS)


def smooth_model(model: nn.Module, act_absmax: dict, alpha: Optional[float] = None,
                 unfolded: Optional[str] = None) -> dict[str, tuple[torch.Tensor, object]]:
    """Fold SmoothQuant's factors into the norms in place (module docstring); returns {projection name:
    (smoothed weight float32 [N, K], inv_smooth [K] or None)}: x * inv_smooth @ W_smoothed.T == x @ W.T."""
    alpha = DEFAULT_ALPHA if alpha is None else alpha          # the module's, read at call time
    unfolded = UNFOLDED if unfolded is None else unfolded
    if unfolded not in ("runtime", "none"):
        raise ValueError(f"smoothquant unfolded mode must be 'runtime' or 'none', got {unfolded!r}")
    out = {}
    for i, layer in enumerate(model.layers):
        for proj, norm_name in FOLDED.items():
            name = f"layers.{i}.{proj}"
            mod, norm = layer.get_submodule(proj), getattr(layer, norm_name)
            w = mod.weight.detach().float()
            s = smoothing_factors(act_absmax[name], w, alpha) if alpha > 0 else torch.ones(w.shape[1])
            old = norm.weight.detach().float()
            new = (old / s).to(norm.weight.dtype)
            eff = torch.where(new.float() != 0, old / new.float(), torch.ones_like(old))  # what `new` carries
            with torch.no_grad():
                norm.weight.copy_(new)
            out[name] = (w * eff, None)
        for proj in UNFOLDED_PROJS:
            name = f"layers.{i}.{proj}"
            w = layer.get_submodule(proj).weight.detach().float()
            if unfolded == "none" or alpha == 0:
                out[name] = (w, None)
            else:
                s = smoothing_factors(act_absmax[name], w, alpha)
                out[name] = (w * s, 1 / s)
    return out


def column_factors(smoothed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """f [K] with smoothed = w * f per input column (smooth_model's factors, folded or not): the smoothed
    product's input is x / f. A column of zeros takes 1."""
    w = w.detach().float()
    den = (w * w).sum(0)
    f = (smoothed * w).sum(0) / den.clamp(min=1e-30)
    return torch.where((den > 0) & (f != 0), f, torch.ones_like(f))


def check_w8a8(model: nn.Module) -> None:
    """Layers W8A8 cannot take, refused in one line naming the knob and the layer: a weight that is not a
    floating 2-D tensor, or a layer whose calibration statistic is missing."""
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or name == "lm_head":
            continue
        w = mod.weight
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.dtype.is_floating_point:
            kind = type(w).__name__ if not isinstance(w, torch.Tensor) else f"{w.dtype} {tuple(w.shape)}"
            raise ValueError(f"quantization: 'w8a8' needs a plain floating 2-D weight; layer {name} has {kind}")


def apply_w8a8(model: nn.Module, stats: dict, alpha: Optional[float] = None, unfolded: Optional[str] = None,
               use_kernel: bool = True, budget_s: float = 0.5, group: int = GROUP,
               rotate: Optional[bool] = None) -> tuple[int, dict]:
    """Smooth, rotate (ROTATE), then replace every projection's weight by a W8A8Weight (scales per `group`
    columns, w8a8.group_for; codes by GPTQ where stats has "gram", else rounded to nearest) and measure the
    kernels. Returns (the quantized weights' bytes, {bucket: kernel})."""
    rotate = ROTATE if rotate is None else rotate             # the module's, read at call time
    grams = stats.get("gram") if GPTQ else None
    check_w8a8(model)
    missing = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"
               and n not in stats["act_absmax"]]
    if missing:
        raise ValueError(f"quantization_calibration: no statistics for layer {missing[0]} (a stale cache file?)")
    smoothed = smooth_model(model, stats["act_absmax"], alpha, unfolded)
    weights, total = [], 0
    prepared, by_shape = {}, {}                  # name -> (rotated weight, inv, rotated?, group); GPTQ's batches
    for name, (w, inv) in smoothed.items():
        orig = model.get_submodule(name).weight
        k, g = w.shape[1], group_for(w.shape[1], group)
        rot = rotates(k, rotate)
        if grams is not None and name in grams:
            h = gptq.change_basis(grams[name], k, column_factors(w, orig), rot)
            by_shape.setdefault((tuple(w.shape), g), []).append((name, h))
        if rot:                                  # in place (one float copy of the model, not two), unless w is orig
            w = rotate_blocks(w.clone() if w.data_ptr() == orig.data_ptr() else w)
        prepared[name] = (w, inv, rot, g)
    codes = {}
    for (_, g), jobs in by_shape.items():       # a model's layers share four shapes: a few calls in all
        codes.update(zip([n for n, _ in jobs], gptq.quantize_many([(prepared[n][0], h) for n, h in jobs], g)))
    for name, (wr, inv, rot, g) in prepared.items():
        q, scale = codes.pop(name) if name in codes else quantize_w8(wr, g)
        qw = W8A8Weight(q, scale, inv, use_kernel, rot)
        mod = model.get_submodule(name)
        del mod._parameters["weight"]
        mod.weight = qw
        weights.append(qw)
    choice = choose_kernels(weights, budget_s) if use_kernel else {}
    total = sum(w.nbytes for w in weights)
    return total, choice


def set_kv_scales(model: nn.Module, stats: dict, kv_dtype: torch.dtype) -> list[tuple[float, float]]:
    """Each attention layer's k_scale / v_scale = max|K| / max, max|V| / max of the float8 format (a layer that
    saw nothing keeps 1.0). Returns [(k_scale, v_scale)] per layer."""
    fmax = torch.finfo(kv_dtype).max
    out = []
    for layer, ka, va in zip(model.layers, stats["k_absmax"], stats["v_absmax"]):
        a = layer.self_attn
        a.k_scale = ka / fmax if ka > 0 else 1.0
        a.v_scale = va / fmax if va > 0 else 1.0
        out.append((a.k_scale, a.v_scale))
    return out


def calibrate_model(model: nn.Module, info, config, kv_dtype: torch.dtype, rows) -> "dict | None":
    """The engine's entry, after load_weights: when config asks for it (calibration.needs_calibration), run
    (or read from the cache) the calibration pass over `rows`, then apply what it calibrates: W8A8 (smoothed
    int8 projections, kernels measured) and the fp8 KV scales. Returns a summary for the ledger (with
    "quantized_bytes" for w8a8) or None. Raises ValueError naming the knob for a setting it cannot take."""
    from batchrun.kernels.kv_quant import is_fp8
    from batchrun.models.calibration import calibrate, needs_calibration
    from batchrun.models.quant_weights import kernels_enabled
    if not needs_calibration(config):
        return None
    w8a8 = config.quantization == "w8a8"
    if w8a8 and config.quantize_lm_head:
        raise ValueError("quantize_lm_head: 'w8a8' quantizes the projections only; leave quantize_lm_head off")
    if config.tensor_parallel_size > 1:
        raise ValueError("quantization_calibration: runs on one rank; use tensor_parallel_size 1")
    if w8a8:
        check_w8a8(model)
    stats = calibrate(model, info, rows, gram=w8a8 and GPTQ)
    out = {"rows": stats["rows"], "tokens": stats["tokens"], "cached": stats["cached"],
           "cache_path": stats["cache_path"], "kv_scales": None}
    if is_fp8(kv_dtype):
        out["kv_scales"] = [[round(k, 6), round(v, 6)] for k, v in set_kv_scales(model, stats, kv_dtype)]
    if w8a8:
        nbytes, choice = apply_w8a8(model, stats, use_kernel=kernels_enabled(),
                                    group=config.group_size)
        out.update(quantized_bytes=nbytes, alpha=DEFAULT_ALPHA, smooth_unfolded=UNFOLDED, rotate=ROTATE,
                   rounding="gptq" if GPTQ and "gram" in stats else "nearest",
                   w8a8_kernels={str(b): k for b, k in choice.items()} or "float (BATCHRUN_QUANT_KERNELS=0)")
    return out
