"""bench_quant.py's third quality layer and its prefill timing: JSON format compliance and prefill tok/s.

Format compliance: the share of valid JSON answers to a JSON-producing prompt set (greedy, chat template):
an answer counts when, code fences stripped, json.loads gives an object with the asked keys. Perplexity can
hold while this falls (the seed's 98% -> 82%), so it is measured beside it. Held-out calibration rows:
stdlib docstrings after the ones the perplexity text takes, written to a JSONL file.

    python scripts/quant_quality.py            # W8A8 vs bf16 speed on SmolLM2: prefill, B=64 and B=1 decode
    python scripts/quant_quality.py --kv       # bf16 vs int8 vs fp8_e4m3 KV cache speed on SmolLM2
    python scripts/quant_quality.py --where    # where W8A8's top-1 loss is, per projection family
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

import torch

from batchrun import SamplingParams

PEOPLE = ["a retired teacher from Lyon who is 67", "Maria, a 34-year-old nurse", "the boy next door, aged 12",
          "Kenji Watanabe, 45, an engineer in Osaka", "a 29 year old painter called Ines", "Grandpa Joe, 91",
          "Dr. Amara Okafor, forty-one", "a student named Li Wei, 20", "Olga (age 58), a pilot",
          "Tom, who turned 7 last week"]
TASKS = [("name and age", ("name", "age"), "for: {p}"),
         ("name, age and occupation", ("name", "age", "occupation"), "describing {p}"),
         ("name and is_adult (a boolean)", ("name", "is_adult"), "for the person: {p}"),
         ("first_name and age_in_months", ("first_name", "age_in_months"), "for: {p}"),
         ("name and a list of two hobbies under hobbies", ("name", "hobbies"), "inventing hobbies for {p}"),
         ("city and age", ("city", "age"), "guessing a city for {p}")]


def json_prompts() -> list[tuple[list[dict], tuple]]:
    """60 (conversation, keys) pairs: each task x each person."""
    out = []
    for what, keys, tail in TASKS:
        for p in PEOPLE:
            msg = f"Return only a JSON object with keys {what} {tail.format(p=p)}"
            out.append(([{"role": "user", "content": msg}], keys))
    return out


def valid_json(text: str, keys: tuple) -> bool:
    t = text.strip()
    m = re.search(r"```(?:json)?\s*(.*?)(```|$)", t, re.S)
    if m:
        t = m.group(1).strip()
    try:
        v = json.loads(t)
    except json.JSONDecodeError:
        return False
    return isinstance(v, dict) and all(k in v for k in keys)


def json_validity(llm, max_tokens: int = 96) -> tuple[float, list[str]]:
    """(share of valid answers, the answers) for json_prompts(), greedy."""
    items = json_prompts()
    outs = llm.chat([c for c, _ in items], SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    return sum(valid_json(t, k) for t, (_, k) in zip(texts, items)) / len(items), texts


def prefill_tps(llm, vocab: int, n: int = 16, length: int = 256) -> float:
    """Prompt tokens per second of n length-token prompts generating one token each (best of 2)."""
    g = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()} for _ in range(n)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    return n * length / best


def calibration_file(skip_docs: int, rows: int = 64) -> str:
    """A JSONL of `rows` stdlib docstrings after the first skip_docs (those the perplexity text uses)."""
    from batchrun.demo_docstrings import stdlib_docstrings
    docs = [d for _, _, d in stdlib_docstrings() if len(d) >= 200]
    picked = docs[skip_docs:skip_docs + rows]
    fd, path = tempfile.mkstemp(prefix="batchrun-calib-", suffix=".jsonl")
    with os.fdopen(fd, "w") as f:
        for d in picked:
            f.write(json.dumps({"prompt": d[:1200]}) + "\n")
    return path


def alternated_speed(path: str, kv: bool = False, rounds: int = 4) -> None:
    """bf16 vs w8a8 (its default groups of 64, groups of 32, and one group: per-row scales), or with kv the
    bf16 model on a bf16, int8 and fp8_e4m3 KV cache, on one model, the engines loaded together, their runs
    alternated (a shared host's noise hits all): best-of-rounds prefill tok/s, B=64 and B=1 decode tok/s
    after 32-token prompts (kv: also B=64 after 512-token prompts, where the cache's reads weigh more), and
    the ratios."""
    import gc
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_quant import decode_tps
    from batchrun import LLM
    common = dict(max_model_len=1024, max_num_seqs=64, enable_prefix_caching=False, dtype="bfloat16")
    calib = calibration_file(skip_docs=400)
    if kv:
        forms = {"bf16": {}, "kv int8": {"kv_cache_dtype": "int8"}, "kv fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"}}
    else:
        w8 = {"quantization": "w8a8", "quantization_calibration": calib}
        forms = {"bf16": {}, "w8a8": w8, "w8a8 g32": {**w8, "quantization_group_size": 32},
                 "w8a8 one group": {**w8, "quantization_group_size": 0}}
    llms = {k: LLM(path, **kw, **common) for k, kw in forms.items()}
    vocab = llms["bf16"].engine.runner.model.embed_tokens.num_embeddings
    runs = {"prefill": lambda llm: prefill_tps(llm, vocab), "decode B=64": lambda llm: decode_tps(llm, 64, 32, vocab),
            "B=1": lambda llm: decode_tps(llm, 1, 32, vocab)}
    if kv:
        runs["B=64 ctx 512"] = lambda llm: decode_tps(llm, 64, 32, vocab, prompt_len=512)
    best = {k: {r: 0.0 for r in runs} for k in llms}
    for _ in range(rounds):
        for k, llm in llms.items():
            for r, f in runs.items():
                best[k][r] = max(best[k][r], f(llm))
    for k, b in best.items():
        print(f"{k:<14} " + "   ".join(f"{r} {b[r]:8.1f} tok/s ({b[r] / best['bf16'][r]:.2f}x)" for r in runs))
    if not kv:
        print("w8a8 kernels:", llms["w8a8"].engine.memory_ledger["calibration"]["w8a8_kernels"])
    del llms
    gc.collect()
    os.unlink(calib)


def loss_by_family(path: str, tokens: int = 2040) -> None:
    """Where W8A8's top-1 loss against bf16 is: teacher-forced agreement with each projection family's
    activations left in bf16 (its int8 weights kept: F.linear on them dequantised), then with only one family's
    activations quantized, then with none (the int8 weights alone). The per-op path, so weights can be swapped."""
    import gc
    os.environ["BATCHRUN_CPU_LAYER_OP"] = "0"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_quant import teacher_forced, text_chunks
    from batchrun import LLM
    common = dict(max_model_len=1024, max_num_seqs=64, enable_prefix_caching=False, dtype="bfloat16")
    ref = LLM(path, **common)
    chunks = text_chunks(ref.tokenizer, tokens, 256)
    ref_top, _ = teacher_forced(ref, chunks)
    del ref
    gc.collect()
    calib = calibration_file(skip_docs=400)
    model = LLM(path, quantization="w8a8", quantization_calibration=calib, **common)
    layers = model.engine.runner.model.layers
    fams = {"qkv": lambda l: l.self_attn.qkv_proj, "o": lambda l: l.self_attn.o_proj,
            "gate_up": lambda l: l.mlp.gate_up_proj, "down": lambda l: l.mlp.down_proj}
    quantized = {f: [g(layer).weight for layer in layers] for f, g in fams.items()}

    def agreement(float_acts: set) -> float:
        for f, g in fams.items():
            for layer, w in zip(layers, quantized[f]):
                g(layer).weight = w.dequantize(torch.bfloat16) if f in float_acts else w
        tops, _ = teacher_forced(model, chunks)
        return sum((a == b).sum().item() for a, b in zip(tops, ref_top)) / sum(len(c) - 1 for c in chunks)
    print(f"top-1 vs bf16 over {sum(len(c) - 1 for c in chunks)} tokens: all W8A8 {agreement(set()):.1%}")
    print("  activations in bf16 in: " + ", ".join(f"{f} {agreement({f}):.1%}" for f in fams))
    print("  only these activations int8: " + ", ".join(f"{f} {agreement(set(fams) - {f}):.1%}" for f in fams))
    print(f"  int8 weights alone: {agreement(set(fams)):.1%}")
    os.unlink(calib)


if __name__ == "__main__":
    from batchrun.models.smollm2 import smollm2_gguf
    if "--where" in sys.argv[1:]:
        loss_by_family(smollm2_gguf())
    else:
        alternated_speed(smollm2_gguf(), kv="--kv" in sys.argv[1:])
