"""The pieces of scripts/bench_peers.py (the entry point, which puts scripts/ on sys.path).

    constants   threads, cache and baseline paths, the peers and their labels
    inputs      the models and prompts of workloads (a) and (b), built and cached
    metrics     pure computations: decode windows, rates, ratios, roofline, baseline comparison
    report      the printed tables, the compare listing, the baseline as committed
    processes   the parent's side of a peer process: launch, peak RSS, llama.cpp's batched-bench
    children    what runs inside a `--_child` process: batchrun, HF generate, HF generate_batch, bandwidth
    workloads   workloads (a) and (b): every peer in turn, its result or its failure
"""
