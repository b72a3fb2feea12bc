"""The runner end to end with the real engine and the real demo model: outputs equal LLM.generate,
every input row exactly once, bad rows become error rows, memory:// works."""
from __future__ import annotations

import csv
import json
import os
import signal
import time

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import parse_job
from test_job_common import (MAX_TOKENS, cli, counts, job_dict, popen_cli, prompt_texts, reference, results,
                             tiny_model, write_job, write_prompt_files)  # noqa: F401 - fixture


def run_inprocess(job: dict, restart: bool = False) -> dict:
    return JobRunner(make_plan(parse_job(job, "<test>", "/")), restart=restart, progress_bar=False).run()


def assert_matches_reference(rows_out, inputs, ref):
    """rows_out from results(); inputs as written; ref = LLM.generate outputs in input order."""
    by_id = {r[0]: r for r in rows_out}
    assert len(by_id) == len(inputs) == len(rows_out)
    for row, o in zip(inputs, ref):
        got = by_id[row["id"]]
        if o.finish_reason == "error":
            assert got[1:4] == (None, "error", o.error), row["id"]
        else:
            assert got[1:3] == (o.text, o.finish_reason), row["id"]
            assert got[3] is None
            assert (got[4], got[5]) == (len(o.prompt_token_ids), len(o.token_ids))


def test_cli_end_to_end_2000_prompts_over_several_files(tmp_path, tiny_model):  # noqa: F811
    inputs = write_prompt_files(str(tmp_path / "in"), 2000, files=4, row_group_size=100)
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"), job_dict(
        tiny_model, "in/*.parquet", "out/", plan={"unit_rows": 200, "window_units": 3},
        engine={"max_num_seqs": 64}))
    p = cli("submit", job, "--json", "--no-progress")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 2000 and summary["units"] == 12 and summary["exit_code"] == 0
    assert 0 < summary["engine_busy_fraction"] <= 1
    assert counts(out) == (2000, 2000)
    con = duckdb.connect()
    ids = {r[0] for r in con.execute(f"SELECT id FROM read_parquet('{out}/*.parquet')").fetchall()}
    assert ids == {r["id"] for r in inputs}
    topics = dict(con.execute(f"SELECT id, topic FROM read_parquet('{out}/*.parquet')").fetchall())
    assert topics == {r["id"]: r["topic"] for r in inputs}
    ref = reference(tiny_model, [r["text"] for r in inputs])
    assert_matches_reference(results(out), inputs, ref)
    assert os.path.exists(os.path.join(out, "_SUCCESS"))
    saved = json.load(open(os.path.join(out, "_batchrun", "summary.json")))
    assert saved["rows"] == 2000 and saved["output_tokens"] == sum(len(o.token_ids) for o in ref)
    assert len(os.listdir(os.path.join(out, "_batchrun", "done"))) == 12
    meta = pq.ParquetFile(os.path.join(out, "part-000000.parquet")).schema_arrow.metadata
    assert meta[b"batchrun.job"] == b"test-job" and meta[b"batchrun.model"] == tiny_model.encode()
    assert json.loads(meta[b"batchrun.sampling"])["max_tokens"] == MAX_TOKENS
    # submitting again is a no-op resume that rewrites nothing
    stamps = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if n.endswith(".parquet")}
    stamps["summary"] = os.stat(os.path.join(out, "_batchrun", "summary.json")).st_mtime_ns
    p = cli("submit", job, "--json", "--no-progress")
    again = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and again["units_committed"] == 0 and again["rows"] == 2000
    assert counts(out) == (2000, 2000)
    after = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if n.endswith(".parquet")}
    after["summary"] = os.stat(os.path.join(out, "_batchrun", "summary.json")).st_mtime_ns
    assert after == stamps and os.path.exists(os.path.join(out, "_SUCCESS"))


def test_bad_rows_are_error_rows_and_the_job_goes_on(tmp_path, tiny_model):  # noqa: F811
    texts = prompt_texts(60, seed=3)
    texts[5], texts[17], texts[40] = None, "", " ".join(["word"] * 1500)     # null, empty, longer than the model
    inputs = write_prompt_files(str(tmp_path / "in"), 60, files=2, texts=texts)
    out = str(tmp_path / "out")
    summary = run_inprocess(job_dict(tiny_model, str(tmp_path / "in"), out, plan={"unit_rows": 20}))
    assert summary["rows"] == 60 and summary["error_rows"] == 3
    rows = {r[0]: r for r in results(out)}
    assert rows["r00005"][1:4] == (None, "error", "null prompt (column 'text')")
    assert rows["r00017"][1:4] == (None, "error", "empty prompt")
    assert rows["r00040"][2] == "error" and "exceeds max_model_len=1024" in rows["r00040"][3]
    ok = [i for i in range(60) if i not in (5, 17, 40)]
    ref = reference(tiny_model, [texts[i] for i in ok])
    assert_matches_reference([rows[inputs[i]["id"]] for i in ok], [inputs[i] for i in ok], ref)


