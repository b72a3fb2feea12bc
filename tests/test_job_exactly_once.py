"""Issue 14 item 4: exactly-once gaps, each with real processes, real signals and moto's S3 on loopback.

  * two live workers on one unit: the second never replaces the part file the first one's done marker
    describes (part files are created create-only);
  * a run that lost its lock while frozen mid-commit (a zombie: its host was silent, so another run
    took the lock over) commits nothing when it wakes, so no marker can vouch for a part that the new
    run's ledger open removed;
  * SIGTERM while the lock is held but the ledger is still opening: exit 75 and the lock released;
  * per-row max_tokens (OpenAI Batch max_completion_tokens) counts in the length order;
  * the traceback of an unexpected error (exit 1), in its log file, carries no credential.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest

from batchrun.connectors import ParquetSink
from batchrun.connectors.secrets import redact
from batchrun.job.commit import WRITER_KEY
from batchrun.job.ledger import Ledger
from batchrun.job.lock import LOCK
from batchrun.job.plan import make_plan
from batchrun.job.run import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNEXPECTED, JobRunner
from batchrun.job.spec import parse_job
from s3util import BUCKET, FaultyProxy, s3  # noqa: F401
from test_job_common import (REPO, wait_for, cli, counts, job_dict, popen_cli, reference_output, results,  # noqa: F401
                             tiny_model, write_job)

# -- two live workers on one unit -----------------------------------------------------------------------
WORKER = r"""
import json, os, sys, time
import pyarrow as pa
from batchrun.connectors import ParquetSink
from batchrun.job.commit import UnitCommitter
from batchrun.job.ledger import Ledger
uri, opts, name, sync = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
def touch(n):
    open(os.path.join(sync, n), "w").close()
def wait(n):
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(sync, n)):
        assert time.time() < deadline, n
        time.sleep(0.01)
led = Ledger(ParquetSink(uri, opts or None))
t = pa.table({"id": [1, 2, 3], "output": [name] * 3})
def at(point, *steps):       # the committer's crash points, used here as sync points
    return lambda p: [s() for s in steps] if p == point else None
if name == "a":      # publishes its part, then waits until b has checked for a marker (none yet)
    m = UnitCommitter(led, crash=at("after_part", lambda: touch("a_published"), lambda: wait("b_checked"))
                      ).commit(0, t, {}, {"rows": 3})
    touch("a_marked")
else:                # checks for a marker while a's part is out, then publishes after a's marker is in
    wait("a_published")
    m = UnitCommitter(led, crash=at("mid_write", lambda: touch("b_checked"), lambda: wait("a_marked"))
                      ).commit(0, t, {}, {"rows": 3})
