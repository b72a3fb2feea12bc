"""The measured choice of bf16 projection implementation (batchrun.models.kernel_choice): row-count buckets,
the decision rule on given times, the knob and env var (one-line errors), a real measured start on the
loaded model (cached per machine: a second start measures nothing and chooses the same), a choice that mixes
forms per bucket running the same greedy tokens as the plain reference, and `validate` showing the choice."""
from __future__ import annotations

import json

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.models import kernel_choice as kc
from batchrun.models.cpu_linear import ChosenWeight, forms_for, packing_supported
from batchrun.models.loader import ModelError

needs_forms = pytest.mark.skipif(not packing_supported(torch.bfloat16),
                                 reason="no bf16 form but plain runs here: nothing to choose")
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 60)), [3] * 20, [9] * 3)]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_each_row_count_takes_the_first_bucket_whose_bound_holds_it():
    for rows in range(1, 2000):
        want = next(i for i, b in enumerate(kc.BOUNDS) if b is None or rows <= b)   # the rule, naively
        assert kc.bucket_of(rows) == want
    assert len(kc.ROWS) == len(kc.BOUNDS) == len(kc.bucket_names())
    assert all(kc.bucket_of(r) == i for i, r in enumerate(kc.ROWS))    # each bucket is timed at its own rows


def test_one_form_within_tolerance_everywhere_is_used_alone():
    # own fastest in both buckets, onednn 3% behind in the first and 4% in the second: one copy suffices
    assert kc.decide(["own", "onednn"], [[1.0, 1.03], [1.0, 1.04]]) == ("own", "own")
    # onednn within 5% of the fastest in every bucket, own 5x slower in the second: onednn alone
    assert kc.decide(["own", "onednn", "plain"], [[1.0, 1.03, 2.0], [5.0, 1.0, 1.02]]) == ("onednn", "onednn")


def test_forms_far_apart_per_bucket_are_both_kept():
    assert kc.decide(["own", "onednn"], [[1.0, 2.0], [1.0, 2.0], [3.0, 1.0]]) == ("own", "own", "onednn")
    assert kc.decide(["own", "onednn", "plain"], [[1, 9, 9], [9, 1, 9], [9, 9, 1]]) == ("own", "onednn", "plain")


def test_every_bucket_is_within_tolerance_of_its_fastest():
    g = torch.Generator().manual_seed(0)
    forms = ["own", "onednn", "plain"]
    for _ in range(200):
        times = (torch.rand(6, 3, generator=g) + 0.5).tolist()
        per = kc.decide(forms, times)
        assert all(ts[forms.index(f)] <= kc.TOLERANCE * min(ts) for ts, f in zip(times, per))


def test_the_knob_wins_over_the_env_var_and_bad_names_are_refused(monkeypatch):
    monkeypatch.setenv(kc.GEMM_ENV, "plain")
    assert kc.resolve_mode("auto") == "plain"           # auto defers to the env var
    assert kc.resolve_mode("onednn") == "onednn"
    monkeypatch.setenv(kc.GEMM_ENV, "fast")
    with pytest.raises(ValueError, match=f"^{kc.GEMM_ENV} must be one of auto, own, onednn, plain, got 'fast'$"):
        kc.resolve_mode("auto")
    monkeypatch.delenv(kc.GEMM_ENV)
    assert kc.resolve_mode(None) == "auto"


def test_a_bad_env_value_is_a_one_line_model_error(hf_models, monkeypatch):
    monkeypatch.setenv(kc.GEMM_ENV, "amx")
    with pytest.raises(ModelError, match=f"{kc.GEMM_ENV} must be one of") as e:
        LLM(hf_models["llama"][0], dtype="bfloat16")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        LLM(hf_models["llama"][0], dtype="bfloat16", cpu_gemm="amx")


@needs_forms
def test_auto_measures_once_per_machine_and_caches_the_choice(hf_models, monkeypatch, tmp_path):
    monkeypatch.delenv(kc.GEMM_ENV, raising=False)
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path))
    path = hf_models["llama"][0]
    first = LLM(path, dtype="bfloat16", max_num_seqs=4).engine.memory_ledger["cpu_gemm"]
    assert first["mode"] == "auto" and first["cached"] is False
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    for shape, per_bucket in saved["choice"]:
        assert len(per_bucket) == len(kc.ROWS) and set(per_bucket) <= set(forms_for(tuple(shape)))
    for name, by_form in first["times_us"].items():   # every candidate timed in every bucket
        out, k = map(int, name.split("x"))
        assert sorted(by_form) == sorted(forms_for((out, k)))
        assert all(len(ts) == len(kc.ROWS) and all(t > 0 for t in ts) for ts in by_form.values())
    second = LLM(path, dtype="bfloat16", max_num_seqs=4).engine.memory_ledger["cpu_gemm"]
    assert second["cached"] is True and second["choice"] == first["choice"]
    files[0].write_text("{not json")                   # a torn cache file: measured again and rewritten
    third = LLM(path, dtype="bfloat16", max_num_seqs=4).engine.memory_ledger["cpu_gemm"]
    assert third["cached"] is False and json.loads(files[0].read_text())["choice"]


