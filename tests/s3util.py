"""A real S3 API on loopback for the object-store tests: moto's ThreadedMotoServer on 127.0.0.1, and a
thin HTTP proxy in front of it that can fail chosen requests (503, or a connection dropped before or
after the server handled the request) and counts the bytes each object's GETs returned.

Credentials are random strings handed to the job only through `${ENV_VAR}` references, so a test can
look for them in everything batchrun writes.
"""
from __future__ import annotations

import http.client
import os
import random
import socket
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import unquote, urlsplit

import pytest

BUCKET = "batchrun-test"
KEY_VAR, SECRET_VAR = "BATCHRUN_TEST_S3_KEY", "BATCHRUN_TEST_S3_SECRET"


@dataclass
class S3:
    """The running server: `endpoint`, the secrets behind KEY_VAR/SECRET_VAR, and helpers."""
    endpoint: str
    key: str
    secret: str

    def options(self, endpoint: Optional[str] = None, **extra) -> dict:
        """storage_options as a job file would hold them: credentials as ${ENV_VAR} references."""
        return {"key": "${%s}" % KEY_VAR, "secret": "${%s}" % SECRET_VAR,
                "client_kwargs": {"endpoint_url": endpoint or self.endpoint, "region_name": "us-east-1"},
                **extra}

    def fs(self, endpoint: Optional[str] = None):
        """A fresh s3fs filesystem (no instance cache: like another process)."""
        import s3fs
        return s3fs.S3FileSystem(key=self.key, secret=self.secret, skip_instance_cache=True,
                                 client_kwargs={"endpoint_url": endpoint or self.endpoint,
                                                "region_name": "us-east-1"})

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key,
                            aws_secret_access_key=self.secret, region_name="us-east-1")


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 (a free port), one bucket, credentials in the environment."""
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s = S3(f"http://{host}:{port}", f"AKIA{uuid.uuid4().hex[:16].upper()}", f"sk-{uuid.uuid4().hex}")
    old = {v: os.environ.get(v) for v in (KEY_VAR, SECRET_VAR)}
    os.environ[KEY_VAR], os.environ[SECRET_VAR] = s.key, s.secret
    s.client().create_bucket(Bucket=BUCKET)
    yield s
    for v, x in old.items():
        if x is None:
            os.environ.pop(v, None)
        else:
            os.environ[v] = x
    server.stop()


# -- the faulty proxy ------------------------------------------------------------------------------
Action = Optional[str]       # None (relay), "503", "drop_before" (never reaches S3), "drop_after" (S3 did it)
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


@dataclass
class Request:
    method: str
    key: str                 # object key (path without the bucket), URL-decoded
    headers: dict
    n: int                   # 0-based count of requests seen so far


@dataclass
class FaultyProxy:
    """Relays HTTP to `target`; `rule(request) -> action` decides each request's fate."""
    target: str
    rule: Callable[[Request], Action] = lambda r: None
    injected: Counter = field(default_factory=Counter)
    get_bytes: Counter = field(default_factory=Counter)       # object key -> response bytes of GETs
    requests: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "FaultyProxy":
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):      # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _drop(self):
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _relay(self):
                body = self._body()
                path = urlsplit(self.path).path
                key = unquote(path.split("/", 2)[2]) if path.count("/") >= 2 else ""
                with proxy.lock:
                    req = Request(self.command, key, dict(self.headers), len(proxy.requests))
                    proxy.requests.append((self.command, key))
                    action = proxy.rule(req)
                    if action:
                        proxy.injected[action] += 1
                if action == "drop_before":
                    return self._drop()
                if action == "503":
                    data = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
                            b'<Message>injected by the test proxy</Message></Error>')
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return
                u = urlsplit(proxy.target)
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if action == "drop_after":
                    return self._drop()
                if self.command == "GET":
                    with proxy.lock:
                        proxy.get_bytes[key] += len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", resp.getheader("Content-Length") if self.command == "HEAD"
                                 and resp.getheader("Content-Length") else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def random_faults(seed: int, p503: float, p_drop_before: float, p_drop_after: float,
                  spare: Callable[[Request], bool] = lambda r: False) -> Callable[[Request], Action]:
    """A rule failing each request with the given probabilities (seeded: the same faults every run)."""
    rng = random.Random(seed)

    def rule(r: Request) -> Action:
        if spare(r):
            return None
        x = rng.random()
        if x < p503:
            return "503"
        if x < p503 + p_drop_before:
            return "drop_before"
        if x < p503 + p_drop_before + p_drop_after:
            return "drop_after"
        return None
    return rule
