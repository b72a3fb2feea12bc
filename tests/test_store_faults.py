"""Storage faults on every object store: jobs read from and write to S3 (moto), GCS (fake-gcs-server)
and Azure Blob (Azurite) through a fault-injecting proxy (tests/faultproxy.py: seeded 500/503, delays,
connections reset or dropped after the server acted, answers truncated mid-body).

Bounded retries: the client libraries' own where they have them (botocore's default 5 tries for S3;
gcsfs's fixed 6 tries; the Azure SDK's policy, made fast through storage_options.client_kwargs), then
batchrun's (connectors/retry.py) around every store call. Oracles: the clean local run's rows, every
id exactly once, each done marker's sha256 against its part's bytes.
"""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from batchrun.errors import EXIT_STORAGE
from emulators import BUCKET, azure, gcs, s3_store  # noqa: F401 - fixtures
from faultproxy import FaultProxy, faults
from hostile_util import Outcome
from s3util import s3  # noqa: F401 - fixture
from storejobs import (FAST_IO, UNITS, assert_no_secrets, markers, reference, run, store_job,  # noqa: F401
                       store_rows)
from test_job_common import cli, tiny_model, write_job  # noqa: F401 - fixture

STORES = ["s3", "gcs", "azure"]
# per request: gcsfs waits 1-2 s before its first retry whatever the fault, so its rates are lower
RATES = {"s3": {"503": 0.03, "500": 0.02, "delay": 0.02, "reset": 0.02, "drop": 0.02, "truncate": 0.02},
         "gcs": {"503": 0.01, "500": 0.01, "delay": 0.02, "reset": 0.01, "drop": 0.01, "truncate": 0.01},
         "azure": {"503": 0.03, "500": 0.02, "delay": 0.02, "reset": 0.02, "drop": 0.02, "truncate": 0.02}}


@pytest.fixture(params=STORES)
def store(request):
    s = request.getfixturevalue(request.param)
    return s3_store(s) if request.param == "s3" else s


def proxy_for(store, **kw) -> FaultProxy:
    return FaultProxy(store.endpoint, store.name, store.object_key, **kw)


def committed_intact(store, name: str) -> int:
    """Every done marker describes the bytes of its part exactly (nothing half-committed); returns the
    number of markers."""
    fs = store.fs()
    ms = markers(store, name)
    for m in ms:
        marker = json.loads(fs.cat_file(m))
        data = fs.cat_file(f"{BUCKET}/{name}/out/{marker['file']}")
        assert hashlib.sha256(data).hexdigest() == marker["sha256"], m
    return len(ms)


def last_line(r: Outcome, code: int, *needles: str) -> str:
    """Exit `code`, no traceback, and the last stderr line `batchrun: ...` holding every needle (the lines
    before it are batchrun's notes: retries, a progress record or lock it could not write)."""
    assert r.code == code and "Traceback" not in r.stdout + r.stderr, r
    line = [x for x in r.stderr.splitlines() if x.strip()][-1]
    assert line.startswith("batchrun: ") and all(n in line for n in needles), (needles, line)
    return line


def test_seeded_faults_job_equals_clean_run(store, reference, monkeypatch):
    """~13% (GCS ~7%) of requests fail one way or another, input and output alike; the job finishes
    with exactly the clean run's rows, each unit committed once and counted once."""
    _, _, ref = reference
    for k, v in FAST_IO.items():
        monkeypatch.setenv(k, v)
    name = f"faults-{store.name}"
    with proxy_for(store, rule=faults(19, RATES[store.name])) as proxy:
        job = store_job(store, reference, name, endpoint=proxy.endpoint, in_endpoint=proxy.endpoint)
        summary = run(job)
    assert summary["units_committed"] == UNITS and summary["rows"] == len(ref)
    assert sum(proxy.injected.values()) >= 3, proxy.injected
    assert store_rows(store, name) == ref
    assert committed_intact(store, name) == UNITS


# S3's outage: tests/test_object_store.py (test_permanent_failure_exits_74_naming_the_url_then_resubmit_resumes)
@pytest.mark.parametrize("which", ["azure",
                                   pytest.param("gcs", marks=pytest.mark.skipif(
                                       not os.environ.get("BATCHRUN_TEST_SLOW"),
                                       reason="gcsfs retries every call 6 times with fixed waits (~31 s in all, no "
                                              "option shortens them): an outage takes minutes to surface; "
                                              "BATCHRUN_TEST_SLOW=1 runs it"))])
def test_outage_exits_74_naming_the_url_then_resubmit_resumes(which, request, reference, tmp_path):
    """After two units are committed the store answers 503 to everything: `submit` (a real process)
    stops with exit 74, its last line naming the store URL and the last error; what was committed is
    intact; once the store is back a re-submit (in this process: the dead run's lock, which it could not
    remove during the outage, is recovered at once) resumes and every id is there exactly once."""
    store = request.getfixturevalue(which)
    _, _, ref = reference
    name = f"outage-{store.name}"
    state = {"marks": 0}
    proxy = proxy_for(store)

    def rule(r):
        if r.method in ("PUT", "POST") and "_batchrun/done/" in r.key:
            state["marks"] += 1
            proxy.down = state["marks"] >= 2
        return None
    proxy.rule = rule
    with proxy:
        job = store_job(store, reference, name, endpoint=proxy.endpoint)
        path = write_job(str(tmp_path / "job.yaml"), job)
        p = cli("submit", path, "--no-progress", env={"BATCHRUN_IO_ATTEMPTS": "2", "BATCHRUN_IO_BACKOFF_S": "0.01"})
        r = Outcome(p.returncode, p.stdout, p.stderr)
        # adlfs's first protocol name is abfs: an az:// output is named abfs:// in messages
        url = f"{'abfs' if store.name == 'azure' else store.scheme}://{BUCKET}/{name}/out/"
        line = last_line(r, EXIT_STORAGE, url, "gave up after 2 attempts", "503")
        assert 2 <= committed_intact(store, name) < UNITS
        proxy.down, state["marks"] = False, -10 ** 9
        summary = run(job)                                          # the re-submit, in this process
    assert 2 <= summary["units_skipped"] < UNITS and summary["rows"] == len(ref)
    assert store_rows(store, name) == ref
    assert_no_secrets(store, name, [r.stdout, r.stderr, line])
