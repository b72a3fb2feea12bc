"""scripts/gpu_check.sh's CPU-safe parts: it runs end to end at toy size and writes its JSON to $OUT."""
import json
import os
import subprocess
import sys


def test_gpu_check_tiny_writes_json(tmp_path):
    env = dict(os.environ, GPU_CHECK_TINY="1", OUT=str(tmp_path), PYTHON=sys.executable)
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout + r.stderr
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written == json.loads(r.stdout.strip().splitlines()[-1])
    assert written["kernel_tests"]["ok"] and "passed" in written["kernel_tests"]["summary"]
    assert written["hf_equality"]["ok"] and "passed" in written["hf_equality"]["summary"]
    t = written["throughput"]
    assert t["tiny"] is True and t["num_prompts"] == 8 and t["output_tokens"] > 0
    for key in ("output_tok_s", "prefill_tok_s", "mfu", "mbu_weights", "matmul_ceiling_tflops",
                "copy_ceiling_gb_s", "memory_ledger"):
        assert key in t


def test_gpu_bench_rejects_unknown_arguments():
    r = subprocess.run([sys.executable, "scripts/gpu_bench.py", "--no-such-flag"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


def _run(*cmd, env=None):
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_help_and_unknown_flags_answer_at_once():
    r = _run("bash", "scripts/gpu_check.sh", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: scripts/gpu_check.sh") and "--tiny" in r.stdout
    r = _run("bash", "scripts/gpu_check.sh", "--bogus")
    assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr


def test_gpu_scripts_refuse_without_cuda_unless_asked_for_the_cpu_run():
    import torch
    if torch.cuda.is_available():
        import pytest
        pytest.skip("the refusal is the CPU-only path; on a GPU machine gpu_check.sh runs for real")
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("GPU_CHECK_TINY", None)
    r = _run("bash", "scripts/gpu_check.sh", env=env)
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and r.stdout == ""
    r = _run(sys.executable, "scripts/gpu_bench.py")
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
    r = _run(sys.executable, "scripts/gpu_bench.py", "--help")
    assert r.returncode == 0 and "--tiny" in r.stdout
