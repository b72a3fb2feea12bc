"""Each workload's floors on this machine, and every peer's time as a share of them. Pure: nothing here times.

A phase's floor is the larger of its compute floor (its FLOPs at the best bf16 GEMM rate measured here,
peaks.py) and its memory floor (the bytes it must move at the measured read bandwidth). Prefill: every prompt
token through every layer (projections 2 x params, attention 4 x heads x head_dim x the keys it sees), one
logits row per sequence, the weights read once. Decode: ntg steps, each producing one token per sequence
(logits included) and reading the weights a step reads (decode_weights_bytes: the embedding table only
where tied) plus every sequence's KV. All sequences are taken as one batch, so the floor holds whatever the
schedule. share = floor / measured time: 100% would be the machine's limit."""
from __future__ import annotations

from typing import Optional


def _phase(flops: float, nbytes: float, peak_gflops: float, bw_gbs: float) -> dict:
    c, m = flops / (peak_gflops * 1e9), nbytes / (bw_gbs * 1e9)
    return {"flops": flops, "bytes": nbytes, "compute_s": c, "memory_s": m, "floor_s": max(c, m),
            "bound": "compute" if c >= m else "memory"}


def _attn(shape: dict, keys: float) -> float:
    """FLOPs of attention for queries that see `keys` keys in all (summed over the queries)."""
    return 4.0 * shape["layers"] * shape["q_heads"] * shape["head_dim"] * keys


def job_floors(prompt_lens: list[int], ntg: int, shape: dict, weights_bytes: int, kv_bytes_per_token: int,
               peak_gflops: float, bw_gbs: float) -> dict:
    """{"prefill", "decode": _phase dicts summed over steps, "e2e_s"} for sequences of these prompt lengths,
    each then producing ntg tokens after the first (which prefill's logits give)."""
    lp, hp = shape["layer_params"], shape["head_params"]
    pre_flops = sum(2.0 * lp * n + _attn(shape, n * (n + 1) / 2) + 2.0 * hp for n in prompt_lens)
    pre_bytes = weights_bytes + kv_bytes_per_token * sum(prompt_lens)
    prefill = _phase(pre_flops, pre_bytes, peak_gflops, bw_gbs)
    dec = {"flops": 0.0, "bytes": 0.0, "compute_s": 0.0, "memory_s": 0.0, "floor_s": 0.0}
    b = len(prompt_lens)
    for i in range(1, ntg + 1):                      # step i: every sequence attends over n + i keys
        keys = sum(n + i for n in prompt_lens)
        s = _phase(b * 2.0 * (lp + hp) + _attn(shape, keys), weights_bytes + kv_bytes_per_token * keys,
                   peak_gflops, bw_gbs)
        for k in dec:
            dec[k] += s[k]
    dec["bound"] = "compute" if dec["compute_s"] >= dec["memory_s"] else "memory"
    return {"prefill": prefill, "decode": dec, "e2e_s": prefill["floor_s"] + dec["floor_s"]}


def _inputs(res: dict, limits: dict) -> Optional[tuple]:
    br = (res.get("peers") or {}).get("batchrun") or {}
    led, shape = br.get("ledger"), br.get("model_shape")
    peak, bw = (limits.get("peaks") or {}).get("bf16_peak"), (limits.get("bandwidth") or {}).get("read_gbs")
    if not (led and shape and peak and bw):
        return None
    return shape, led.get("decode_weights_bytes", led["weights_bytes"]), led["kv_bytes_per_token"], peak, bw


def floors_a(res: dict, limits: dict) -> Optional[dict]:
    """Workload (a): per batch, the floors and each peer's decode and e2e share; None without the inputs.
    e2e counts ntg + 1 tokens per sequence (batchrun, HF; llama.cpp's e2e covers ntg, so its share reads
    ~1.5% high)."""
    got = _inputs(res, limits)
    if got is None:
        return None
    out = {}
    for b in res["batches"]:
        f = job_floors([res["npp"]] * b, res["ntg"], *got)
        shares = {}
        for peer, p in res["peers"].items():
            row = (p.get("by_batch") or {}).get(str(b)) or {}
            d, e = row.get("decode_tok_s"), row.get("e2e_tok_s")
            shares[peer] = {"decode": d * f["decode"]["floor_s"] / (b * res["ntg"]) if d else None,
                            "e2e": e * f["e2e_s"] / (b * (res["ntg"] + 1)) if e else None}
        out[str(b)] = dict(f, shares=shares)
    return out


def floors_b(res: dict, limits: dict) -> Optional[dict]:
    """Workload (b): the job's floors and each peer's share of the e2e floor (seconds of its whole run)."""
    got = _inputs(res, limits)
    if got is None or not res.get("prompt_lens"):
        return None
    f = job_floors(res["prompt_lens"], res["max_tokens"] - 1, *got)
    f["shares"] = {peer: (f["e2e_s"] / p["seconds"] if p.get("seconds") else None)
                   for peer, p in res["peers"].items()}
    return f
