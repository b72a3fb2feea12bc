"""Penalties and biases against oracles: greedy with repetition_penalty, logit_bias, min_tokens and bad_words
token-identical to HF generate with the same logits processors (float32, vLLM's order); presence and
frequency penalties (HF has none) against a naive per-row reference loop over HF's own logits."""
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                    NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from batchrun import LLM, SamplingParams
from batchrun.engine.logits_processors import bad_words_token_ids
from conftest import hf_greedy, mixed_prompts

EOS = 2
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def setup(hf_models):
    path, hf = hf_models["llama"]
    llm = LLM(path, dtype="float32", max_num_seqs=8, block_size=8)
    prompts = [p for p in mixed_prompts(8, 60, seed=3) if len(p) > 2][:5]
    return llm, hf, prompts


def hf_generate(hf, prompt, procs, max_tokens=MAX_TOKENS, eos=None):
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                        logits_processor=LogitsProcessorList(procs), eos_token_id=eos, pad_token_id=0)
    return g[0, len(prompt):].tolist()


def ours(llm, prompts, **kw):
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **kw}
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw), use_tqdm=False)
    return [o.token_ids for o in outs]


def test_repetition_penalty_and_logit_bias_match_hf(setup):
    llm, hf, prompts = setup
    plain = hf_greedy(hf, prompts, MAX_TOKENS)
    bias = {plain[0][1]: -5.0, 77: 3.0, 300: 1.5}
    got = ours(llm, prompts, repetition_penalty=1.8, logit_bias=bias)
    for p, g, base in zip(prompts, got, plain):
        want = hf_generate(hf, p, [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
                                   RepetitionPenaltyLogitsProcessor(1.8)])
        assert g == want
    assert got != plain       # the processors changed something
    # a penalty below 1 rewards repeats: still HF's
    got = ours(llm, prompts[:2], repetition_penalty=0.6)
    for p, g in zip(prompts, got):
        assert g == hf_generate(hf, p, [RepetitionPenaltyLogitsProcessor(0.6)])


def test_min_tokens_and_bad_words_match_hf(setup):
    llm, hf, prompts = setup
    # EOS biased to the top: without min_tokens every row would stop at once
    got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, min_tokens=5, logit_bias={EOS: 100}),
                       use_tqdm=False)
    for p, o in zip(prompts, got):
        want = hf_generate(hf, p, [MinNewTokensLengthLogitsProcessor(len(p), 5, EOS),
                                   SequenceBiasLogitsProcessor([[[EOS], 100.0]])], eos=EOS)
        assert o.token_ids == want and len(want) == 6 and o.finish_reason == "stop"
    tok = llm.tokenizer
    plain = hf_greedy(hf, prompts, MAX_TOKENS)
    # words greedy would produce: a one-token one and a two-token one, each tokenizing back to those ids
    words = [_word(tok, plain, 1), _word(tok, plain, 2)]
    ids = bad_words_token_ids(words, tok)
    got = ours(llm, prompts, bad_words=words)
    for p, g in zip(prompts, got):
        assert g == hf_generate(hf, p, [NoBadWordsLogitsProcessor(ids)])
    assert got != plain


def _word(tok, outputs, k):
    for out in outputs:
        for j in range(2, len(out) - k):
            w = tok.decode(out[j:j + k])
            if w.strip() and out[j:j + k] in bad_words_token_ids([w], tok):
                return w
    raise AssertionError(f"no {k}-token word in the greedy outputs tokenizes back to its ids")


def naive_penalised_greedy(hf, prompt, presence, frequency, max_tokens=MAX_TOKENS):
    """One token at a time over HF's logits, the penalties applied token by token in Python."""
    ids = list(prompt)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float().clone()
        out = ids[len(prompt):]
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_presence_and_frequency_penalties_match_a_naive_reference(setup):
    llm, hf, prompts = setup
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)):
        got = ours(llm, prompts[:3], presence_penalty=presence, frequency_penalty=frequency)
        for p, g in zip(prompts, got):
            assert g == naive_penalised_greedy(hf, p, presence, frequency), (presence, frequency)


