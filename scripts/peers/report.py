"""What the benchmark prints and stores: the workload tables, the extras (bandwidth, roofline,
batchrun's overhead and memory), the change against the baseline, and the baseline as committed."""
from __future__ import annotations

import json
import os

from .constants import LABELS
from .metrics import compare


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _load(p: dict) -> str:
    """The 1-minute load average before->after a peer ran (2 cores: above ~2 means contention)."""
    ld = p.get("load")
    return f"{ld[0]:.1f}->{ld[1]:.1f}" if ld else "-"


def format_table_a(res: dict) -> str:
    batches = res["batches"]
    peers = res["peers"]
    lines = [f"Workload (a): {res['npp']} prompt tokens, {res['ntg']} new tokens, batch {','.join(map(str, batches))}"
             f" - {res.get('model_desc', '')}",
             "decode tok/s (after every sequence has its first token) | e2e tok/s (prefill included)"]
    head = f"{'peer':<26}" + "".join(f"{'B=' + str(b):>18}" for b in batches) + f"{'peak RSS':>11}{'load':>11}"
    lines += [head, "-" * len(head)]
    for name, p in peers.items():
        row = f"{LABELS.get(name, name):<26}"
        for b in batches:
            d = (p.get("by_batch") or {}).get(str(b))
            row += f"{(_fmt(d.get('decode_tok_s')) + ' | ' + _fmt(d.get('e2e_tok_s'))) if d else '-':>18}"
        row += f"{_fmt(p.get('peak_rss_mib'), 0) + ' MiB' if p.get('peak_rss_mib') else '-':>11}"
        row += f"{_load(p):>11}"
        lines.append(row)
    lines.append("ratio batchrun/peer (decode | e2e)")
    for name in peers:
        if name == "batchrun":
            continue
        row = f"{'  vs ' + LABELS.get(name, name):<26}"
        for b in batches:
            d = res["ratios"].get(f"batchrun/{name}/decode/b{b}")
            e = res["ratios"].get(f"batchrun/{name}/e2e/b{b}")
            row += f"{(_fmt(d, 2) + 'x | ' + _fmt(e, 2) + 'x') if (d or e) else '-':>18}"
        lines.append(row)
        spread = res.get("ratio_runs")
        if spread:
            row = f"{'    each repeat (decode)':<26}"
            for b in batches:
                v = spread.get(f"batchrun/{name}/decode/b{b}")
                row += f"{('/'.join(_fmt(x, 2) for x in v)) if v else '-':>18}"
            lines.append(row)
    for name, p in peers.items():
        if p.get("status", "ok") != "ok":
            lines.append(f"{LABELS.get(name, name)}: {p['status']}")
        for b in p.get("skipped_batches", []):
            lines.append(f"{LABELS.get(name, name)}: B={b} skipped ({p.get('skip_reason', '')})")
    return "\n".join(lines)


def format_table_b(res: dict) -> str:
    lines = [f"Workload (b): {res['rows']} stdlib-docstring summaries, prompts {res['prompt_min']}-{res['prompt_max']} "
             f"tokens (mean {res['prompt_mean']:.0f}), {res['max_tokens']} new tokens each - {res.get('model_desc', '')}"]
    head = f"{'peer':<26}{'tok/s':>10}{'seconds':>10}{'batchrun/peer':>15}{'peak RSS':>12}{'load':>11}  notes"
    lines += [head, "-" * len(head)]
    for name, p in res["peers"].items():
        r = res["ratios"].get(f"batchrun/{name}")
        lines.append(f"{LABELS.get(name, name):<26}{_fmt(p.get('tok_s')):>10}{_fmt(p.get('seconds'), 1):>10}"
                     f"{(_fmt(r, 2) + 'x') if r else ('1.00x' if name == 'batchrun' and p.get('tok_s') else '-'):>15}"
                     f"{(_fmt(p.get('peak_rss_mib'), 0) + ' MiB') if p.get('peak_rss_mib') else '-':>12}"
                     f"{_load(p):>11}  "
                     f"{p.get('note', '') if p.get('status', 'ok') == 'ok' else p['status']}")
    return "\n".join(lines)


