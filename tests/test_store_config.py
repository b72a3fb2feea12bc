"""Bad storage configuration on real emulators: a wrong endpoint, a bucket that does not exist, credentials
that are refused. Each is one line naming the URL and what failed, with a documented exit code (3 for
an input that is not there, 74 for storage that fails for good), no traceback, no credential.

Azurite checks the account key's signatures itself; fake-gcs-server accepts any token, so a proxy in
front of it answers 403 to any other bearer token than the right one (what GCS says to a token without
access). S3's wrong endpoint: tests/test_hostile_s3.py.
"""
from __future__ import annotations

import base64
import os

import pytest

from batchrun.errors import EXIT_INPUT, EXIT_STORAGE
from emulators import GCS_TOKEN_VAR, azure, azure_connection, gcs  # noqa: F401 - fixtures
from faultproxy import FaultProxy
from hostile_util import Outcome, invoke, job
from storejobs import reference, upload_inputs  # noqa: F401 - fixture
from test_job_common import tiny_model  # noqa: F401 - fixture

BAD_VAR = "BATCHRUN_TEST_BAD_TOKEN"


def validate(tmp_path, model, uri: str, options: dict) -> Outcome:
    inp = {"uri": uri, "storage_options": options, "id_column": "id", "prompt_column": "text"}
    return invoke("validate", job(tmp_path, model, uri, input=inp))


def one_line(r: Outcome, code: int, secrets, *needles: str) -> str:
    """Exit `code`, no traceback, no credential, the last stderr line `batchrun: ...` with every needle."""
    assert r.code == code and "Traceback" not in r.stdout + r.stderr, r
    line = [x for x in r.stderr.splitlines() if x.strip()][-1]
    assert line.startswith("batchrun: ") and all(n in line for n in needles), (needles, line)
    assert not any(s in r.stdout + r.stderr for s in secrets), "credential in the output"
    return line


@pytest.fixture
def fast_io(monkeypatch):
    monkeypatch.setenv("BATCHRUN_IO_ATTEMPTS", "2")
    monkeypatch.setenv("BATCHRUN_IO_BACKOFF_S", "0.01")


def test_missing_bucket_is_exit_3_naming_the_url(gcs, azure, tmp_path, tiny_model):  # noqa: F811
    for store in (gcs, azure):
        uri = f"{store.scheme}://no-such-bucket-{store.name}/prompts/"
        one_line(validate(tmp_path, tiny_model, uri, store.options()), EXIT_INPUT, store.secrets, uri,
                 "no such file")


def test_azure_wrong_endpoint_is_74_naming_the_url(azure, tmp_path, tiny_model, fast_io):  # noqa: F811
    uri = azure.url("shared/in/")
    line = one_line(validate(tmp_path, tiny_model, uri, azure.options("http://127.0.0.1:9")), EXIT_STORAGE,
                    azure.secrets, uri.rstrip("/"), "gave up after 2 attempts")
    assert "ServiceRequestError" in line or "onnect" in line, line


def test_refused_credentials_are_74_naming_the_url(gcs, azure, reference, tmp_path, tiny_model,  # noqa: F811
                                                   fast_io, monkeypatch):
    """A wrong Azure account key (Azurite: 403 AuthorizationFailure) and a GCS token without access
    (403): a permanent error at the first call, neither the right nor the wrong credential printed."""
    wrong = base64.b64encode(os.urandom(32)).decode()
    monkeypatch.setenv(BAD_VAR, wrong)
    uri = upload_inputs(azure, reference)
    opts = {**azure.options(), "connection_string": azure_connection(f"{azure.endpoint}", "${%s}" % BAD_VAR)}
    one_line(validate(tmp_path, tiny_model, uri, opts), EXIT_STORAGE, azure.secrets + [wrong],
             uri.rstrip("/"), "permanent error", "403")
    good = os.environ[GCS_TOKEN_VAR]
    with FaultProxy(gcs.endpoint, "gcs", gate=lambda h: None if h.get("Authorization") == f"Bearer {good}"
                    else 403) as proxy:
        uri = upload_inputs(gcs, reference)
        opts = {**gcs.options(proxy.endpoint), "token": "${%s}" % BAD_VAR}
        one_line(validate(tmp_path, tiny_model, uri, opts), EXIT_STORAGE, gcs.secrets + [wrong],
                 uri.rstrip("/"), "permanent error", "Forbidden")
