"""Google Cloud Storage (fake-gcs-server) and Azure Blob (Azurite) for real, on loopback: Parquet in and
out with `${ENV}` credentials, a job SIGKILLed mid-way and resumed with every id exactly once, and the
create-only done marker refusing a second writer (both emulators honour the preconditions gcsfs and
adlfs send: GCS `ifGenerationMatch=0` -> 412, Azure `If-None-Match: *` -> 409). S3 has the same tests
in tests/test_object_store.py.

Oracles: the same job run on local files, the emulators' own refusals, and a scan of every stored byte
and every line printed for the credentials.
"""
from __future__ import annotations

import signal

import pytest

from batchrun.connectors import ParquetSink
from batchrun.job.ledger import Ledger
from emulators import BUCKET, azure, gcs  # noqa: F401 - fixtures
from storejobs import (UNITS, assert_no_secrets, markers, reference, run, store_job,  # noqa: F401
                       store_rows)
from test_job_common import cli, tiny_model, write_job  # noqa: F401 - fixture

STORES = ["gcs", "azure"]


@pytest.fixture(params=STORES)
def store(request):
    return request.getfixturevalue(request.param)


def test_create_only_write_refuses_a_second_writer(store):
    """The emulator itself refuses a second create-only write of a name (the first bytes stay), and so
    two ledgers (separate filesystem instances, like two workers) marking one unit done: one wins, and
    the marker is the winner's; a retry that finds its own bytes counts as its own."""
    fs = store.fs()
    fs.pipe_file(f"{BUCKET}/cas/raw", b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{BUCKET}/cas/raw", b"second", mode="create")
    assert fs.cat_file(f"{BUCKET}/cas/raw") == b"first"
    uri = store.url("cas/out")
    a, b = (Ledger(ParquetSink(uri, {**store.options(), "skip_instance_cache": True})) for _ in range(2))
    assert a.mark_done(0, {"unit": 0, "worker": "a"})
    assert not b.mark_done(0, {"unit": 0, "worker": "b"})
    assert b.done_markers()[0]["worker"] == "a"
    assert a.sink.put_new("_batchrun/done/0.json", a.sink.read("_batchrun/done/0.json"))   # own bytes: ours


def test_sigkill_mid_job_then_resume_every_id_once(store, reference, tmp_path):
    """`batchrun submit` (a real process) reads Parquet from the store and writes Parquet to it, with
    the credentials only as ${VAR} in the job file; it is SIGKILLed after unit 3's part is stored but
    before its marker. The resume (in this process) commits the rest, and DuckDB reads exactly the local run's rows from
    the store; no credential in any stored byte or printed line."""
    _, _, ref = reference
    name = f"crash-{store.name}"
    job = store_job(store, reference, name)
    path = write_job(str(tmp_path / "job.yaml"), job)
    assert not any(s in open(path).read() for s in store.secrets)
    p = cli("submit", path, "--no-progress", env={"BATCHRUN_TEST_CRASH_AT": "after_part:3"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    fs = store.fs()
    parts = [x for x in fs.find(f"{BUCKET}/{name}/out") if x.endswith(".parquet")]
    assert len(parts) == 3 and len(markers(store, name)) == 2     # one part stored without its marker
    summary = run(job)                                             # the resume, in this process
    assert summary["units_skipped"] == 2 and summary["units_committed"] == UNITS - 2
    got = store_rows(store, name)
    assert got == ref and len({g[0] for g in got}) == len(ref)
    assert len(markers(store, name)) == UNITS
    assert assert_no_secrets(store, name, [p.stdout, p.stderr]) > UNITS
