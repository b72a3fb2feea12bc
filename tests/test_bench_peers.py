"""scripts/bench_peers.py (its pieces in scripts/peers/) and scripts/llamacpp.py: parsing, decode windows,
ratios, roofline and the baseline comparison, on tiny hand-made inputs. Nothing is timed, built or run,
but for the one end-to-end `--quick` run at the end."""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def _load(name):
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _import(name):
    """A module of the scripts/peers/ package (scripts/ is on sys.path, as bench_peers.py puts it)."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def bp():
    return _load("bench_peers")


@pytest.fixture(scope="module")
def metrics():
    return _import("peers.metrics")


@pytest.fixture(scope="module")
def report():
    return _import("peers.report")


@pytest.fixture(scope="module")
def lc():
    return _load("llamacpp")


BB_TABLE = """\
0.00.116.605 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 4096

llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.144 |   887.21 |    1.030 |    62.11 |    1.175 |   163.45 |
|   128 |     64 |   16 |   3072 |    2.436 |   840.76 |    3.312 |   309.19 |    5.748 |   534.46 |

llama_perf_context_print:        load time =      97.35 ms
| some other | table |
"""


def test_parse_batched_bench_markdown(lc):
    rows = lc.parse_batched_bench(BB_TABLE)
    assert [r["pl"] for r in rows] == [1, 16]
    r = rows[1]
    assert (r["pp"], r["tg"], r["n_kv"]) == (128, 64, 3072)
    assert r["speed_tg"] == pytest.approx(309.19)
    assert r["t_pp"] == pytest.approx(2.436) and r["t"] == pytest.approx(5.748)
    assert isinstance(r["pl"], int) and isinstance(r["speed"], float)
    s = lc.parse_bb_settings(BB_TABLE)
    assert s["n_kv_max"] == 4096 and s["flash_attn"] == -1 and s["n_threads"] == 2


def test_parse_batched_bench_jsonl_and_garbage(lc):
    line = json.dumps({"n_kv_max": 4096, "pp": 128, "tg": 64, "pl": 4, "n_kv": 768, "t_pp": 0.5,
                       "speed_pp": 1024.0, "t_tg": 1.0, "speed_tg": 256.0, "t": 1.5, "speed": 512.0})
    rows = lc.parse_batched_bench("noise\n" + line + "\n{not json \"speed_tg\"\n")
    assert rows == [{"pp": 128, "tg": 64, "pl": 4, "n_kv": 768, "t_pp": 0.5, "speed_pp": 1024.0,
                     "t_tg": 1.0, "speed_tg": 256.0, "t": 1.5, "speed": 512.0}]
    assert lc.parse_batched_bench("") == []
    # a table row before any batched-bench header is not a result
    assert lc.parse_batched_bench("| 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 9 | 10 |\n") == []


def test_batched_bench_argv_sizes_context(lc, monkeypatch):
    monkeypatch.setattr(lc, "ensure_built", lambda targets, cache=None: {"llama-batched-bench": "/x/bb"})
    argv = lc.batched_bench_argv("m.gguf", 128, 64, [1, 16, 256], threads=2)
    assert argv[0] == "/x/bb"
    assert argv[argv.index("-c") + 1] == str(256 * 192)
    assert argv[argv.index("-npl") + 1] == "1,16,256"
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-tb") + 1] == "2"


def test_decode_window_steps(metrics):
    # two prefill steps (the second also decodes), then three pure decode steps of 4 tokens
    steps = [(1.0, 0, True), (2.0, 2, True), (2.5, 4, False), (3.0, 4, False), (3.5, 4, False)]
    assert metrics.decode_window_steps(steps) == (12, 1.5, 3)
    assert metrics.decode_window_steps([(1.0, 0, True)]) == (0, 0.0, 0)        # nothing after prefill
    assert metrics.decode_window_steps([(1.0, 1, False)]) == (0, 0.0, 0)       # no prefill step: no window
    assert metrics.decode_window_steps([]) == (0, 0.0, 0)


def test_decode_window_token_times(metrics):
    # request 0 starts early and decodes while request 1 is still prefilling (t=2.0)
    times = [[1.0, 1.5, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0]]
    assert metrics.decode_window_token_times(times) == (4, 2.0)
    assert metrics.decode_window_token_times([[], []]) == (0, 0.0)
    assert metrics.decode_window_token_times([[5.0]]) == (0, 0.0)


def test_rate_and_ratio(metrics):
    assert metrics.rate(100, 2.0) == 50.0
    assert metrics.rate(100, 0.0) is None and metrics.rate(0, 1.0) is None
    assert metrics.ratio(30.0, 10.0) == 3.0
    assert metrics.ratio(None, 10.0) is None and metrics.ratio(3.0, None) is None
    assert metrics.ratio(3.0, 0.0) is None


def _result(scale=1.0):
    return {
        "bandwidth": {"read_gbs": 20.0},
        "a": {"npp": 128, "ntg": 64, "batches": [1, 16],
              "peers": {"batchrun": {"status": "ok", "peak_rss_mib": 500.0,
                                     "by_batch": {"1": {"decode_tok_s": 60.0 * scale, "e2e_tok_s": 50.0},
                                                  "16": {"decode_tok_s": 400.0 * scale, "e2e_tok_s": 300.0}}},
                        "hf_generate": {"status": "ok", "by_batch": {"1": {"decode_tok_s": 30.0, "e2e_tok_s": 25.0}},
                                        "skipped_batches": [16], "skip_reason": "--hf-max-batch 1"},
                        "llamacpp_bf16": {"status": "failed: no compiler"}}},
        "b": {"rows": 4, "max_tokens": 8, "prompt_min": 150, "prompt_max": 300, "prompt_mean": 200.0,
              "peers": {"batchrun": {"status": "ok", "tok_s": 100.0 * scale, "seconds": 0.32},
                        "hf_generate_batch": {"status": "ok", "tok_s": 50.0, "seconds": 0.64}}},
    }


def test_ratios(metrics):
    r = _result()
    ra = metrics.ratios_a(r["a"]["peers"], [1, 16])
    assert ra == {"batchrun/hf_generate/decode/b1": 2.0, "batchrun/hf_generate/e2e/b1": 2.0}
    assert metrics.ratios_b(r["b"]["peers"]) == {"batchrun/hf_generate_batch": 2.0}
    assert metrics.ratios_b({"hf_generate": {"tok_s": 1.0}}) == {}       # no batchrun: no ratio


def test_repeats_take_each_batch_median_and_keep_every_ratio(metrics, report):
    runs = [{"status": "ok", "peak_rss_mib": 5, "by_batch": {"1": {"decode_tok_s": d1}, "16": {"decode_tok_s": d16}}}
            for d1, d16 in ((3.0, 30.0), (1.0, 50.0), (2.0, 40.0))] + [{"status": "failed: boom"}]
    m = metrics.median_run(runs, [1, 16])
    assert m["by_batch"] == {"1": {"decode_tok_s": 2.0}, "16": {"decode_tok_s": 40.0}}   # per batch, not per run
    assert m["repeats"] == {"1": [1.0, 2.0, 3.0], "16": [30.0, 40.0, 50.0]} and m["peak_rss_mib"] == 5
    two = metrics.median_run(runs[:2], [1])
    assert two["by_batch"]["1"] == {"decode_tok_s": 1.0}                  # even count: the lower middle
    assert metrics.median_run(runs[3:], [1]) == runs[3]                   # nothing succeeded: as it is
    spread = metrics.ratio_spread([{"k": 2.0, "j": 1.0}, {"k": 1.5}])
    assert spread == {"k": [1.5, 2.0], "j": [1.0]}
    r = _result()
    r["a"]["ratios"] = metrics.ratios_a(r["a"]["peers"], [1, 16])
    r["a"]["ratio_runs"] = {"batchrun/hf_generate/decode/b1": [1.5, 2.0, 2.5]}
    assert "1.50/2.00/2.50" in report.format_table_a(r["a"])


def test_tables_render_failures_and_skips(metrics, report):
    r = _result()
    r["a"]["ratios"] = metrics.ratios_a(r["a"]["peers"], [1, 16])
    r["b"]["ratios"] = metrics.ratios_b(r["b"]["peers"])
    ta = report.format_table_a(r["a"])
    assert "2.00x | 2.00x" in ta
    assert "llama.cpp bf16: failed: no compiler" in ta
    assert "B=16 skipped (--hf-max-batch 1)" in ta
    tb = report.format_table_b(r["b"])
    assert "2.00x" in tb and "100.0" in tb


def test_flatten_compare_and_baseline(metrics, report, tmp_path):
    old, new = _result(1.0), _result(1.5)
    for r in (old, new):
        r["a"]["ratios"] = metrics.ratios_a(r["a"]["peers"], [1, 16])
        r["b"]["ratios"] = metrics.ratios_b(r["b"]["peers"])
    flat = metrics.flatten(new)
    assert flat["a/decode_tok_s/batchrun/b16"] == 600.0
    assert flat["b/ratio/batchrun/hf_generate_batch"] == 3.0
    assert flat["a/peak_rss_mib/batchrun"] == 500.0
    assert not any(k.startswith("a/decode_tok_s/llamacpp_bf16") for k in flat)   # failed peer: no numbers
    rows = {k: (o, n, pct) for k, o, n, pct in metrics.compare(old, new)}
    assert rows["a/decode_tok_s/batchrun/b1"] == (60.0, 90.0, pytest.approx(50.0))
    assert rows["a/e2e_tok_s/batchrun/b1"][2] == 0.0
    # a metric only in the new run has no change
    new["b"]["peers"]["hf_generate"] = {"tok_s": 10.0}
    rows = {k: (o, n, pct) for k, o, n, pct in metrics.compare(old, new)}
    assert rows["b/tok_s/hf_generate"] == (None, 10.0, None)
    text = report.format_compare(metrics.compare(old, new))
    assert "+50.0%" in text and "b/tok_s/hf_generate" in text
    assert metrics.compare({}, {}) == []
    # the committed baseline drops machine paths and still compares
    new["a"]["model"] = "/root/x"
    base = report.strip_for_baseline(new)
    assert "model" not in base["a"] and "model" in new["a"]
    assert metrics.flatten(base) == metrics.flatten(new)


def test_stored_baseline_is_comparable(metrics, report):
    path = _import("peers.constants").BASELINE
    assert os.path.exists(path), "the committed baseline is missing"
    by_machine = report.load_baselines(path)
    assert by_machine
    for kind, base in by_machine.items():           # one entry per machine kind, each named by its own run
        assert report._kind(base) == kind
        flat = metrics.flatten(base)
        assert flat and all(isinstance(v, (int, float)) for v in flat.values())


def test_the_baseline_keeps_one_entry_per_machine_kind(report, tmp_path):
    path = str(tmp_path / "b.json")
    old = {"meta": {"started": "then"}, "bandwidth": {"read_gbs": 1.0}}          # the old one-result format
    with open(path, "w") as f:
        json.dump(old, f)
    assert report.load_baselines(path) == {report.UNKNOWN_KIND: old}
    zen = {"meta": {"machine_kind": "AMD EPYC (AVX-512 BF16, VNNI; 2 cores)"}, "bandwidth": {"read_gbs": 2.0}}
    amx = {"meta": {"machine_kind": "Intel Xeon (AMX, VNNI; 2 cores)"}, "bandwidth": {"read_gbs": 3.0}}
    report.save_baseline(path, zen)
    report.save_baseline(path, amx)
    saved = report.load_baselines(path)
    assert set(saved) == {report.UNKNOWN_KIND, report._kind(zen), report._kind(amx)}
    assert "bandwidth/read_gbs" in report.compare_with_baseline(path, dict(amx, bandwidth={"read_gbs": 6.0}))
    assert "+100.0%" in report.compare_with_baseline(path, dict(amx, bandwidth={"read_gbs": 6.0}))
    assert "no baseline for AVX2 box" in report.compare_with_baseline(path, {"meta": {"machine_kind": "AVX2 box"}})


def test_floors_by_hand():
    """One sequence of 2 prompt tokens, one decode step, at 1 FLOP/s and 1 byte/s: every term counted by hand."""
    floors = _import("peers.floors")
    shape = {"layer_params": 10, "head_params": 5, "layers": 1, "q_heads": 1, "head_dim": 1}
    f = floors.job_floors([2], 1, shape, weights_bytes=100, kv_bytes_per_token=1, peak_gflops=1e-9, bw_gbs=1e-9)
    # prefill: 2 x 10 x 2 tokens + 4 x (1 + 2 keys) + 2 x 5 logits = 62 FLOPs; 100 weight + 2 KV bytes
    assert (f["prefill"]["flops"], f["prefill"]["bytes"], f["prefill"]["bound"]) == (62, 102, "memory")
    # decode: 2 x (10 + 5) + 4 x 3 keys = 42 FLOPs; 100 + 3 KV bytes
    assert (f["decode"]["flops"], f["decode"]["bytes"]) == (42, 103)
    assert f["e2e_s"] == pytest.approx(205)
    fast_memory = floors.job_floors([2], 1, shape, 100, 1, peak_gflops=1e-9, bw_gbs=1.0)
    assert fast_memory["prefill"]["bound"] == "compute" and fast_memory["e2e_s"] == pytest.approx(62 + 42)
    res = {"batches": [1], "npp": 2, "ntg": 1, "peers": {
        "batchrun": {"ledger": {"weights_bytes": 100, "kv_bytes_per_token": 1}, "model_shape": shape,
                     "by_batch": {"1": {"decode_tok_s": 1 / 206, "e2e_tok_s": 2 / 410}}}}}
    fa = floors.floors_a(res, {"peaks": {"bf16_peak": 1e-9}, "bandwidth": {"read_gbs": 1e-9}})
    assert fa["1"]["shares"]["batchrun"] == {"decode": pytest.approx(0.5), "e2e": pytest.approx(0.5)}
    assert floors.floors_a(res, {"peaks": {}, "bandwidth": {"read_gbs": 1e-9}}) is None


def test_roofline_and_overhead(metrics):
    r = metrics.roofline(weights_bytes=100_000_000, kv_bytes_per_token=4096, context_tokens=64 * 160,
                         bandwidth_bps=20e9, step_seconds=0.01)
    assert r["step_bytes"] == 100_000_000 + 4096 * 64 * 160
    assert r["floor_s"] == pytest.approx(r["step_bytes"] / 20e9)
    assert r["pct_of_roofline"] == pytest.approx(100 * r["floor_s"] / 0.01)
    res = {"npp": 128, "ntg": 64, "peers": {
        "batchrun": {"ledger": {"weights_bytes": 1000, "kv_bytes_per_token": 10},
                     "by_batch": {"64": {"decode_s": 2.0, "decode_steps": 64, "mean_decode_batch": 64.0},
                                  "1": {"decode_s": 1.0, "decode_steps": 64}}},
        "llamacpp_bf16": {"by_batch": {"64": {"t_tg": 1.0}}}}}
    rl = metrics.roofline_a(res, {"read_gbs": 1e-6})   # 1000 B/s
    assert rl["step_bytes"] == 1000 + 10 * 64 * 160
    assert rl["step_s"] == pytest.approx(2.0 / 64)
    assert rl["llamacpp_pct_of_roofline"] == pytest.approx(2 * rl["pct_of_roofline"])
    assert rl["b1_step_s"] == pytest.approx(1.0 / 64)
    assert metrics.roofline_a(res, {}) is None
    # the ledger's decode_weights_bytes (no untied embedding table) is what a step reads
    res["peers"]["batchrun"]["ledger"]["decode_weights_bytes"] = 600
    assert metrics.roofline_a(res, {"read_gbs": 1e-6})["step_bytes"] == 600 + 10 * 64 * 160
    assert metrics.overhead_stats({"steps": 3, "host_overhead_ms_per_step": 1.5, "host_s": 2.0, "forward_s": 1.0,
                                   "swap_host_blocks": 1, "flag_overhead": True}) == {
        "host_overhead_ms_per_step": 1.5, "host_s": 2.0, "forward_s": 1.0, "steps": 3}
    assert metrics.overhead_stats({"steps": 3, "forward_s": 1.0}) == {}      # not exposed: nothing to print


def test_parse_args_defaults_and_peers(bp):
    a = bp.parse_args(["--quick", "--workload", "a", "--batches", "1,4", "--peers", "batchrun,hf_generate"])
    assert a.quick and a.workload == "a" and a.batches == [1, 4] and a.peers == ["batchrun", "hf_generate"]
    assert a.repeat == 1 and bp.parse_args(["--repeat", "3"]).repeat == 3
    with pytest.raises(SystemExit):
        bp.parse_args(["--peers", "vllm"])


def test_quick_run_end_to_end(tmp_path):
    """`--quick` on the tiny random model, batchrun only: the child protocol and the JSON it writes."""
    import subprocess
    out = tmp_path / "r.json"
    env = dict(os.environ, BATCHRUN_BENCH_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "bench_peers.py"), "--quick", "--workload", "a",
                        "--peers", "batchrun", "--repeat", "2", "--json", str(out), "--compare",
                        "--baseline", str(tmp_path / "none.json")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "Workload (a)" in p.stdout and "no baseline for" in p.stdout
    assert "Machine: " in p.stdout and "share of floor" in p.stdout
    r = json.loads(out.read_text())
    br = r["a"]["peers"]["batchrun"]
    assert br["status"] == "ok"
    assert set(br["by_batch"]) == {"1", "4"}
    for b, row in br["by_batch"].items():
        assert row["output_tokens"] == int(b) * 9          # ntg + 1 tokens per sequence
        assert row["decode_tokens"] == int(b) * 8 and row["decode_steps"] == 8
        assert row["decode_tok_s"] > 0 and row["e2e_tok_s"] > 0
    assert br["peak_rss_mib"] > 0 and br["ledger"]["weights_bytes"] > 0
    assert {b: len(v) for b, v in br["repeats"].items()} == {"1": 2, "4": 2}    # --repeat 2: both runs kept
    assert r["peaks"]["bf16_peak"] == max(r["peaks"]["bf16_gflops"].values()) > 0
    for b in ("1", "4"):
        share = r["a"]["floors"][b]["shares"]["batchrun"]
        assert 0 < share["decode"] and 0 < share["e2e"]
