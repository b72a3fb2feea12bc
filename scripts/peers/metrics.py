"""Pure computations of the benchmark: decode windows, rates and ratios, the memory roofline, the
host-overhead figures of llm.stats, and a result flattened for the comparison against the baseline.
Nothing here times, builds or runs anything (tests/test_bench_peers.py covers it all)."""
from __future__ import annotations

from typing import Optional


def decode_window_steps(steps: list[tuple[float, int, bool]]) -> tuple[int, float, int]:
    """(tokens, seconds, n_steps) of the decode window of a step log.

    steps: (end time, tokens produced, step held prefill) per engine step, in order. The window opens
    at the end of the last step that held prefill (then every sequence has its first token) and closes
    at the end of the last step; its tokens are those produced by the steps inside it."""
    last_prefill = max((i for i, s in enumerate(steps) if s[2]), default=-1)
    inside = steps[last_prefill + 1:]
    if last_prefill < 0 or not inside:
        return 0, 0.0, 0
    return sum(s[1] for s in inside), inside[-1][0] - steps[last_prefill][0], len(inside)


def decode_window_token_times(token_times: list[list[float]]) -> tuple[int, float]:
    """(tokens, seconds) of the decode window from per-request token timestamps: it opens when the
    last request gets its first token and closes at the last token; tokens stamped after the opening."""
    firsts = [ts[0] for ts in token_times if ts]
    if not firsts:
        return 0, 0.0
    t0 = max(firsts)
    after = [t for ts in token_times for t in ts if t > t0]
    return len(after), (max(after) - t0) if after else 0.0


def rate(tokens: float, seconds: float) -> Optional[float]:
    return tokens / seconds if tokens and seconds and seconds > 0 else None


def ratio(ours: Optional[float], peer: Optional[float]) -> Optional[float]:
    """ours / peer, None when either is missing or the peer is zero."""
    if ours is None or peer is None or not peer:
        return None
    return ours / peer


def roofline(weights_bytes: int, kv_bytes_per_token: int, context_tokens: float, bandwidth_bps: float,
             step_seconds: float) -> dict:
    """The memory-bound floor of one decode step against its measured time.

    context_tokens: KV tokens read in the step, summed over the batch."""
    step_bytes = weights_bytes + kv_bytes_per_token * context_tokens
    floor = step_bytes / bandwidth_bps
    return {"step_bytes": int(step_bytes), "floor_s": floor, "step_s": step_seconds,
            "pct_of_roofline": 100.0 * floor / step_seconds if step_seconds > 0 else None}


def overhead_stats(stats: dict) -> dict:
    """The per-step host-overhead figures llm.stats exposes (keys naming overhead or host time), if any."""
    out = {k: v for k, v in stats.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)
           and ("overhead" in k or k.startswith("host_") or k.endswith("_host_s") or k.endswith("_host_ms"))}
    if out:   # the totals they are shares of
        out.update({k: stats[k] for k in ("step_s", "forward_s", "steps") if isinstance(stats.get(k), (int, float))})
    return out


def flatten(result: dict) -> dict[str, float]:
    """The comparable numbers of a result as {"a/decode_tok_s/batchrun/b64": x, ...}."""
    out: dict[str, float] = {}
    if not isinstance(result, dict):
        return out
    for wl in ("a", "b"):
        w = result.get(wl)
        if not isinstance(w, dict):
            continue
        for peer, p in (w.get("peers") or {}).items():
            if not isinstance(p, dict):
                continue
            if isinstance(p.get("peak_rss_mib"), (int, float)):
                out[f"{wl}/peak_rss_mib/{peer}"] = p["peak_rss_mib"]
            for b, row in (p.get("by_batch") or {}).items():
                for m in ("decode_tok_s", "e2e_tok_s"):
                    if isinstance(row.get(m), (int, float)):
                        out[f"{wl}/{m}/{peer}/b{b}"] = row[m]
            for m in ("tok_s", "decode_tok_s"):
                if isinstance(p.get(m), (int, float)):
                    out[f"{wl}/{m}/{peer}"] = p[m]
        for key, v in (w.get("ratios") or {}).items():
            if isinstance(v, (int, float)):
                out[f"{wl}/ratio/{key}"] = v
        rl = w.get("roofline") or {}
        if isinstance(rl.get("pct_of_roofline"), (int, float)):
            out[f"{wl}/roofline_pct/batchrun"] = rl["pct_of_roofline"]
        fl = w.get("floors") or {}
        per = fl.items() if wl == "a" else ([("", fl)] if fl else [])
        for b, f in per:
            for peer, s in (f.get("shares") or {}).items():
                for m, v in (s.items() if isinstance(s, dict) else [("e2e", s)]):
                    if isinstance(v, (int, float)):
                        out[f"{wl}/floor_share_{m}/{peer}" + (f"/b{b}" if b else "")] = v
    bw = result.get("bandwidth") or {}
    if isinstance(bw.get("read_gbs"), (int, float)):
        out["bandwidth/read_gbs"] = bw["read_gbs"]
    for k in ("bf16_peak", "int8_peak"):
        if isinstance((result.get("peaks") or {}).get(k), (int, float)):
            out[f"peaks/{k}"] = result["peaks"][k]
    return out


