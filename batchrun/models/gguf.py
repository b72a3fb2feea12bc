"""GGUF models (llama.cpp's format): the header becomes an HF-style config, the tensors HF-named float32 weights.

Only the `gguf` package reads the file (GGUFReader, quants.dequantize); nothing here parses the format.
Architectures: `llama` (Llama, SmolLM2, Mistral converted as llama), `qwen2` (q/k/v bias), `qwen3` (q/k norm).
GGUF lists a tensor's dims fastest-first (ne order): torch's shape is the reverse.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Iterator

import numpy as np
import torch

from batchrun.gguf_header import cached_reader
from batchrun.models.args import SUPPORTED_ARCHITECTURES
from batchrun.models.model_info import ModelError, ModelInfo, model_args

# GGUF general.architecture -> HF architecture; convert_hf_to_gguf writes Mistral as llama (plus a window)
ARCHITECTURES = {short: hf for hf, short in SUPPORTED_ARCHITECTURES.items() if short != "mistral"}
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ROPE_FREQS = "rope_freqs.weight"
_REQUIRED = object()


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def open_reader(file: str):
    """A GGUFReader over `file`, shared while the file is unchanged: parsing the header of a real model's
    vocabulary takes seconds, and inspect, load and the tokenizer all need it (batchrun/gguf_header.py: one
    reader for them all). ModelError if unreadable."""
    try:
        st = os.stat(file)
    except OSError as e:
        raise ModelError(f"{file}: {_one_line(e)}") from e
    try:
        return cached_reader(file, st.st_size, st.st_mtime_ns)
    except Exception as e:  # the reader raises ValueError, KeyError, IndexError, OSError... on bad bytes
        raise ModelError(f"{file}: not a readable GGUF file, truncated or corrupt ({_one_line(e)})") from e


def _meta(reader, file: str, key: str, kind: type, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelError(f"{file}: metadata key {key!r} is missing")
        return default
    try:
        value = field.contents()
    except Exception as e:
        raise ModelError(f"{file}: metadata key {key!r} cannot be read ({_one_line(e)})") from e
    numeric = (int, float) if kind is float else (int,) if kind is int else None
    ok = isinstance(value, numeric) and not isinstance(value, bool) if numeric else isinstance(value, kind)
    if not ok:
        raise ModelError(f"{file}: metadata key {key!r} is {value!r}, not {kind.__name__}")
    return kind(value)


def hf_name(name: str) -> str:
    """GGUF tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`);
    the input unchanged when it is not a tensor of these architectures."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL:
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return name


def _expected_shapes(cfg: dict[str, Any], arch: str, has_bias: bool) -> dict[str, tuple[int, ...]]:
    """Torch shape of every tensor the file must hold (output.weight only when untied)."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    out = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = (V, H)
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out.update({b + "attn_q.weight": (q, H), b + "attn_k.weight": (kv, H), b + "attn_v.weight": (kv, H),
                    b + "attn_output.weight": (H, q), b + "ffn_gate.weight": (I, H), b + "ffn_up.weight": (I, H),
                    b + "ffn_down.weight": (H, I), b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,)})
        if has_bias:
            out.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,)})
        if arch == "qwen3":
            out.update({b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,)})
    return out


def _llama3_from_factors(file: str, factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """rope_scaling recovered from llama.cpp's `rope_freqs` tensor (llama3 scaling, stored per frequency).

    Only the ratios original_max_position_embeddings : low_freq_factor : high_freq_factor show in the
    factors, so low_freq_factor is fixed at 1 (llama 3.x's value) and the result is checked against them."""
    from batchrun.models.rope import inv_frequencies
    r = factors.astype(np.float64)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if r.shape != inv.shape:
        raise ModelError(f"{file}: tensor {_ROPE_FREQS!r} has {r.size} entries, expected {inv.size}")
    factor = float(r.max())
    w = 2 * math.pi / inv
    mid = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    s = (1 / r - 1 / factor) / (1 - 1 / factor)           # 0 at `factor`, 1 unscaled; linear in 1/wavelength
    if mid.sum() >= 2:
        alpha, beta = np.polyfit(1 / w[mid], s[mid], 1)
        low, high, old = 1.0, 1.0 - 1.0 / beta, -alpha / beta
    else:   # one point or none in the smooth band: llama 3.x's 1 and 4, the context from the band's edge
        low, high = 1.0, 4.0
        short, long_ = w[r <= 1 + 1e-6], w[r >= factor * (1 - 1e-6)]
        if mid.any():
            old = float((s[mid][0] * (high - low) + low) * w[mid][0])
        else:
            old = math.sqrt(high * (short.max() if short.size else 1.0) * (long_.min() if long_.size else 1e9))
    if abs(old - round(old)) < 1e-3 * old:
        old = float(round(old))
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": float(high),
              "original_max_position_embeddings": old}
    got = inv_frequencies(head_dim, dict(params, rope_theta=theta)).double().numpy()
    if not np.allclose(got, inv / r, rtol=1e-4, atol=0):
        raise ModelError(f"{file}: tensor {_ROPE_FREQS!r} is not a llama3 rope scaling batchrun can express")
    return params


def _identity(file: str, data_offset: int) -> dict[str, Any]:
    """Cheap file identity: name, size, sha256 of the header (metadata, tensor table) and of the first and
    last MiB of tensor data."""
    h = hashlib.sha256()
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        h.update(f.read(data_offset))
        h.update(f.read(1 << 20))
        f.seek(max(data_offset, size - (1 << 20)))
        h.update(f.read())
    return {"file": os.path.basename(file), "bytes": size, "sha256_header_and_edges": h.hexdigest()}


def inspect_gguf(file: str) -> ModelInfo:
    """Read a GGUF file's header only (no tensor data) and check it: an HF-style config that LlamaModel
    builds from, every tensor's name, type and shape against it. Raises ModelError naming file and key."""
    reader = open_reader(file)
    arch = _meta(reader, file, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ModelError(f"{file}: architecture {arch!r} (metadata key 'general.architecture') is not supported; "
                         f"batchrun loads GGUF {', '.join(ARCHITECTURES)}")
    m = lambda key, kind=int, default=_REQUIRED: _meta(reader, file, f"{arch}.{key}", kind, default)  # noqa: E731
    tensors = {t.name: t for t in reader.tensors}
    H, heads = m("embedding_length"), m("attention.head_count")
    if H < 1 or heads < 1:
        raise ModelError(f"{file}: metadata keys '{arch}.embedding_length'/'{arch}.attention.head_count' are "
                         f"{H}/{heads}")
    head_dim = m("attention.key_length", int, None) or m("rope.dimension_count", int, None) or H // heads
    for key in ("attention.value_length", "rope.dimension_count"):
        if m(key, int, head_dim) != head_dim:   # partial rotary / v != k heads: not this decoder
            raise ModelError(f"{file}: metadata key '{arch}.{key}' is {m(key)}, expected head_dim {head_dim}")
    embd = tensors.get("token_embd.weight")
    vocab = m("vocab_size", int, None) or (int(embd.shape[1]) if embd is not None and len(embd.shape) == 2 else None)
    if vocab is None:
        raise ModelError(f"{file}: metadata key '{arch}.vocab_size' and tensor 'token_embd.weight' are missing")
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch, "hidden_size": H,
        "intermediate_size": m("feed_forward_length"), "num_hidden_layers": m("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": m("attention.head_count_kv", int, heads),
        "rms_norm_eps": m("attention.layer_norm_rms_epsilon", float),
        "rope_theta": m("rope.freq_base", float, 10000.0), "max_position_embeddings": m("context_length"),
        "vocab_size": vocab, "tie_word_embeddings": "output.weight" not in tensors}
    if head_dim != H // heads:
        cfg["head_dim"] = head_dim
    for key in ("bos_token_id", "eos_token_id"):
        if (v := _meta(reader, file, f"tokenizer.ggml.{key}", int, None)) is not None:
            cfg[key] = v
    window = m("attention.sliding_window", int, None)
    if window:
        cfg["sliding_window"] = window
        if arch == "llama":   # Mistral converted as llama; MistralForCausalLM is llama with the window on
            cfg["architectures"] = ["MistralForCausalLM"]
    scaling = m("rope.scaling.type", str, "none")
    if scaling == "linear" or m("rope.scale_linear", float, None):
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": m("rope.scaling.factor", float, None) or m("rope.scale_linear", float)}
    elif scaling != "none":
        raise ModelError(f"{file}: metadata key '{arch}.rope.scaling.type' is {scaling!r}; batchrun supports "
                         "linear and llama3 (rope_freqs)")
    if _ROPE_FREQS in tensors:
        if "rope_scaling" in cfg:
            raise ModelError(f"{file}: both '{arch}.rope.scaling.type' and tensor {_ROPE_FREQS!r} are set")
        factors = dequantize(file, tensors[_ROPE_FREQS])
        if factors.size and factors.max() > 1:   # all ones: no scaling
            cfg["rope_scaling"] = _llama3_from_factors(file, factors, head_dim, cfg["rope_theta"])
    has_bias = arch == "qwen2" or "blk.0.attn_q.bias" in tensors
    cfg["attention_bias"] = has_bias
    expected = _expected_shapes(cfg, arch, has_bias)
    types: dict[str, tuple[int, int]] = {}
    num_params = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ModelError(f"{file}: tensor {t.name!r} has type {kind}; batchrun loads {', '.join(TENSOR_TYPES)}")
        n, b = types.get(kind, (0, 0))
        types[kind] = (n + 1, b + int(t.n_bytes))
        if t.name == _ROPE_FREQS:
            continue
        if t.name not in expected:
            raise ModelError(f"{file}: unexpected tensor {t.name!r} for GGUF architecture {arch!r}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expected[t.name]:
            raise ModelError(f"{file}: tensor {t.name!r} has shape {shape}, expected {expected[t.name]} from "
                             f"the metadata ({arch}.*)")
        num_params += int(t.n_elements)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelError(f"{file}: tensors missing: {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    return ModelInfo(
        path=file, architecture=cfg["architectures"][0], config=cfg, weight_files=[file], num_params=num_params,
        weights_bytes=sum(b for _, b in types.values()), max_model_len=cfg["max_position_embeddings"],
        args=model_args(cfg, file), format="gguf", tensor_types=types, identity=_identity(file, reader.data_offset))


def dequantize(file: str, tensor) -> np.ndarray:
    """One reader tensor as float32 in torch's dim order, via gguf.quants.dequantize."""
    from gguf.quants import dequantize as _dequantize
    try:
        out = _dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise ModelError(f"{file}: tensor {tensor.name!r} ({tensor.tensor_type.name}) cannot be dequantised "
                         f"({_one_line(e)})") from e
    return out.astype(np.float32, copy=False).reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of llama Q/K rows (interleaved rotary pairs -> HF's rotate-half)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(info: ModelInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight of a GGUF model inspected by inspect_gguf."""
    reader = open_reader(info.path)
    cfg = info.config
    permuted = cfg["model_type"] == "llama"   # llama.cpp permutes Q/K for llama only, not qwen2/qwen3
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue   # folded into config["rope_scaling"] by inspect_gguf
        w = dequantize(info.path, t)
        tensor = torch.from_numpy(w) if w.flags.writeable else torch.tensor(w)
        if permuted and ".attn_q." in t.name:
            tensor = unpermute(tensor, cfg["num_attention_heads"])
        elif permuted and ".attn_k." in t.name:
            tensor = unpermute(tensor, cfg["num_key_value_heads"])
        yield hf_name(t.name), tensor
