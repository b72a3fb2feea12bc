"""What runs inside a `--_child SPEC` process: one Python peer (batchrun, HF generate, HF generate_batch)
or the memory-bandwidth probe, with torch on 2 threads. The spec is JSON written by processes.run_child;
the result goes to spec["out"] with the process's own peak RSS (VmHWM) added."""
from __future__ import annotations

import json
import time
from typing import Any

from .constants import THREADS
from .inputs import random_prompts
from .metrics import decode_window_steps, decode_window_token_times, overhead_stats, rate
from .processes import vm_hwm_mib


def _setup_child_torch():
    import torch
    torch.set_num_threads(THREADS)
    torch.set_num_interop_threads(1)
    return torch


def child_bandwidth(spec: dict) -> dict:
    """Memory bandwidth with 2 threads: best of 5 sums (reads) and copies (read+write) of 512 MiB."""
    torch = _setup_child_torch()
    n = spec.get("mib", 512) * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    read, copy = [], []
    for _ in range(5):
        t = time.perf_counter(); x.sum(); read.append(time.perf_counter() - t)
        t = time.perf_counter(); y.copy_(x); copy.append(time.perf_counter() - t)
    nbytes = x.numel() * 4
    return {"read_gbs": nbytes / min(read) / 1e9, "copy_gbs": 2 * nbytes / min(copy) / 1e9,
            "mib": spec.get("mib", 512)}


def by_batch(spec: dict, run) -> dict:
    """Workload (a): {"<B>": run(prompts, n)} for every batch size B in spec["batches"]; before each
    measured run (B prompts of spec["npp"] random ids, ntg + 1 new tokens) a warm-up run at batch B
    (16 prompt tokens, 3 new tokens)."""
    out = {}
    for b in spec["batches"]:
        run(random_prompts(b, 16, spec["vocab"], 7), 3)
        out[str(b)] = run(random_prompts(b, spec["npp"], spec["vocab"], spec["seed"] + b), spec["ntg"] + 1)
    return out


def _batchrun_run(llm, prompts, params) -> dict:
    """Step the engine over `prompts` as LLM.generate does, logging every step (end time, tokens
    produced, held prefill) from the llm.stats counters."""
    engine = llm.engine
    base = f"r{time.perf_counter_ns()}-"
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(base + str(i), p, params)
    steps, outs = [], []
    prev = engine.stats
    while engine.has_unfinished_requests():
        done = engine.step()
        now = time.perf_counter()
        s = engine.stats
        d_batched = s["batched_tokens"] - prev["batched_tokens"]
        d_entries = s["decode_entries"] - prev["decode_entries"]
        d_tokens = s["decode_tokens"] - prev["decode_tokens"]
        prefill = d_batched != d_entries               # some scheduled tokens were prompt tokens
        # tokens out of this step: decode tokens + one first token per sequence whose prefill ended;
        # only pure-decode steps enter the window, and those produce exactly d_tokens
        steps.append((now, d_tokens, prefill))
        outs += done
        prev = s
    total = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    dec_tokens, dec_s, dec_steps = decode_window_steps(steps)
    return {"e2e_tok_s": rate(n_out, total), "decode_tok_s": rate(dec_tokens, dec_s), "seconds": total,
            "output_tokens": n_out, "decode_tokens": dec_tokens, "decode_s": dec_s,
            "decode_steps": dec_steps, "steps": len(steps),
            "mean_decode_batch": dec_tokens / dec_steps if dec_steps else None}


def _model_shape(model) -> dict:
    """What floors.py needs of the model: projection parameters of the layers and of the logits, layers,
    query heads and head_dim."""
    import torch

    def numel(w):
        return w.numel() if isinstance(w, torch.Tensor) else w.shape[0] * w.shape[1]
    layer = sum(numel(m.weight) for layer in model.layers for m in layer.modules()
                if isinstance(m, torch.nn.Linear))
    a = model.layers[0].self_attn
    head = model.embed_tokens.weight.numel()         # the logits weight: [vocab, hidden], tied or not
    return {"layer_params": layer, "head_params": head, "layers": len(model.layers), "q_heads": a.num_heads,
            "head_dim": a.head_dim}


