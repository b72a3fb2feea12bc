"""The cost of storage faults: wall time of one job through the test suite's fault-injecting proxy
(tests/faultproxy.py) at 0%, 1% and 5% injected 503s, for each object-store emulator (tests/emulators.py),
printed as a table with ratios to the 0% run.

The job is sized so that storage dominates: 3,000 prompts in 3 Parquet files on the store, 30 units of
100 rows, the tiny random-init test model (2 layers, hidden 64) generating 1 token per prompt, output to
the same store. Every run starts on a fresh output prefix and reads and writes through the proxy; each
503 is retried by the client library first (botocore's default 5 tries, gcsfs's fixed 6 tries with
1-2 s before its first retry, the Azure SDK's policy set to 0.05 s backoff), then by batchrun.

    python scripts/bench_faults.py [--stores s3,gcs,azure] [--rows 3000] [--seed 1]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(HERE)]
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

RATES = (0.0, 0.01, 0.05)


def make_inputs(d: str, rows: int) -> tuple[str, str]:
    """(prompt dir, model dir) of the benchmark job."""
    from test_job_common import MODEL_SHAPE, write_prompt_files
    from batchrun.demo import write_demo_model
    texts = [f"prompt number {i} about {['rivers', 'stones', 'clouds'][i % 3]}" for i in range(rows)]
    write_prompt_files(os.path.join(d, "in"), rows, files=3, row_group_size=100, texts=texts)
    return os.path.join(d, "in"), write_demo_model(os.path.join(d, "model"), **MODEL_SHAPE)


def bench_store(name: str, start, d: str, rows: int, seed: int) -> list[tuple]:
    from emulators import BUCKET
    from faultproxy import FaultProxy, faults
    from storejobs import run
    from test_job_common import job_dict
    src, model = os.path.join(d, "in"), os.path.join(d, "model")
    out = []
    with start() as store:
        fs = store.fs()
        for f in sorted(os.listdir(src)):
            fs.put_file(os.path.join(src, f), f"{BUCKET}/bench/in/{f}")
        for rate in RATES:
            with FaultProxy(store.endpoint, store.name, store.object_key, rule=faults(seed, {"503": rate})) as proxy:
                job = job_dict(model, store.url("bench/in/"), store.url(f"bench/out-{int(rate * 1000)}"),
                               sampling={"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                               engine={"max_num_seqs": 128, "kv_cache_memory": 64 << 20, "swap_space": 0},
                               plan={"unit_rows": 100, "window_units": 4})
                job["input"]["storage_options"] = store.options(proxy.endpoint)
                job["output"]["storage_options"] = store.options(proxy.endpoint)
                t = time.perf_counter()
                summary = run(job)
                wall = time.perf_counter() - t
            assert summary["rows"] == rows, summary
            out.append((name, rate, wall, proxy.seen, proxy.injected["503"]))
    return out


def warm_up(d: str, rows: int) -> None:
    """One untimed local run: the engine's one-time costs (CPU kernels built, first forward) stay out of
    the first timed run."""
    from storejobs import run
    from test_job_common import job_dict
    src, model = make_inputs(d, rows)
    run(job_dict(model, src, os.path.join(d, "warm"), sampling={"max_tokens": 1, "temperature": 0.0},
                 plan={"unit_rows": 100, "window_units": 4}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", default="s3,gcs,azure")
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("BATCHRUN_IO_BACKOFF_S", "0.05")
    import logging
    logging.disable(logging.WARNING)        # one warning per retry otherwise
    from emulators import Unavailable, start_azure, start_gcs, start_s3
    starts = {"s3": start_s3, "gcs": start_gcs, "azure": start_azure}
    results = []
    with tempfile.TemporaryDirectory() as d:
        warm_up(d, args.rows)
        for name in args.stores.split(","):
            try:
                results += bench_store(name, starts[name], d, args.rows, args.seed)
            except Unavailable as e:
                print(f"{name}: skipped: {e}", file=sys.stderr)
    print(f"{'store':<7} {'503 rate':>8} {'wall s':>8} {'ratio':>6} {'requests':>9} {'503s':>5}")
    base = {}
    for name, rate, wall, seen, n503 in results:
        base.setdefault(name, wall)
        print(f"{name:<7} {rate:>8.0%} {wall:>8.2f} {wall / base[name]:>6.2f} {seen:>9} {n503:>5}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
