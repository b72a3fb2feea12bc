"""A fault-injecting HTTP proxy for the storage tests, in front of any of the emulators (S3, GCS, Azure).

Per request, a rule picks the fate; `faults(seed, ...)` draws it from a seeded generator, so a run sees
the same sequence of faults every time:

    None        relay the request and the answer unchanged
    "500"/"503" answer the error in the store's own shape (XML for S3 and Azure, JSON for GCS); the
                request never reaches the server
    "delay"     wait `delay_s`, then relay
    "reset"     close the connection before relaying (the server never sees the request)
    "drop"      relay, then close the connection without answering (the server acted; the answer is lost)
    "truncate"  relay, then send the headers with the full Content-Length and half the body, and close

`down = True` answers 503 to everything (an outage); `gate(headers) -> status` can refuse requests (a
store that rejects credentials). Response headers naming the server (an upload session's Location) are
rewritten to the proxy, so follow-up requests come back through it.
"""
from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade",
       "content-length"}
ACTIONS = ("500", "503", "delay", "reset", "drop", "truncate")


def error_body(flavor: str, status: int) -> tuple[str, bytes]:
    """(content type, body) of an injected error as the store would word it."""
    if flavor == "gcs":
        return "application/json", (b'{"error": {"code": %d, "message": "injected by the test proxy", '
                                    b'"errors": [{"reason": "backendError"}]}}' % status)
    code = {"s3": {500: b"InternalError", 503: b"ServiceUnavailable"},
            "azure": {500: b"InternalError", 503: b"ServerBusy"}}[flavor].get(status, b"AccessDenied")
    return "application/xml", (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>' + code +
                               b"</Code><Message>injected by the test proxy</Message></Error>")


@dataclass
class Req:
    """What a rule sees of a request."""
    method: str
    path: str           # the HTTP path and query
    key: str            # the object key it is about ("" for bucket-level requests)
    headers: dict
    n: int              # 0-based count of requests seen


Rule = Callable[[Req], Optional[str]]


def faults(seed: int, rates: dict, spare: Callable[[Req], bool] = lambda r: False) -> Rule:
    """A rule failing each request with the given probabilities ({action: p}), seeded."""
    rng = random.Random(seed)
    order = [(a, rates[a]) for a in ACTIONS if rates.get(a)]

    def rule(r: Req) -> Optional[str]:
        x = rng.random()
        if spare(r):
            return None
        for action, p in order:
            if x < p:
                return action
            x -= p
        return None
    return rule


@dataclass
class FaultProxy:
    """Relays HTTP to `target` (http://host:port); `rule` decides each request's fate."""
    target: str
    flavor: str                              # "s3", "gcs" or "azure": the shape of injected errors
    key_of: Callable[[str], str] = lambda path: path
    rule: Rule = lambda r: None
    delay_s: float = 0.2
    down: bool = False
    gate: Optional[Callable[[dict], Optional[int]]] = None
    injected: Counter = field(default_factory=Counter)
    seen: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "FaultProxy":
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *a) -> None:
        self.stop()

    def decide(self, method: str, path: str, headers: dict) -> Optional[str]:
        with self.lock:
            req = Req(method, path, self.key_of(path), headers, self.seen)
            self.seen += 1
            action = "503" if self.down else self.rule(req)
            if action:
                self.injected[action] += 1
            return action


def _handler(proxy: FaultProxy):
    target = urlsplit(proxy.target)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _close(self) -> None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _answer(self, status: int, headers: list, data: bytes, length: Optional[int] = None) -> None:
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in HOP:
                    self.send_header(k, v.replace(proxy.target, proxy.endpoint))
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
                self.wfile.flush()

        def _relay(self):
            body = self._body()
            refused = proxy.gate(dict(self.headers)) if proxy.gate else None
            action = None if refused else proxy.decide(self.command, self.path, dict(self.headers))
            if refused or action in ("500", "503"):
                status = refused or int(action)
                ctype, data = error_body(proxy.flavor, status)
                return self._answer(status, [("Content-Type", ctype)], data)
            if action == "reset":
                return self._close()
            if action == "delay":
                time.sleep(proxy.delay_s)
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            if body or self.command in ("PUT", "POST", "PATCH"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            if action == "drop":
                return self._close()
            length = resp.getheader("Content-Length") if self.command == "HEAD" else None
            if action == "truncate" and len(data) > 1:
                self._answer(resp.status, resp.getheaders(), data[:len(data) // 2], len(data))
                return self._close()
            self._answer(resp.status, resp.getheaders(), data, int(length) if length else None)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

    return Handler
