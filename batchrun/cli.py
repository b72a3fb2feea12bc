"""The batchrun command line: submit, status, validate, query, demo.

Exit codes (a scheduler should retry 75 and 1, and fix the job for the others):
  0 finished   1 unexpected error   2 bad job file or usage   3 input error (path, column, format)
  4 output holds a different job (use --restart)   5 model error (architecture, weights, tokenizer)
  75 interrupted by SIGTERM/SIGINT: resubmit to resume
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import List, Optional

import typer

from batchrun.job.run import (EXIT_BAD_JOB, EXIT_ERROR, EXIT_FINGERPRINT, EXIT_INPUT, EXIT_INTERRUPTED,
                              EXIT_MODEL, EXIT_OK)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Offline batch inference with resumable jobs.")


def _exit_code(e: BaseException) -> int:
    from batchrun.connectors import InputError
    from batchrun.job.ledger import FingerprintMismatch
    from batchrun.job.run import Interrupted
    from batchrun.job.spec import JobError
    from batchrun.models.loader import ModelError
    from batchrun.tokenizer import TokenizerError
    for cls, code in ((JobError, EXIT_BAD_JOB), (InputError, EXIT_INPUT), (FingerprintMismatch, EXIT_FINGERPRINT),
                      (ModelError, EXIT_MODEL), (TokenizerError, EXIT_MODEL), (Interrupted, EXIT_INTERRUPTED)):
        if isinstance(e, cls):
            return code
    return EXIT_ERROR


def _fail(e: BaseException, as_json: bool) -> None:
    code = _exit_code(e)
    msg = str(e) if code != EXIT_ERROR else f"{type(e).__name__}: {e}"
    typer.echo(f"batchrun: error: {msg}", err=True)
    if as_json:
        typer.echo(json.dumps({"ok": False, "exit_code": code, "error": msg}))
    raise typer.Exit(code)


def _logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")


@app.command()
def submit(job: str = typer.Argument(..., help="the job file (YAML)"),
           set_: List[str] = typer.Option([], "--set", help="override a key: engine.max_num_seqs=64"),
           restart: bool = typer.Option(False, "--restart", help="discard results of a different earlier job"),
           as_json: bool = typer.Option(False, "--json", help="print a one-line JSON summary as the last stdout line"),
           quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar, warnings only")) -> None:
    """Run a job; re-submitting the same job resumes it."""
    from batchrun.job.run import submit as run_job
    from batchrun.job.spec import load_job
    _logging(quiet)
    try:
        spec = load_job(job, set_)
        summary = run_job(spec, restart=restart, progress_bar=not quiet)
    except Exception as e:
        _fail(e, as_json)
    typer.echo(f"batchrun: {summary['rows']} rows ({summary['error_rows']} errors) in {summary['output']}, "
               f"{summary['output_tok_s']} output tokens/s", err=True)
    if as_json:
        typer.echo(json.dumps({"ok": True, "exit_code": EXIT_OK, **summary}, default=str))


def _output_of(target: str) -> tuple[str, dict]:
    if target.endswith((".yaml", ".yml")) and os.path.isfile(target):
        from batchrun.job.spec import load_job
        spec = load_job(target)
        return spec.output.uri, spec.output.storage_options
    return target, {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def job_status(target: str) -> dict:
    """Units and rows done of total, throughput, ETA and state, read from the output's ledger."""
    from batchrun.connectors import ParquetSink
    from batchrun.job.ledger import Ledger
    uri, opts = _output_of(target)
    sink = ParquetSink(uri, opts)
    ledger = Ledger(sink)
    manifest = ledger.manifest()
    if manifest is None:
        raise FileNotFoundError(f"{uri}: no batchrun job output here (no _batchrun/manifest.json)")
    done = ledger.done_units()
    progress = ledger.progress() or {}
    rows_done = sum(r.get("rows", 0) for r in done.values())
    total = manifest["num_rows"]
    if ledger.succeeded():
        state = "finished"
    elif progress.get("state") == "running" and _pid_alive(int(progress.get("pid", -1))) \
            and time.time() - progress.get("updated", 0) < 60:
        state = "running"
    elif progress.get("state") == "interrupted":
        state = "interrupted"
    else:
        state = "stopped"      # killed, or not started since planning: resubmit to resume
    rate = progress.get("rows_per_s") or 0.0
    return {"output": sink.url, "job": manifest["job"], "state": state,
            "units_done": len(done), "units_total": manifest["num_units"],
            "rows_done": rows_done, "rows_total": total,
            "error_rows": sum(r.get("error_rows", 0) for r in done.values()),
            "output_tokens": sum(r.get("output_tokens", 0) for r in done.values()),
            "rows_per_s": rate, "output_tok_s": progress.get("output_tok_s", 0.0),
            "eta_s": round((total - rows_done) / rate, 1) if state == "running" and rate else None}


