"""models/rope.py (the one RoPE formula: default, linear, llama3) against transformers' rotary embedding, and
models/args.py (ModelArgs, read once from config.json) against transformers' own config classes."""
from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from batchrun.models.args import ConfigError, ModelArgs  # noqa: E402
from batchrun.models.rope import RopeError, cos_sin_cache, inv_frequencies, rope_params  # noqa: E402

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3.1": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192},
    "llama3-short": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 128},
    "llama3-wide": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                    "original_max_position_embeddings": 1024},
}


def _hf_config(head_dim, scaling):
    return tf.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                          max_position_embeddings=4096, rope_theta=500000.0, rope_scaling=scaling)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_table_match_transformers(head_dim, name):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = _hf_config(head_dim, SCALINGS[name])
    params = rope_params(cfg.to_dict())
    ours = inv_frequencies(head_dim, params)
    rot = LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(ours, rot.inv_freq.float(), atol=0, rtol=1e-6)
    if name.startswith("llama3"):     # every case has kept, slowed and interpolated frequencies
        plain = inv_frequencies(head_dim, {"rope_theta": 500000.0, "rope_type": "default"})
        ratio, factor = plain / ours, SCALINGS[name]["factor"]
        assert (ratio < 1.0001).any() and (ratio > factor * 0.9999).any()
        assert ((ratio > 1.0001) & (ratio < factor * 0.9999)).any()
    pos = torch.tensor([[0, 1, 7, 100, 3000]])
    cos, sin = rot(torch.zeros(1, 5, head_dim), pos)      # HF duplicates cos/sin over both halves
    table = cos_sin_cache(head_dim, params, 3001)[pos[0]]
    half = head_dim // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-5, rtol=1e-5)


def test_the_table_is_built_on_the_device_asked_for_even_under_meta():
    params = rope_params({"rope_theta": 10000.0})
    want = cos_sin_cache(32, params, 16)
    with torch.device("meta"):
        got = cos_sin_cache(32, params, 16, device=torch.device("cpu"))
    assert got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "llama3", "factor": 8.0}, "needs key 'low_freq_factor'"),
    ({"rope_type": "linear"}, "needs key 'factor'"),
    ({"rope_type": "yarn", "factor": 2.0}, "rope type 'yarn' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "high_freq_factor > low_freq_factor"),
])
def test_bad_rope_settings_name_the_key(scaling, match):
    with pytest.raises(RopeError, match=match):
        rope_params({"rope_theta": 10000.0, "rope_scaling": scaling})
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8, "rope_scaling": scaling}
    with pytest.raises(ConfigError, match=f"^m/config.json: .*{match}"):
        ModelArgs.from_config(cfg, "m/config.json")


HF_CONFIGS = {
    "llama": lambda: tf.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=96, num_hidden_layers=2, vocab_size=50),
    "llama-mha-bias": lambda: tf.LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                             num_hidden_layers=1, vocab_size=50, attention_bias=True),
    "mistral": lambda: tf.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                        intermediate_size=96, num_hidden_layers=1, vocab_size=50,
                                        sliding_window=32),
    "qwen2": lambda: tf.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=96, num_hidden_layers=1, vocab_size=50,
                                    tie_word_embeddings=True),
    "qwen3": lambda: tf.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    intermediate_size=96, num_hidden_layers=1, vocab_size=50),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_model_args_read_what_transformers_builds(name):
    cfg = HF_CONFIGS[name]()
    d = cfg.to_dict()
    d["architectures"] = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    a = ModelArgs.from_config(d)
    model = getattr(tf, d["architectures"][0])(cfg)
    attn = model.model.layers[0].self_attn
    assert a.head_dim == attn.head_dim
    assert a.q_size == attn.q_proj.out_features and a.kv_size == attn.k_proj.out_features
    assert a.num_kv_heads * attn.num_key_value_groups == a.num_heads
    assert a.qkv_bias == (attn.q_proj.bias is not None)
    assert a.qk_norm == hasattr(attn, "q_norm")
    # HF masks with config.sliding_window where the model has no layer_types (Mistral), else where a layer
    # type says "sliding_attention" (Qwen2/3 with use_sliding_window)
    types = getattr(cfg, "layer_types", None)
    slides = "sliding_attention" in types if types else getattr(cfg, "sliding_window", None) is not None
    assert a.sliding_window == (cfg.sliding_window if slides else None)
    assert a.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    assert a.rms_norm_eps == model.model.norm.variance_epsilon
    assert (a.num_layers, a.hidden_size, a.intermediate_size, a.vocab_size) == (
        len(model.model.layers), model.config.hidden_size, model.model.layers[0].mlp.up_proj.out_features,
        model.model.embed_tokens.num_embeddings)


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures \\['GPT2LMHeadModel'\\] not supported"),
    ({"hidden_size": "64"}, "key 'hidden_size' missing or not a positive integer"),
    ({"num_hidden_layers": None}, "key 'num_hidden_layers' missing"),
    ({"vocab_size": 0}, "key 'vocab_size' missing or not a positive integer"),
])
def test_bad_config_names_the_file_and_key(change, match):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8, **change}
    with pytest.raises(ConfigError, match=f"^m/config.json: {match}"):
        ModelArgs.from_config(cfg, "m/config.json")
