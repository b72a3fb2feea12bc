"""The job on Ray: two CPU replicas of a tiny random model on a local Ray the tests start (once for the
module). Oracle: the single-process run of the same job. Every test checks every id exactly once
(count(*) = count(DISTINCT id) = N) and the outputs equal to the oracle's.

Faults are real: ray.kill of an actor, SIGKILL of its worker process, SIGKILL of a `batchrun submit
--ray` driver subprocess (then re-submitted with and without Ray), a Parquet column chunk overwritten
with garbage."""
from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pyarrow.parquet as pq
import ray
import pytest

from batchrun.job.plan import make_plan
from batchrun.job.run import JobRunner
from batchrun.job.spec import JobError, parse_job
from batchrun.job.status import format_status, job_status
from s3util import BUCKET, s3  # noqa: F401
from test_job_common import cli, counts, job_dict, popen_cli, results, tiny_model, write_job, write_prompt_files  # noqa: F401,E501


N = 320
UNIT_ROWS = 20
UNITS = N // UNIT_ROWS
RUNTIME = {"backend": "ray", "replicas": 2, "cpus_per_replica": 1, "max_restarts": 2, "max_unit_attempts": 2,
           "units_in_flight": 2}


@pytest.fixture(scope="module")
def cluster(s3):  # noqa: F811
    """One local Ray for the module: 2 CPUs, one per replica. Yields its address for subprocess drivers.
    Started after the S3 server, so the replicas inherit its credential variables as workers started by
    `ray start` inherit that shell's environment."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model, cluster):  # noqa: F811
    d = tmp_path_factory.mktemp("ray")
    write_prompt_files(str(d / "in"), N, files=2, row_group_size=UNIT_ROWS, seed=5)
    job = job_dict(tiny_model, str(d / "in"), str(d / "ref"), plan={"unit_rows": UNIT_ROWS, "window_units": 1},
                   engine={"max_num_seqs": 16}, runtime=dict(RUNTIME))
    # the oracle: the same job, single process
    local = {**job, "runtime": {"backend": "local"}}
    JobRunner(make_plan(parse_job(local, "<ref>", "/")), progress_bar=False).run()
    ref = results(str(d / "ref"))
    assert len(ref) == N
    return d, job, ref


def ray_runner(job: dict, out: str):
    from batchrun.job.ray_runner import RayJobRunner
    return RayJobRunner(make_plan(parse_job({**job, "output": {"uri": out}}, "<ray>", "/")), progress_bar=False)


def check_exactly_once(out: str, ref: list) -> None:
    assert counts(out) == (N, N)
    assert results(out) == ref
    assert os.path.exists(os.path.join(out, "_SUCCESS"))
    assert len(os.listdir(os.path.join(out, "_batchrun", "done"))) == UNITS


def test_ray_job_equals_the_single_process_run(setup):
    d, job, ref = setup
    out = str(d / "clean")
    summary = ray_runner(job, out).run()
    check_exactly_once(out, ref)
    # the local summary's shape, plus per-replica rows that add up to it
    local_keys = json.load(open(d / "ref" / "_batchrun" / "summary.json")).keys()
    assert set(local_keys) <= set(summary)
    assert summary["backend"] == "ray" and len(summary["replicas"]) == 2
    assert sum(r["units_committed"] for r in summary["replicas"]) == UNITS == summary["units_committed"]
    assert sum(r["rows_committed"] for r in summary["replicas"]) == N == summary["rows"]
    assert summary["replica_restarts"] == summary["units_requeued"] == 0
    assert len({r["pid"] for r in summary["replicas"]}) == 2
    # `batchrun status` aggregates the replicas (progress.json written by the driver)
    st = cli("status", out, "--json")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["state"] == "finished" and status["rows_done"] == N
    assert [r["replica"] for r in status["replicas"]] == [0, 1]
    text = format_status(job_status(out))
    assert "replica 0" in text and "replica 1" in text


def kill_mid_job(job: dict, out: str, how: str) -> dict:
    """Run on Ray in a thread; once a replica has committed a unit and holds others, kill it."""
    runner = ray_runner(job, out)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(summary=runner.run()), daemon=True)
    t.start()
    deadline = time.time() + 180
    victim = None
    while victim is None:
        assert t.is_alive() and time.time() < deadline, "the job ended before a replica could be killed"
        for rep in runner.replicas:
            if rep.state == "running" and rep.cur.get("units_committed", 0) >= 1 and rep.assigned:
                victim = rep
                break
        time.sleep(0.005)
    if how == "ray.kill":
        ray.kill(victim.handle, no_restart=False)
    else:
        os.kill(victim.info["pid"], signal.SIGKILL)
    t.join(timeout=240)
    assert not t.is_alive()
    summary = box["summary"]
    assert summary["replicas"][victim.index]["restarts"] == 1
    return summary


@pytest.mark.parametrize("how", ["ray.kill", "sigkill"])
def test_replica_killed_mid_job_its_units_are_redone_elsewhere(setup, how):
    d, job, ref = setup
    out = str(d / f"kill-{how}")
    summary = kill_mid_job(job, out, how)
    check_exactly_once(out, ref)
    # the dead replica's units were re-queued (or found committed by their markers), none lost
    assert summary["units_requeued"] + summary["units_recovered"] >= 1
    assert summary["replica_restarts"] == 1 and summary["error_rows"] == 0


def test_ray_job_on_object_storage(setup, s3):  # noqa: F811
    """Input and output on S3 (a real S3 API on loopback): each replica reads its units from the bucket
    and commits to it; DuckDB reads back exactly the single-process run's rows."""
    d, job, ref = setup
    fs = s3.fs()
    for name in sorted(os.listdir(d / "in")):
        fs.put_file(str(d / "in" / name), f"{BUCKET}/ray/in/{name}")
    s3_job = {**job, "input": {**job["input"], "uri": s3.url("ray/in/"), "storage_options": s3.options()},
              "output": {"uri": s3.url("ray/out"), "storage_options": s3.options()}}
    from batchrun.job.ray_runner import RayJobRunner
    summary = RayJobRunner(make_plan(parse_job(s3_job, "<s3>", "/")), progress_bar=False).run()
    assert summary["rows"] == N and summary["units_committed"] == UNITS
    import duckdb
    con = duckdb.connect()
    con.register_filesystem(s3.fs())
    got = con.execute(f"SELECT id, output, finish_reason, error, prompt_tokens, output_tokens FROM "
                      f"read_parquet('s3://{BUCKET}/ray/out/*.parquet') ORDER BY id").fetchall()
    assert got == ref
    assert len([p for p in fs.find(f"{BUCKET}/ray/out/_batchrun/done")]) == UNITS