@app.command()
def status(target: str = typer.Argument(..., help="an output URL/directory, or the job file"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Progress of a job, also while it runs in another process."""
    try:
        st = job_status(target)
    except FileNotFoundError as e:
        typer.echo(f"batchrun: error: {e}", err=True)
        raise typer.Exit(EXIT_INPUT)
    except Exception as e:
        _fail(e, as_json)
    if as_json:
        typer.echo(json.dumps(st))
        return
    eta = f", ETA {st['eta_s']:.0f}s" if st["eta_s"] is not None else ""
    typer.echo(f"{st['job']} [{st['state']}] units {st['units_done']}/{st['units_total']}, "
               f"rows {st['rows_done']}/{st['rows_total']} ({st['error_rows']} errors), "
               f"{st['rows_per_s']} rows/s, {st['output_tok_s']} output tok/s{eta}")


@app.command()
def validate(job: str = typer.Argument(...), set_: List[str] = typer.Option([], "--set"),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Check the job file, the input schema and the model config without loading weights; print the plan."""
    from batchrun.job.run import JobRunner
    from batchrun.job.spec import load_job
    from batchrun.job.plan import render, tokenize
    try:
        spec = load_job(job, set_)
        r = JobRunner(spec, progress_bar=False)
        r.plan()
        sample = r.source.read(r.units[0], spec.input.columns() or None).slice(0, 256) if r.units else None
        lens = []
        if sample is not None:
            prompts, _ = render(spec, sample, r.tokenizer)
            lens = sorted(len(t) for t in tokenize(spec, prompts, r.tokenizer) if t is not None)
    except Exception as e:
        _fail(e, as_json)
    info = r.model_info
    import torch
    dtype = info.torch_dtype(spec.model.dtype)
    plan = {
        "job": spec.name, "files": [f.path for f in r.source.listing.files], "units": len(r.units),
        "rows": r.source.num_rows, "unit_rows": spec.plan.unit_rows,
        "sample_prompt_tokens": {"n": len(lens), "min": lens[0] if lens else None,
                                 "median": lens[len(lens) // 2] if lens else None,
                                 "p95": lens[int(len(lens) * 0.95)] if lens else None, "max": lens[-1] if lens else None},
        "model": {"architecture": info.architecture, "params": info.num_params, "dtype": str(dtype).removeprefix("torch."),
                  "weights_bytes": info.num_params * torch.empty((), dtype=dtype).element_size(),
                  "kv_bytes_per_token": info.kv_bytes_per_token(dtype), "max_model_len": info.max_model_len},
    }
    if as_json:
        typer.echo(json.dumps(plan))
        return
    typer.echo(f"job {plan['job']}: ok")
    typer.echo(f"  input: {len(plan['files'])} files, {plan['rows']} rows, {plan['units']} units of <= ~{spec.plan.unit_rows} rows")
    s = plan["sample_prompt_tokens"]
    typer.echo(f"  prompt tokens (sample of {s['n']}): min {s['min']}, median {s['median']}, p95 {s['p95']}, max {s['max']}")
    m = plan["model"]
    typer.echo(f"  model: {m['architecture']}, {m['params'] / 1e6:.1f}M params, {m['dtype']}, weights "
               f"{m['weights_bytes'] / 2**20:.1f} MiB, KV {m['kv_bytes_per_token']} B/token, max_model_len {m['max_model_len']}")


@app.command()
def query(output: str = typer.Argument(..., help="the job's output URL/directory"),
          sql: str = typer.Argument(..., help="SQL over the view `results`"),
          as_json: bool = typer.Option(False, "--json", help="one JSON object per row")) -> None:
    """Run DuckDB SQL over a `results` view of the committed part files."""
    import duckdb
    from batchrun.connectors import filesystem
    fs, root = filesystem(output)
    con = duckdb.connect()
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    if proto in ("file", "local"):
        glob = f"{root.rstrip('/')}/part-*.parquet"
    else:
        con.register_filesystem(fs)
        glob = f"{proto}://{root.rstrip('/')}/part-*.parquet"
    if not fs.glob(f"{root.rstrip('/')}/part-*.parquet"):
        typer.echo(f"batchrun: error: {output}: no committed part files", err=True)
        raise typer.Exit(EXIT_INPUT)
    con.execute(f"CREATE VIEW results AS SELECT * FROM read_parquet('{glob}')")
    try:
        rel = con.sql(sql)
    except duckdb.Error as e:
        typer.echo(f"batchrun: error: {e}", err=True)
        raise typer.Exit(EXIT_BAD_JOB)
    if rel is None:
        return
    if as_json:
        cols = rel.columns
        for row in rel.fetchall():
            typer.echo(json.dumps(dict(zip(cols, row)), default=str))
    else:
        typer.echo(str(rel))


@app.command()
def demo(dir: str = typer.Argument("batchrun-demo", help="where to write the demo")) -> None:
    """Write a small random-init model, a prompts Parquet file and a job file; no download."""
    from batchrun.demo import write_demo_job
    job = write_demo_job(dir)
    typer.echo(f"wrote {dir}/model, {dir}/prompts.parquet and {job}")
    typer.echo(f"next: batchrun submit {job}")


if __name__ == "__main__":
    app()
