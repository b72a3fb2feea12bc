"""Scheduled runs: the example Airflow DAG (jobs/airflow_dag.py), the cron line (jobs/batchrun.cron)
and the README's exit-code table.

Airflow is not installed here (it is large and only the example needs it). The DAG file keeps what can
be checked without it in plain functions: the command it runs is executed for real, the way Airflow's
SubprocessHook runs it (`bash -c`, stderr merged into stdout, the last line to XCom); the Airflow-only
part (operator subclass, DAG arguments) is checked on the file's syntax tree. The cron line is run for
real, twice at once, under flock.
"""
from __future__ import annotations

import ast
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from batchrun.job import run as run_mod
from batchrun.job.lock import STALE_AFTER_S
from test_job_common import REPO, counts, job_dict, tiny_model, write_job, write_prompt_files  # noqa: F401

DAG_FILE = os.path.join(REPO, "jobs", "airflow_dag.py")
CRON_FILE = os.path.join(REPO, "jobs", "batchrun.cron")
N = 60


def load_dag_module():
    spec = importlib.util.spec_from_file_location("batchrun_example_dag", DAG_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def shell_env(**extra) -> dict:
    """The environment of a scheduler's shell: `batchrun` on PATH (this interpreter's scripts dir)."""
    bindir = os.path.dirname(sys.executable)
    assert shutil.which("batchrun", path=bindir), f"no batchrun console script in {bindir} (pip install -e .)"
    return {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}", "OMP_NUM_THREADS": "2",
            **extra}


def run_like_airflow(command: str, env: dict) -> tuple[int, str]:
    """What Airflow's SubprocessHook does: bash -c, stdout and stderr in one stream."""
    p = subprocess.run(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=300, cwd="/")
    return p.returncode, p.stdout


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model):  # noqa: F811
    d = tmp_path_factory.mktemp("sched")
    write_prompt_files(str(d / "in"), N, files=2, row_group_size=10, seed=3)
    path = write_job(str(d / "job.yaml"), job_dict(tiny_model, str(d / "in"), str(d / "default-out"),
                                                   plan={"unit_rows": 10, "window_units": 2}))
    return d, path


# -- exit codes ---------------------------------------------------------------------------------------
def test_the_dag_and_the_readme_agree_with_batchrun_exit_codes():
    mod = load_dag_module()
    codes = {v for k, v in vars(run_mod).items() if k.startswith("EXIT_")}
    # every failure code is classified by the DAG, once; the permanent ones are exactly these three
    assert sorted(mod.RETRY_EXIT_CODES + mod.PERMANENT_EXIT_CODES) == sorted(codes - {run_mod.EXIT_OK})
    assert mod.PERMANENT_EXIT_CODES == (run_mod.EXIT_BAD_JOB, run_mod.EXIT_INPUT, run_mod.EXIT_FINGERPRINT)
    assert {run_mod.EXIT_UNEXPECTED, run_mod.EXIT_LOCKED, run_mod.EXIT_INTERRUPTED} <= set(mod.RETRY_EXIT_CODES)
    readme = open(os.path.join(REPO, "README.md")).read()
    table = readme.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \|(.*)$", table, re.M)}
    assert set(rows) == codes                                   # every code documented, none invented
    for c in mod.PERMANENT_EXIT_CODES:
        assert "not retry" in rows[c]
    for c in mod.RETRY_EXIT_CODES:
        assert "retry" in rows[c] and "not retry" not in rows[c]


