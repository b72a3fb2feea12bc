"""The measured choice of CPU attention implementation (batchrun.models.attention_choice): the op's SDPA
path for fresh prompt chunks against the naive reference (mixed batches: decodes, fresh chunks, chunks with a
cached prefix, GQA, sliding windows and float8 caches left to the own kernel), the decision rule on given
times, a real measured start (cached per machine), float32's fixed path, forced modes giving the reference
path's greedy tokens, the knob and env var (one-line errors), and `validate` showing the choice."""
from __future__ import annotations

import json

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu_attention as ca
from batchrun.kernels.kv_quant import quantize
from batchrun.models import attention_choice as ac, kernel_choice as kc
from batchrun.models.loader import ModelError

needs_op = pytest.mark.skipif(not ca.load(), reason="the compiled CPU attention op does not build here")
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20, [9] * 3)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _batch(spec, dtype, hq=6, hkv=2, d=64, bs=16, seed=0):
    """q and paged caches for [(query_len, context_len)] sequences, blocks in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    nbl = [-(-c // bs) for _, c in spec]
    n = sum(nbl) + 2
    kc_, vc_ = (torch.randn(n, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(n, generator=g)[:sum(nbl)]
    bt = torch.zeros(len(spec), max(nbl), dtype=torch.int32)
    o = 0
    for i, k in enumerate(nbl):
        bt[i, :k] = perm[o:o + k]
        o += k
    qsl = torch.tensor([0] + torch.tensor([q for q, _ in spec]).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor([c for _, c in spec], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=g).to(dtype)
    return q, kc_, vc_, qsl, lens, bt


# a decode, fresh chunks (long, short), a chunk after a cached prefix, another decode
MIXED = [(1, 40), (70, 70), (20, 50), (5, 5), (1, 9)]


@needs_op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sdpa_from", [1, 6, 64, 1000])
def test_fresh_chunks_on_sdpa_equal_the_reference(dtype, sdpa_from):
    q, k, v, qsl, lens, bt = _batch(MIXED, dtype)
    ref = ca.paged_attention_ref(q, k, v, qsl, lens, bt, 0.125).float()
    got = ca.paged_attention(q, k, v, qsl, lens, bt, 0.125, sdpa_from=sdpa_from).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@needs_op
@pytest.mark.parametrize("case", ["window", "fp8"])
def test_sequences_sdpa_cannot_take_stay_on_the_own_kernel(case):
    """A sliding window or a float8 cache: sdpa_from changes nothing (both go to the own kernel)."""
    q, k, v, qsl, lens, bt = _batch(MIXED, torch.bfloat16, seed=1)
    kw = {"sliding_window": 24} if case == "window" else {"k_scale": 0.5, "v_scale": 0.25}
    if case == "fp8":
        k, v = quantize(k, torch.float8_e4m3fn, 0.5), quantize(v, torch.float8_e4m3fn, 0.25)
    own = ca.paged_attention(q, k, v, qsl, lens, bt, 0.125, **kw)
    assert torch.equal(ca.paged_attention(q, k, v, qsl, lens, bt, 0.125, sdpa_from=1, **kw), own)


def _times(prefill: dict, decode=(1.0, 2.0)) -> dict:
    return {"prefill": {n: {"own": o, "sdpa": s} for n, (o, s) in prefill.items()},
            "decode": {"own": decode[0], "torch": decode[1]}}


def test_sdpa_runs_from_the_length_where_it_wins_at_every_longer_one():
    assert ac.decide(_times({32: (1, 2), 128: (1, 2), 512: (1, 2)})) == (None, "own")
    assert ac.decide(_times({32: (2, 1), 128: (2, 1), 512: (2, 1)})) == (1, "own")
    assert ac.decide(_times({32: (1, 2), 128: (1, 2), 512: (2, 1), 2048: (2, 1)})) == (512, "own")
    assert ac.decide(_times({32: (1, 2), 128: (2, 1), 512: (1, 2)})) == (None, "own")   # not at every longer
    assert ac.decide(_times({32: (1, 2)}, decode=(2.0, 1.0))) == (None, "torch")


def test_the_knob_wins_over_the_env_var_and_bad_names_are_refused(monkeypatch):
    monkeypatch.setenv(ac.ATTENTION_ENV, "torch")
    assert ac.resolve_mode(None) == "torch" and ac.resolve_mode("own") == "own"
    monkeypatch.setenv(ac.ATTENTION_ENV, "amx")
    with pytest.raises(ValueError, match=f"{ac.ATTENTION_ENV} must be one of auto, own, sdpa, torch, got 'amx'"):
        ac.resolve_mode("auto")
    with pytest.raises(ValueError, match="cpu_attention must be one of"):
        LLM("unused", cpu_attention="flash")


def test_a_bad_env_value_is_a_one_line_model_error(hf_models, monkeypatch):
    monkeypatch.setenv(ac.ATTENTION_ENV, "flash")
    with pytest.raises(ModelError) as e:
        LLM(hf_models["llama"][0], dtype="bfloat16")
    assert "BATCHRUN_CPU_ATTENTION" in str(e.value) and "\n" not in str(e.value)


@needs_op
def test_auto_measures_once_per_machine_and_caches_the_choice(hf_models, monkeypatch, tmp_path):
    monkeypatch.delenv(ac.ATTENTION_ENV, raising=False)
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path))
    path = hf_models["llama"][0]
    engine = LLM(path, dtype="bfloat16", max_num_seqs=4).engine
    first = engine.memory_ledger["cpu_attention"]
    longest = min(engine.runner.max_model_len, engine.runner.config.max_num_batched_tokens)
    assert first["mode"] == "auto" and first["cached"] is False and first["measure_s"] > 0
    files = list((tmp_path / "attention").glob("*.json"))
    assert len(files) == 1
    timed = first["times_us"]
    assert sorted(map(int, timed["prefill"])) == [n for n in ac.QUERY_LENS if n <= longest]   # chunks it can have
    assert all(sorted(t) == ["own", "sdpa"] and min(t.values()) > 0 for t in timed["prefill"].values())
    assert sorted(timed["decode"]) == ["own", "torch"]
    second = LLM(path, dtype="bfloat16", max_num_seqs=4).engine
    led = second.memory_ledger["cpu_attention"]
    assert led["cached"] is True and led["sdpa_from"] == first["sdpa_from"]
    assert second.runner.backend.sdpa_from == (first["sdpa_from"] or -1)
    files[0].write_text("{not json")                   # a torn cache file: measured again and rewritten
    third = LLM(path, dtype="bfloat16", max_num_seqs=4).engine.memory_ledger["cpu_attention"]
    assert third["cached"] is False and json.loads(files[0].read_text())["report"]


@needs_op
def test_float32_keeps_the_own_kernel_without_measuring(hf_models, monkeypatch):
    monkeypatch.delenv(ac.ATTENTION_ENV, raising=False)
    monkeypatch.setattr(ac, "measure", lambda *a: pytest.fail("float32 must not measure"))
    llm = LLM(hf_models["llama"][0], dtype="float32")
    assert llm.engine.memory_ledger["cpu_attention"]["prefill"] == "own"
    assert llm.engine.runner.backend.sdpa_from == -1 and llm.engine.runner.backend.impl in ("op", "op?")


@needs_op
@pytest.mark.parametrize("mode", ["sdpa", "own"])
def test_forced_modes_give_the_reference_paths_greedy_tokens(hf_models, monkeypatch, mode):
    """float32 (HF parity's dtype): SDPA for every fresh chunk, or the own kernel, against the torch path."""
    path = hf_models["llama"][0]
    monkeypatch.setenv(ac.ATTENTION_ENV, "torch")
    ref = LLM(path, dtype="float32")
    assert ref.engine.runner.backend.impl == "torch"
    want = [o.token_ids for o in ref.generate(PROMPTS, PARAMS, use_tqdm=False)]
    monkeypatch.delenv(ac.ATTENTION_ENV)
    llm = LLM(path, dtype="float32", cpu_attention=mode)
    assert llm.engine.runner.backend.sdpa_from == (1 if mode == "sdpa" else -1)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == want


@needs_op
def test_validate_shows_the_choice_and_refuses_a_bad_knob(tmp_path, monkeypatch, hf_models):
    from hostile_util import fails, invoke, job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    path = hf_models["llama"][0]
    threads = torch.get_num_threads()
    jf = job(tmp_path, path, "in", model={"path": path, "dtype": "bfloat16"}, engine={"threads": threads})
    monkeypatch.delenv(ac.ATTENTION_ENV, raising=False)
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path / "cache"))
    r = invoke("validate", "--json", jf)
    assert r.code == 0, r
    assert json.loads(r.stdout)["memory_ledger"]["cpu_attention"]["report"] is None    # not measured here yet
    led = LLM(path, dtype="bfloat16", threads=threads).engine.memory_ledger["cpu_attention"]
    r = invoke("validate", jf)
    assert r.code == 0, r
    assert f"cpu_attention auto: cached from an earlier start on this machine; prefill {led['prefill']}, " \
           f"decode {led['decode']}" in r.stdout, r.stdout
    monkeypatch.setenv(ac.ATTENTION_ENV, "sdpa")
    assert "cpu_attention sdpa: forced; prefill sdpa, decode own" in invoke("validate", jf).stdout
    bad = job(tmp_path, path, "in", name="bad.yaml", engine={"cpu_attention": "flash"})
    fails(invoke("validate", bad), 2, "bad.yaml", "cpu_attention", "flash")
