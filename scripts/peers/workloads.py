"""Workloads (a) and (b): each prepares its model and prompts, runs every selected peer in turn (a
failed peer is reported, the others still run) and adds the batchrun/peer ratios."""
from __future__ import annotations

import importlib.util
import json
import os
import time
from typing import Any, Callable, Optional

import llamacpp   # scripts/llamacpp.py (bench_peers.py puts scripts/ on sys.path)

from .constants import LABELS, PEERS_A, PEERS_B
from .inputs import build_model_a, prepare_smollm2, random_prompts, summary_prompts
from .metrics import median_run, ratio_spread, ratios_a, ratios_b
from .processes import llamacpp_ready, run_child, run_llamacpp

# called after every peer with (workload, peer, its result): bench_peers.py --json writes the partial result
OnPeer = Callable[[str, str, dict], None]


def _peer_failed(name: str, e: Exception) -> dict:
    msg = f"failed: {e}".replace("\n", " ")
    print(f"  {LABELS.get(name, name)}: {msg[:600]}", flush=True)
    return {"status": msg[:1000]}


def _timed_peer(wl: str, name: str, fn, on_peer: Optional[OnPeer]) -> dict:
    """Run one peer's fn() -> result dict; a failure becomes {"status": "failed: ..."}. Records the wall
    time and the 1-minute load average before/after (the machine may be shared), then calls on_peer."""
    print(f"[{wl}] {LABELS[name]} ...", flush=True)
    l0, t = os.getloadavg()[0], time.perf_counter()
    try:
        p = fn()
    except Exception as e:   # noqa: BLE001 - a failed peer is reported, the others still run
        p = _peer_failed(name, e)
    p["wall_s"] = time.perf_counter() - t
    p["load"] = [round(l0, 2), round(os.getloadavg()[0], 2)]
    print(f"    {p['wall_s']:.0f} s, load {p['load'][0]:.1f} -> {p['load'][1]:.1f}", flush=True)
    if on_peer is not None:
        on_peer(wl, name, p)
    return p


def workload_a(args, workdir: str, result: Optional[dict] = None, on_peer: Optional[OnPeer] = None) -> dict:
    npp, ntg = (16, 8) if args.quick else (128, 64)
    batches = args.batches or ([1, 4] if args.quick else [1, 16, 64, 256])
    path, shape = build_model_a(args.quick)
    res: dict[str, Any] = {"npp": npp, "ntg": ntg, "batches": batches, "model": path, "shape": shape,
                           "peers": {}}
    if result is not None:
        result["a"] = res     # visible to the progress checkpoint as peers finish
    base = {"workload": "a", "model": path, "npp": npp, "ntg": ntg, "vocab": shape["vocab_size"],
            "seed": args.seed, "warmup": random_prompts(2, 8, shape["vocab_size"], 12345)}

    def llama():
        why = llamacpp_ready(args)
        if why:
            raise RuntimeError(why)
        gguf = llamacpp.convert_hf_to_gguf(path, path.rstrip("/") + "-bf16.gguf", "bf16")
        rows, settings, rss = run_llamacpp(gguf, npp, ntg, batches, workdir, args.timeout, "a")
        p = {"status": "ok", "peak_rss_mib": rss, "settings": settings, "by_batch": {},
             "note": f"llama-batched-bench, flash_attn={settings.get('flash_attn')}"}
        for r in rows:
            p["by_batch"][str(r["pl"])] = {"decode_tok_s": r["speed_tg"], "e2e_tok_s": r["pl"] * r["tg"] / r["t"],
                                           "seconds": r["t"], "t_pp": r["t_pp"], "t_tg": r["t_tg"]}
        return p

    def child(name):
        spec = dict(base, peer=name, batches=batches)
        skipped = []
        if name.startswith("hf_") and args.hf_max_batch:
            skipped = [b for b in batches if b > args.hf_max_batch]
            spec["batches"] = [b for b in batches if b <= args.hf_max_batch]
        if name == "batchrun":
            # defaults, except room for the largest batch (CPU default max_num_seqs may be smaller)
            spec["engine"] = {"dtype": "bfloat16", "max_num_seqs": max(batches)}
        out, rss = run_child(spec, workdir, args.timeout)
        p = dict(out, status="ok", peak_rss_mib=rss)
        if skipped:
            p["skipped_batches"] = skipped
            p["skip_reason"] = f"--hf-max-batch {args.hf_max_batch}"
        return p

    # --repeat N: the peers run in turn N times (the machine's speed drifts; a ratio of neighbouring runs
    # holds best); each peer's table row is its median run, and every repeat's ratios are kept
    names = [p for p in PEERS_A if p in args.peers]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    per_repeat = []
    for _ in range(max(1, args.repeat)):
        for name in names:
            runs[name].append(_timed_peer("a", name, llama if name == "llamacpp_bf16" else (lambda: child(name)),
                                          on_peer))
        per_repeat.append(ratios_a({name: r[-1] for name, r in runs.items()}, batches))
    for name in names:
        res["peers"][name] = median_run(runs[name], batches)
    if len(per_repeat) > 1:
        res["ratio_runs"] = ratio_spread(per_repeat)
    res["model_desc"] = (f"random-init Llama bf16, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
                         f"{shape['num_attention_heads']}q/{shape['num_key_value_heads']}kv heads, "
                         f"vocab {shape['vocab_size']}")
    led = (res["peers"].get("batchrun") or {}).get("ledger")
    if led:
        res["model_desc"] += f", {led['weights_bytes'] / 1e6:.0f} MB weights"
    res["ratios"] = ratios_a(res["peers"], batches)
    return res


