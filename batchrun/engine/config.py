"""EngineConfig: every engine knob in one place, named as in vLLM."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional


@dataclass
class EngineConfig:
    """Knobs of one engine replica. Names follow vLLM's so users can carry settings over.

    model: HF model directory (config.json, *.safetensors, tokenizer.json).
    dtype: "auto" (config.json's dtype), "bfloat16", "float16" or "float32".
    max_num_seqs: most sequences in one step's batch.
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    block_size: tokens per KV-cache block.
    max_model_len: longest prompt + output; default from config.json.
    kv_cache_memory: bytes for the KV cache on CPU (default: a share of free RAM).
    gpu_memory_utilization: share of GPU memory the engine may use (CUDA only).
    swap_space: GiB of host memory for swapped-out KV blocks (0 disables swapping).
    preemption_mode: "swap" (swap out when worth it and the host pool has room, else recompute)
        or "recompute" (always drop the KV and recompute, as vLLM V1 does).
    swap_min_tokens: sequences with fewer computed tokens are recomputed rather than swapped
        (recomputing a short sequence is cheaper than two copies; see scripts/bench_swap.py).
    enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
    speculative_config: {"method": "ngram", "num_speculative_tokens": k,
        "prompt_lookup_max": n_max, "prompt_lookup_min": n_min} or None.
    enforce_eager: disable CUDA graphs.
    attention_backend: "auto" (Triton on CUDA, torch on CPU), "torch" or "triton" (on CPU the Triton
        kernels run only under TRITON_INTERPRET=1: a test path, not a fast one).
    device: "auto", "cpu" or "cuda".
    seed: seed of the global sampler generator (requests with a seed use their own).
    """

    model: str = ""
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    max_model_len: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    preemption_mode: str = "swap"
    swap_min_tokens: int = 16
    enable_prefix_caching: bool = False
    speculative_config: Optional[dict[str, Any]] = None
    enforce_eager: bool = False
    attention_backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False  # accepted for vLLM compatibility; never executes code
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