# -- the Airflow DAG ------------------------------------------------------------------------------------
def test_dag_file_parses_and_imports_without_airflow():
    tree = ast.parse(open(DAG_FILE).read(), DAG_FILE)
    mod = load_dag_module()                  # importing it needs no Airflow (and no batchrun)
    assert mod.submit_command("/j/job.yaml") == "batchrun submit /j/job.yaml --json --no-progress"

    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    op = classes["BatchrunSubmitOperator"]
    assert [b.id for b in op.bases] == ["BashOperator"]
    init = next(f for f in op.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    sup = next(c for c in ast.walk(init) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
               and c.func.attr == "__init__")
    kw = {k.arg: k.value for k in sup.keywords}
    assert isinstance(kw["skip_on_exit_code"], ast.Name) and kw["skip_on_exit_code"].id == "PERMANENT_EXIT_CODES"
    assert kw["bash_command"].func.id == "submit_command"
    execute = next(f for f in op.body if isinstance(f, ast.FunctionDef) and f.name == "execute")
    handler = next(h for h in ast.walk(execute) if isinstance(h, ast.ExceptHandler))
    assert handler.type.id == "AirflowSkipException"           # the permanent codes, and only those ...
    raised = next(n for n in ast.walk(handler) if isinstance(n, ast.Raise))
    assert raised.exc.func.id == "AirflowFailException"         # ... fail the task without a retry

    dag = next(c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "DAG")
    dkw = {k.arg: k.value for k in dag.keywords}
    assert ast.literal_eval(dkw["max_active_runs"]) == 1
    args = {ast.literal_eval(k): v for k, v in zip(dkw["default_args"].keys, dkw["default_args"].values)}
    assert ast.literal_eval(args["retries"]) >= 1
    delay = eval(compile(ast.Expression(args["retry_delay"]), DAG_FILE, "eval"), {"timedelta": timedelta})
    assert delay.total_seconds() > STALE_AFTER_S   # a retry comes after a dead run's lock went stale
    task = next(c for c in ast.walk(tree) if isinstance(c, ast.Call)
                and getattr(c.func, "id", None) == "BatchrunSubmitOperator")
    assert {k.arg for k in task.keywords} >= {"task_id", "job_file", "sets"}
    sensors = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and "Sensor" in n.id]
    assert not sensors


def test_dag_command_runs_the_job_and_its_last_line_is_the_summary(job):
    d, path = job
    mod = load_dag_module()
    out = str(d / "airflow-out")
    env = shell_env()
    cmd = mod.submit_command(path, [f"output.uri={out}"])
    assert "--json" in cmd
    rc, output = run_like_airflow(cmd, env)
    assert rc == 0, output[-3000:]
    summary = mod.parse_summary(output)                  # what goes to XCom
    assert summary["ok"] is True and summary["exit_code"] == 0 and summary["rows"] == N
    assert summary["output"].rstrip("/") == out
    assert counts(out) == (N, N)
    # a retry of a run that already succeeded: it resumes, commits nothing again, and reports the same
    rc, output = run_like_airflow(cmd, env)
    assert rc == 0, output[-3000:]
    again = mod.parse_summary(output)
    assert again["units_committed"] == 0 and again["rows"] == N and counts(out) == (N, N)
    # a permanent failure: a code the operator does not retry, and still a JSON last line
    rc, output = run_like_airflow(mod.submit_command(path, ["engine.max_num_seq=4"]), env)
    assert rc in mod.PERMANENT_EXIT_CODES
    failed = mod.parse_summary(output)
    assert failed["ok"] is False and failed["exit_code"] == rc and "max_num_seq" in failed["error"]


def test_pod_command_copies_the_summary_to_the_xcom_file_and_keeps_the_exit_code(job, tmp_path):
    d, path = job
    mod = load_dag_module()
    env = shell_env()
    xcom, stdout = str(tmp_path / "return.json"), str(tmp_path / "stdout")
    rc, _ = run_like_airflow(mod.pod_command(path, ["engine.max_num_seq=4"], xcom, stdout), env)
    assert rc == run_mod.EXIT_BAD_JOB
    assert json.load(open(xcom))["exit_code"] == run_mod.EXIT_BAD_JOB
    out = str(d / "pod-out")
    rc, output = run_like_airflow(mod.pod_command(path, [f"output.uri={out}"], xcom, stdout), env)
    assert rc == 0, output[-3000:]
    assert json.load(open(xcom))["rows"] == N and counts(out) == (N, N)


