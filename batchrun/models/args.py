"""ModelArgs: the decoder's shape and options, read once from config.json (or a GGUF header's equivalent).

The one architecture table lives here too: which HF `architectures` entries batchrun serves and what each
switches on. Everything downstream (the loader's checks, models/llama.py, the runner's KV sizing) reads
these typed fields instead of looking keys up in the config dict again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from batchrun.models.rope import RopeError, rope_params

# HF architecture -> the short name the model code and GGUF files use.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


class ConfigError(ValueError):
    """config.json cannot describe a model batchrun builds; the message names the file and key."""


@dataclass(frozen=True)
class ModelArgs:
    """One decoder's hyper-parameters (HF config.json names in the comments)."""

    arch: str                       # SUPPORTED_ARCHITECTURES value: llama, mistral, qwen2, qwen3
    hidden_size: int
    intermediate_size: int
    num_layers: int                 # num_hidden_layers
    num_heads: int                  # num_attention_heads
    num_kv_heads: int               # num_key_value_heads (default: num_heads)
    head_dim: int                   # head_dim (default: hidden_size // num_heads)
    vocab_size: int
    rms_norm_eps: float             # default 1e-6
    qkv_bias: bool                  # qwen2, or attention_bias
    qk_norm: bool                   # qwen3: RMSNorm on each head of q and k
    sliding_window: Optional[int]   # mistral, or use_sliding_window with sliding_window
    tie_word_embeddings: bool
    rope: dict[str, Any]            # models/rope.py: rope_params(config)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelArgs":
        """Check and read `cfg`; raises ConfigError naming `source` and the key."""
        archs = cfg.get("architectures") or []
        hf_arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if hf_arch is None:
            raise ConfigError(f"{source}: architectures {archs or '(none)'} not supported; batchrun serves "
                              f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        for key in _INT_KEYS:
            if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] < 1:
                raise ConfigError(f"{source}: key {key!r} missing or not a positive integer")
        try:
            rope = rope_params(cfg)
        except RopeError as e:
            raise ConfigError(f"{source}: {e}") from e
        arch = SUPPORTED_ARCHITECTURES[hf_arch]
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window")
        uses_window = arch == "mistral" or bool(cfg.get("use_sliding_window", False))
        return cls(
            arch=arch, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"], rms_norm_eps=float(1e-6 if cfg.get("rms_norm_eps") is None else cfg["rms_norm_eps"]),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)), qk_norm=arch == "qwen3",
            sliding_window=window if uses_window and window else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope=rope)

    @staticmethod
    def hf_architecture(cfg: dict[str, Any]) -> str:
        """The first supported entry of cfg["architectures"] (from_config has checked there is one)."""
        return next(a for a in cfg.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES)
