"""Shared pieces of the benchmark scripts: a random-init Llama of a realistic small shape, timed runs."""
from __future__ import annotations

import os
import time

import torch

SMALL_LLAMA = dict(vocab_size=32000, hidden_size=576, intermediate_size=1536, num_hidden_layers=12,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096)


def build_model(path: str, dtype: str = "bfloat16", **shape) -> str:
    """Save a random-init LlamaForCausalLM (HF transformers, a benchmark-only dependency) and a tokenizer."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import transformers as tf
    from batchrun.demo import build_tokenizer
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(**{**SMALL_LLAMA, **shape}, bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    tf.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    build_tokenizer(path, vocab_size=2048)
    return path


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t, outs
