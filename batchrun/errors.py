"""Exit codes, and the one place that turns any exception reaching the command line into one.

classify(e) gives (exit code, one-line message) for every error a command can meet: the project's own
types (a bad job file, an unusable input or model, a different job in the output, a held lock, storage
that failed for good, a signal) and the raw ones that slip past them (an OSError naming a path that
cannot be written, a YAML error). Anything else is unexpected (exit 1): report_unexpected() writes its
traceback, redacted, to a log file and the command prints one line pointing there.

Light on purpose (no torch, no pyarrow at import): the CLI loads it first, so a signal during start-up
already has a handler (startup_signals).
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Optional

# Exit codes (README: "Exit codes"). A scheduler should retry 1, 73, 74 and 75, not 2, 3 or 4.
EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_JOB = 2          # bad job file or command line
EXIT_INPUT = 3            # input or model unusable (missing column, corrupt file, unknown architecture)
EXIT_FINGERPRINT = 4      # output holds a different job's results; --restart to discard them
EXIT_LOCKED = 73          # EX_CANTCREAT: another live run holds _batchrun/lock.json; re-submit later
EXIT_STORAGE = 74         # EX_IOERR: storage I/O failed for good (retries spent, or denied); re-submit resumes
EXIT_INTERRUPTED = 75     # EX_TEMPFAIL: SIGTERM/SIGINT; re-submit to resume

# OSErrors that no retry fixes but a person can (permissions, a full or read-only disk): storage failed
STORAGE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO}
# ... of which these are the device's even where the error names no file (a full disk's write or fsync)
DEVICE_ERRNOS = {errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO}

# (module, class, exit code), most specific first. Matched only when the module is already imported:
# an exception of a class whose module was never loaded cannot exist, and importing it here would
# cost the start-up time this module exists to avoid.
_KINDS = [
    ("batchrun.errors", "StartupInterrupted", EXIT_INTERRUPTED),
    ("batchrun.job.run", "Interrupted", EXIT_INTERRUPTED),
    ("batchrun.engine.tp_group", "TPWorkerError", EXIT_INTERRUPTED),   # a rank died (OOM killer...): resume
    ("builtins", "KeyboardInterrupt", EXIT_INTERRUPTED),      # Ctrl-C where no handler of ours stands
    ("batchrun.job.schema", "JobError", EXIT_BAD_JOB),
    ("batchrun.connectors.secrets", "MissingEnvVar", EXIT_BAD_JOB),   # a ${VAR} unset where it was expanded
    ("batchrun.connectors.base", "OutputError", EXIT_BAD_JOB),
    ("batchrun.job.ray_check", "RayUnavailable", EXIT_BAD_JOB),
    ("yaml", "YAMLError", EXIT_BAD_JOB),
    ("batchrun.job.ledger", "FingerprintMismatch", EXIT_FINGERPRINT),
    ("batchrun.job.lock", "LockHeld", EXIT_LOCKED),
    ("batchrun.connectors.retry", "StorageError", EXIT_STORAGE),
]


class StartupInterrupted(BaseException):
    """SIGTERM/SIGINT while a run loads the weights (batchrun/job/run.py). A BaseException, like
    KeyboardInterrupt, so no `except Exception` on the way rewords it."""


def one_line(text: str) -> str:
    """`text` with its line breaks and runs of spaces collapsed: a scheduler's log shows one line."""
    return " ".join(str(text).split())


def classify(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached a command."""
    for module, name, code in _KINDS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return code, one_line(e) or type(e).__name__
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS and e.filename:
        return EXIT_STORAGE, one_line(f"{e.filename}: {e.strerror or e}")
    if isinstance(e, OSError) and e.errno in DEVICE_ERRNOS:      # a write() or fsync() names no file
        return EXIT_STORAGE, one_line(f"storage I/O failed: {e.strerror or e} (errno {e.errno})")
    if isinstance(e, ValueError):       # InputError, ModelError, TokenizerError: they name the file
        return EXIT_INPUT, one_line(e)
    return EXIT_UNEXPECTED, one_line(f"unexpected error: {type(e).__name__}: {e}")


def error_log_path(output_uri: Optional[str]) -> tuple[str, int]:
    """(path, open fd) of a new log file: `<output>/_batchrun/error-<time>-<pid>-<random>.log` when the
    output is a local directory whose `_batchrun/` already exists and is writable, else
    `$TMPDIR/batchrun-error-<time>-<pid>-<random>.log`."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"error-{stamp}-{os.getpid()}"
    if output_uri and "://" not in output_uri.replace("file://", "", 1):
        d = os.path.join(output_uri.replace("file://", "", 1), "_batchrun")
        try:
            fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=d)
            return path, fd
        except OSError:
            pass
    fd, path = tempfile.mkstemp(prefix=f"batchrun-{name}-", suffix=".log")
    return path, fd


def report_unexpected(e: BaseException, output_uri: Optional[str]) -> str:
    """Write `e`'s traceback, scrubbed of credentials, to a log file; returns its path ("" if none could
    be written)."""
    from batchrun.connectors.secrets import redact
    text = redact("".join(traceback.format_exception(type(e), e, e.__traceback__)))
    try:
        path, fd = error_log_path(output_uri)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    except OSError:
        return ""


def _on_startup_signal(signum, frame):
    # Nothing is held yet (a run takes the lock only after installing its own handlers), so leave at once:
    # an exception raised here could land inside an import and leave half-initialised modules behind.
    msg = (f"stopped by {signal.Signals(signum).name} outside a run (start-up or shutdown), while nothing was "
           "being written; re-submit to resume")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001 - the signal may have come in the middle of a write to it
            pass
    if "--json" in sys.argv:
        os.write(1, (json.dumps({"ok": False, "state": "interrupted", "exit_code": EXIT_INTERRUPTED,
                                 "error": msg}) + "\n").encode())
    os.write(2, f"batchrun: {msg}\n".encode())
    os._exit(EXIT_INTERRUPTED)


def startup_signals() -> None:
    """SIGTERM/SIGINT exit at once with 75 and one line whenever no run has its own handlers installed
    (batchrun/job/run.py: from taking the lock to releasing it), instead of a KeyboardInterrupt traceback
    or a bare kill."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _on_startup_signal)
