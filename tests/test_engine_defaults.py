"""Engine defaults that fit the device: the threads knob, KV sizing from what the job can use (touched only
as used), no host swap pool on CPU unless asked for, device-dependent batch defaults, host-overhead
counters, and bad settings refused at engine start naming the knob. No timing assertions."""
from __future__ import annotations

import os

import pytest
import torch
import yaml

from batchrun import LLM, SamplingParams
from batchrun.engine.config import DEVICE_DEFAULTS, EngineConfig, default_threads
from batchrun.engine.kv_cache import blocks_needed
from batchrun.job.spec import JobError, load_job
from batchrun.models.loader import ModelError, inspect_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def path(hf_models):
    return hf_models["llama"][0]


def per_token(path):
    return inspect_model(path).kv_bytes_per_token(torch.float32)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- threads -----------------------------------------------------------------------------------
def test_threads_knob_sets_torch_threads(path):
    llm = LLM(path, dtype="float32", threads=1)
    assert torch.get_num_threads() == 1 and llm.engine.memory_ledger["threads"] == 1
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_threads_default_is_the_cores_this_process_may_use(path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == len(os.sched_getaffinity(0))
    torch.set_num_threads(1)
    llm = LLM(path, dtype="float32")
    assert torch.get_num_threads() == len(os.sched_getaffinity(0)) == llm.engine.memory_ledger["threads"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # a launcher's per-worker share wins over the core count
    assert default_threads() == 1


@pytest.mark.parametrize("bad", [0, -2])
def test_threads_below_one_is_a_value_error_naming_the_knob(path, bad):
    with pytest.raises(ValueError, match=r"threads must be >= 1"):
        EngineConfig(model=path, threads=bad)
    with pytest.raises(ValueError, match=r"threads must be >= 1"):
        LLM(path, threads=bad)


def test_job_file_threads_key(tmp_path):
    base = {"name": "j", "model": {"path": "m"}, "input": {"uri": "in.parquet", "prompt_column": "text"},
            "output": {"uri": "out/"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**base, "engine": {"threads": None}}))
    assert load_job(str(job)).engine.threads is None
    assert load_job(str(job), ["engine.threads=3"]).engine_kwargs()["threads"] == 3
    with pytest.raises(JobError, match="threads must be >= 1"):
        load_job(str(job), ["engine.threads=0"])


# -- device defaults ---------------------------------------------------------------------------
def test_batch_defaults_depend_on_the_device(path):
    cfg = EngineConfig(model=path)
    assert cfg.max_num_seqs is None and cfg.max_num_batched_tokens is None and cfg.swap_space is None
    cpu, cuda = cfg.resolved("cpu"), cfg.resolved("cuda")
    for key in ("max_num_seqs", "max_num_batched_tokens", "swap_space", "compile"):
        assert getattr(cpu, key) == DEVICE_DEFAULTS["cpu"][key]
        assert getattr(cuda, key) == DEVICE_DEFAULTS["cuda"][key]
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens, cuda.swap_space) == (256, 8192, 4.0)
    assert cpu.swap_space == 0
    # a value set by the user is kept on every device
    mine = EngineConfig(model=path, max_num_seqs=7, max_num_batched_tokens=99, swap_space=1.5).resolved("cpu")
    assert (mine.max_num_seqs, mine.max_num_batched_tokens, mine.swap_space) == (7, 99, 1.5)

    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.config.max_num_seqs == DEVICE_DEFAULTS["cpu"]["max_num_seqs"]
    assert llm.engine.scheduler.max_num_seqs == DEVICE_DEFAULTS["cpu"]["max_num_seqs"]
    assert llm.engine.scheduler.max_num_batched_tokens == DEVICE_DEFAULTS["cpu"]["max_num_batched_tokens"]


# -- KV sizing ---------------------------------------------------------------------------------
def test_kv_cache_sized_from_max_num_seqs_and_max_model_len(path):
    llm = LLM(path, dtype="float32", max_num_seqs=4, max_model_len=200)
    assert llm.engine.kv.num_blocks == 4 * blocks_needed(200, 16)
    llm = LLM(path, dtype="float32", device="cpu")          # default max_num_seqs, model's max_model_len
    cap = llm.engine.config.max_num_seqs * blocks_needed(llm.engine.max_model_len, 16)
    assert llm.engine.kv.num_blocks == cap       # 4096 blocks of 8 KiB: far under half the RAM


def test_kv_budget_caps_the_blocks(path):
    llm = LLM(path, dtype="float32", max_num_seqs=64, max_model_len=128, kv_cache_memory=20 * 16 * per_token(path))
    assert llm.engine.kv.num_blocks == 20


