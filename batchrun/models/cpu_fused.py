"""The dense parts of a layer through compiled CPU ops: a transform applied to a loaded model.

llama.py's pre_attention/post_attention are ~45 torch calls per layer (a norm is 8, RoPE of q and k 17);
at small batches each call's Python and dispatch cost is a large share of a decode step. These are the same
functions over batchrun.kernels.cpu_layer_ops (one call per norm, RoPE of q and k together, SwiGLU's
activation; the residual add fused into the post-attention norm), ~15 calls per layer. Results equal llama.py's math
but for a few float32 ulp (kernels/cpu_layer_ops.py says where). use_fused_layer_ops() installs them;
BATCHRUN_CPU_FUSED_OPS=0 keeps the torch math.

Where every layer is a bf16 Llama/Mistral layer (its projections in any of models/cpu_linear.py's forms,
chosen per step's rows, or W8A8 ones where their measured kernel is batchrun's own), the whole layer,
attention included, is one call (kernels/cpu_decoder_layer.py): the same ops in the same order as
pre_attention -> attention -> post_attention here, so bit-identical to them, which remain its reference and
the path for everything else. BATCHRUN_CPU_LAYER_OP=0 keeps the per-op path.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from batchrun.kernels import cpu_decoder_layer, cpu_layer_ops as ops, cpu_w8a8
from batchrun.models.cpu_linear import ChosenWeight, linear
from batchrun.models.kernel_choice import ROWS, bucket_of
from batchrun.models.llama import DenseFns
from batchrun.models.w8a8 import W8A8Weight, rotates

FUSED_OPS_ENV = "BATCHRUN_CPU_FUSED_OPS"
LAYER_OP_ENV = "BATCHRUN_CPU_LAYER_OP"


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


FUSED_DENSE = DenseFns(_rope_inputs, pre_attention, post_attention, norm=ops.rms_norm)


def fused_ops_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU, float32 or bfloat16, not switched off by the environment, and the ops build here."""
    if device.type != "cpu" or dtype not in ops.DTYPES:
        return False
    if os.environ.get(FUSED_OPS_ENV, "1") == "0":
        return False
    return ops.available()


def whole_layers(model, h: torch.Tensor, rope: tuple, kv_caches: torch.Tensor, meta, backend) -> torch.Tensor:
    """LlamaModel.run_layers with one decoder_layer call per layer, its projections in the forms chosen for
    this step's rows; the per-op path where attention does not run the compiled op (BATCHRUN_CPU_ATTENTION=torch,
    another backend)."""
    ready = getattr(backend, "op_ready", None)
    if ready is None or not ready(h):
        return model.run_layers(h, rope, kv_caches, meta, backend)
    cos_sin, positions = rope
    h = h.contiguous()
    step = (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    args = model._layer_op_args[bucket_of(h.shape[0])]      # the projections' forms for this many rows
    if args is None:                       # a W8A8 kernel other than the op's was measured fastest here
        return model.run_layers(h, rope, kv_caches, meta, backend)
    for i, (layer, (weights, shape, w8a8, rotate)) in enumerate(zip(model.layers, args)):
        a = layer.self_attn        # the KV scales are read per call: a calibration may set them after load
        cpu_decoder_layer.decoder_layer(h, weights, kv_caches, i, cos_sin, positions, *step, *shape,
                                        a.k_scale, a.v_scale, backend.sdpa_from, w8a8, w8a8_rotate=rotate)
    return h


def _op_form(w) -> bool:
    """A projection weight the op can run: bf16 in the own layouts, oneDNN's, or plain [n, K] (or a
    ChosenWeight of those); or W8A8 in whole blocks of 16 outputs where the own kernel runs."""
    if isinstance(w, ChosenWeight):
        return all(_op_form(f) for f in w.forms.values())
    if isinstance(w, W8A8Weight):
        return w.shape[0] % 16 == 0 and w.shape[1] % 4 == 0 and cpu_w8a8.supported()
    return isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and (w.dim() >= 4 or w.dim() == 2)


_NONE = torch.empty(0)


def _form_for(w, rows: int) -> Optional[tuple]:
    """(the weight the op takes for `rows`, its three w8a8 tensors or empty ones); None where a W8A8 weight's
    kernel for these rows is not the own one the op runs."""
    if isinstance(w, ChosenWeight):
        return w.form_for(rows), (_NONE,) * 3
    if isinstance(w, W8A8Weight):
        if w.kernel_for(rows) != "own":
            return None
        p = w.own_packed()
        return p.wp, (p.offset, p.scales, _NONE if w.inv_smooth is None else w.inv_smooth)
    return w, (_NONE,) * 3


def _bucket_args(args: list, rows: int) -> Optional[list]:
    """Each layer's (weights, shape, w8a8 tensors, w8a8 rotation) for a step of `rows` rows, or None (the
    per-op path). The op rotates every int8 projection whose K 64 divides, or none: W8A8 weights otherwise
    mixed take the per-op path."""
    out = []
    for (ln1, qkv, o, ln2, gate_up, down), shape in args:
        projs = (qkv, o, gate_up, down)
        forms = [_form_for(w, rows) for w in projs]
        if any(f is None for f in forms):
            return None
        int8 = [w for w in projs if isinstance(w, W8A8Weight)]
        rotate = any(w.rotate for w in int8)
        if any(w.rotate != rotates(w.shape[1], rotate) for w in int8):
            return None
        w8a8 = [t for _, extra in forms for t in extra] if int8 else []
        (qkv, _), (o, _), (gate_up, _), (down, _) = forms
        out.append(((ln1, qkv, o, ln2, gate_up, down), shape, w8a8, rotate))
    return out


def _layer_op_args(layer) -> Optional[tuple]:
    """((ln1, qkv, o, ln2, gate_up, down), (num_heads, eps, scale, sliding_window or -1)) if decoder_layer can
    run this layer, else None."""
    a, mlp = layer.self_attn, layer.mlp
    projs = (a.qkv_proj.weight, a.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
    if a.qk_norm or a.qkv_proj.bias is not None or not all(_op_form(w) for w in projs):
        return None
    qkv, o, gate_up, down = projs
    weights = (layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down)
    window = -1 if a.sliding_window is None else a.sliding_window
    return weights, (a.num_heads, layer.input_layernorm.eps, a.scale, window)


def use_fused_layer_ops(model, whole_layer: bool = True) -> None:
    """Install the fused dense functions on a loaded LlamaModel (its cos_sin table must be float32), and, with
    whole_layer, the whole-layer op where every layer can take it (call after every other weight transform)."""
    model.cos_sin = model.cos_sin.float().contiguous()
    model._dense_fns = FUSED_DENSE
    if not whole_layer or os.environ.get(LAYER_OP_ENV, "1") == "0" or not cpu_decoder_layer.available():
        return
    args = [_layer_op_args(layer) for layer in model.layers]
    if all(a is not None for a in args):     # per row-count bucket: each weight in that bucket's form
        model._layer_op_args = [_bucket_args(args, rows) for rows in ROWS]
        model._dense_fns = FUSED_DENSE._replace(layers=whole_layers)
