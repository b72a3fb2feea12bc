"""The calibration pass (batchrun.models.calibration): its statistics against HF transformers' float32
activations (forward hooks, the KV cache), its cache, its rows and its one-line errors, and the fp8 KV scales
it sets."""
import json

import pytest
import torch

from batchrun.models.calibration import (calibrate, collect_stats, pick_rows, read_prompts, resolve_rows)
from batchrun.models.loader import ModelError, inspect_model

ROWS = [list(range(5, 70)), list(range(200, 230)), [7, 9, 11] * 10]


def _llm(path, **kw):
    from batchrun import LLM
    return LLM(path, dtype="float32", max_num_seqs=4, **kw)


def _hf_stats(hf, rows):
    """Per-input-channel absmax of q_proj's and down_proj's inputs, and |K| (post-RoPE), |V| per layer."""
    seen = {}

    def hook(name):
        def f(mod, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
            seen[name] = a if name not in seen else torch.maximum(seen[name], a)
        return f
    hs = [m.register_forward_pre_hook(hook(n)) for n, m in hf.named_modules() if n.endswith(("q_proj", "down_proj"))]
    k = [0.0] * hf.config.num_hidden_layers
    v = list(k)
    try:
        for r in rows:
            with torch.no_grad():
                cache = hf(torch.tensor([r]), use_cache=True).past_key_values
            for i in range(len(k)):
                lk, lv = cache.layers[i].keys, cache.layers[i].values
                k[i], v[i] = max(k[i], lk.abs().max().item()), max(v[i], lv.abs().max().item())
    finally:
        for h in hs:
            h.remove()
    return seen, k, v


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_stats_match_hf_activations(hf_models, arch):
    path, hf = hf_models[arch]
    stats = collect_stats(_llm(path).engine.runner.model, ROWS)
    seen, k, v = _hf_stats(hf, ROWS)
    for i in range(hf.config.num_hidden_layers):
        torch.testing.assert_close(stats["act_absmax"][f"layers.{i}.self_attn.qkv_proj"],
                                   seen[f"model.layers.{i}.self_attn.q_proj"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats["act_absmax"][f"layers.{i}.mlp.down_proj"],
                                   seen[f"model.layers.{i}.mlp.down_proj"], rtol=1e-4, atol=1e-5)
    assert stats["k_absmax"] == pytest.approx(k, rel=1e-4) and stats["v_absmax"] == pytest.approx(v, rel=1e-4)
    assert stats["rows"] == 3 and stats["tokens"] == sum(map(len, ROWS))


def test_cache_hit_reads_the_file(hf_models, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", str(tmp_path))
    path = hf_models["llama"][0]
    model, info = _llm(path).engine.runner.model, inspect_model(path)
    first = calibrate(model, info, ROWS)
    assert first["cached"] is False and len(list(tmp_path.iterdir())) == 1

    def boom(*a, **k):
        raise AssertionError("the pass ran again")
    monkeypatch.setattr("batchrun.models.calibration.collect_stats", boom)
    second = calibrate(model, info, ROWS)
    assert second["cached"] is True and second["cache_path"] == first["cache_path"]
    assert second["k_absmax"] == first["k_absmax"]
    assert all(torch.equal(second["act_absmax"][n], a) for n, a in first["act_absmax"].items())
    with pytest.raises(AssertionError, match="ran again"):     # other rows: another key
        calibrate(model, info, ROWS[:2])


def test_rows_from_files_and_counts(tmp_path):
    enc = lambda s: [len(w) for w in s.split()]       # noqa: E731 - a stand-in tokenizer
    (tmp_path / "a.jsonl").write_text('{"prompt": "a bb"}\n{"text": "ccc"}\n"dd d"\n{"other": 1}\n')
    (tmp_path / "a.txt").write_text("one two\n\n three \n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": [1, 2], "prompt": ["x y z", None]}), tmp_path / "a.parquet")
    assert read_prompts(str(tmp_path / "a.jsonl")) == ["a bb", "ccc", "dd d"]
    assert read_prompts(str(tmp_path / "a.txt")) == ["one two", "three"]
    assert resolve_rows(str(tmp_path / "a.parquet"), enc) == [[1, 1, 1]]
    job = [[1] * n for n in (3, 50, 2, 40, 1, 5)]
    assert resolve_rows(4, enc, job) == [[1] * 3, [1] * 50, [1] * 2, [1] * 40]      # the two longest, in order
    assert pick_rows([[], [1]], 5) == [[1]]
    assert len(resolve_rows(None, enc, [[1]] * 300)) == 256


@pytest.mark.parametrize("content,name,match", [
    (None, "missing.jsonl", "no such file"), ("\n\n", "empty.txt", "no usable rows"),
    ('{"other": 1}\n', "none.jsonl", "no usable rows"), ("{bad\n", "bad.jsonl", "a line is not JSON")])
def test_bad_calibration_files_are_one_line_errors(tmp_path, content, name, match):
    f = tmp_path / name
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match=f"^quantization_calibration: .*{match}") as e:
        resolve_rows(str(f), str.split)
    assert "\n" not in str(e.value)