def _alternating(model, forms_by_shape, batch_hint):
    """Times that make each shape's forms win in turn, bucket by bucket, the own kernel apart where another
    form can run (oneDNN's sums are F.linear's, bit for bit; the own kernel's run in another order)."""
    out = {}
    for s, fs in forms_by_shape.items():
        exact = [i for i, f in enumerate(fs) if f != "own"] if len(fs) > 2 else list(range(len(fs)))
        out[s] = [[1.0 if i == exact[b % len(exact)] else 9.0 for i in range(len(fs))] for b in range(len(kc.ROWS))]
    return out


@needs_forms
@pytest.mark.parametrize("arch", ["llama", "qwen2"])      # qwen2: q/k/v bias and tied embeddings
def test_a_choice_mixing_forms_per_bucket_gives_the_plain_greedy_tokens(hf_models, monkeypatch, arch):
    path = hf_models[arch][0]
    monkeypatch.setenv(kc.GEMM_ENV, "plain")
    ref = LLM(path, dtype="bfloat16", max_num_seqs=4)
    assert ref.engine.memory_ledger["packed_linear"] is False
    want = [o.token_ids for o in ref.generate(PROMPTS, PARAMS, use_tqdm=False)]
    monkeypatch.delenv(kc.GEMM_ENV)
    monkeypatch.setenv(kc.CACHE_ENV, "0")
    monkeypatch.setattr(kc, "measure", _alternating)
    mixed = LLM(path, dtype="bfloat16", max_num_seqs=4)
    led = mixed.engine.memory_ledger
    assert led["packed_linear"] is True and led["packed_extra_bytes"] > 0
    assert led["decoder_layer_op"] is (arch == "llama" and led["fused_layer_ops"])  # qwen2's bias: per-op
    for m in mixed.engine.runner.model.modules():
        if isinstance(m, torch.nn.Linear):       # each weight holds both of its timed forms
            assert isinstance(m.weight, ChosenWeight) and len(m.weight.forms) == 2
    got = [o.token_ids for o in mixed.generate(PROMPTS, PARAMS, use_tqdm=False)]
    if "onednn" in forms_for((64, 64)):
        assert got == want                     # oneDNN and plain: the same sums, bit for bit
    else:                                      # own and plain: the first token of each prompt agrees
        assert [g[0] for g in got] == [w[0] for w in want]


@needs_forms
def test_validate_shows_the_choice_and_refuses_a_bad_knob(tmp_path, monkeypatch, hf_models):
    from hostile_util import fails, invoke, job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    path = hf_models["llama"][0]
    threads = torch.get_num_threads()
    jf = job(tmp_path, path, "in", model={"path": path, "dtype": "bfloat16"}, engine={"threads": threads})
    monkeypatch.delenv(kc.GEMM_ENV, raising=False)
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path / "cache"))
    r = invoke("validate", "--json", jf)
    assert r.code == 0, r
    assert json.loads(r.stdout)["memory_ledger"]["cpu_gemm"]["choice"] is None     # not measured here yet
    led = LLM(path, dtype="bfloat16", threads=threads).engine.memory_ledger["cpu_gemm"]
    r = invoke("validate", jf)
    assert r.code == 0, r
    for shape, forms in led["choice"].items():       # the cached choice, shape by shape
        assert any(line.split() == [shape, *forms.split()] for line in r.stdout.splitlines()), (shape, r.stdout)
    monkeypatch.setenv(kc.GEMM_ENV, "plain")
    assert "cpu_gemm plain: forced" in invoke("validate", jf).stdout
    bad = job(tmp_path, path, "in", name="bad.yaml", engine={"cpu_gemm": "amx"})
    fails(invoke("validate", bad), 2, "bad.yaml", "cpu_gemm", "amx")


def test_a_choice_measured_under_an_isa_cap_is_cached_apart(monkeypatch, tmp_path):
    """BATCHRUN_TEST_MAX_ISA (and torch's / oneDNN's caps) change which kernels run, so the cache file too."""
    monkeypatch.setenv("BATCHRUN_KERNEL_CACHE", str(tmp_path))
    for v in kc.ISA_CAP_ENVS:
        monkeypatch.delenv(v, raising=False)
    plain = kc.cache_file(kc.signature([(8, 8)], 2))
    files = {plain}
    for v, cap in zip(kc.ISA_CAP_ENVS, ("avx2", "avx2", "AVX2")):
        monkeypatch.setenv(v, cap)
        files.add(kc.cache_file(kc.signature([(8, 8)], 2)))
    assert len(files) == 4
    for v in kc.ISA_CAP_ENVS:
        monkeypatch.delenv(v)
    assert kc.cache_file(kc.signature([(8, 8)], 2)) == plain
