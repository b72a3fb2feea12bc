"""LLM.generate / LLM.chat input forms, output order and counters."""
import pytest

from batchrun import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_models):
    return LLM(hf_models["qwen2"][0], dtype="float32", max_num_seqs=4)


def test_prompt_forms_agree_and_outputs_keep_input_order(llm):
    texts = ["hello world", "a much longer prompt about the weather today and tomorrow", "x"]
    ids = llm.tokenizer.encode_batch(texts)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    by_text = llm.generate(texts, p, use_tqdm=False)
    by_ids = llm.generate(ids, p, use_tqdm=False)
    by_dict = llm.generate([{"prompt_token_ids": x} for x in ids], p, use_tqdm=False)
    assert [o.token_ids for o in by_text] == [o.token_ids for o in by_ids] == [o.token_ids for o in by_dict]
    assert [o.prompt for o in by_text] == texts
    assert [o.prompt_token_ids for o in by_text] == ids
    for o, x in zip(by_text, ids):      # each output is its own prompt's: compare to a solo run
        assert llm.generate([x], p, use_tqdm=False)[0].token_ids == o.token_ids
    one = llm.generate("hello world", p, use_tqdm=False)
    assert len(one) == 1 and one[0].token_ids == by_text[0].token_ids


def test_per_prompt_params_and_metrics(llm):
    outs = llm.generate(["a b c", "d e f"], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                           SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)],
                        use_tqdm=True)
    assert [len(o.token_ids) for o in outs] == [3, 9]
    m = outs[1].metrics
    assert m.prompt_tokens == len(outs[1].prompt_token_ids) and m.output_tokens == 9
    assert 0 <= m.queued_s <= m.first_token_s <= m.total_s
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()])


def test_chat_renders_template_and_generates(llm):
    conv = [{"role": "user", "content": "hi there"}]
    out = llm.chat([conv], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    rendered = llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    same = llm.generate([{"prompt_token_ids": out.prompt_token_ids}],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert same.token_ids == out.token_ids


def test_stats_counters(llm):
    before = llm.stats
    llm.generate(["one two three"] * 6, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    after = llm.stats
    assert after["output_tokens"] - before["output_tokens"] == 24
    assert after["steps"] > before["steps"] and after["tokens_per_step"] > 0
    assert after["peak_blocks_used"] >= 4 and after["blocks_used"] == 0
    assert set(after) >= {"steps", "tokens_per_step", "preemptions", "peak_blocks_used", "num_blocks"}