def compare(baseline: dict, current: dict) -> list[tuple[str, Optional[float], Optional[float], Optional[float]]]:
    """(key, baseline, now, change %) for every number in either result, sorted by key."""
    old, new = flatten(baseline), flatten(current)
    rows = []
    for k in sorted(set(old) | set(new)):
        o, n = old.get(k), new.get(k)
        pct = 100.0 * (n - o) / o if (o is not None and n is not None and o) else None
        rows.append((k, o, n, pct))
    return rows


def ratios_a(peers: dict, batches: list[int]) -> dict[str, float]:
    """{"batchrun/<peer>/decode/b<B>": x, "batchrun/<peer>/e2e/b<B>": x} for every peer with numbers."""
    ours = (peers.get("batchrun") or {}).get("by_batch") or {}
    out = {}
    for peer, p in peers.items():
        if peer == "batchrun":
            continue
        for b in batches:
            theirs = (p.get("by_batch") or {}).get(str(b)) or {}
            mine = ours.get(str(b)) or {}
            for m, short in (("decode_tok_s", "decode"), ("e2e_tok_s", "e2e")):
                r = ratio(mine.get(m), theirs.get(m))
                if r is not None:
                    out[f"batchrun/{peer}/{short}/b{b}"] = r
    return out


def median_run(runs: list[dict], batches: list[int]) -> dict:
    """One peer's repeated workload-(a) results as one: per batch the row of the run with the median decode
    tok/s (the lower middle of an even count), the other fields from the first successful run; "repeats"
    keeps every run's decode tok/s per batch. A single run, or none that succeeded, comes back as it is."""
    ok = [p for p in runs if p.get("status", "ok") == "ok" and p.get("by_batch")]
    if len(runs) == 1 or not ok:
        return runs[0]
    out = dict(ok[0], by_batch={}, repeats={})
    for b in map(str, batches):
        rows = sorted((p["by_batch"][b] for p in ok if b in p["by_batch"]),
                      key=lambda r: r.get("decode_tok_s") or 0.0)
        if rows:
            out["by_batch"][b] = rows[(len(rows) - 1) // 2]
            out["repeats"][b] = [r.get("decode_tok_s") for r in rows]
    return out


def ratio_spread(per_repeat: list[dict]) -> dict[str, list[float]]:
    """ratios_a of each repeat (peers run back to back within a repeat) -> {key: sorted ratios}."""
    out: dict[str, list[float]] = {}
    for r in per_repeat:
        for k, v in r.items():
            out.setdefault(k, []).append(v)
    return {k: sorted(v) for k, v in out.items()}


def ratios_b(peers: dict) -> dict[str, float]:
    ours = (peers.get("batchrun") or {}).get("tok_s")
    out = {}
    for peer, p in peers.items():
        if peer != "batchrun":
            r = ratio(ours, p.get("tok_s"))
            if r is not None:
                out[f"batchrun/{peer}"] = r
    return out


def roofline_a(res: dict, bw: dict, at: int = 64) -> Optional[dict]:
    """Workload (a)'s roofline: batchrun's decode step at B=`at` against the memory floor of that step,
    with llama.cpp's share at the same B and batchrun's B=1 step beside it; None without the numbers."""
    br = res["peers"].get("batchrun") or {}
    led = br.get("ledger")
    row = (br.get("by_batch") or {}).get(str(at))
    if not led or not row or not row.get("decode_steps") or not bw.get("read_gbs"):
        return None
    # KV read per decode step: each sequence attends over npp + (its step index); the mean over the
    # window's steps is npp + ntg/2 tokens per sequence
    ctx = row["mean_decode_batch"] * (res["npp"] + res["ntg"] / 2)
    # the weights one step reads: not the embedding table (a row per token), unless tied to the logits
    wbytes = led.get("decode_weights_bytes", led["weights_bytes"])
    r = roofline(wbytes, led["kv_bytes_per_token"], ctx, bw["read_gbs"] * 1e9,
                 row["decode_s"] / row["decode_steps"])
    r["batch"] = at
    lc = (res["peers"].get("llamacpp_bf16") or {}).get("by_batch", {}).get(str(at))
    if lc and lc.get("t_tg"):
        r["llamacpp_pct_of_roofline"] = 100.0 * r["floor_s"] / (lc["t_tg"] / res["ntg"])
    one = (br.get("by_batch") or {}).get("1")
    if one and one.get("decode_steps"):
        r["b1_step_s"] = one["decode_s"] / one["decode_steps"]
        r["b1_floor_s"] = (wbytes + led["kv_bytes_per_token"] * (res["npp"] + res["ntg"] / 2)) \
            / (bw["read_gbs"] * 1e9)
    return r