def corrupt_text_chunk(path: str, row_group: int) -> None:
    """Overwrite the start of one row group's `text` column chunk (page header) with garbage; the footer
    stays valid, so planning works and only that row group's prompts are unreadable."""
    md = pq.ParquetFile(path).metadata
    rg = md.row_group(row_group)
    col = next(rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == "text")
    start = col.dictionary_page_offset or col.data_page_offset
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\xff" * 24)


def test_unit_whose_input_keeps_failing_becomes_error_rows(setup):
    d, job, ref = setup
    inp = str(d / "in-corrupt")
    shutil.copytree(d / "in", inp)
    corrupt_text_chunk(os.path.join(inp, "prompts-01.parquet"), 2)
    bad_job = {**job, "input": {**job["input"], "uri": inp}}
    plan = make_plan(parse_job({**bad_job, "output": {"uri": str(d / "unused")}}, "<p>", "/"))
    bad = next(u for u in plan.units if u.path.endswith("prompts-01.parquet") and u.row_start == 2 * UNIT_ROWS)
    with pytest.raises(Exception):           # the premise: the unit's prompts cannot be read
        plan.source.read(bad, ["id", "text"])
    out = str(d / "corrupt")
    summary = ray_runner(bad_job, out).run()
    assert counts(out) == (N, N)
    bad_ids = {f"r{bad.first_row + i:05d}" for i in range(bad.num_rows)}
    got = {r[0]: r for r in results(out)}
    for row in ref:
        if row[0] in bad_ids:
            assert got[row[0]][2] == "error" and got[row[0]][1] is None and got[row[0]][3]
        else:
            assert got[row[0]] == row
    assert summary["error_rows"] == UNIT_ROWS and summary["units_given_up"] == 1
    assert summary["units"] == UNITS and os.path.exists(os.path.join(out, "_SUCCESS"))


def wait_for_markers(proc, out: str, n: int) -> None:
    done = os.path.join(out, "_batchrun", "done")
    deadline = time.time() + 240
    while not (os.path.exists(done) and len(os.listdir(done)) >= n):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.01)


def pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


NO_RAY = "ray-missing"


@pytest.fixture(scope="module")
def no_ray_path(tmp_path_factory):
    """A PYTHONPATH entry whose `ray` package fails to import, as if Ray were not installed."""
    d = tmp_path_factory.mktemp(NO_RAY)
    os.makedirs(d / "ray")
    (d / "ray" / "__init__.py").write_text("raise ImportError('No module named ray (test shim)')\n")
    return str(d)


