"""The parent's side of a peer process: every peer runs in its own subprocess with 2 threads, and its
peak RSS is read from /proc. Python peers are bench_peers.py `--_child SPEC` (peers/children.py runs
inside); llama.cpp is llama-batched-bench, built by scripts/llamacpp.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional

import llamacpp   # scripts/llamacpp.py (bench_peers.py puts scripts/ on sys.path)

from .constants import ENTRY, THREADS


def child_env() -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[k] = str(THREADS)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def vm_hwm_mib(pid="self") -> Optional[float]:
    """VmHWM (peak resident set) of a process from /proc, MiB; None where /proc has no such field."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_process(argv: list[str], log_path: str, timeout: float) -> tuple[int, Optional[float], str]:
    """(exit status, peak RSS MiB, output) of argv run to completion; killed after `timeout` seconds.

    Peak RSS is the child's VmHWM, polled every 50 ms (it only grows, so the last reading misses at
    most the final 50 ms). Not ru_maxrss: Linux carries the forking parent's RSS over fork+exec into
    it, so every child would report at least this (torch-importing) parent's size."""
    peak: Optional[float] = None
    killed = False
    with open(log_path, "w") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
        deadline = time.monotonic() + timeout
        while True:
            hwm = vm_hwm_mib(p.pid)
            if hwm is not None:
                peak = max(peak or 0.0, hwm)
            pid, status, _ = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                p.kill()
                killed = True
                pid, status, _ = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
    with open(log_path, errors="replace") as f:
        text = f.read()
    if killed:
        text += f"\n[killed after {timeout:.0f} s]"
    return p.returncode, peak, text


def run_child(spec: dict, workdir: str, timeout: float) -> tuple[dict, float]:
    """Run one peer (`--_child`) in a fresh interpreter; (its result dict, peak RSS MiB)."""
    spec = dict(spec, out=os.path.join(workdir, f"{spec['peer']}-{spec['workload']}.json"))
    spec_path = spec["out"] + ".spec"
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    rc, rss, text = run_process([sys.executable, ENTRY, "--_child", spec_path],
                                spec["out"] + ".log", timeout)
    if rc != 0 or not os.path.exists(spec["out"]):
        tail = " | ".join(l for l in text.strip().splitlines()[-4:])
        raise RuntimeError(f"exit {rc}: {tail[-500:]}")
    with open(spec["out"]) as f:
        out = json.load(f)
    own = out.pop("vm_hwm_mib", None)
    return out, max(x for x in (rss, own, 0.0) if x is not None) or None


def llamacpp_ready(args) -> Optional[str]:
    """None when llama-batched-bench is (or now is) built, else the one-line reason."""
    try:
        if args.quick or args.no_build:
            if not os.access(llamacpp.binary("llama-batched-bench"), os.X_OK):
                return "llama-batched-bench not built (run scripts/llamacpp.py build; --quick/--no-build never build)"
            return None
        llamacpp.ensure_built()
        return None
    except llamacpp.LlamaCppError as e:
        return str(e)


def run_llamacpp(gguf: str, npp: int, ntg: int, npl: list[int], workdir: str, timeout: float,
                 tag: str) -> tuple[list[dict], dict, float]:
    argv = llamacpp.batched_bench_argv(gguf, npp, ntg, npl, threads=THREADS)
    rc, rss, text = run_process(argv, os.path.join(workdir, f"llamacpp-{tag}.log"), timeout)
    rows = llamacpp.parse_batched_bench(text)
    if rc != 0 or not rows:
        tail = " | ".join(text.strip().splitlines()[-3:])
        raise RuntimeError(f"llama-batched-bench exit {rc}, {len(rows)} rows: {tail[-400:]}")
    return rows, llamacpp.parse_bb_settings(text), rss