def test_a_template_failing_on_one_row(tmp_path, tiny_model):  # noqa: F811
    texts = prompt_texts(30, seed=4)
    texts[7] = "tiny"
    inputs = write_prompt_files(str(tmp_path / "in"), 30, files=1, texts=texts)
    out = str(tmp_path / "out")
    tmpl = "Fifth letter {text[4]} of: {text}"
    summary = run_inprocess(job_dict(tiny_model, str(tmp_path / "in"), out,
                                     input={"prompt_column": None, "prompt_template": tmpl},
                                     output={"include_prompt": True}))
    assert summary["error_rows"] == 1
    rows = {r[0]: r for r in results(out)}
    assert rows["r00007"][2] == "error" and "IndexError" in rows["r00007"][3]
    ok = [i for i in range(30) if i != 7]
    ref = reference(tiny_model, [tmpl.format(text=texts[i]) for i in ok])
    assert_matches_reference([rows[inputs[i]["id"]] for i in ok], [inputs[i] for i in ok], ref)
    prompts = dict(duckdb.connect().execute(f"SELECT id, prompt FROM read_parquet('{out}/*.parquet')").fetchall())
    assert prompts["r00003"] == tmpl.format(text=texts[3]) and prompts["r00007"] is None


def test_chat_messages_from_jsonl_with_a_rejected_row(tmp_path, tiny_model):  # noqa: F811
    from batchrun.api import LLM
    from batchrun.outputs import SamplingParams
    convs = [[{"role": "user", "content": t}] for t in prompt_texts(12, seed=5)]
    convs[3] = [{"role": "oracle", "content": "hm"}]
    with open(tmp_path / "c.jsonl", "w") as f:
        for i, c in enumerate(convs):
            f.write(json.dumps({"cid": i * 10, "messages": c}) + "\n")
    out = str(tmp_path / "out")
    job = job_dict(tiny_model, str(tmp_path / "c.jsonl"), out, plan={"unit_rows": 5},
                   input={"id_column": "cid", "prompt_column": None, "messages_column": "messages",
                          "passthrough": []})
    assert run_inprocess(job)["error_rows"] == 1
    rows = {r[0]: r for r in results(out)}
    assert rows[30][2] == "error" and "Unknown role oracle" in rows[30][3]
    ok = [i for i in range(12) if i != 3]
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory=32 << 20, swap_space=0)
    ref = llm.chat([convs[i] for i in ok], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    for i, o in zip(ok, ref):
        assert rows[i * 10][1:3] == (o.text, o.finish_reason)


def test_csv_input_without_id_column_gets_row_numbers(tmp_path, tiny_model):  # noqa: F811
    texts = prompt_texts(25, seed=6)
    for k in range(2):
        with open(tmp_path / f"t{k}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows([t, k] for t in texts[k * 13:(k + 1) * 13])
    out = str(tmp_path / "out")
    run_inprocess(job_dict(tiny_model, str(tmp_path / "*.csv"), out, plan={"unit_rows": 6},
                           input={"id_column": None, "passthrough": ["label"]}))
    got = duckdb.connect().execute(f"SELECT id, output, label FROM read_parquet('{out}/*.parquet') ORDER BY id").fetchall()
    ref = reference(tiny_model, texts)
    assert [g[0] for g in got] == list(range(25))
    assert [g[1] for g in got] == [o.text for o in ref]
    assert [g[2] for g in got] == [0] * 13 + [1] * 12


def test_duplicate_ids_are_kept_one_row_per_input_row(tmp_path, tiny_model):  # noqa: F811
    """Documented behaviour: ids are the user's; a duplicated id yields one output row per input row."""
    texts = prompt_texts(20, seed=7)
    rows = [{"id": f"dup{i % 7}", "text": t, "n": i} for i, t in enumerate(texts)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    out = str(tmp_path / "out")
    run_inprocess(job_dict(tiny_model, str(tmp_path / "d.parquet"), out, plan={"unit_rows": 6},
                           input={"passthrough": ["n"]}))
    con = duckdb.connect()
    assert con.execute(f"SELECT count(*), count(DISTINCT id), count(DISTINCT n) FROM "
                       f"read_parquet('{out}/*.parquet')").fetchone() == (20, 7, 20)
    got = dict(con.execute(f"SELECT n, output FROM read_parquet('{out}/*.parquet')").fetchall())
    ref = reference(tiny_model, texts)
    assert [got[i] for i in range(20)] == [o.text for o in ref]


def test_order_length_and_input_give_the_same_results(tmp_path, tiny_model):  # noqa: F811
    write_prompt_files(str(tmp_path / "in"), 120, files=2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_inprocess(job_dict(tiny_model, str(tmp_path / "in"), a, plan={"order": "length", "unit_rows": 30}))
    run_inprocess(job_dict(tiny_model, str(tmp_path / "in"), b, plan={"order": "input", "unit_rows": 30}))
    assert results(a) == results(b)


def test_memory_filesystem_end_to_end(tiny_model):  # noqa: F811
    fs = fsspec.filesystem("memory")
    texts = prompt_texts(90, seed=8)
    for k in range(3):
        with fs.open(f"/jobtest/in/p{k}.parquet", "wb") as f:
            pq.write_table(pa.table({"id": list(range(k * 30, (k + 1) * 30)), "text": texts[k * 30:(k + 1) * 30]}),
                           f, row_group_size=10)
    job = job_dict(tiny_model, "memory://jobtest/in/*.parquet", "memory://jobtest/out",
                   input={"passthrough": []}, plan={"unit_rows": 20})
    try:
        summary = run_inprocess(job)
        assert summary["rows"] == 90 and summary["output"] == "memory://jobtest/out"
        assert fs.exists("/jobtest/out/_SUCCESS") and fs.exists("/jobtest/out/_batchrun/manifest.json")
        con = duckdb.connect()
        con.register_filesystem(fs)
        got = con.execute("SELECT id, output FROM read_parquet('memory://jobtest/out/*.parquet') ORDER BY id").fetchall()
        assert [g[0] for g in got] == list(range(90))
        assert [g[1] for g in got] == [o.text for o in reference(tiny_model, texts)]
        assert run_inprocess(job)["units_committed"] == 0
    finally:
        fs.rm("/jobtest", recursive=True)


def test_status_from_another_process_while_the_job_runs(tmp_path, tiny_model):  # noqa: F811
    write_prompt_files(str(tmp_path / "in"), 400, files=2, row_group_size=20)
    out = str(tmp_path / "out")
    job = write_job(str(tmp_path / "job.yaml"), job_dict(tiny_model, "in", "out", plan={"unit_rows": 20}))
    proc = popen_cli("submit", job, "--no-progress")
    progress = os.path.join(out, "_batchrun", "progress.json")
    try:
        deadline = time.time() + 120
        while not os.path.exists(progress) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)        # freeze it mid-run: status must read it from outside
        p = cli("status", out, "--json")
        st = json.loads(p.stdout)
        assert p.returncode == 0 and st["state"] == "running", st
        assert st["units_total"] == 20 and st["rows_total"] == 400 and st["units_done"] < 20
        assert st["pid"] == proc.pid
        text = cli("status", job).stdout
        assert "running" in text and "rows" in text
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=120) == 0
    st = json.loads(cli("status", out, "--json").stdout)
    assert st["state"] == "finished" and st["units_done"] == 20 and st["rows_done"] == 400


def test_a_bad_line_found_mid_job_is_an_error_row_naming_file_and_line(tmp_path, tiny_model):  # noqa: F811
    texts = prompt_texts(150, seed=9)
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    lines[120] = '{"id": 120, "text": "unterminated'
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    job = job_dict(tiny_model, str(tmp_path / "p.jsonl"), out, plan={"unit_rows": 25, "window_units": 1},
                   input={"passthrough": []})
    summary = run_inprocess(job)                     # the job goes on (issue 6): one error row, the rest run
    assert summary["rows"] == 150 and summary["error_rows"] == 1
    rows = results(out)
    assert sorted(r[0] for r in rows if r[0] is not None) == [i for i in range(150) if i != 120]
    (bad,) = [r for r in rows if r[0] is None]
    assert bad[2] == "error" and bad[3].startswith(f"{tmp_path / 'p.jsonl'}: line 121: not valid JSON")
