"""tensor_parallel_size=2 on CPU (gloo, two real processes): greedy float32 output token-identical to one
rank, with the throughput features on; a worker killed with SIGKILL fails the engine with a clear error
and a job resumes exactly once after it; sizes that do not split are refused at start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from batchrun import LLM, SamplingParams
from conftest import mixed_prompts
from jobutil import cli, counts, prompt_rows, tiny_model, write_job, write_parquet_files

# CPU (gloo) here; scripts/gpu_check.sh sets cuda on a machine with two GPUs (NCCL)
DEVICE = os.environ.get("BATCHRUN_TEST_TP_DEVICE", "cpu")
PROMPTS = mixed_prompts(10, 150, seed=21) + [[7, 8, 9, 10] * 12, [5] * 40]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# a budget that forces chunked prefill, queueing and preemption, with prefix caching (default) and speculation
# (40 blocks of 16 tokens at one rank's 512 B/token: ~3 of these sequences; each rank of two holds twice the
# blocks, so the two runs schedule differently and must still agree token for token)
TIGHT = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256, kv_cache_memory=40 * 16 * 512,
             speculative_config=SPEC, swap_space=0.001)


def _greedy(path: str, **kw) -> list[list[int]]:
    with LLM(path, dtype="float32", threads=1, device=DEVICE, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        ledger = llm.engine.memory_ledger
    assert ledger["tensor_parallel_size"] == kw.get("tensor_parallel_size", 1)
    return [o.token_ids for o in outs]


# llama (2 KV heads) under the tight budget with every feature on; qwen2's q/k/v bias; qwen3's q/k norms, on
# an int8 KV cache (quantized per head row: a rank's rows are its share of the same bytes).
# (mistral's window is per head, unchanged by the split: its attention path is llama's.)
@pytest.mark.parametrize("arch,kw", [("qwen2", {}), ("qwen3", {"kv_cache_dtype": "int8"}), ("llama", TIGHT)],
                         ids=["qwen2", "qwen3-kv-int8", "llama-tight"])
def test_two_ranks_generate_what_one_does(hf_models, arch, kw):
    path = hf_models[arch][0]
    assert _greedy(path, tensor_parallel_size=2, **kw) == _greedy(path, **kw)


def _workers() -> list[int]:
    """This process's tensor-parallel workers (multiprocessing spawn children, not its resource tracker)."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(os.getpid())], capture_output=True,
                         text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if "multiprocessing.spawn" in line and "resource_tracker" not in line]


def test_a_killed_worker_fails_the_engine_with_a_clear_error(hf_models):
    from batchrun.engine.tp_group import TPWorkerError
    llm = LLM(hf_models["llama"][0], dtype="float32", threads=1, device="cpu", tensor_parallel_size=2)
    try:
        [pid] = _workers()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TPWorkerError, match="rank 1 exited with code -9"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.parametrize("size,match", [(3, "does not divide this model's attention heads 4"),
                                        (0, "must be an integer >= 1")])
def test_sizes_that_cannot_run_are_refused_at_start(hf_models, size, match):
    with pytest.raises(ValueError, match=f"tensor_parallel_size.*{match}"):
        LLM(hf_models["llama"][0], dtype="float32", device="cpu", tensor_parallel_size=size)


def test_job_refuses_a_bad_size_with_exit_2(tmp_path):
    model = tiny_model(str(tmp_path / "model"))
    write_parquet_files(str(tmp_path / "in"), prompt_rows(8), files=1)
    job = write_job(str(tmp_path / "job.yaml"), model, str(tmp_path / "in"), str(tmp_path / "out"),
                    engine={"tensor_parallel_size": 3, "device": "cpu"})
    res = cli("submit", job)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine.tensor_parallel_size" in lines[0] and "Traceback" not in res.stderr


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_job_with_a_killed_worker_resumes_exactly_once(tmp_path):
    """The job freezes right after its first unit is committed (windows of two units, so most rows are
    still to come), its worker is killed, and the job wakes: exit 75, then a resubmit finishes the rest."""
    model = tiny_model(str(tmp_path / "model"))
    n = 96
    write_parquet_files(str(tmp_path / "in"), prompt_rows(n), files=2)
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"), model, str(tmp_path / "in"), out,
                    engine={"tensor_parallel_size": 2, "max_num_seqs": 8, "device": "cpu"},
                    sampling={"max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
                    plan={"unit_rows": 12, "window_units": 2})
    env = {**os.environ, "BATCHRUN_TEST_STOP_AT": "after_done:1"}
    proc = subprocess.Popen([sys.executable, "-m", "batchrun.cli", "submit", job, "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not _stopped(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        ps = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        workers = [int(x.split()[0]) for x in ps.stdout.splitlines()
                   if "multiprocessing.spawn" in x and "resource_tracker" not in x]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert "tensor-parallel worker failed: rank 1 exited with code -9" in err and "Traceback" not in err
    done_before = counts(out)[0]
    assert 0 < done_before < n
    res = cli("submit", job)
    assert res.returncode == 0, res.stderr
    rows, distinct = counts(out)
    assert rows == distinct == n


def test_two_ranks_follow_a_grammar_as_one_does(hf_models):
    """Structured outputs under tensor parallelism: rank 0 samples and holds the matchers; the constrained
    greedy answers equal one rank's token for token and each matches its spec."""
    import re
    path = hf_models["llama"][0]
    specs = [{"regex": "[a-e]{3}-[0-9]{2}"}, {"choice": ["alpha", "beta gamma", "delta"]}]
    params = [SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=specs[i % 2]) for i in range(6)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:6]]

    def run(**kw):
        with LLM(path, dtype="float32", threads=1, device=DEVICE, **kw) as llm:
            return llm.generate(prompts, params, use_tqdm=False)
    one, two = run(), run(tensor_parallel_size=2)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    for i, o in enumerate(two):
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        assert re.fullmatch(specs[0]["regex"], o.text) if i % 2 == 0 else o.text in specs[1]["choice"], o.text
