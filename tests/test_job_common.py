"""Shared helpers for the job-runner tests (no tests here): a tiny real demo model, prompt files,
job files, the CLI as a real subprocess, and DuckDB reads of the output."""
from __future__ import annotations

import os
import subprocess
import time
import sys
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

MAX_TOKENS = 8
MODEL_SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                   vocab_size=512, max_position_embeddings=1024)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-init Llama written by batchrun.demo (real safetensors, real BPE tokenizer)."""
    from batchrun.demo import write_demo_model
    return write_demo_model(str(tmp_path_factory.mktemp("tiny-model")), **MODEL_SHAPE)


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    from batchrun.demo import write_demo_prompts
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        write_demo_prompts(os.path.join(d, "p.parquet"), n, seed=seed)
        return pq.read_table(os.path.join(d, "p.parquet")).column("text").to_pylist()


def write_prompt_files(dir: str, n: int, files: int = 3, seed: int = 0, row_group_size: int = 50,
                       texts: Optional[list] = None) -> list[dict[str, Any]]:
    """n rows (id 'r00000'.., text, topic, n_words) spread over `files` Parquet files; returns the rows."""
    os.makedirs(dir, exist_ok=True)
    texts = texts if texts is not None else prompt_texts(n, seed)
    rows = [{"id": f"r{i:05d}", "text": t, "topic": ["a", "b", "c"][i % 3],
             "n_words": None if t is None else len(t.split())} for i, t in enumerate(texts)]
    per = -(-len(rows) // files)
    for f in range(files):
        chunk = rows[f * per:(f + 1) * per]
        table = pa.Table.from_pylist(chunk, schema=pa.schema([("id", pa.string()), ("text", pa.string()),
                                                              ("topic", pa.string()), ("n_words", pa.int64())]))
        pq.write_table(table, os.path.join(dir, f"prompts-{f:02d}.parquet"), row_group_size=row_group_size)
    return rows


def job_dict(model_path: str, input_uri: str, output_uri: str, **sections) -> dict:
    """A job file as a dict; each keyword updates (dict) or replaces (other) one section."""
    job = {"name": "test-job", "model": {"path": model_path, "dtype": "float32"},
           "input": {"uri": input_uri, "id_column": "id", "prompt_column": "text", "passthrough": ["topic"]},
           "output": {"uri": output_uri},
           "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
           "engine": {"max_num_seqs": 32, "kv_cache_memory": 32 << 20, "swap_space": 0},
           "plan": {"unit_rows": 50, "window_units": 2}}
    for key, value in sections.items():
        if isinstance(value, dict):
            job.setdefault(key, {}).update(value)
        else:
            job[key] = value
    return job


def write_job(path: str, job: dict) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def cli(*args: str, env: Optional[dict] = None, timeout: float = 240, preexec=None) -> subprocess.CompletedProcess:
    """`python -m batchrun.cli ARGS` in a real subprocess (preexec: run in the child before exec)."""
    e = {**os.environ, **(env or {})}
    e.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.run([sys.executable, "-m", "batchrun.cli", *args], capture_output=True, text=True,
                          env=e, timeout=timeout, cwd=REPO, preexec_fn=preexec)


def popen_cli(*args: str, env: Optional[dict] = None) -> subprocess.Popen:
    e = {**os.environ, **(env or {})}
    e.setdefault("OMP_NUM_THREADS", "2")
    return subprocess.Popen([sys.executable, "-m", "batchrun.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e, cwd=REPO)


def wait_for(pred, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    """Poll pred() until true; fail if the job process exits first or after `timeout` s (a hang guard)."""
    deadline = time.time() + timeout
    while not pred():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}"
        assert time.time() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.005)


def results(out: str) -> list[tuple]:
    """(id, output, finish_reason, error, prompt_tokens, output_tokens) of every row DuckDB sees."""
    import duckdb
    con = duckdb.connect()
    return con.execute(f"SELECT id, output, finish_reason, error, prompt_tokens, output_tokens "
                       f"FROM read_parquet('{out}/*.parquet') ORDER BY id").fetchall()


def counts(out: str) -> tuple[int, int]:
    import duckdb
    return duckdb.connect().execute(
        f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{out}/*.parquet')").fetchone()


def reference(model: str, texts: list, max_tokens: int = MAX_TOKENS) -> list:
    """LLM.generate on the same prompts (greedy): the oracle for the runner's outputs."""
    from batchrun.api import LLM
    from batchrun.outputs import SamplingParams
    llm = LLM(model=model, dtype="float32", max_num_seqs=64, kv_cache_memory=32 << 20, swap_space=0)
    return llm.generate(texts, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)


def reference_output(d, model: str, n: int, unit_rows: int, seed: int) -> tuple[dict, list]:
    """Prompt files under d/in and the uninterrupted in-process run over them (output d/ref): the job
    dict and its rows, the oracle every crashed, locked or resumed run must reproduce."""
    from batchrun.job.plan import make_plan
    from batchrun.job.run import JobRunner
    from batchrun.job.spec import parse_job
    write_prompt_files(str(d / "in"), n, files=3, row_group_size=unit_rows, seed=seed)
    job = job_dict(model, str(d / "in"), str(d / "ref"), plan={"unit_rows": unit_rows, "window_units": 2},
                   engine={"max_num_seqs": 16})
    JobRunner(make_plan(parse_job(job, "<ref>", "/")), progress_bar=False).run()
    ref = results(str(d / "ref"))
    assert len(ref) == n
    return job, ref


def job_for(d, job: dict, name: str) -> tuple[str, str]:
    """(job file, output dir) of `job` redirected to output d/name."""
    out = str(d / name)
    return write_job(str(d / f"{name}.yaml"), {**job, "output": {"uri": out}}), out
