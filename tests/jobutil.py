"""Helpers for the job-runner tests: a tiny demo model, prompt files, job files, CLI subprocesses, DuckDB."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

WORDS = "alpha beta gamma delta river stone cloud paper engine garden window music table light".split()


def tiny_model(path: str) -> str:
    from batchrun.demo import write_demo_model
    return write_demo_model(path, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=128, vocab_size=512, max_position_embeddings=512)


def prompt_rows(n: int, seed: int = 0, start_id: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": start_id + i, "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))),
             "topic": rng.choice(["a", "b", "c"])} for i in range(n)]


def write_parquet_files(dir: str, rows: list[dict], files: int, row_group_size: int = 64) -> list[str]:
    os.makedirs(dir, exist_ok=True)
    per = -(-len(rows) // files)
    paths = []
    for k in range(files):
        p = os.path.join(dir, f"prompts-{k:02d}.parquet")
        pq.write_table(pa.Table.from_pylist(rows[k * per:(k + 1) * per]), p, row_group_size=row_group_size)
        paths.append(p)
    return paths


def write_job(path: str, model: str, input_uri: str, output_uri: str, **overrides) -> str:
    job = {"name": "test-job", "model": {"path": model, "dtype": "float32"},
           "input": {"uri": input_uri, "id_column": "id", "prompt_column": "text",
                     "prompt_template": "Q: {text}", "passthrough": ["topic"]},
           "output": {"uri": output_uri},
           "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
           "engine": {"max_num_seqs": 64},
           "plan": {"unit_rows": 100, "window_units": 2}}
    for key, value in overrides.items():
        node = job
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def cli(*args, env=None, check=False, timeout=300) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, "-m", "batchrun.cli", *args], capture_output=True, text=True,
                       env=e, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def results(output_dir: str) -> list[tuple]:
    """(id, output, finish_reason, output_tokens) of every committed row, by id, through DuckDB."""
    return duckdb.sql(f"SELECT id, output, finish_reason, output_tokens FROM "
                      f"read_parquet('{output_dir}/*.parquet') ORDER BY id").fetchall()


def counts(output_dir: str) -> tuple[int, int]:
    return duckdb.connect().execute(f"SELECT count(*), count(DISTINCT id) FROM read_parquet('{output_dir}/*.parquet')").fetchone()