@pytest.mark.parametrize("resume_with", ["ray", "local"])
def test_driver_killed_then_resubmitted(setup, cluster, no_ray_path, resume_with):
    d, job, ref = setup
    out = str(d / f"driver-{resume_with}")
    path = write_job(str(d / f"driver-{resume_with}.yaml"), {**job, "output": {"uri": out},
                                                              "runtime": {**RUNTIME, "backend": "local"}})
    proc = popen_cli("submit", path, "--ray", cluster, "--no-progress")
    wait_for_markers(proc, out, 3)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert not os.path.exists(os.path.join(out, "_SUCCESS"))
    # the driver's actors die with it (Ray owner fate-sharing): no orphan keeps computing
    prog = json.load(open(os.path.join(out, "_batchrun", "progress.json")))
    pids = [r["pid"] for r in prog["replicas"] if r.get("pid")]
    assert pids
    deadline = time.time() + 60
    while not all(pid_gone(p) for p in pids):
        assert time.time() < deadline, f"replica processes {pids} outlived their driver"
        time.sleep(0.1)
    assert json.loads(cli("status", out, "--json").stdout)["state"] == "failed"
    committed = len(os.listdir(os.path.join(out, "_batchrun", "done")))
    if resume_with == "ray":
        p = cli("submit", path, "--ray", cluster, "--no-progress", "--json")
    else:   # without Ray: not even importable, proving the local path never needs it
        env = {"PYTHONPATH": os.pathsep.join([no_ray_path, os.environ.get("PYTHONPATH", "")])}
        p = cli("submit", path, "--no-progress", "--json", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["units_skipped"] >= committed >= 3
    assert summary["units_committed"] == UNITS - summary["units_skipped"]
    assert summary.get("backend", "local") == ("ray" if resume_with == "ray" else "local")
    check_exactly_once(out, ref)


def test_sigterm_stops_a_ray_driver_with_exit_75_then_resumes(setup, cluster):
    """Ray installs its own SIGTERM handlers in the driver; ours must win: stop admission, commit what is
    complete, exit 75, and leave an output that a re-submit finishes."""
    d, job, ref = setup
    out = str(d / "sigterm")
    path = write_job(str(d / "sigterm.yaml"), {**job, "output": {"uri": out}})
    proc = popen_cli("submit", path, "--ray", cluster, "--no-progress", "--json")
    wait_for_markers(proc, out, 2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["state"] == "interrupted"
    parts = {n for n in os.listdir(out) if n.endswith(".parquet")}
    markers = {f"part-{int(n[:-5]):06d}.parquet" for n in os.listdir(os.path.join(out, "_batchrun", "done"))}
    assert parts == markers and 2 <= len(parts) < UNITS        # nothing half-committed
    assert json.loads(cli("status", out, "--json").stdout)["state"] == "interrupted"
    p = cli("submit", path, "--ray", cluster, "--no-progress", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    check_exactly_once(out, ref)


def test_ray_missing_fails_with_the_extra_named(setup, no_ray_path):
    d, job, _ = setup
    path = write_job(str(d / "noray.yaml"), {**job, "output": {"uri": str(d / "noray")}})
    env = {"PYTHONPATH": os.pathsep.join([no_ray_path, os.environ.get("PYTHONPATH", "")])}
    for args in (["--ray"], ["--ray", "auto"], []):        # [] : runtime.backend: ray in the job file
        p = cli("submit", path, *args, "--no-progress", env=env)
        assert p.returncode == 2, p.stderr
        assert "pip install 'batchrun[ray]'" in p.stderr
    assert not os.path.exists(str(d / "noray"))


def test_runtime_section_is_validated():
    base = {"name": "j", "model": {"path": "/m"}, "input": {"uri": "/i.parquet", "prompt_column": "t"},
            "output": {"uri": "/o"}}
    with pytest.raises(JobError, match="runtime.replica: unknown key, did you mean replicas"):
        parse_job({**base, "runtime": {"replica": 2}})
    with pytest.raises(JobError, match="runtime.backend"):
        parse_job({**base, "runtime": {"backend": "slurm"}})
    with pytest.raises(JobError, match="runtime.replicas"):
        parse_job({**base, "runtime": {"replicas": 0}})


def test_a_dry_replica_steals_queued_units(setup):
    """units_in_flight = all units: the first replica up is handed every unit; the second, up a moment
    later, is dry at once and must steal the first one's assigned-but-unread units instead of idling.
    Batches of 2 sequences (the others run 16) and 6x the module's new tokens, so the job outlasts the
    second replica's start even where the tests' other worker slows that start (the module's job alone
    takes ~1.5 s of engine time); the oracle is the same job's single-process run."""
    d, job, _ = setup
    slow = {**job, "engine": {**job["engine"], "max_num_seqs": 2},
            "sampling": {**job["sampling"], "max_tokens": 6 * job["sampling"]["max_tokens"]}}
    JobRunner(make_plan(parse_job({**slow, "runtime": {"backend": "local"}, "output": {"uri": str(d / "steal_ref")}},
                                  "<ref>", "/")), progress_bar=False).run()
    ref = results(str(d / "steal_ref"))
    out = str(d / "steal")
    s = ray_runner({**slow, "runtime": {**RUNTIME, "units_in_flight": UNITS}}, out).run()
    check_exactly_once(out, ref)
    assert s["units_stolen"] >= 1
    assert all(r["units_committed"] >= 1 for r in s["replicas"])