def format_extras(result: dict) -> str:
    lines = []
    bw = result.get("bandwidth") or {}
    if bw.get("read_gbs"):
        lines.append(f"memory bandwidth (2 threads, {bw['mib']} MiB): read {bw['read_gbs']:.1f} GB/s, "
                     f"copy {bw['copy_gbs']:.1f} GB/s")
    a = result.get("a") or {}
    rl = a.get("roofline")
    if rl:
        s = (f"roofline, batchrun decode at B={rl['batch']}: {rl['step_bytes'] / 1e6:.1f} MB read per step "
             f"(weights but the embedding table + KV) / {bw['read_gbs']:.1f} GB/s = "
             f"{rl['floor_s'] * 1e3:.2f} ms floor; measured "
             f"{rl['step_s'] * 1e3:.2f} ms per step -> {rl['pct_of_roofline']:.0f}% of the memory roofline")
        if rl.get("llamacpp_pct_of_roofline"):
            s += f" (llama.cpp: {rl['llamacpp_pct_of_roofline']:.0f}%)"
        lines.append(s)
        if rl.get("b1_step_s"):
            lines.append(f"batchrun decode step at B=1: {rl['b1_step_s'] * 1e3:.2f} ms measured vs "
                         f"{rl['b1_floor_s'] * 1e3:.2f} ms memory floor ({(rl['b1_step_s'] - rl['b1_floor_s']) * 1e3:.2f} ms "
                         "above it: host overhead + compute inefficiency)")
    elif a.get("peers"):
        lines.append("roofline: needs batchrun at B=64 in --batches and a bandwidth figure")
    for wl in ("a", "b"):
        br = ((result.get(wl) or {}).get("peers") or {}).get("batchrun") or {}
        if br.get("status") == "ok":
            oh = br.get("overhead") or {}
            st = br.get("stats") or {}
            if oh:
                lines.append(f"batchrun per-step overhead ({wl}, llm.stats): "
                             + ", ".join(f"{k}={v:.4g}" for k, v in oh.items()))
            else:
                lines.append(f"batchrun per-step overhead ({wl}): not exposed by llm.stats")
            led = br.get("ledger") or {}
            if led.get("kv_bytes") is not None:
                swap = led.get("host_swap_blocks", 0) * led.get("block_size", 0) * led.get("kv_bytes_per_token", 0)
                lines.append(f"batchrun memory ({wl}, ledger): weights {led['weights_bytes'] / 2**20:.0f} MiB, "
                             f"KV cache reserved {led['kv_bytes'] / 2**20:.0f} MiB, host swap pool "
                             f"{swap / 2**20:.0f} MiB (engine defaults)")
            if st:
                lines.append(f"batchrun stats ({wl}, whole child run): steps={st.get('steps')}, "
                             f"tokens_per_step={st.get('tokens_per_step', 0):.1f}, preemptions={st.get('preemptions')}")
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def format_limits(result: dict) -> str:
    """The machine kind, its measured peaks, and each workload's floors with every peer's share of them."""
    pk, bw = result.get("peaks") or {}, result.get("bandwidth") or {}
    if not pk:
        return "machine limits: not measured"
    lines = [f"Machine: {pk['machine_kind']}; 2 threads",
             f"peaks: bf16 GEMM {pk['bf16_peak']:.0f} GFLOP/s ("
             + ", ".join(f"{k} {v:.0f}" for k, v in pk["bf16_gflops"].items()) + "), int8 GEMM "
             + (f"{pk['int8_peak']:.0f} GOP/s (" + ", ".join(f"{k} {v:.0f}" for k, v in pk["int8_gops"].items()) + ")"
                if pk.get("int8_peak") else "-")
             + f" on [{pk['shape'][0]}x{pk['shape'][2]}] x [{pk['shape'][2]}x{pk['shape'][1]}]; read bandwidth "
             + (f"{bw['read_gbs']:.1f} GB/s" if bw.get("read_gbs") else "-"),
             "floor = max(FLOPs / bf16 peak, bytes / read bandwidth) per phase; share = floor / measured time"]
    fa = (result.get("a") or {}).get("floors")
    if fa:
        peers = list(next(iter(fa.values()))["shares"])
        lines.append(f"{'(a) batch':<12}{'prefill floor':>22}{'decode floor':>22}  share of floor, decode | e2e")
        for b, f in fa.items():
            p, d = f["prefill"], f["decode"]
            row = (f"{'B=' + b:<12}{p['floor_s'] * 1e3:>12.1f} ms {p['bound']:<7}{d['floor_s'] * 1e3:>12.1f} ms "
                   f"{d['bound']:<7}  ")
            row += ", ".join(f"{LABELS.get(n, n)} {_pct(f['shares'][n]['decode'])} | {_pct(f['shares'][n]['e2e'])}"
                             for n in peers)
            lines.append(row)
    fb = (result.get("b") or {}).get("floors")
    if fb:
        lines.append(f"(b) job floor {fb['e2e_s']:.2f} s (prefill {fb['prefill']['floor_s']:.2f} s "
                     f"{fb['prefill']['bound']}, decode {fb['decode']['floor_s']:.2f} s {fb['decode']['bound']}); "
                     "share of floor: " + ", ".join(f"{LABELS.get(n, n)} {_pct(s)}" for n, s in fb["shares"].items()))
    return "\n".join(lines)


