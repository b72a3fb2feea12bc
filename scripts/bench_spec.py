"""Prompt-lookup speculation on against off at batch 1, 8 and 64, side by side in one run.

Measured on a model that really copies from its prompt (scripts/train_copy_model.py: answers repeat a
sentence of the document); it is trained first when --model does not hold one yet. For each batch size
the same held-out prompts run with speculation off and on; the script prints wall-clock speedup beside
the draft acceptance rate and the tokens each sequence gains per forward pass, checks that greedy
outputs are identical, and reports how many answers the model gets exactly right (how well it learned).
At batch 64 the default `disable_by_batch_size` (32) switches proposals off, as a compute-bound batch
would want on a GPU; the `64-forced` row keeps them on to show what that switch avoids or forgoes.

    python scripts/bench_spec.py [--model /tmp/batchrun-copy-model] [--num-prompts 64] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def engine(path: str, batch: int, spec):
    from batchrun import LLM
    return LLM(path, dtype="float32", max_num_seqs=batch, speculative_config=spec)


def timed(llm, prompts, params) -> dict:
    base = dict(llm.stats)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - t
    st = llm.stats
    d = {k: st[k] - base[k] for k in ("steps", "spec_proposed", "spec_accepted", "decode_entries", "decode_tokens",
                                      "output_tokens")}
    return {"seconds": round(secs, 3), "output_tok_s": round(d["output_tokens"] / secs, 1), "steps": d["steps"],
            "acceptance_rate": round(d["spec_accepted"] / d["spec_proposed"], 3) if d["spec_proposed"] else None,
            "tokens_per_seq_per_forward": round(d["decode_tokens"] / d["decode_entries"], 3)
            if d["decode_entries"] else None,
            "tokens": [o.token_ids for o in outs]}


def compare(path: str, prompts, params, batch: int, spec, repeats: int) -> dict:
    """Off and on alternately, `repeats` times each; the fastest of each is reported (shared, noisy machine)."""
    llms = {"off": engine(path, batch, None), "on": engine(path, batch, spec)}
    for llm in llms.values():
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)      # warm-up, not timed
    best: dict = {}
    for _ in range(repeats):
        for name, llm in llms.items():
            r = timed(llm, prompts, params)
            if name not in best or r["seconds"] < best[name]["seconds"]:
                best[name] = r
    off, on = best["off"], best["on"]
    return {"speedup": round(off["seconds"] / on["seconds"], 2),
            "identical_outputs": off.pop("tokens") == on.pop("tokens"), "off": off, "on": on}


def proposer_cost(spec: dict, history: int = 16384, steps: int = 512) -> dict:
    """Microseconds per proposal for one sequence with a long history: first call (indexes the whole
    prompt) and the steady state (one new token a step), to set against a decode step's time."""
    from batchrun.engine.speculative import NgramProposer, SeqSpecState, SpecConfig
    rng = random.Random(0)
    tokens = [rng.randrange(6, 256) for _ in range(history)]
    prop, st = NgramProposer(SpecConfig.from_dict(spec)), SeqSpecState()
    t = time.perf_counter()
    prop.propose(st, tokens, 4)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(steps):
        tokens.append(rng.randrange(6, 256))
        prop.propose(st, tokens, 4)
    return {"history_tokens": history, "first_call_us": round(first * 1e6),
            "steady_us_per_call": round((time.perf_counter() - t) / steps * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/batchrun-copy-model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=3)
    ap.add_argument("--lookup-min", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-minutes", type=float, default=8.0)
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        subprocess.run([sys.executable, os.path.join(HERE, "train_copy_model.py"), "--out", args.model,
                        "--minutes", str(args.train_minutes)], check=True, stdout=sys.stderr)
    sys.path.insert(0, HERE)
    from train_copy_model import EOS, sample
    from batchrun import SamplingParams

    rng = random.Random(12345)          # not a training seed: held-out documents
    examples = [sample(rng) for _ in range(args.num_prompts)]
    prompts = [p for p, _ in examples]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    rows = {}
    cases = [(b, str(b), spec) for b in args.batch_sizes]
    if max(args.batch_sizes) > 32:
        cases.append((max(args.batch_sizes), f"{max(args.batch_sizes)}-forced", {**spec, "disable_by_batch_size": None}))
    for batch, name, sp in cases:
        rows[name] = compare(args.model, prompts, params, batch, sp, args.repeats)
    with_eos = [a for _, a in examples]
    got = timed(engine(args.model, max(args.batch_sizes), None), prompts, params)["tokens"]
    exact = sum(g == a or g + [EOS] == a for g, a in zip(got, with_eos))
    print(json.dumps({"model": args.model, "num_prompts": args.num_prompts, "speculative_config": spec,
                      "answers_exactly_right": f"{exact}/{len(examples)}",
                      "mean_answer_tokens": round(sum(len(a) for a in with_eos) / len(with_eos), 1),
                      "by_batch_size": rows, "proposer": {
                          **proposer_cost(spec),
                          "decode_step_us_batch_1": round(rows[str(args.batch_sizes[0])]["off"]["seconds"]
                                                          / rows[str(args.batch_sizes[0])]["off"]["steps"] * 1e6)}},
                     indent=1))


if __name__ == "__main__":
    main()