def workload_b(args, workdir: str, result: Optional[dict] = None, on_peer: Optional[OnPeer] = None) -> dict:
    rows = args.rows or (8 if args.quick else 64)
    max_tokens = 8 if args.quick else 64
    res: dict[str, Any] = {"rows": rows, "max_tokens": max_tokens, "peers": {}}
    if result is not None:
        result["b"] = res
    try:
        gguf, hf_dir = prepare_smollm2()
        prompts = summary_prompts(hf_dir, rows, args.seed)
    except Exception as e:   # noqa: BLE001
        res["status"] = f"failed: {e}"
        print(f"[b] cannot prepare the workload: {e}", flush=True)
        return res
    lens = [len(p) for p in prompts]
    res.update(prompt_min=min(lens), prompt_max=max(lens), prompt_mean=sum(lens) / len(lens),
               prompt_tokens=sum(lens), prompt_lens=lens, gguf=gguf, hf_dir=hf_dir,
               model_desc="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to bf16 for batchrun/HF)")
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    pad = cfg.get("pad_token_id") or cfg.get("eos_token_id") or 0
    pad = pad[0] if isinstance(pad, list) else pad
    batchrun_model = hf_dir
    if args.batchrun_gguf == "yes" or (args.batchrun_gguf == "auto" and _batchrun_reads_gguf()):
        batchrun_model = gguf
    base = {"workload": "b", "prompts": prompts, "max_tokens": max_tokens, "pad_token_id": pad,
            "hf_batch_size": args.hf_batch_size, "warmup": [p[:32] for p in prompts[:2]]}

    def llama(name):
        why = llamacpp_ready(args)
        if why:
            raise RuntimeError(why)
        model = gguf if name == "llamacpp_q4_1" else llamacpp.convert_hf_to_gguf(
            hf_dir, hf_dir.rstrip("/") + "-bf16.gguf", "bf16")
        npp = round(res["prompt_mean"])
        out, settings, rss = run_llamacpp(model, npp, max_tokens, [rows], workdir, args.timeout, f"b-{name}")
        r = out[0]
        return {"status": "ok", "tok_s": r["pl"] * r["tg"] / r["t"], "seconds": r["t"],
                "decode_tok_s": r["speed_tg"], "peak_rss_mib": rss, "settings": settings,
                "note": f"batched-bench -npl {rows} -npp {npp} -ntg {max_tokens}: uniform lengths, random ids"}

    def child(name):
        spec = dict(base, peer=name, model=batchrun_model if name == "batchrun" else hf_dir)
        if name == "batchrun":
            spec["engine"] = {"dtype": "bfloat16"}   # the weights HF runs; every engine knob at its default
        out, rss = run_child(spec, workdir, args.timeout)
        p = dict(out, status="ok", peak_rss_mib=rss)
        if name == "batchrun":
            p["note"] = (f"default engine settings, bf16, model {'the GGUF itself' if batchrun_model == gguf else 'bf16 HF dir'}"
                         f" (max_num_seqs {(out.get('engine') or {}).get('max_num_seqs', '?')})")
        elif name == "hf_generate":
            p["note"] = f"batches of {args.hf_batch_size}, left padding, input order"
        elif name == "hf_generate_batch":
            p["note"] = "paged cache sized for the job, max_batch_tokens 8192"
        return p

    for name in [p for p in PEERS_B if p in args.peers]:
        res["peers"][name] = _timed_peer("b", name, (lambda: llama(name)) if name.startswith("llamacpp")
                                         else (lambda: child(name)), on_peer)
    res["ratios"] = ratios_b(res["peers"])
    return res


def _batchrun_reads_gguf() -> bool:
    return importlib.util.find_spec("batchrun.models.gguf") is not None