def format_compare(rows) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    lines = [f"{'metric':<52} {'baseline':>10} {'now':>10} {'change':>8}"]
    for k, o, n, pct in rows:
        lines.append(f"{k:<52} {f(o):>10} {f(n):>10} {('-' if pct is None else f'{pct:+.1f}%'):>8}")
    return "\n".join(lines)


def format_result(result: dict) -> str:
    """The tables of the workloads that ran, then the extras."""
    parts = []
    if "a" in result:
        parts.append(format_table_a(result["a"]))
    if "b" in result:
        b = result["b"]
        parts.append(format_table_b(b) if b.get("status", "ok") == "ok" else f"Workload (b): {b['status']}")
    return "\n\n".join(parts + [format_extras(result), format_limits(result)])


UNKNOWN_KIND = "unknown machine"


def _kind(result: dict) -> str:
    return (result.get("meta") or {}).get("machine_kind") or UNKNOWN_KIND


def load_baselines(path: str) -> dict:
    """{machine kind: stored result}; a file of one result (the old format) is that result's kind."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        saved = json.load(f)
    return saved["by_machine"] if "by_machine" in saved else {_kind(saved): saved}


def compare_with_baseline(path: str, result: dict) -> str:
    """The change of every number against the baseline stored for this machine kind, or why there is none."""
    base = load_baselines(path).get(_kind(result))
    if base is None:
        return f"no baseline for {_kind(result)} in {path} (--save-baseline writes it)"
    return (f"change against {os.path.relpath(path)}, {_kind(result)} ({base.get('meta', {}).get('started', '?')}):\n"
            + format_compare(compare(base, result)))


def save_baseline(path: str, result: dict) -> None:
    """Store the result as its machine kind's baseline, keeping the other kinds' entries."""
    by_machine = load_baselines(path)
    by_machine[_kind(result)] = strip_for_baseline(result)
    with open(path, "w") as f:
        json.dump({"by_machine": by_machine}, f, indent=1, sort_keys=True)
        f.write("\n")


def strip_for_baseline(result: dict) -> dict:
    """The result without machine-local paths and bulky fields (the baseline is committed)."""
    out = json.loads(json.dumps(result))
    for wl in ("a", "b"):
        w = out.get(wl)
        if not isinstance(w, dict):
            continue
        for k in ("model", "gguf", "hf_dir"):
            w.pop(k, None)
    return out
