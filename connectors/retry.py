"""Bounded retries for object-store I/O: transient failures (5xx, throttling, dropped connections,
timeouts) are retried with exponential backoff and full jitter; anything else, or a transient failure
that outlives the attempts, becomes a StorageError naming the URL and the error.

Knobs (environment, read at each call): BATCHRUN_IO_ATTEMPTS (default 6, the first try included),
BATCHRUN_IO_BACKOFF_S (default 0.5: the first wait is up to that, doubling to at most 20 s).
"""
from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
from typing import Callable, Optional, TypeVar

from batchrun.connectors.secrets import redact

T = TypeVar("T")
log = logging.getLogger("batchrun.io")

MAX_WAIT_S = 20.0
# errors a caller handles itself (a missing marker, a lost create-only race, a listing of nothing)
PASS_THROUGH = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
TRANSIENT_ERRNOS = {errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED,
                    errno.EPIPE, errno.EAGAIN, getattr(errno, "EREMOTEIO", 121)}
# client-library exception classes that mean "the network or the service hiccupped" (matched by name,
# so no client library has to be importable): botocore, aiohttp, fsspec, http.client, google, azure
TRANSIENT_NAMES = {"HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
                   "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError", "ResponseParserError",
                   "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "ClientOSError",
                   "ServerTimeoutError", "FSTimeoutError", "IncompleteRead", "RemoteDisconnected",
                   "TransportError", "ServiceRequestError", "ServiceResponseError"}
THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                  "TooManyRequestsException", "RequestThrottled", "RequestTimeout", "InternalError",
                  "ServiceUnavailable", "ServerBusy", "OperationTimedOut"}

STATS = {"retries": 0}          # retries taken in this process (tests and logs read it)
_stats_lock = threading.Lock()


class StorageError(OSError):
    """Storage I/O failed for good: a permanent error, or transient ones past the last attempt.
    The message names the URL, the operation and the error; a re-submit resumes the job."""

    def __init__(self, url: str, op: str, error: BaseException, attempts: int, transient: bool):
        self.url, self.op, self.error, self.attempts, self.transient = url, op, error, attempts, transient
        why = f"gave up after {attempts} attempts" if transient else "permanent error"
        super().__init__(redact(f"{url}: {op} failed ({why}): {describe(error)}"))


def describe(e: BaseException) -> str:
    """`Type: message`, with the service's error code and HTTP status when the client library kept them."""
    code, status = _code_status(e)
    extra = " ".join(x for x in (code and f"code={code}", status and f"http={status}") if x)
    return f"{type(e).__name__}: {e}" + (f" [{extra}]" if extra else "")


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _code_status(e: BaseException) -> tuple[Optional[str], Optional[int]]:
    for x in _chain(e):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):      # botocore ClientError
            err = resp.get("Error") or {}
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            return err.get("Code"), status
        for attr in ("status_code", "status", "code"):     # google / azure / aiohttp errors
            v = getattr(x, attr, None)
            if isinstance(v, int) and 100 <= v < 600:
                return None, v
    return None, None


def is_transient(e: BaseException) -> bool:
    """Would the same call plausibly succeed if repeated? (5xx, 429/throttling, timeouts, dropped
    connections.) 4xx answers, missing keys and refused preconditions are not transient."""
    if isinstance(e, PASS_THROUGH):
        return False
    code, status = _code_status(e)
    if status is not None:
        return status >= 500 or status == 429 or code in THROTTLE_CODES
    if code in THROTTLE_CODES:
        return True
    for x in _chain(e):
        if isinstance(x, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in TRANSIENT_NAMES for c in type(x).__mro__):
            return True
        if isinstance(x, OSError) and x.errno in TRANSIENT_ERRNOS:
            return True
    return False


def is_http_error(e: BaseException) -> bool:
    """A client library's exception for an HTTP answer (Azure's HttpResponseError, gcsfs's HttpError,
    aiohttp's ClientResponseError: an HTTP status and no OSError base): a refused credential, a missing
    container. A ValueError (a corrupt file, a bad request the library words itself) is not one."""
    return not isinstance(e, ValueError) and _code_status(e)[1] is not None


def _settings() -> tuple[int, float]:
    return max(1, int(os.environ.get("BATCHRUN_IO_ATTEMPTS", "6"))), \
        float(os.environ.get("BATCHRUN_IO_BACKOFF_S", "0.5"))


def retry_io(fn: Callable[[], T], url: str, op: str) -> T:
    """fn() with retries. Transient errors: up to BATCHRUN_IO_ATTEMPTS tries, waiting
    uniform(0, backoff * 2**k) between them (full jitter). Errors in PASS_THROUGH reach the caller
    unchanged; any other OSError or HTTP answer (permission, refused credentials, missing bucket) becomes
    a StorageError at once; non-I/O exceptions (a corrupt file's ValueError) pass through for the caller to word."""
    attempts, base = _settings()
    for k in range(attempts):
        try:
            return fn()
        except StorageError:
            raise
        except PASS_THROUGH:
            raise
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                if isinstance(e, OSError) or is_http_error(e):
                    raise StorageError(url, op, e, k + 1, transient=False) from e
                raise
            if k == attempts - 1:
                raise StorageError(url, op, e, attempts, transient=True) from e
            wait = random.uniform(0, min(MAX_WAIT_S, base * 2 ** k))
            with _stats_lock:
                STATS["retries"] += 1
            log.warning("%s", redact(f"{url}: {op} failed ({describe(e)}); retry {k + 1}/{attempts - 1} "
                                     f"in {wait:.2f}s"))
            time.sleep(wait)
    raise AssertionError("unreachable")
