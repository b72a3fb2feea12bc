"""How the own kernel's few-row products load the weights (batchrun.models.weight_loads): the decision rule on
given times, the env var (a one-line error naming it), a real measured start on the loaded model (cached per
machine: a second start measures nothing and sets the same mode), a forced mode, the greedy tokens unchanged
by either mode, and `validate` showing it."""
from __future__ import annotations

import json

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu_gemm
from batchrun.models import weight_loads as wl
from batchrun.models.loader import ModelError

pytestmark = pytest.mark.skipif(not cpu_gemm.supported(), reason="the own kernel does not run here")
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20)]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _restore_mode(monkeypatch):
    monkeypatch.delenv(wl.ENV, raising=False)
    monkeypatch.setenv("BATCHRUN_CPU_GEMM", "own")     # the own kernel holds every weight: something to time
    old = cpu_gemm.weight_loads()
    yield
    cpu_gemm.set_weight_loads(old)


def test_nontemporal_only_where_it_is_clearly_faster():
    assert wl.decide({"ratio": 0.97}) == "nontemporal"
    assert wl.decide({"ratio": wl.MARGIN}) == "nontemporal"
    assert wl.decide({"ratio": 0.99}) == "cached"        # within noise: the CPU's default
    assert wl.decide({"ratio": 1.5}) == "cached"


def test_the_measured_ratio_is_the_median_of_adjacent_pairs(monkeypatch):
    """On a clock where a step with non-temporal loads takes 0.9 of an ordinary one, but one of them 5x (a
    neighbour's burst), the ratio is 0.9; the process's mode is restored after."""
    clock, steps = [0.0], {"cached": 0, "nontemporal": 0}

    def step():                 # stands in for a decode step: advances the clock by the mode's cost
        mode = cpu_gemm.weight_loads()
        steps[mode] += 1
        clock[0] += 5e-3 if mode == "nontemporal" and steps[mode] == 4 else {"cached": 1e-3, "nontemporal": 9e-4}[mode]
    monkeypatch.setattr(wl.time, "perf_counter", lambda: clock[0])
    cpu_gemm.set_weight_loads("nontemporal")
    m = wl.measure(step)
    assert m["reps"] == wl.REPS and steps == {"cached": wl.REPS + 1, "nontemporal": wl.REPS + 1}
    assert m["ratio"] == pytest.approx(0.9) and m["cached"] == pytest.approx(1e-3)
    assert m["nontemporal"] == pytest.approx(9e-4) and wl.decide(m) == "nontemporal"
    assert cpu_gemm.weight_loads() == "nontemporal"


def test_long_steps_take_fewer_reps():
    assert wl.reps_for(1e-3) == wl.REPS
    assert wl.reps_for(wl.BUDGET_S / 8) == 4
    assert wl.reps_for(10.0) == wl.MIN_REPS


def test_a_bad_env_value_is_a_one_line_model_error(hf_models, monkeypatch):
    monkeypatch.setenv(wl.ENV, "streaming")
    with pytest.raises(ValueError, match=f"^{wl.ENV} must be one of auto, cached, nontemporal, got 'streaming'$"):
        wl.resolve_mode()
    with pytest.raises(ModelError, match=f"{wl.ENV} must be one of") as e:
        LLM(hf_models["llama"][0], dtype="bfloat16")
    assert "\n" not in str(e.value)


