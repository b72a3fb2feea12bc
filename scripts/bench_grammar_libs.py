"""Compare the grammar libraries on the real SmolLM2 tokenizer (49,152 tokens): xgrammar, llguidance,
outlines-core. For each: vocabulary setup time, compile time of three specs (a flat object schema, a
nested schema with an enum and an array, a choice list), the mean time to fill the token bitmask of 64
rows per step (the first step apart: llguidance builds lazily) along a valid answer's tokens, and
correctness (every token of the valid answer allowed at its step, EOS allowed at the end, a wrong first
token refused).

    python scripts/bench_grammar_libs.py            # prints one line per library and spec
"""
from __future__ import annotations

import json
import time

import torch

from batchrun.gguf_tokenizer import _byte_alphabet
from batchrun.models.smollm2 import smollm2_gguf
from batchrun.tokenizer import load_tokenizer

FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string"}, "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "author": {"type": "object", "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
               "required": ["name", "year"], "additionalProperties": False}},
    "required": ["title", "sentiment", "tags", "author"], "additionalProperties": False}
CHOICE = ["positive", "negative", "neutral"]
ANSWERS = {"flat": {"name": "Ada Lovelace", "age": 36, "city": "London"},
           "nested": {"title": "Notes", "sentiment": "positive", "tags": ["math", "engines"],
                      "author": {"name": "Ada", "year": 1843}},
           "choice": "negative"}
SPECS = {"flat": ("json", FLAT), "nested": ("json", NESTED), "choice": ("regex", "(positive|negative|neutral)")}
B = 64


def answer_text(name: str) -> str:
    a = ANSWERS[name]
    return a if isinstance(a, str) else json.dumps(a, separators=(",", ":"))


class XGrammar:
    def __init__(self, tok, V):
        import xgrammar as xgr
        self.xgr = xgr
        t0 = time.perf_counter()
        vocab = [""] * V
        for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
            vocab[i] = s
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.backend.to_str())
        info = xgr.TokenizerInfo(vocab, vocab_type=meta["vocab_type"], vocab_size=V,
                                 stop_token_ids=[tok.eos_token_id], add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, kind, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                                      separators=(",", ":"))
        return self.compiler.compile_regex(spec)

    def matchers(self, g, n):
        return [self.xgr.GrammarMatcher(g) for _ in range(n)]

    def fill(self, ms, bitmask):
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def advance(self, m, t):
        return m.accept_token(t)


class LLGuidance:
    def __init__(self, tok, V):
        import llguidance as llg
        self.llg = llg
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tok.backend.to_str(), n_vocab=V, eos_token=tok.eos_token_id)   # general slices
        self.setup_s = time.perf_counter() - t0
        self.executor = llg.LLExecutor(2)

    def compile(self, kind, spec):
        M = self.llg.LLMatcher
        g = M.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}) if kind == "json" \
            else M.grammar_from_regex(spec)
        m = M(self.tok, g)          # llguidance compiles lazily: the first matcher holds the work
        assert not m.is_error(), m.get_error()
        return g

    def matchers(self, g, n):
        return [self.llg.LLMatcher(self.tok, g) for _ in range(n)]

    def fill(self, ms, bitmask):
        # the executor's call direct: llguidance.torch's wrapper imports torch._dynamo (seconds, once)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def advance(self, m, t):
        return m.consume_token(t)


class OutlinesCore:
    def __init__(self, tok, V):
        import outlines_core as oc
        self.oc = oc
        t0 = time.perf_counter()
        unbyte = {c: b for b, c in _byte_alphabet().items()}
        special = {t.content for t in tok.backend.get_added_tokens_decoder().values()}
        vocab: dict = {}
        for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
            if i == tok.eos_token_id:
                continue
            b = s.encode() if s in special else bytes(unbyte[c] for c in s)
            vocab.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(tok.eos_token_id, vocab)
        self.setup_s = time.perf_counter() - t0

    def compile(self, kind, spec):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
        return self.oc.Index(regex, self.vocab)

    def matchers(self, g, n):
        return [self.oc.Guide(g) for _ in range(n)]

    def fill(self, ms, bitmask):
        for i, m in enumerate(ms):      # no batch call: one row at a time
            row = bitmask[i]
            m.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def advance(self, m, t):
        m.advance(t)
        return True


def allowed(bitmask_row: torch.Tensor, t: int) -> bool:
    return bool((int(bitmask_row[t // 32]) >> (t % 32)) & 1)


def run(lib_cls, tok, V) -> None:
    lib = lib_cls(tok, V)
    print(f"{lib_cls.__name__}: vocabulary setup {lib.setup_s * 1e3:.0f} ms")
    for name, (kind, spec) in SPECS.items():
        t0 = time.perf_counter()
        g = lib.compile(kind, spec)
        compile_s = time.perf_counter() - t0
        ids = tok.encode(answer_text(name), add_special_tokens=False) + [tok.eos_token_id]
        ms = lib.matchers(g, B)
        bitmask = torch.zeros((B, (V + 31) // 32), dtype=torch.int32)
        ok, fill_s, first_s = True, 0.0, 0.0
        for step, t in enumerate(ids):
            t1 = time.perf_counter()
            lib.fill(ms, bitmask)
            if step == 0:
                first_s = time.perf_counter() - t1
            else:
                fill_s += time.perf_counter() - t1
            ok &= all(allowed(bitmask[r], t) for r in range(B))
            if step == 0:
                ok &= not allowed(bitmask[0], tok.encode("x", add_special_tokens=False)[0])
            if t != tok.eos_token_id:
                for m in ms:
                    ok &= bool(lib.advance(m, t))
        steps = len(ids) - 1
        print(f"  {name:7s} compile {compile_s * 1e3:7.1f} ms   batch {B} mask: first step {first_s * 1e3:7.2f} ms, "
              f"then {fill_s / steps * 1e3:6.2f} ms/step ({fill_s / steps / B * 1e6:5.1f} us/row) over "
              f"{steps} steps   correct: {ok}")


def main() -> None:
    tok = load_tokenizer(smollm2_gguf())
    V = tok.vocab_size
    print(f"SmolLM2 tokenizer: {V} tokens; torch threads {torch.get_num_threads()}")
    for lib in (XGrammar, LLGuidance, OutlinesCore):
        try:
            run(lib, tok, V)
        except Exception as e:  # noqa: BLE001 - a library that fails is reported, the others still run
            print(f"{lib.__name__}: failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