def child_batchrun(spec: dict) -> dict:
    """batchrun's LLM (spec["engine"] settings), its engine stepped directly; with the memory ledger, the
    engine settings it ran with, llm.stats and the overhead figures among them."""
    _setup_child_torch()
    from batchrun import LLM, SamplingParams
    llm = LLM(spec["model"], **spec.get("engine", {}))
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    _batchrun_run(llm, spec["warmup"], sp(4))
    out: dict[str, Any] = {"ledger": llm.engine.memory_ledger, "model_shape": _model_shape(llm.engine.runner.model),
                           "engine": {k: getattr(llm.engine.config, k, None) for k in
                                      ("max_num_seqs", "max_num_batched_tokens", "swap_space", "compile",
                                       "threads", "dtype")}}
    if spec["workload"] == "a":
        out["by_batch"] = by_batch(spec, lambda prompts, n: _batchrun_run(llm, prompts, sp(n)))
    else:
        r = _batchrun_run(llm, spec["prompts"], sp(spec["max_tokens"]))
        out.update(tok_s=r["e2e_tok_s"], seconds=r["seconds"], output_tokens=r["output_tokens"],
                   decode_tok_s=r["decode_tok_s"], steps=r["steps"])
    stats = llm.stats
    out["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
    out["overhead"] = overhead_stats(stats)
    return out


def _hf_model(path):
    torch = _setup_child_torch()
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    return torch, tf, model


def child_hf_generate(spec: dict) -> dict:
    """Static batches: left-padded, one generate call per batch; a logits processor stamps each forward."""
    torch, tf, model = _hf_model(spec["model"])
    pad = spec.get("pad_token_id", 0)

    class Stamp(tf.LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    def gen(prompts, n):
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cfg = tf.GenerationConfig(max_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=pad)
        stamp = Stamp()
        t = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                                 logits_processor=tf.LogitsProcessorList([stamp]))
        return time.perf_counter() - t, (seq.shape[1] - width) * len(prompts), stamp.t

    gen(spec["warmup"], 4)
    out: dict[str, Any] = {}
    if spec["workload"] == "a":
        def timed(prompts, n):
            dt, n_out, stamps = gen(prompts, n)
            b = len(prompts)      # every forward makes one token per sequence; the first one holds prefill
            steps = [(stamps[0], b, True)] + [(t, b, False) for t in stamps[1:]]
            dec_tokens, dec_s, _ = decode_window_steps(steps)
            return {"e2e_tok_s": rate(n_out, dt), "decode_tok_s": rate(dec_tokens, dec_s),
                    "seconds": dt, "output_tokens": n_out}

        out["by_batch"] = by_batch(spec, timed)
    else:
        bs, total, n_out = spec["hf_batch_size"], 0.0, 0
        prompts = spec["prompts"]
        for i in range(0, len(prompts), bs):
            dt, n, _ = gen(prompts[i:i + bs], spec["max_tokens"])
            total += dt
            n_out += n
        out.update(tok_s=rate(n_out, total), seconds=total, output_tokens=n_out)
    return out


def child_hf_generate_batch(spec: dict) -> dict:
    """transformers' continuous batching (model.generate_batch), per-token timestamps recorded."""
    torch, tf, model = _hf_model(spec["model"])

    def gen(prompts, n):
        cfg = tf.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=spec.get("pad_token_id", 0))
        # size the paged cache for the job: left to itself on CPU it claims most of free RAM
        page = 256
        blocks = sum(-(-(len(p) + n) // page) for p in prompts)
        cb = tf.ContinuousBatchingConfig(page_size=page, num_blocks=blocks + blocks // 10 + 4,
                                         max_batch_tokens=spec.get("max_batch_tokens", 8192))
        t = time.perf_counter()
        res = model.generate_batch(prompts, generation_config=cfg, continuous_batching_config=cb,
                                   record_timestamps=True, progress_bar=False)
        dt = time.perf_counter() - t
        outs = list(res.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            raise RuntimeError(f"generate_batch returned {len(outs)}/{len(prompts)} results, "
                               f"{sum(1 for o in outs if o.error)} with errors")
        n_out = sum(len(o.generated_tokens) for o in outs)
        dec_tokens, dec_s = decode_window_token_times([o.timestamps or [] for o in outs])
        return {"e2e_tok_s": rate(n_out, dt), "decode_tok_s": rate(dec_tokens, dec_s), "seconds": dt,
                "output_tokens": n_out}

    gen(spec["warmup"], 4)
    out: dict[str, Any] = {}
    if spec["workload"] == "a":
        out["by_batch"] = by_batch(spec, gen)
    else:
        r = gen(spec["prompts"], spec["max_tokens"])
        out.update(tok_s=r["e2e_tok_s"], seconds=r["seconds"], output_tokens=r["output_tokens"],
                   decode_tok_s=r["decode_tok_s"])
    return out


def _child_peaks(spec: dict) -> dict:
    from .peaks import child_peaks
    return child_peaks(spec)


CHILDREN = {"bandwidth": child_bandwidth, "peaks": _child_peaks, "batchrun": child_batchrun,
            "hf_generate": child_hf_generate, "hf_generate_batch": child_hf_generate_batch}


def child_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    result = CHILDREN[spec["peer"]](spec)
    result["vm_hwm_mib"] = vm_hwm_mib()     # exact peak, read by the process itself at the end
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0