def test_engine_refuses_a_missing_file_at_start(hf_models, tmp_path):
    with pytest.raises(ModelError, match="^quantization_calibration: no such file"):
        _llm(hf_models["llama"][0], quantization="w8a8", quantization_calibration=str(tmp_path / "nope.txt"))


def test_fp8_kv_scales_from_calibration(hf_models, tmp_path, monkeypatch):
    """Calibrated k_scale = max|K| / 448: positive, and the calibration rows' K fill e4m3's range (their
    max |K| / k_scale is 448, where uncalibrated (1.0) it was max |K| itself); uncalibrated stays 1.0."""
    monkeypatch.setenv("BATCHRUN_CALIBRATION_CACHE", str(tmp_path))
    path, hf = hf_models["llama"]
    f = tmp_path / "rows.jsonl"
    from batchrun.tokenizer import load_tokenizer
    tok = load_tokenizer(path)
    texts = ["the quick brown fox jumps over the lazy dog " * 4, "a b c d e f g"]
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    llm = _llm(path, kv_cache_dtype="fp8_e4m3", quantization_calibration=str(f))
    _, k, v = _hf_stats(hf, [tok.encode(t) for t in texts])
    layers = llm.engine.runner.model.layers
    for a, ka, va in zip((layer.self_attn for layer in layers), k, v):
        assert a.k_scale > 0 and a.v_scale > 0
        assert ka / a.k_scale == pytest.approx(448, rel=1e-4) and va / a.v_scale == pytest.approx(448, rel=1e-4)
        assert ka < 448                             # at scale 1.0 the cache would use a sliver of the range
    assert llm.engine.memory_ledger["calibration"]["kv_scales"][0] == [round(layers[0].self_attn.k_scale, 6),
                                                                      round(layers[0].self_attn.v_scale, 6)]
    plain = _llm(path, kv_cache_dtype="fp8_e4m3")
    assert plain.engine.runner.model.layers[0].self_attn.k_scale == 1.0
    assert plain.engine.memory_ledger["calibration"] is None


def test_job_rows_are_the_first_prompts(tmp_path, job_model):
    """A job's quantization_calibration N: the first 4 N rendered prompts (the template filled, tokenized as
    the pipeline does); a file path or no calibration: none from the job."""
    from jobutil import prompt_rows, write_job, write_parquet_files
    from batchrun.job.calibration_rows import job_calibration_rows
    from batchrun.job.plan import make_plan
    from batchrun.job.spec import load_job
    rows = prompt_rows(50)
    write_parquet_files(str(tmp_path / "in"), rows, files=2)
    job = write_job(str(tmp_path / "job.yaml"), job_model, str(tmp_path / "in"), str(tmp_path / "out"),
                    engine__quantization="w8a8", engine__quantization_calibration=3)
    plan = make_plan(load_job(job))
    got = job_calibration_rows(plan)
    assert got == [plan.tokenizer.encode(f"Q: {r['text']}") for r in rows[:12]]
    plain = write_job(str(tmp_path / "plain.yaml"), job_model, str(tmp_path / "in"), str(tmp_path / "out2"))
    assert job_calibration_rows(make_plan(load_job(plain))) is None


def test_job_refuses_a_missing_calibration_file_at_plan(tmp_path, job_model):
    from jobutil import prompt_rows, write_job, write_parquet_files
    from batchrun.job.plan import make_plan
    from batchrun.job.spec import JobError, load_job
    write_parquet_files(str(tmp_path / "in"), prompt_rows(5), files=1)
    job = write_job(str(tmp_path / "job.yaml"), job_model, str(tmp_path / "in"), str(tmp_path / "out"),
                    engine__quantization="w8a8", engine__quantization_calibration=str(tmp_path / "no.jsonl"))
    with pytest.raises(JobError, match=r"^engine\.quantization_calibration: no such file"):
        make_plan(load_job(job))
