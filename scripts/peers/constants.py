"""The benchmark's fixed settings, shared by every module of the peers package."""
from __future__ import annotations

import os

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(SCRIPTS, "bench_peers.py")        # children run it with --_child
CACHE = os.environ.get("BATCHRUN_BENCH_CACHE", os.path.expanduser("~/.cache/batchrun/bench_peers"))
BASELINE = os.path.join(SCRIPTS, "bench_peers_baseline.json")
THREADS = 2

PEERS_A = ("batchrun", "hf_generate", "hf_generate_batch", "llamacpp_bf16")
PEERS_B = ("batchrun", "hf_generate", "hf_generate_batch", "llamacpp_bf16", "llamacpp_q4_1")
LABELS = {"batchrun": "batchrun", "hf_generate": "HF generate (static)",
          "hf_generate_batch": "HF generate_batch (CB)", "llamacpp_bf16": "llama.cpp bf16",
          "llamacpp_q4_1": "llama.cpp Q4_1"}
