"""Example Airflow DAG: run a batchrun job every night; a retry resumes whatever an attempt committed.

Copy this file into your DAGs folder and edit JOB_FILE, OUTPUT_ROOT and the schedule. Airflow 2.6+ or
3.x; batchrun must be installed where the task runs (the DAG file itself never imports batchrun, so
the scheduler parsing it needs neither batchrun nor torch).

Design
- One task, no sensors: `batchrun submit JOB --json` runs the whole job inside the task and exits
  when it is done; nothing polls.
- Retries are safe: results are committed unit by unit, exactly once, and a re-submission skips every
  committed unit (README, "Resuming"). A retry after a lost worker, an OOM kill or a SIGTERM
  (execution_timeout, a cancelled run: batchrun finishes the units in flight and exits 75) loses
  nothing and duplicates nothing.
- Which exit codes a retry can fix (README, "Exit codes"):
      1   unexpected error (a flaky disk, a storage outage)  -> retry
      73  another live run holds the output's lock           -> retry later
      74  object-store I/O failed for good (an outage past the retry budget; also access denied)
                                                             -> retry with backoff
      75  interrupted by SIGTERM/SIGINT                      -> retry; it resumes
      2, 3, 4  bad job file, unusable input or model, output holds another job's results
               -> a retry fails the same way: fail at once.
  A plain BashOperator retries every non-zero exit. BatchrunSubmitOperator below routes 2, 3 and 4
  through skip_on_exit_code (which would otherwise mark the task *skipped*, hiding the failure) and turns
  that into AirflowFailException: the task fails at once, with no retries left to waste.
- XCom: BashOperator pushes the last output line, and batchrun prints its JSON summary as the very
  last line (also on failure). Airflow merges stderr into that output; batchrun writes nothing after
  the summary. execute() returns it parsed, so XCom holds a dict: ti.xcom_pull(task_ids="submit")["rows"].
- Concurrency: max_active_runs=1 keeps two DAG runs from overlapping, and batchrun's own lock
  (`_batchrun/lock.json`) refuses a second live run of the same output anyway (exit 73). A worker
  killed without a word leaves that lock behind; the next attempt takes it over once the dead run's
  heartbeat is 60 s old (at once on the same machine), so retry_delay is longer than that.
"""
from __future__ import annotations

import json
import shlex
from datetime import datetime, timedelta
from typing import Iterable

JOB_FILE = "/opt/batchrun/jobs/summarize-reviews.yaml"     # absolute: the task runs in a temp directory
OUTPUT_ROOT = "s3://my-bucket/batchrun/summaries"          # one output per logical date: {{ ds }}
RETRY_EXIT_CODES = (1, 73, 74, 75)
PERMANENT_EXIT_CODES = (2, 3, 4)


