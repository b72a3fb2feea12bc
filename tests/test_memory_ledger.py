"""The memory ledger shows the real bytes: `batchrun validate` (from config.json and a GGUF header, no weight
read) predicts exactly what a loaded engine counts, its tensors' own bytes being the oracle, for quantized
weights (int8, int4, GGUF kept quantized, with and without the logits weight) and float8 KV caches."""
import pytest
import torch

import gguf_util as gu
from batchrun import LLM
from batchrun.models.loader import inspect_model
from batchrun.models.quant import weight_bytes_after
from test_job_common import tiny_model  # noqa: F401 - fixture


@pytest.fixture(autouse=True)
def unpacked(monkeypatch):
    """bf16 projections stay as loaded (no packed copy, which the ledger counts apart as packed_extra_bytes),
    so the model's own tensors are the oracle of weights_bytes."""
    from batchrun.models.kernel_choice import GEMM_ENV
    monkeypatch.setenv(GEMM_ENV, "plain")


def engine_bytes(path, dtype, **kw):
    """The engine's ledger, checked against its model's tensors (parameters plus quantized codes/scales)."""
    llm = LLM(path, dtype=dtype, max_num_seqs=2, max_model_len=64, **kw)
    runner = llm.engine.runner
    model = runner.model
    seen, real = set(), 0
    for t in list(model.parameters()) + [w for m in model.modules() for w in [getattr(m, "weight", None)]
                                         if hasattr(w, "tensors")] + \
            ([model.logits_weight] if hasattr(getattr(model, "logits_weight", None), "tensors") else []):
        for x in (t.tensors() if hasattr(t, "tensors") else [t]):
            if id(x) not in seen:
                seen.add(id(x))
                real += x.numel() * x.element_size()
    led = llm.engine.memory_ledger
    assert led["weights_bytes"] == real
    # a decode step reads every weight but the embedding table, unless the logits come from that table
    emb = model.embed_tokens.weight
    logits_from_table = model.tie_word_embeddings and not hasattr(getattr(model, "logits_weight", None), "tensors")
    assert led["decode_weights_bytes"] == real - (0 if logits_from_table else emb.numel() * emb.element_size())
    return led


CASES = [("llama", None, {}), ("llama", "int8", {}), ("llama", "int4", {"quantization_group_size": 32}),
         ("qwen2", "int8", {"quantize_lm_head": True}),            # tied: a quantized logits copy besides
         ("qwen3", "int4", {"quantization_group_size": 32, "quantize_lm_head": True})]


@pytest.mark.parametrize("arch,mode,kw", CASES, ids=[f"{a}-{m}-{len(k)}" for a, m, k in CASES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_predicted_weight_bytes_equal_the_loaded_engines(hf_models, arch, mode, kw, dtype):
    path = hf_models[arch][0]
    led = engine_bytes(path, dtype, quantization=mode, **kw)
    dt = getattr(torch, dtype)
    total, quant = weight_bytes_after(inspect_model(path), mode, kw.get("quantization_group_size", 128),
                                      kw.get("quantize_lm_head", False), dt)
    assert (total, quant) == (led["weights_bytes"], led["quantized_bytes"])
    if mode:
        assert total < inspect_model(path).memory_bytes(dt) or kw.get("quantize_lm_head")


@pytest.mark.parametrize("arch,kind,lm_head", [("llama", "Q4_1", False), ("llama", "Q8_0", True),
                                               ("qwen2", "Q4_0", True)])
def test_predicted_gguf_bytes_equal_the_loaded_engines(hf_models, tmp_path, arch, kind, lm_head):
    path = gu.model_gguf(hf_models[arch][1], arch, kind, str(tmp_path), hf_models[arch][0])
    led = engine_bytes(path, "float32", quantization="gguf", quantize_lm_head=lm_head)
    assert led["quantized_bytes"] > 0
    assert weight_bytes_after(inspect_model(path), "gguf", 128, lm_head, torch.float32) == \
        (led["weights_bytes"], led["quantized_bytes"])


@pytest.mark.parametrize("engine", [{"quantization": "int8"}, {"kv_cache_dtype": "fp8_e5m2"},
                                    {"quantization": "int4", "quantization_group_size": 32, "kv_cache_dtype": "fp8"}])
def test_validate_report_shows_what_the_engine_holds(tmp_path, tiny_model, engine):  # noqa: F811
    from batchrun.job.plan import make_plan
    from batchrun.job.validate_report import format_report, plan_report
    from batchrun.job.spec import load_job
    from hostile_util import job
    from test_job_common import write_prompt_files
    write_prompt_files(str(tmp_path / "in"), 4, files=1)
    plan = make_plan(load_job(job(tmp_path, tiny_model, "in", engine=engine)))
    report = plan_report(plan)
    m = report["memory_ledger"]
    led = engine_bytes(tiny_model, "float32", **engine)
    assert (m["weights_memory_bytes"], m["quantized_bytes"]) == (led["weights_bytes"], led["quantized_bytes"])
    assert (m["kv_bytes_per_token"], m["kv_cache_dtype"]) == (led["kv_bytes_per_token"], led["kv_cache_dtype"])
    text = format_report(report)
    assert f"KV {led['kv_bytes_per_token']} B/token ({led['kv_cache_dtype']})" in text
    if "quantization" in engine:
        assert f"({engine['quantization']}: " in text