def test_auto_measures_once_per_machine_and_sets_the_mode(hf_models, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHRUN_KERNEL_CACHE", str(tmp_path))
    path = hf_models["llama"][0]
    first = LLM(path, dtype="bfloat16", max_num_seqs=2).engine.memory_ledger["cpu_gemm"]["weight_loads"]
    assert first["mode"] == "auto" and first["cached"] is False and first["measure_s"] > 0
    assert sorted(first["times_us"]) == ["cached", "nontemporal"] and all(t > 0 for t in first["times_us"].values())
    assert first["choice"] == wl.decide(first) == cpu_gemm.weight_loads() and first["ratio"] > 0
    files = list((tmp_path / "weight_loads").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choice"] == first["choice"]
    cpu_gemm.set_weight_loads("cached" if first["choice"] == "nontemporal" else "nontemporal")
    second = LLM(path, dtype="bfloat16", max_num_seqs=2).engine.memory_ledger["cpu_gemm"]["weight_loads"]
    assert second["cached"] is True and second["choice"] == first["choice"] == cpu_gemm.weight_loads()
    files[0].write_text("{not json")                   # a torn cache file: measured again and rewritten
    third = LLM(path, dtype="bfloat16", max_num_seqs=2).engine.memory_ledger["cpu_gemm"]["weight_loads"]
    assert third["cached"] is False and json.loads(files[0].read_text())["choice"] == third["choice"]


def test_the_probe_step_is_a_greedy_decode_step_of_the_engine(hf_models, monkeypatch):
    """What the choice times: one decode step through the runner (inputs, forward, logits, argmax) on the
    first blocks of the KV cache, leaving the runner's counters and a job's first step as they were."""
    from batchrun.engine.probe_step import CONTEXT, decode_step
    llm = LLM(hf_models["llama"][0], dtype="bfloat16", max_num_seqs=2)
    runner = llm.engine.runner
    assert wl.runs_own_at_one_row(runner.model)
    seen = []
    real = runner.execute
    monkeypatch.setattr(runner, "execute", lambda out: seen.append(out) or real(out))
    before = runner.forward_s
    decode_step(runner)()
    (out,) = seen
    (e,) = out.scheduled
    assert e.num_new_tokens == 1 and e.samples and e.seq.num_computed_tokens == CONTEXT
    assert e.seq.block_table == list(range(-(-(CONTEXT + 1) // runner.block_size)))
    assert runner.forward_s == before
    monkeypatch.setattr(runner, "execute", real)
    want = LLM(hf_models["llama"][0], dtype="bfloat16", max_num_seqs=2).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == [o.token_ids for o in want]


@pytest.mark.parametrize("mode", ["cached", "nontemporal"])
def test_a_forced_mode_is_set_and_changes_no_token(hf_models, monkeypatch, mode):
    path = hf_models["llama"][0]
    monkeypatch.setenv(wl.ENV, "cached" if mode == "nontemporal" else "nontemporal")
    other = LLM(path, dtype="bfloat16", max_num_seqs=2)
    want = [o.token_ids for o in other.generate(PROMPTS, PARAMS, use_tqdm=False)]
    monkeypatch.setenv(wl.ENV, mode)
    llm = LLM(path, dtype="bfloat16", max_num_seqs=2)
    rep = llm.engine.memory_ledger["cpu_gemm"]["weight_loads"]
    assert rep["mode"] == rep["choice"] == mode == cpu_gemm.weight_loads() and rep["times_us"] is None is rep["ratio"]
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == want


def test_validate_shows_the_weight_loads(tmp_path, monkeypatch, hf_models):
    from hostile_util import invoke, job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    path = hf_models["llama"][0]
    threads = torch.get_num_threads()
    jf = job(tmp_path, path, "in", model={"path": path, "dtype": "bfloat16"}, engine={"threads": threads})
    monkeypatch.setenv("BATCHRUN_KERNEL_CACHE", str(tmp_path / "cache"))
    r = invoke("validate", "--json", jf)
    assert r.code == 0, r
    assert json.loads(r.stdout)["memory_ledger"]["cpu_gemm"]["weight_loads"] == "measured at engine start"
    chosen = LLM(path, dtype="bfloat16", threads=threads).engine.memory_ledger["cpu_gemm"]["weight_loads"]
    r = invoke("validate", jf)
    assert r.code == 0 and f"weight loads at few rows {chosen['choice']} (cached)" in r.stdout, r
    monkeypatch.setenv(wl.ENV, "nontemporal")
    r = invoke("validate", "--json", jf)
    assert json.loads(r.stdout)["memory_ledger"]["cpu_gemm"]["weight_loads"] == "nontemporal (forced)"
