"""Error paths: bad rows finish as error outputs beside good ones; bad model directories fail before any weight is read."""
import json
import os
import shutil

import pytest

from batchrun import LLM, SamplingParams
from batchrun.models.loader import ModelError


@pytest.fixture(scope="module")
def llm(hf_models):
    return LLM(hf_models["llama"][0], dtype="float32", max_model_len=256)


def test_bad_rows_become_error_outputs_and_the_rest_goes_on(llm):
    good = [5, 6, 7, 8]
    prompts = [{"prompt_token_ids": good}, {"prompt_token_ids": []}, "",
               {"prompt_token_ids": [9] * 250}, {"prompt_token_ids": [10**6]}, {"prompt_token_ids": good}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length"]
    assert outs[1].error == "empty prompt" and outs[2].error == "empty prompt"
    assert "exceeds max_model_len=256" in outs[3].error and "250 tokens" in outs[3].error
    assert "outside the vocabulary" in outs[4].error
    assert outs[0].token_ids == outs[5].token_ids and len(outs[0].token_ids) == 16
    assert all(o.token_ids == [] and o.text == "" for o in outs[1:5])
    assert llm.stats["blocks_used"] == 0


def test_request_larger_than_whole_cache_is_an_error(hf_models):
    """A cache must hold one sequence of max_model_len (else the engine refuses to start, naming the knob:
    tests/test_engine_defaults.py), so a request that fits max_model_len always fits the cache."""
    from batchrun.models.loader import inspect_model
    import torch
    path = hf_models["llama"][0]
    per_token = inspect_model(path).kv_bytes_per_token(torch.float32)
    llm = LLM(path, dtype="float32", kv_cache_memory=4 * 16 * per_token, max_model_len=64)   # 4 blocks = 64 tokens
    outs = llm.generate([{"prompt_token_ids": [5] * 60}, {"prompt_token_ids": [5] * 10}],
                        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert outs[0].finish_reason == "error" and "exceeds max_model_len=64" in outs[0].error
    assert outs[1].finish_reason == "length"


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def corrupt_weights(path):
    """Garbage weights: reading any of them would raise a different error than the one expected."""
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with open(os.path.join(path, f), "r+b") as fh:
                fh.seek(64)
                fh.write(b"\xff" * 256)


def test_unknown_architecture_fails_before_weights_load(hf_models, tmp_path):
    path = copy_model(hf_models["llama"][0], tmp_path / "m")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    corrupt_weights(path)
    with pytest.raises(ModelError, match=r"config.json: architectures \['GPT2LMHeadModel'\] not supported"):
        LLM(path)


def test_pickle_checkpoint_refused_with_safetensors_message(hf_models, tmp_path):
    path = copy_model(hf_models["llama"][0], tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "pytorch_model.bin"), "wb") as f:
        f.write(b"not really a pickle")
    with pytest.raises(ModelError, match="pytorch_model.bin.*safetensors only"):
        LLM(path)


def test_missing_config_and_missing_shard(hf_models, tmp_path):
    path = copy_model(hf_models["llama"][0], tmp_path / "a")
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(ModelError, match="config.json: missing"):
        LLM(path)
    sharded = copy_model(hf_models["qwen3"][0], tmp_path / "b")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(ModelError, match=f"shards that are missing: {shard}"):
        LLM(sharded)
    with pytest.raises(ModelError, match="is not a directory"):
        LLM(str(tmp_path / "nope"))


def test_missing_tokenizer_is_a_clear_error(hf_models, tmp_path):
    from batchrun.tokenizer import TokenizerError
    path = copy_model(hf_models["llama"][0], tmp_path / "m")
    os.remove(os.path.join(path, "tokenizer.json"))
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        LLM(path)


def test_bad_sampling_params_and_engine_args():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("x", max_num_seq=4)