def test_kv_cache_is_not_paged_in_up_front_and_grows_with_the_working_set(path):
    # 512 sequences x 64 blocks x 16 tokens x 512 bytes: 256 MiB of KV if it were written up front
    before = rss_bytes()
    llm = LLM(path, dtype="float32", max_num_seqs=512, max_model_len=1024, enforce_eager=True)
    runner = llm.engine.runner
    kv_bytes = runner.kv_caches.numel() * runner.kv_caches.element_size()
    assert kv_bytes >= 256 << 20
    assert rss_bytes() - before < kv_bytes // 4
    assert float(runner.kv_caches[:, :, :4].abs().sum()) == 0.0        # reads as zeros
    outs = llm.generate([[5 + i, 6, 7] * 10 for i in range(8)], GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    pool = llm.engine.kv.pool
    # used blocks are reused before never-used ones: the touched region is the peak working set
    assert 0 < pool.num_touched == pool.peak_used <= 8 * 3
    again = llm.generate([[9, 9, i] * 10 for i in range(8)], GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in again)
    assert pool.num_touched == pool.peak_used and llm.stats["blocks_touched"] == pool.num_touched


def test_cache_smaller_than_one_sequence_fails_at_start_naming_the_knob(path):
    with pytest.raises(ModelError, match=r"kv_cache_memory.*max_model_len=1024.*raise kv_cache_memory"):
        LLM(path, dtype="float32", kv_cache_memory=4 * 16 * per_token(path))
    with pytest.raises(ValueError, match="kv_cache_memory must be > 0"):
        LLM(path, dtype="float32", kv_cache_memory=0)
    # enough for one sequence of max_model_len: starts
    LLM(path, dtype="float32", kv_cache_memory=4 * 16 * per_token(path), max_model_len=64)


@pytest.mark.parametrize("knob,value,match", [
    ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
    ("max_num_batched_tokens", 0, "max_num_batched_tokens must be >= 1"),
    ("swap_space", -1, "swap_space must be >= 0"),
    ("max_model_len", 0, "max_model_len must be >= 1"),
])
def test_bad_knobs_are_value_errors_naming_the_knob(path, knob, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=path, **{knob: value})


# -- host swap pool ----------------------------------------------------------------------------
def test_no_host_swap_pool_on_cpu_by_default(path):
    llm = LLM(path, dtype="float32", device="cpu")
    assert llm.engine.runner.host_kv is None and llm.engine.kv.host_pool is None
    assert llm.engine.memory_ledger["host_swap_blocks"] == 0


def test_explicit_swap_space_on_cpu_allocates_a_lazy_pool(path):
    before = rss_bytes()
    llm = LLM(path, dtype="float32", device="cpu", swap_space=0.25, max_num_seqs=512, enforce_eager=True)
    r = llm.engine.runner
    assert r.host_kv is not None and llm.engine.kv.host_pool is not None
    assert r.num_host_blocks == (0.25 * 2**30) // (16 * per_token(path))
    assert rss_bytes() - before < (r.host_kv.numel() * r.host_kv.element_size()) // 4
    llm = LLM(path, dtype="float32", device="cpu", swap_space=0.25, preemption_mode="recompute")
    assert llm.engine.runner.host_kv is None        # recompute never swaps: no pool


def test_tight_budget_preempts_by_recompute_and_matches_hf(hf_models):
    """Greedy output under a cache that forces preemption equals HF's (no host pool on CPU)."""
    from conftest import hf_greedy, mixed_prompts
    path, hf = hf_models["llama"]
    prompts = mixed_prompts(10, 200, seed=4)
    want = hf_greedy(hf, prompts, 16)
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=256, enable_prefix_caching=False,
              kv_cache_memory=20 * 16 * per_token(path))        # 20 blocks: under 2 of the longest
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    st = llm.stats
    assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0 and st["swapped_out_blocks"] == 0


# -- host overhead counters, compile knob --------------------------------------------------------
def test_host_overhead_counters(path):
    llm = LLM(path, dtype="float32")
    llm.generate([[5, 6, 7] * 5] * 4, GREEDY, use_tqdm=False)
    st = llm.stats
    assert st["steps"] > 0 and st["forward_s"] > 0 and st["step_s"] >= st["forward_s"]
    assert st["host_overhead_s"] == pytest.approx(st["step_s"] - st["forward_s"])
    assert st["host_overhead_ms_per_step"] == pytest.approx(1e3 * st["host_overhead_s"] / st["steps"])
    assert 0 <= st["host_overhead_fraction"] <= 1


def test_enforce_eager_turns_compile_off(path):
    llm = LLM(path, dtype="float32", device="cpu", compile=True, enforce_eager=True)
    assert llm.engine.memory_ledger["compiled"] is False
    from batchrun.models import cpu_fused, llama
    assert llm.engine.runner.model.dense_fns.pre in (llama.pre_attention, cpu_fused.pre_attention)   # not compiled
