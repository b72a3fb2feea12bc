"""Engines and jobs with a float8 KV cache (kv_cache_dtype): the compiled-op engine generates what an engine
on the torch reference attention generates (both read the same float8 bytes: the stores are bit-identical,
tests/test_kv_fp8.py), with chunked prefill, prefix caching and swap preemption; the ledger shows half of
bf16's KV bytes and twice the blocks; the job file takes the key, refuses bad values (exit 2) and
fingerprints it."""
import random

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu_attention
from batchrun.kernels.kv_quant import KV_CACHE_DTYPES
from batchrun.models.attention_choice import ATTENTION_ENV as CPU_ATTENTION_ENV
from batchrun.models.loader import inspect_model
from conftest import VOCAB, mixed_prompts
from test_job_common import tiny_model  # noqa: F401 - fixture

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts():
    """Mixed lengths (chunked at 64 tokens a step) and a shared 64-token prefix (prefix-cache hits)."""
    rng = random.Random(4)
    prefix = [rng.randrange(3, VOCAB) for _ in range(64)]
    return mixed_prompts(8, 200, seed=3) + [prefix + p for p in mixed_prompts(6, 40, seed=9)]


def kv_budget(path, blocks, dtype):
    return blocks * 16 * inspect_model(path).kv_bytes_per_token(dtype)


FEATURES = {
    "chunked": {"max_num_batched_tokens": 64},
    "prefix_caching": {"enable_prefix_caching": True, "max_num_batched_tokens": 64},
    # 24 blocks of 16 tokens against 14 sequences of up to 224 tokens: preemption, by swapping the raw bytes
    "swap": {"kv_blocks": 24, "max_model_len": 256, "preemption_mode": "swap", "swap_space": 0.01,
             "swap_min_tokens": 0},
}


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_quantized_kv_engine_equals_the_reference_attention_engine(hf_models, monkeypatch, kv, feature):
    """float8 and int8 caches (tests/test_kv_int8.py: the int8 stores are bit-identical too)."""
    if not cpu_attention.load():
        pytest.skip("CPU attention op unavailable: the engine runs the reference path only")
    path = hf_models["llama"][0]
    kw = dict(FEATURES[feature])
    if "kv_blocks" in kw:
        kw["kv_cache_memory"] = kv_budget(path, kw.pop("kv_blocks"), KV_CACHE_DTYPES[kv])
    ps = [{"prompt_token_ids": p} for p in prompts()]
    llm = LLM(path, dtype="float32", kv_cache_dtype=kv, **kw)
    assert llm.engine.runner.kv_caches.dtype == KV_CACHE_DTYPES[kv]
    assert llm.engine.runner.backend.impl in ("op", "op?")
    got = llm.generate(ps, PARAMS, use_tqdm=False)
    st = llm.stats
    if feature == "swap":
        assert st["swapped_out_blocks"] > 0 and st["swapped_in_blocks"] == st["swapped_out_blocks"]
    if feature == "prefix_caching":
        assert st["prefix_cache_hits"] > 0
    monkeypatch.setenv(CPU_ATTENTION_ENV, "torch")
    ref = LLM(path, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=64)
    assert ref.engine.runner.backend.impl == "torch"
    want = ref.generate(ps, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_fp8_halves_kv_bytes_and_doubles_the_blocks(hf_models):
    """Same kv_cache_memory: a float8 cache holds twice the blocks of a bf16 one (four times float32's),
    so twice as many sequences of max_model_len fit."""
    path = hf_models["qwen3"][0]
    mem = kv_budget(path, 40, torch.bfloat16)
    led = {kv: LLM(path, dtype=dt, kv_cache_dtype=kv, kv_cache_memory=mem, max_model_len=256,
                   max_num_seqs=64).engine.memory_ledger
           for kv, dt in [("auto", "bfloat16"), ("fp8", "bfloat16"), ("fp8_e5m2", "float32")]}
    bf16, e4m3, e5m2 = led["auto"], led["fp8"], led["fp8_e5m2"]
    assert (bf16["kv_cache_dtype"], e4m3["kv_cache_dtype"], e5m2["kv_cache_dtype"]) == \
        ("bfloat16", "float8_e4m3fn", "float8_e5m2")
    assert bf16["kv_bytes_per_token"] == 2 * e4m3["kv_bytes_per_token"] == 2 * e5m2["kv_bytes_per_token"]
    info = inspect_model(path)
    assert e4m3["kv_bytes_per_token"] == 2 * info.num_layers * info.num_kv_heads * info.head_dim    # 1 byte each
    assert bf16["num_blocks"] == 40 and e4m3["num_blocks"] == e5m2["num_blocks"] == 80
    assert e4m3["max_concurrency_at_max_model_len"] == 2 * bf16["max_concurrency_at_max_model_len"]
    assert e4m3["kv_bytes"] == bf16["kv_bytes"]


def test_auto_keeps_the_model_dtype_cache(hf_models):
    llm = LLM(hf_models["llama"][0], dtype="bfloat16", max_num_seqs=2, max_model_len=64)
    assert llm.engine.runner.kv_caches.dtype == torch.bfloat16
    assert llm.engine.memory_ledger["kv_cache_dtype"] == "bfloat16"


def test_engine_config_refuses_an_unknown_kv_cache_dtype():
    from batchrun.engine.config import EngineConfig
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8, got 'fp4'"):
        EngineConfig(model="x", kv_cache_dtype="fp4")


@pytest.mark.parametrize("value,needles", [("fp4", ["kv_cache_dtype", "fp4"]), ("float8", ["kv_cache_dtype"]),
                                           (8, ["engine.kv_cache_dtype"])])
def test_job_file_rejects_bad_kv_cache_dtype(tmp_path, tiny_model, value, needles):  # noqa: F811
    from hostile_util import fails, invoke, job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    fails(invoke("validate", job(tmp_path, tiny_model, "in", engine={"kv_cache_dtype": value})), 2, "job.yaml",
          *needles)


def _plan(tmp_path, model, **engine):
    from batchrun.job.plan import make_plan
    from batchrun.job.spec import load_job
    from hostile_util import job
    from test_job_common import write_prompt_files
    if not (tmp_path / "in").exists():
        write_prompt_files(str(tmp_path / "in"), 4, files=1)
    name = "job-" + "-".join(f"{k}{v}" for k, v in engine.items()) + ".yaml"
    return make_plan(load_job(job(tmp_path, model, "in", name=name, engine=engine)), load_tokenizer=False)


def test_job_file_accepts_kv_cache_dtype_and_fingerprints_it(tmp_path, tiny_model):  # noqa: F811
    """A float8 cache changes outputs as dtype does: an output of one is not resumed by the other; fp8 and
    fp8_e4m3 name one format, and "auto" leaves old manifests valid."""
    auto, fp8, e4m3, e5m2 = (_plan(tmp_path, tiny_model, **kw).fingerprint for kw in
                             ({}, {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"},
                              {"kv_cache_dtype": "fp8_e5m2"}))
    assert "kv_cache_dtype" not in auto["model"]
    assert fp8 == e4m3 and fp8["model"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert e5m2["model"]["kv_cache_dtype"] == "float8_e5m2"
    assert {k: v for k, v in fp8.items() if k != "model"} == {k: v for k, v in auto.items() if k != "model"}
    spec = _plan(tmp_path, tiny_model, kv_cache_dtype="fp8_e5m2").spec
    assert spec.engine_kwargs()["kv_cache_dtype"] == "fp8_e5m2"
