"""Shared fixtures: tiny random-init HF models of every supported architecture, saved with save_pretrained.

Weights are drawn with a large init range so greedy choices are far from ties; transformers is the oracle.
"""
from __future__ import annotations

import os
import random
import sys

# `python -m pytest` puts the working directory, the repository root, first on sys.path, where the source
# folder kernels/ (installed as batchrun.kernels) would shadow the PyPI package `kernels` that transformers
# >= 5.25 imports. batchrun is installed (editable), so the root is not needed on the path.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # before any test module imports batchrun.kernels (and so triton): Triton kernels decorated without it
    # cannot run on CPU, and re-decorating them later does not reach triton's own jit'd library functions
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 512
ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def hf_config(arch: str):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.15)
    if arch == "llama":
        return tf.LlamaConfig(**common, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128})
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "mistral":
        # a window shorter than the longest test prompt, so the sliding-window mask is exercised
        return tf.MistralConfig(**common, sliding_window=96, rope_theta=1e6)
    raise ValueError(arch)


def build_hf_model(arch: str, path: str, seed: int = 0, shard: bool = False):
    import transformers as tf
    torch.manual_seed(seed)
    cfg = hf_config(arch)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM, "mistral": tf.MistralForCausalLM}[arch]
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)   # non-trivial norm weights catch a missing norm
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, max_shard_size="60KB" if shard else "5GB")
    from batchrun.demo import build_tokenizer
    build_tokenizer(path, vocab_size=VOCAB)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{arch: (path, hf_model)} built once per session."""
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(f"model-{arch}"))
        out[arch] = (path, build_hf_model(arch, path, shard=(arch == "qwen3")))
    return out


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF generate, one prompt at a time (no padding), never stopping at EOS: the greedy oracle."""
    out = []
    for p in prompts:
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def assert_same_greedy_with_env_off(path: str, monkeypatch, env: str, ledger_key: str, dtype: str = "bfloat16",
                                    **engine_kwargs):
    """An engine feature a variable turns off (a CPU fast path): greedy tokens with it on (the default) equal
    those with `env`=0, and the memory ledger says which ran. engine_kwargs: EngineConfig fields for both."""
    from batchrun import LLM, SamplingParams
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    on = LLM(path, dtype=dtype, max_num_seqs=4, **engine_kwargs)
    assert on.engine.memory_ledger[ledger_key] is True
    monkeypatch.setenv(env, "0")
    off = LLM(path, dtype=dtype, max_num_seqs=4, **engine_kwargs)
    assert off.engine.memory_ledger[ledger_key] is False
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (on, off))
    assert [x.token_ids for x in a] == [y.token_ids for y in b]


def mixed_prompts(n: int = 32, max_len: int = 400, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [1, 2, max_len] + [rng.randint(1, max_len) for _ in range(n - 3)]
    return [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lens]


@pytest.fixture(scope="session")
def job_model(tmp_path_factory):
    """A tiny demo-format model (batchrun.demo, no transformers) for job-runner tests."""
    from jobutil import tiny_model
    return tiny_model(str(tmp_path_factory.mktemp("job-model")))
