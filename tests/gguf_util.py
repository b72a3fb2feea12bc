"""Synthetic GGUF files written with gguf.GGUFWriter from tiny random HF models, as llama.cpp's converter
would: metadata under `{arch}.*`, tensors renamed, llama Q/K rows permuted for interleaved rotary,
llama3 rope scaling as a `rope_freqs` tensor, 1-D tensors kept F32, 2-D ones in the file's type.

gguf 0.19's Python `quantize` handles F32, F16, BF16, Q8_0, Q4_0, Q4_1 (and Q5_0/Q5_1) but raises
NotImplementedError for the K-quants. Q4_K/Q5_K/Q6_K tensors are therefore random but well-formed blocks
(scale fields set to sane half-floats): the file no longer holds the HF model's values, so its oracle is
transformers loading the same file, or an HF model given the dequantised weights.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def kquant_hf_model(arch: str, path: str, seed: int = 0):
    """A tiny random HF model whose every matrix row is a multiple of 256 (K-quant super-blocks): hidden 256,
    intermediate 512, qwen3 head_dim 128 (what transformers assumes for GGUF qwen3), llama without rope
    scaling (transformers ignores `rope_freqs` when loading a GGUF). PATH gets the tiny tokenizer."""
    from conftest import hf_config
    import transformers as tf
    cfg = hf_config(arch)
    cfg.hidden_size, cfg.intermediate_size = 256, 512
    cfg.head_dim = 128 if arch == "qwen3" else 64
    if arch == "llama":
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[arch]
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    from batchrun.demo import build_tokenizer
    build_tokenizer(path, vocab_size=cfg.vocab_size)
    return model


def gguf_name(hf: str) -> str:
    name = hf.removeprefix("model.")
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        mod, leaf = rest.rsplit(".", 1)
        return f"blk.{i}.{_LAYER[mod]}.{leaf}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (rotate-half pairs -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's `rope_freqs` for llama3 rope scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def random_kquant(shape: tuple[int, int], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Well-formed random K-quant bytes [rows, row_bytes] whose values have std ~0.1 and mean ~0."""
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    rows, cols = shape
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=(rows, cols // block)).astype(np.float32)
    if qtype == "Q6_K":          # ql, qh, int8 scales[16], then d: value = d * scale * (q - 32)
        b[..., -2:] = (d * 1e-4).astype(np.float16)[..., None].view(np.uint8)
    else:                        # d, dmin, 6-bit scales/mins, q: value = d * sc * q - dmin * m
        levels = 7.5 if qtype == "Q4_K" else 15.5
        b[..., 0:2] = (d * 0.1 / (40 * levels)).astype(np.float16)[..., None].view(np.uint8)
        b[..., 2:4] = (d * 0.1 / 40).astype(np.float16)[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def metadata(cfg, arch: str) -> dict[str, Any]:
    """`{arch}.*` keys for an HF config, as the converter writes them (values typed by write_gguf)."""
    g = GGUF_ARCH[arch]
    head_dim = _head_dim(cfg)
    meta = {f"{g}.block_count": cfg.num_hidden_layers, f"{g}.context_length": cfg.max_position_embeddings,
            f"{g}.embedding_length": cfg.hidden_size, f"{g}.feed_forward_length": cfg.intermediate_size,
            f"{g}.attention.head_count": cfg.num_attention_heads,
            f"{g}.attention.head_count_kv": cfg.num_key_value_heads,
            f"{g}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            f"{g}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
            f"{g}.vocab_size": cfg.vocab_size,
            "tokenizer.ggml.bos_token_id": cfg.bos_token_id, "tokenizer.ggml.eos_token_id": cfg.eos_token_id}
    if g == "llama":
        meta[f"{g}.rope.dimension_count"] = head_dim
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        meta[f"{g}.attention.key_length"] = meta[f"{g}.attention.value_length"] = head_dim
    if arch == "mistral":
        meta[f"{g}.attention.sliding_window"] = cfg.sliding_window
    return meta


def tensors(model, arch: str, qtype: str, seed: int = 0) -> list[tuple[str, np.ndarray, str]]:
    """(GGUF name, data, type) for every weight of an HF model; K-quant types fall back to Q8_0 for a
    matrix whose rows are not a multiple of 256, as llama.cpp's quantizer does."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    out = []
    if cfg.rope_parameters.get("rope_type") == "llama3":
        out.append(("rope_freqs.weight", llama3_rope_factors(cfg.rope_parameters, _head_dim(cfg)), "F32"))
    for hf, p in model.state_dict().items():
        if "rotary_emb" in hf or (hf == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        w = p.detach().float().numpy()
        name = gguf_name(hf)
        if GGUF_ARCH[arch] == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = permute(w, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        kind = qtype if w.ndim == 2 else "F32"
        if kind in K_QUANTS and w.shape[1] % 256:
            kind = "Q8_0"
        data = random_kquant(w.shape, kind, rng) if kind in K_QUANTS else quantize(w, Q[kind])
        out.append((name, data, kind))
    return out


def add_tokenizer(w, tokenizer_dir: str) -> None:
    """The tiny byte-level BPE of an HF directory (batchrun.demo.build_tokenizer) as tokenizer.ggml.* keys."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    vocab = data["model"]["vocab"] | {t["content"]: t["id"] for t in data["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t["content"] for t in data["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]])
    w.add_bool("tokenizer.ggml.add_bos_token", bool(config.get("add_bos_token")))
    w.add_chat_template(config["chat_template"])


def write_gguf(path: str, arch: str, meta: dict[str, Any], tensor_list, name: str = "tiny test model",
               tokenizer_dir: Optional[str] = None) -> str:
    """Write a GGUF file: general.architecture=arch, `meta` (ints as uint32, floats as float32, str), the
    tokenizer of `tokenizer_dir` when given, then the tensors [(name, data, type)]."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    for key, value in meta.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    if tokenizer_dir is not None:
        add_tokenizer(w, tokenizer_dir)
    for tname, data, kind in tensor_list:
        w.add_tensor(tname, data, raw_dtype=None if kind in ("F32", "F16") else Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_gguf(model, arch: str, qtype: str, dir: str, tokenizer_dir: Optional[str] = None) -> str:
    """DIR/model-{qtype}.gguf from an HF model (the whole conversion), with the tokenizer of `tokenizer_dir`."""
    os.makedirs(dir, exist_ok=True)
    name = "Mistral tiny" if arch == "mistral" else "tiny test model"
    return write_gguf(os.path.join(dir, f"model-{qtype}.gguf"), GGUF_ARCH[arch], metadata(model.config, arch),
                      tensors(model, arch, qtype), name, tokenizer_dir)


def dequantised_hf(model, path: str):
    """A copy of an HF model holding a GGUF file's weights (dequantised, unpermuted): the oracle for files
    transformers cannot load itself."""
    import copy
    from batchrun.models.gguf import hf_name, open_reader, unpermute
    from gguf.quants import dequantize
    ref = copy.deepcopy(model)
    cfg = ref.config
    sd = {}
    for t in open_reader(path).tensors:
        if t.name == "rope_freqs.weight":
            continue
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if ".attn_q." in t.name or ".attn_k." in t.name:
            if getattr(cfg, "model_type", "") in ("llama", "mistral"):
                w = unpermute(w, cfg.num_attention_heads if ".attn_q." in t.name else cfg.num_key_value_heads)
        sd[hf_name(t.name)] = w
    missing = ref.load_state_dict(sd, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_word_embeddings), missing
    return ref