def test_penalised_rows_beside_plain_rows_and_speculation(hf_models):
    """Processed rows share a batch with plain greedy ones (which keep the fast path) and with n-gram
    speculation on (processed rows do not speculate): each row gets what it gets alone."""
    path, hf = hf_models["llama"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = LLM(path, dtype="float32", max_num_seqs=8, speculative_config=spec)
    prompts = mixed_prompts(6, 50, seed=5)
    base = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(**base, frequency_penalty=1.0) if i % 2 else SamplingParams(**base)
              for i in range(len(prompts))]
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, o in zip(prompts, params, mixed):
        if sp.frequency_penalty:
            assert o.token_ids == naive_penalised_greedy(hf, p, 0.0, 1.0, 16)
        else:
            assert o.token_ids == hf_greedy(hf, [p], 16)[0]


@pytest.mark.parametrize("kw, msg", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens=20 must be <= max_tokens=10"),
    ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias: key 'x' is not a token id"),
    ({"bad_words": [""]}, "bad_words must be a list of non-empty strings"),
])
def test_bad_settings_are_one_line_errors(kw, msg):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_out_of_vocabulary_bias_is_an_error_row(setup):
    llm, _, prompts = setup
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * 2,
                        [SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}), SamplingParams(max_tokens=4)],
                        use_tqdm=False)
    assert outs[0].finish_reason == "error" and "logit_bias: token id 1000000 is outside" in outs[0].error
    assert outs[1].finish_reason == "length"


def test_real_smollm2_bad_words_and_penalties_match_hf(smollm2_hf_tokenizer):
    """The real model: "Paris" banned from the answer to the capital of France, a repetition penalty and
    min_tokens, token-identical to transformers on the same GGUF with the same processors; logprobs of the
    raw distribution within 1e-4 of its logits."""
    import os
    import warnings

    import transformers as tf

    from batchrun.models.smollm2 import smollm2_gguf
    from batchrun.tokenizer import load_tokenizer
    from conftest import gguf_parsed_once
    path = smollm2_gguf()
    folder, name = os.path.split(path)
    with warnings.catch_warnings(), gguf_parsed_once(path):
        warnings.simplefilter("ignore")
        hf = tf.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    llm = LLM(path, dtype="float32", tokenizer=tok, max_num_seqs=4, max_model_len=256)
    hf_tok = smollm2_hf_tokenizer
    prompts = [list(hf_tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"])
               for q in ("What is the capital of France?", "List three colours.")]
    eos = sorted(tok.eos_token_ids)
    sp = SamplingParams(max_tokens=16, temperature=0.0, bad_words=["Paris"], repetition_penalty=1.3, min_tokens=4,
                        logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ids = bad_words_token_ids(["Paris"], tok)
    for p, o in zip(prompts, outs):
        want = hf_generate(hf, p, [NoBadWordsLogitsProcessor(ids), MinNewTokensLengthLogitsProcessor(len(p), 4, eos),
                                   RepetitionPenaltyLogitsProcessor(1.3)], max_tokens=16, eos=eos)
        assert o.token_ids == want, (tok.decode(o.token_ids), tok.decode(want))
        assert "Paris" not in o.text
        with torch.no_grad():
            raw = hf(torch.tensor([p + o.token_ids[:-1]])).logits[0, len(p) - 1:].float().log_softmax(-1)
        for j, (t, d) in enumerate(zip(o.token_ids, o.outputs[0].logprobs)):
            assert abs(d[t].logprob - raw[j, t].item()) < 1e-4
            top = sorted(d, key=lambda x: d[x].rank)[:3]
            assert top == raw[j].topk(3).indices.tolist()
    plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=16, temperature=0.0),
                         use_tqdm=False)[0]
    assert "Paris" in plain.text          # the ban changed a real answer
