"""The measured limits of CPU weight-only products (batchrun.models.quant_kernel_choice): the decision rule on
given times, a real measured start on an int8 and an int4 model (every weight takes the measured limits, a
second start reads them from the cache), and the greedy tokens of the extreme choices equal to the
dequantise-then-F.linear reference in float32 (whichever side of the limit a product falls on)."""
from __future__ import annotations

import pytest

from batchrun import LLM, SamplingParams
from batchrun.models import kernel_choice as kc, quant_kernel_choice as qc
from batchrun.models.quant_weights import QUANT_KERNELS_ENV, Int4Weight, Int8Weight

PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8], list(range(10, 150)), [3] * 40, [9] * 3)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _int8(kernel_wins_up_to: int) -> dict:
    return {r: {"kernel": 1.0 if r <= kernel_wins_up_to else 3.0, "dense": 2.0} for r in qc.ROWS}


def test_the_int8_kernel_runs_up_to_the_last_count_where_it_won_at_every_count():
    for up_to in (0, 1, 16, 128):
        assert qc.decide({"int8": _int8(up_to), "int4": {}})["int8_kernel_rows"] == up_to
    times = _int8(128)
    times[8] = {"kernel": 3.0, "dense": 2.0}           # lost at 8: not past it, whatever it does after
    assert qc.decide({"int8": times, "int4": {}})["int8_kernel_rows"] == 4
    assert qc.decide({"int8": {}, "int4": {4: 3.0, 8: 1.0, 16: 2.0}}) == {"int8_kernel_rows": qc.INT8_KERNEL_ROWS,
                                                                           "int4_chunk_rows": 8}


def _weights(llm):
    return qc._weights(llm.engine.runner.model)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_start_measures_sets_every_weight_and_caches(hf_models, monkeypatch, tmp_path, mode):
    monkeypatch.setenv(kc.CACHE_ENV, str(tmp_path))
    kw = dict(dtype="bfloat16", quantization=mode, quantization_group_size=64, max_num_seqs=4)
    llm = LLM(hf_models["llama"][0], **kw)
    rep = llm.engine.memory_ledger["quant_kernel_choice"]
    assert rep["cached"] is False and rep["measure_s"] > 0
    ws = _weights(llm)
    assert ws and all(isinstance(w, Int8Weight if mode == "int8" else Int4Weight) for w in ws)
    if mode == "int8":
        assert rep["int8_kernel_rows"] in (0,) + qc.ROWS and rep["times_us"]["int8"]
        assert all(w.kernel_rows == rep["int8_kernel_rows"] for w in ws)
    else:
        assert rep["int4_chunk_rows"] in qc.INT4_CHUNKS and sorted(map(int, rep["times_us"]["int4"])) == \
            list(qc.INT4_CHUNKS)
        assert all(w.chunk_rows == rep["int4_chunk_rows"] for w in ws)
    again = LLM(hf_models["llama"][0], **kw)
    rep2 = again.engine.memory_ledger["quant_kernel_choice"]
    assert rep2["cached"] is True and {k: rep2[k] for k in ("int8_kernel_rows", "int4_chunk_rows")} == \
        {k: rep[k] for k in ("int8_kernel_rows", "int4_chunk_rows")}


@pytest.mark.parametrize("mode,choice", [("int8", {"int8_kernel_rows": 0, "int4_chunk_rows": 16}),
                                         ("int8", {"int8_kernel_rows": 128, "int4_chunk_rows": 16}),
                                         ("int4", {"int8_kernel_rows": 32, "int4_chunk_rows": 4}),
                                         ("int4", {"int8_kernel_rows": 32, "int4_chunk_rows": 64})])
def test_extreme_choices_give_the_reference_greedy_tokens(hf_models, monkeypatch, mode, choice):
    path = hf_models["llama"][0]
    kw = dict(dtype="float32", quantization=mode, quantization_group_size=64, max_num_seqs=4)
    monkeypatch.setenv(QUANT_KERNELS_ENV, "0")
    want = [o.token_ids for o in LLM(path, **kw).generate(PROMPTS, PARAMS, use_tqdm=False)]
    monkeypatch.delenv(QUANT_KERNELS_ENV)
    monkeypatch.setenv(kc.CACHE_ENV, "0")
    monkeypatch.setattr(qc, "measure", lambda *a: {"int8": {}, "int4": {}})
    monkeypatch.setattr(qc, "decide", lambda times: dict(choice))
    llm = LLM(path, **kw)
    assert all(getattr(w, "kernel_rows" if mode == "int8" else "chunk_rows") ==
               choice["int8_kernel_rows" if mode == "int8" else "int4_chunk_rows"] for w in _weights(llm))
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == want
