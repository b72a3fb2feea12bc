"""Issue 14 item 5: identical deterministic rows computed once, the output fanned out to each of them.

Oracle: the same job with `dedupe: false`. Rows repeat across units and windows (so both a leader in
flight and the cache of finished outputs are used). Kills (real SIGKILL of a real `batchrun submit`)
between a computation and its fan-out, and between units, still end with every row exactly once and
the outputs of the dedupe-off run.
"""
from __future__ import annotations

import glob
import json
import random
import signal

import duckdb
import pytest

from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import parse_job
from test_job_common import cli, counts, job_dict, prompt_texts, tiny_model, write_job, write_prompt_files  # noqa: F401

N, DISTINCT = 200, 25
COLS = "id, output, finish_reason, error, prompt_tokens, output_tokens"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dedupe")
    base = prompt_texts(DISTINCT, seed=8)
    texts = [base[i % DISTINCT] for i in range(N)]
    random.Random(1).shuffle(texts)
    write_prompt_files(str(d / "in"), N, files=2, row_group_size=20, texts=texts)
    return d


SAMPLING = {"greedy": {"temperature": 0.0},
            "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 7},
            "unseeded": {"temperature": 0.9}}


def make_job(d, model, out, sampling, **extra):
    return job_dict(model, str(d / "in"), str(d / out), sampling={"max_tokens": 12, **SAMPLING[sampling]},
                    plan={"unit_rows": 20, "window_units": 2}, engine={"max_num_seqs": 8}, **extra)


def rows(out, cols=COLS):
    return duckdb.connect().execute(f"SELECT {cols} FROM read_parquet('{out}/*.parquet') ORDER BY id").fetchall()


def n_shared(out) -> int:
    return duckdb.connect().execute(f"SELECT count(*) FILTER (WHERE shared) FROM read_parquet('{out}/*.parquet')"
                                    ).fetchone()[0]


def run(job):
    return JobRunner(make_plan(parse_job(job, "<t>", "/")), progress_bar=False).run()


@pytest.mark.parametrize("sampling", ["greedy", "seeded", "unseeded"])
def test_outputs_equal_a_run_with_dedupe_off(data, tiny_model, sampling):  # noqa: F811
    off = run(make_job(data, tiny_model, f"off-{sampling}", sampling, dedupe=False))
    on = run(make_job(data, tiny_model, f"on-{sampling}", sampling))
    assert off["dedupe"]["rows_shared"] == 0 and not off["dedupe"]["enabled"]
    shared = n_shared(data / f"on-{sampling}")
    if sampling == "unseeded":               # not deterministic: every row computed
        assert on["dedupe"]["rows_shared"] == shared == 0
        return
    assert rows(data / f"on-{sampling}") == rows(data / f"off-{sampling}")
    assert on["dedupe"]["rows_shared"] == shared == N - DISTINCT
    assert on["dedupe"]["output_tokens_saved"] > 0 and on["dedupe"]["prompt_tokens_saved"] > 0
    assert on["rows"] == N and on["output_tokens"] == off["output_tokens"]       # each row keeps its metrics
    assert on["engine"]["steps"] < off["engine"]["steps"]


@pytest.fixture(scope="module")
def reference(data, tiny_model):  # noqa: F811
    run(make_job(data, tiny_model, "ref", "greedy", dedupe=False))
    return rows(data / "ref")


@pytest.mark.parametrize("point", ["fanout:1", "fanout:8", "after_done:3"])
def test_a_kill_between_computation_and_fanout_still_gives_every_row_once(data, tiny_model, reference, point):  # noqa: F811
    name = "kill-" + point.replace(":", "-")
    path = write_job(str(data / f"{name}.yaml"), make_job(data, tiny_model, name, "greedy"))
    p = cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": point})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    out = str(data / name)
    if glob.glob(f"{out}/*.parquet"):            # what is visible meanwhile: no row twice
        n, distinct = counts(out)
        assert n == distinct < N
    r = cli("submit", path, "--no-progress", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts(out) == (N, N) and rows(out) == reference
    assert summary["dedupe"]["rows_shared"] == n_shared(out) > 0
    st = json.loads(cli("status", out, "--json").stdout)
    assert st["state"] == "finished" and st["dedupe"]["rows_shared"] == summary["dedupe"]["rows_shared"]
    assert "rows shared an identical row's output" in cli("status", out).stdout