def submit_command(job_file: str, sets: Iterable[str] = (), batchrun: str = "batchrun") -> str:
    """The shell line the task runs: `batchrun submit JOB --json --no-progress [--set k=v ...]`.

    Arguments are shell-quoted; Jinja ({{ ds }}) inside them still renders, since Airflow renders the
    whole bash_command before bash sees it."""
    argv = [batchrun, "submit", job_file, "--json", "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    return " ".join(shlex.quote(a) for a in argv)


def pod_command(job_file: str, sets: Iterable[str] = (), xcom_path: str = "/airflow/xcom/return.json",
                stdout_path: str = "/tmp/batchrun.out") -> str:
    """The KubernetesPodOperator variant's shell line: KPO's XCom is the file /airflow/xcom/return.json,
    not stdout, so batchrun's last stdout line is copied there; batchrun's exit code is kept."""
    out = shlex.quote(stdout_path)
    return (f"{submit_command(job_file, sets)} > {out}; rc=$?; cat {out}; "
            f"tail -n 1 {out} > {shlex.quote(xcom_path)}; exit $rc")


def parse_summary(output: str) -> dict:
    """The JSON summary `batchrun submit --json` printed as its last line."""
    lines = [ln for ln in (output or "").splitlines() if ln.strip()]
    if not lines:
        raise ValueError("batchrun printed nothing: was --json passed?")
    return json.loads(lines[-1])


try:                                    # Airflow is only needed where the DAG is parsed and run
    from airflow.exceptions import AirflowFailException, AirflowSkipException
    try:
        from airflow.providers.standard.operators.bash import BashOperator     # Airflow 3
    except ImportError:
        from airflow.operators.bash import BashOperator                        # Airflow 2
    try:
        from airflow.sdk import DAG                                            # Airflow 3
    except ImportError:
        from airflow import DAG                                                # Airflow 2
except ImportError:
    BashOperator = None


if BashOperator is not None:
    class BatchrunSubmitOperator(BashOperator):
        """BashOperator for `batchrun submit --json`: exit 2, 3 or 4 fails the task without retrying;
        XCom gets the summary as a dict."""

        def __init__(self, *, job_file: str, sets: Iterable[str] = (), **kwargs):
            super().__init__(bash_command=submit_command(job_file, sets),
                             skip_on_exit_code=PERMANENT_EXIT_CODES, **kwargs)

        def execute(self, context):
            try:
                output = super().execute(context)
            except AirflowSkipException as e:       # only PERMANENT_EXIT_CODES get here
                raise AirflowFailException(f"batchrun failed permanently ({e}); retrying cannot help: fix "
                                           "the job file, the input or the output (README: Exit codes)") from e
            return parse_summary(output)

    with DAG(
        dag_id="batchrun_summarize_reviews",
        schedule="0 2 * * *",
        start_date=datetime(2026, 1, 1),
        catchup=False,
        max_active_runs=1,
        default_args={
            "retries": 4,                               # safe: a re-submission resumes
            "retry_delay": timedelta(minutes=5),        # > the 60 s after which a dead run's lock is stale
            "retry_exponential_backoff": True,
            "max_retry_delay": timedelta(hours=1),
        },
        tags=["batchrun"],
    ) as dag:
        BatchrunSubmitOperator(
            task_id="submit",
            job_file=JOB_FILE,
            # a new output per logical date; every retry of that date's run resumes the same output
            sets=[f"output.uri={OUTPUT_ROOT}/{{{{ ds }}}}"],
            execution_timeout=timedelta(hours=12),      # on timeout: SIGTERM, exit 75, the retry resumes
        )

        # --- The same on Kubernetes: one pod per attempt, the GPU requested from the cluster. ----------
        # Exit codes and skip_on_exit_code behave as above (cncf-kubernetes provider >= 6.1), so the same
        # override applies. Each retry runs in a new pod, i.e. on "another host" for batchrun's lock: a
        # pod killed without a word leaves a lock that is taken over after 60 s, hence retry_delay.
        #
        # from kubernetes.client import models as k8s
        # from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
        #
        # class BatchrunPodOperator(KubernetesPodOperator):
        #     def execute(self, context):
        #         try:
        #             return super().execute(context)
        #         except AirflowSkipException as e:
        #             raise AirflowFailException(f"batchrun failed permanently ({e})") from e
        #
        # BatchrunPodOperator(
        #     task_id="submit_k8s",
        #     name="batchrun-summarize-reviews",
        #     image="registry.example.com/batchrun:0.1.0",
        #     cmds=["sh", "-c"],
        #     arguments=[pod_command("/jobs/summarize-reviews.yaml", [f"output.uri={OUTPUT_ROOT}/{{{{ ds }}}}"])],
        #     do_xcom_push=True,                   # reads /airflow/xcom/return.json, written by pod_command
        #     skip_on_exit_code=PERMANENT_EXIT_CODES,
        #     container_resources=k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": "1"}),
        #     termination_grace_period=120,        # SIGTERM: batchrun commits what is finished, exits 75
        #     on_finish_action="delete_pod",
        # )
