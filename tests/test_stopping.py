"""Stop conditions: stop strings, stop_token_ids, EOS (and ignore_eos), max_tokens."""
import json
import shutil

import pytest

from batchrun import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_models):
    return LLM(hf_models["llama"][0], dtype="float32")


PROMPT = "the quick brown fox jumps over the lazy dog"


def greedy(max_tokens=40, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate([PROMPT], greedy(max_tokens=7), use_tqdm=False)[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.tokenizer.encode(PROMPT)


def test_stop_string_truncates_text_and_tokens(llm):
    full = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
    text = full.text
    assert len(text) > 20
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    out = llm.generate([PROMPT], greedy(stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    kept = llm.generate([PROMPT], greedy(stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == text[:cut + len(stop)]


def test_stop_token_ids_end_at_first_occurrence(llm):
    full = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
    t = full.token_ids[9]
    first = full.token_ids.index(t)
    out = llm.generate([PROMPT], greedy(stop_token_ids=[t]), use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:first + 1]


def test_eos_from_generation_config_stops_unless_ignored(hf_models, tmp_path, llm):
    full = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]
    eos = full.token_ids[5]
    model = tmp_path / "model"
    shutil.copytree(hf_models["llama"][0], model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm2 = LLM(str(model), dtype="float32")
    assert eos in llm2.tokenizer.eos_token_ids
    stopped = llm2.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    ignored = llm2.generate([PROMPT], greedy(), use_tqdm=False)[0]
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"