# -- cron -------------------------------------------------------------------------------------------
FIELD_RANGES = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]


def valid_field(field: str, lo: int, hi: int) -> bool:
    for part in field.split(","):
        rng, _, step = part.partition("/")
        if step and not (step.isdigit() and int(step) > 0):
            return False
        if rng == "*":
            continue
        a, _, b = rng.partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            return False
        if not (lo <= int(a) <= hi and (not b or int(a) <= int(b) <= hi)):
            return False
    return True


def cron_command(text: str) -> str:
    """A crontab command as /bin/sh receives it: `\\%` is `%`; an unescaped `%` would start stdin."""
    assert not re.search(r"(?<!\\)%", text), "unescaped % in a crontab command"
    return text.replace("\\%", "%")


def parse_crontab(path: str) -> tuple[dict, list[tuple[list[str], str]]]:
    env, entries = {}, []
    for line in open(path).read().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$", s)
        if m:
            env[m.group(1)] = m.group(2)
            continue
        fields = s.split(None, 5)
        assert len(fields) == 6, f"{path}: not a 5-field schedule and a command: {line!r}"
        for f, (lo, hi) in zip(fields[:5], FIELD_RANGES):
            assert valid_field(f, lo, hi), f"{path}: bad schedule field {f!r} in {line!r}"
        entries.append((fields[:5], cron_command(fields[5])))
    return env, entries


def test_crontab_syntax():
    env, entries = parse_crontab(CRON_FILE)
    assert entries and {"JOB", "LOCK", "LOG", "OUT_ROOT", "PATH"} <= set(env)
    for _, cmd in entries:
        assert cmd.startswith('flock -n -E 73 "$LOCK" batchrun submit "$JOB" --json')
        assert str(run_mod.EXIT_LOCKED) in cmd.split()


def test_cron_line_started_twice_runs_batchrun_once(job, tmp_path):
    assert shutil.which("flock"), "flock (util-linux) is needed by jobs/batchrun.cron"
    _, path = job
    cron_env, entries = parse_crontab(CRON_FILE)
    cmd = entries[0][1]
    root = str(tmp_path / "out")
    base = shell_env(JOB=path, OUT_ROOT=root, LOCK=str(tmp_path / "job.lock"))
    first = subprocess.Popen(["/bin/sh", "-c", cmd], env={**base, "LOG": str(tmp_path / "first.log")})
    deadline = time.time() + 180
    while not glob.glob(f"{root}/*/_batchrun/lock.json"):   # batchrun itself is running under flock
        assert first.poll() is None, open(tmp_path / "first.log").read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.005)
    (lock,) = glob.glob(f"{root}/*/_batchrun/lock.json")
    pid = json.load(open(lock))["pid"]
    os.kill(pid, signal.SIGSTOP)                            # keep the first run alive and busy
    try:
        second = subprocess.run(["/bin/sh", "-c", cmd], env={**base, "LOG": str(tmp_path / "second.log")},
                                timeout=60)
        assert second.returncode == run_mod.EXIT_LOCKED
        assert open(tmp_path / "second.log").read() == ""   # flock refused: batchrun never started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert first.wait(timeout=300) == 0, open(tmp_path / "first.log").read()[-3000:]
    out = os.path.dirname(os.path.dirname(lock))
    summary = json.loads(open(tmp_path / "first.log").read().strip().splitlines()[-1])
    assert summary["rows"] == N and counts(out) == (N, N)
    # a later tick the same day: the job is finished, so nothing runs again
    third = subprocess.run(["/bin/sh", "-c", cmd], env={**base, "LOG": str(tmp_path / "third.log")}, timeout=300)
    assert third.returncode == 0
    assert json.loads(open(tmp_path / "third.log").read().strip().splitlines()[-1])["units_committed"] == 0
    assert counts(out) == (N, N)
