"""Benchmark the Ray backend: rows/s with 1 and 2 replicas, and each replica's idle fraction, in one run.

One local Ray (num_cpus = --cpus) is started once; the same job (a random-init demo model, --rows short
prompts) runs single-process (the peer every ratio is against), then on Ray with 1 and with 2 replicas
of --threads torch threads each. Printed per run:
  wall rows/s    rows / the job's wall time (includes starting the actors and loading their weights)
  loop rows/s    rows / the longest replica engine loop (weights already loaded)
  idle           per replica: the share of its engine loop with no request to run (waiting for units)
  busy           per replica: the share of its engine loop inside LLMEngine.step
and the 2-vs-1 replica ratios. On a 2-core machine shared with other work the ratio is bounded by the
cores left free; on a cluster each replica has its own GPU.

    python scripts/bench_ray.py                       # 1200 rows, max_tokens 16, 2 CPUs
    python scripts/bench_ray.py --rows 4000 --hidden 256 --layers 4 --cpus 4 --threads 2
    python scripts/bench_ray.py --in-flight 8           # deeper per-replica queues: work stealing at the tail
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1200)
    ap.add_argument("--unit-rows", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica (and of the peer)")
    ap.add_argument("--in-flight", type=int, default=None, help="runtime.units_in_flight (default 2 x "
                    "window_units); more leaves assigned-but-unread units that a dry replica steals")
    args = ap.parse_args()

    import ray
    import torch

    from batchrun.demo import write_demo_model, write_demo_prompts
    from batchrun.job.plan import make_plan
    from batchrun.job.ray_runner import RayJobRunner
    from batchrun.job.run import JobRunner
    from batchrun.job.spec import parse_job

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    d = tempfile.mkdtemp(prefix="bench-ray-")
    try:
        model = write_demo_model(os.path.join(d, "model"), hidden_size=args.hidden, num_layers=args.layers,
                                 num_heads=4, num_kv_heads=2, intermediate_size=2 * args.hidden, vocab_size=2048,
                                 max_position_embeddings=1024)
        os.makedirs(os.path.join(d, "in"))
        write_demo_prompts(os.path.join(d, "in", "prompts.parquet"), args.rows, seed=3)

        def job(name: str, replicas: int) -> dict:
            return {"name": f"bench-{name}", "model": {"path": model, "dtype": "float32"},
                    "input": {"uri": os.path.join(d, "in"), "id_column": "id", "prompt_column": "text"},
                    "output": {"uri": os.path.join(d, name)},
                    "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True},
                    "engine": {"max_num_seqs": 64, "kv_cache_memory": 64 << 20, "swap_space": 0},
                    "plan": {"unit_rows": args.unit_rows, "window_units": 1},
                    "runtime": {"backend": "ray", "replicas": replicas, "cpus_per_replica": args.threads,
                                "units_in_flight": args.in_flight}}

        runs = []
        t = time.perf_counter()
        peer = JobRunner(make_plan(parse_job(job("local", 1), "<bench>", "/")), progress_bar=False)
        s = peer.run()
        s["replicas"] = [{"units_committed": s["units_committed"], "loop_s": s["engine_loop_s"],
                          "idle_fraction": peer.idle_s / max(peer.loop_s, 1e-9),
                          "engine_busy_fraction": s["engine_busy_fraction"]}]
        runs.append(("single process", s, time.perf_counter() - t))
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        try:
            for n in (1, 2):
                t = time.perf_counter()
                s = RayJobRunner(make_plan(parse_job(job(f"ray{n}", n), "<bench>", "/")), progress_bar=False).run()
                runs.append((f"ray, {n} replica(s)", s, time.perf_counter() - t))
        finally:
            ray.shutdown()

        print(f"\n{args.rows} rows, max_tokens {args.max_tokens}, model hidden {args.hidden} x {args.layers} layers, "
              f"{args.threads} torch thread(s) per engine, Ray with {args.cpus} CPUs, {os.cpu_count()} cores here, "
              f"load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end (other work competes for cores)")
        print(f"{'run':<20} {'wall s':>7} {'wall rows/s':>12} {'loop rows/s':>12}  per replica: units, idle, busy")
        loop_rate = {}
        for name, s, wall in runs:
            assert s["rows"] == args.rows, s
            reps = s["replicas"]
            loop = max(r["loop_s"] for r in reps)
            loop_rate[name] = args.rows / loop
            per = "; ".join(f"{r['units_committed']}u idle "
                            + ("-" if r["idle_fraction"] is None else f"{100 * r['idle_fraction']:.0f}%")
                            + f" busy {100 * (r['engine_busy_fraction'] or 0):.0f}%" for r in reps)
            print(f"{name:<20} {wall:7.1f} {args.rows / wall:12.1f} {loop_rate[name]:12.1f}  {per}")
        one, two = runs[1], runs[2]
        print(f"\n2 vs 1 replica: wall rows/s x{one[2] / two[2]:.2f}, loop rows/s "
              f"x{loop_rate[two[0]] / loop_rate[one[0]]:.2f}; 1 replica vs single process: loop rows/s "
              f"x{loop_rate[one[0]] / loop_rate[runs[0][0]]:.2f}; units stolen with 2 replicas: {two[1]['units_stolen']}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