print(json.dumps(m is not None))
"""


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_second_live_worker_never_replaces_the_part_a_marker_describes(s3, tmp_path, where):  # noqa: F811
    uri = s3.url("two-live/out") if where == "s3" else str(tmp_path / "out")
    opts = s3.options() if where == "s3" else {}
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = {n: subprocess.Popen([sys.executable, "-c", WORKER, uri, json.dumps(opts), n, str(sync)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for n in ("a", "b")}
    out = {n: p.communicate(timeout=300) for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, out[n][1][-3000:]
    assert json.loads(out["a"][0]) is True and json.loads(out["b"][0]) is False     # a committed, b did not
    led = Ledger(ParquetSink(uri, opts or None, create=False))
    marker = led.done_markers()[0]
    data = led.fs.cat_file(led.sink.path("part-000000.parquet"))
    assert hashlib.sha256(data).hexdigest() == marker["sha256"] and len(data) == marker["bytes"]
    assert set(pq.read_table(led.fs.open(led.sink.path("part-000000.parquet"))).column("output").to_pylist()) == {"a"}
    assert list(led.sink.list_parts()) == ["part-000000.parquet"]


# -- a zombie holder wakes up after a takeover ---------------------------------------------------------------
N, UNIT_ROWS = 240, 20
UNITS = N // UNIT_ROWS


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):  # noqa: F811
    d = tmp_path_factory.mktemp("exactly-once")
    job, ref = reference_output(d, tiny_model, N, unit_rows=UNIT_ROWS, seed=21)
    return d, job, ref


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_zombie_holder_commits_nothing_after_a_takeover(setup):
    """A freezes right after publishing its third part (no marker yet). Its host is then made to look
    silent for an hour, so B takes the lock over, opens the ledger (removing A's marker-less part) and
    freezes after its first step. A wakes: before, it wrote the marker of the part B had removed, and B
    then skipped that unit as committed: its rows were lost. Now A finds the lock gone and stops."""
    d, job, ref = setup
    out = str(d / "zombie")
    path = write_job(str(d / "zombie.yaml"), {**job, "output": {"uri": out}})
    a = popen_cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_STOP_AT": "after_part:3"})
    b = None
    try:
        wait_for(lambda: stopped(a.pid), a, "A frozen after its third part")
        lock = os.path.join(out, LOCK)
        rec = json.load(open(lock))
        rec.update(process_space="another-host|boot|pid:[1]", host="another-host", heartbeat_at=time.time() - 3600)
        with open(lock + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(lock + ".tmp", lock)
        b = popen_cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_STOP_AT": "step:1"})
        wait_for(lambda: stopped(b.pid), b, "B frozen after its first step")
        os.kill(a.pid, signal.SIGCONT)
        _, a_err = a.communicate(timeout=240)
        assert a.returncode == EXIT_INTERRUPTED, a_err[-3000:]
        assert "no longer held by this run" in a_err or "no longer ours" in a_err, a_err[-3000:]
        os.kill(b.pid, signal.SIGCONT)
        _, b_err = b.communicate(timeout=300)
        assert b.returncode == EXIT_OK, b_err[-3000:]
        assert "taking over the stale lock" in b_err
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    assert counts(out) == (N, N) and results(out) == ref
    led = Ledger(ParquetSink(out))
    assert len(led.done_markers(verify=True)) == UNITS      # every marker's files are there, of its size
    writers = {json.loads(pq.read_metadata(os.path.join(out, n)).metadata[WRITER_KEY.encode()])["pid"]
               for n in led.sink.list_parts()}
    assert writers <= {a.pid, b.pid}


# -- SIGTERM while the ledger opens --------------------------------------------------------------------------
def test_sigterm_while_the_ledger_opens_releases_the_lock(setup, s3, tmp_path):  # noqa: F811
    """The proxy in front of S3 holds the manifest PUT (the ledger opening, under the lock) until the
    process has been sent SIGTERM: exit 75, the lock released, and a re-submit finishes the job."""
    d, job, ref = setup
    reached, release = threading.Event(), threading.Event()

    def rule(r):
        if r.method == "PUT" and r.key.endswith("sigterm-open/out/_batchrun/manifest.json") and not release.is_set():
            reached.set()
            release.wait(120)
        return None
    proxy = FaultyProxy(s3.endpoint, rule).start()
    try:
        s3job = {**job, "output": {"uri": s3.url("sigterm-open/out"), "storage_options": s3.options(proxy.endpoint)}}
        path = write_job(str(tmp_path / "job.yaml"), s3job)
        p = popen_cli("submit", path, "--no-progress", "--json")
        wait_for(reached.is_set, p, "the manifest PUT")
        assert s3.fs().exists(f"{BUCKET}/sigterm-open/out/{LOCK}")
        p.send_signal(signal.SIGTERM)
        release.set()
        stdout, stderr = p.communicate(timeout=240)
    finally:
        release.set()
        proxy.stop()
    assert p.returncode == EXIT_INTERRUPTED, (p.returncode, stderr[-3000:])
    assert json.loads(stdout.strip().splitlines()[-1])["state"] == "interrupted"
    assert not s3.fs().exists(f"{BUCKET}/sigterm-open/out/{LOCK}")
    s3job["output"]["storage_options"] = s3.options()          # the proxy is gone: straight to the server
    r = cli("submit", write_job(str(tmp_path / "job.yaml"), s3job), "--no-progress", "--json")
    assert r.returncode == EXIT_OK and "taking over" not in r.stderr, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["rows"] == N


# -- per-row max_tokens in the length order --------------------------------------------------------------------
def test_length_order_counts_each_rows_own_max_tokens(tmp_path, tiny_model):  # noqa: F811
    """OpenAI Batch rows whose max_completion_tokens shrink as their prompts grow: the engine must get
    them longest (prompt + that row's max_tokens) first, not by prompt length alone (max tokens shrink by 6
    a row, prompts grow by 4 words: the two orders are opposite)."""
    lines = []
    for i in range(24):
        words = "please summarise the following list of words carefully: " + " ".join(["word"] * (3 + 4 * i))
        body = {"messages": [{"role": "user", "content": words}], "max_completion_tokens": 4 + 6 * (23 - i)}
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    job = job_dict(tiny_model, str(tmp_path / "batch.jsonl"), str(tmp_path / "out"),
                   plan={"unit_rows": 12, "window_units": 2}, engine={"max_num_seqs": 4})
    job["input"] = {"uri": str(tmp_path / "batch.jsonl"), "format": "openai_batch"}     # one window, one prefix
    runner = JobRunner(make_plan(parse_job(job, "<t>", "/")), progress_bar=False)
    added = []

    def engine(tokenizer):
        eng = runner._default_engine(tokenizer)
        add = eng.add_request

        def record(rid, ids, params, prompt=None):
            added.append(len(ids) + params.max_tokens)
            return add(rid, ids, params, prompt=prompt)
        eng.add_request = record
        return eng
    runner.engine_factory = engine
    assert runner.run()["rows"] == 24
    assert len(added) == 24 and added == sorted(added, reverse=True), added


# -- the traceback of an unexpected error ----------------------------------------------------------------------
def test_n_samples_are_committed_exactly_once_across_sigkill_and_resume(tmp_path, tiny_model):  # noqa: F811
    """n=3: every input row is n output rows (id, sample_index 0..2), an error row too; a SIGKILL after the
    second unit's marker and a resume leave each (id, sample_index) exactly once, equal to the uninterrupted
    run, and the summary counts input rows (the ledger's markers: rows and output_rows = rows x n)."""
    import duckdb
    from test_job_common import prompt_texts, write_prompt_files
    n, rows = 3, 40
    texts = prompt_texts(rows, 5)
    texts[7] = None            # an error row: n of them
    write_prompt_files(str(tmp_path / "in"), rows, files=2, row_group_size=10, texts=texts)
    sampling = {"n": n, "temperature": 1.0, "seed": 9, "max_tokens": 4, "logprobs": 1}
    ref_job = job_dict(tiny_model, str(tmp_path / "in"), str(tmp_path / "ref"), sampling=sampling,
                       plan={"unit_rows": 10, "window_units": 1}, engine={"max_num_seqs": 8})
    summary = JobRunner(make_plan(parse_job(ref_job, "<ref>", "/")), progress_bar=False).run()
    assert summary["rows"] == rows
    job = write_job(str(tmp_path / "job.yaml"), {**ref_job, "output": {"uri": str(tmp_path / "out")}})
    p = cli("submit", job, "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "after_done:2"})
    assert p.returncode == -9, p.stderr[-2000:]
    assert cli("submit", job, "--no-progress").returncode == 0
    q = ("SELECT id, sample_index, output, finish_reason, error, logprobs FROM read_parquet('{}/*.parquet') "
         "ORDER BY id, sample_index")
    got, want = (duckdb.connect().execute(q.format(tmp_path / d)).fetchall() for d in ("out", "ref"))
    assert [r[:5] for r in got] == [r[:5] for r in want] and len(got) == rows * n
    for g, w in zip(got, want):      # float32 logprobs of other batch shapes
        assert (g[5] is None) == (w[5] is None) and (g[5] is None or (
            [x["token_id"] for x in g[5]] == [x["token_id"] for x in w[5]]
            and max(abs(x["logprob"] - y["logprob"]) for x, y in zip(g[5], w[5])) < 1e-4))
    assert len({(r[0], r[1]) for r in got}) == rows * n
    assert {r[1] for r in got} == set(range(n))
    assert [(r[0], r[1]) for r in got if r[3] == "error"] == [("r00007", k) for k in range(n)]
    led = Ledger(ParquetSink(str(tmp_path / "out"), None, create=False))
    markers = led.done_markers().values()
    assert sum(m["rows"] for m in markers) == rows and sum(m["output_rows"] for m in markers) == rows * n


def test_the_traceback_of_an_unexpected_error_carries_no_credential(setup, s3, tmp_path, monkeypatch):  # noqa: F811
    """A KMS key id of the wrong type (a list) makes botocore raise ParamValidationError quoting the
    value: an unexpected error (exit 1) whose traceback used to print the key."""
    d, job, _ = setup
    monkeypatch.setenv("BATCHRUN_TEST_SSE_KEY", "sse-c-0123456789abcdef")
    opts = s3.options(s3_additional_kwargs={"SSEKMSKeyId": ["${BATCHRUN_TEST_SSE_KEY}"]})
    path = write_job(str(tmp_path / "job.yaml"), {**job, "output": {"uri": s3.url("tb/out"), "storage_options": opts}})
    p = cli("submit", path, "--no-progress", "--json")
    assert p.returncode == EXIT_UNEXPECTED, (p.returncode, p.stderr[-3000:])
    # one line on stderr pointing at the log file that holds the traceback (the output is on S3: a temp file)
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr[-3000:]
    log = re.search(r"\(traceback in (\S+\.log)\)", p.stderr).group(1)
    with open(log, encoding="utf-8") as f:
        text = f.read()
    os.remove(log)
    assert "Traceback" in text and "ParamValidationError" in text, text[-3000:]
    for secret in ("sse-c-0123456789abcdef", s3.key, s3.secret):
        assert secret not in p.stderr and secret not in p.stdout and secret not in text
    assert "***" in text


def test_credential_like_environment_variables_are_redacted(monkeypatch):
    """A provider chain reads AWS_SECRET_ACCESS_KEY and friends without any ${VAR} in the job: their
    values are scrubbed too; ordinary variables (TOKENIZERS_PARALLELISM=false) are not."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "DefaultEndpointsProtocol=https;AccountKey=abc123xyz")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    text = ("denied for wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY with "
            "DefaultEndpointsProtocol=https;AccountKey=abc123xyz: false")
    assert redact(text) == "denied for *** with ***: false"


# -- the takeover path: a part without a marker ----------------------------------------------------------------
def test_a_marker_less_part_is_replaced_only_once_its_writer_is_gone(s3, tmp_path):  # noqa: F811
    """Unit 0's part is on S3 without a marker, written (says its metadata) by a live process of this
    run on this machine: the commit waits, leaving it alone, until that process is killed, then replaces
    it and writes a marker describing its own bytes. A part left by an earlier run (another lock token)
    is replaced at once."""
    import pyarrow as pa
    from batchrun.job.commit import UnitCommitter, writer_identity
    from batchrun.job.lock import pid_start, process_space
    proxy = FaultyProxy(s3.endpoint).start()          # counts the reads of the part's footer
    led = Ledger(ParquetSink(s3.url("takeover/out"), s3.options(proxy.endpoint)))
    sleeper = subprocess.Popen(["sleep", "600"])
    footer_reads = lambda: sum(1 for m, k in list(proxy.requests)  # noqa: E731
                               if m == "GET" and k == "takeover/out/part-000000.parquet")
    try:
        other = {"token": "T", "pid": sleeper.pid, "host": "here", "process_space": process_space(),
                 "pid_start": pid_start(sleeper.pid)}
        led.sink.publish("part-000000.parquet", led.sink.encode(pa.table({"x": [0]}),
                                                                 {WRITER_KEY: json.dumps(other)}))
        got = {}
        t = threading.Thread(target=lambda: got.update(m=UnitCommitter(led, writer_identity("T")).commit(
            0, pa.table({"x": [1, 2]}), {}, {"rows": 2})))
        t.start()
        deadline = time.time() + 120
        while footer_reads() < 6 and t.is_alive() and time.time() < deadline:
            time.sleep(0.02)                            # its writer looked up more than once: it waits
        assert t.is_alive() and footer_reads() >= 6     # waiting on the live writer: nothing replaced
        assert pq.read_table(led.fs.open(led.sink.path("part-000000.parquet"))).num_rows == 1
    finally:
        sleeper.kill()
        sleeper.wait()
    t.join(120)
    proxy.stop()
    assert not t.is_alive() and got["m"] is not None
    data = led.fs.cat_file(led.sink.path("part-000000.parquet"))
    assert hashlib.sha256(data).hexdigest() == led.done_markers()[0]["sha256"]
    # an earlier run's marker-less part: replaced without waiting
    led.sink.publish("part-000001.parquet", led.sink.encode(pa.table({"x": [0]}),
                                                             {WRITER_KEY: json.dumps({**other, "token": "old"})}))
    m = UnitCommitter(led, writer_identity("T")).commit(1, pa.table({"x": [1, 2]}), {}, {"rows": 2})
    assert m is not None and pq.read_table(led.fs.open(led.sink.path("part-000001.parquet"))).num_rows == 2
