"""The output store: every read and write under a job's output URL, over fsspec, and the only place that
knows local filesystems from object stores. publish (replace atomically), put_new (create-only: what
exactly-once rests on), read, replace (a heartbeat), remove_if (the lock's stale-token takeover), list,
find, remove. Local: a fsynced temp file under `_batchrun/tmp/`, then a rename or a hard link. Object
stores: one PUT of the final key, create-only for put_new (S3 `If-None-Match: *`). Every call is
retried on transient failures (connectors/retry.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Optional

from batchrun.connectors.base import OutputError, filesystem, full_path
from batchrun.connectors.retry import retry_io

TMP_DIR = "_batchrun/tmp"


def is_local(fs) -> bool:
    """True for the local filesystem (fsspec's `file` / `local` protocol)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols or "local" in protocols


def fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (power loss, not just a killed process)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _names(path: str):
    """An OSError with no file name (ENOSPC from a write or an fsync) gets `path`: the error line names it."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


def _write_all(f, data: bytes) -> None:
    """Write and fsync: the bytes are durable before they are renamed or linked into view."""
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


@dataclass
class Committed:
    """A file made visible: full path, size, sha256, name relative to the root (what a marker records)."""
    path: str
    bytes: int
    sha256: str
    name: str = ""


class OutputStore:
    """Names (relative paths) under one output URL, on any fsspec filesystem."""

    def __init__(self, uri: str, storage_options: Optional[dict] = None, create: bool = True):
        """create=False: only read (status, query); the output directory is not made."""
        self.fs, root = filesystem(uri, storage_options)
        self.root = root.rstrip("/") or "/"
        self.local = is_local(self.fs)
        if create:
            try:
                retry_io(lambda: self.fs.makedirs(self.root, exist_ok=True), self.url, "makedirs")
            except (FileExistsError, NotADirectoryError) as e:    # a file where a directory must be
                raise OutputError(f"output.uri: {self.url} cannot be a directory: "
                                  f"{e.filename or self.url} is a file") from None

    def path(self, name: str) -> str:
        """The filesystem path of `name` (relative to the output root)."""
        return f"{self.root}/{name}"

    @property
    def url(self) -> str:
        """The output root as a full URL (what messages name)."""
        return full_path(self.fs, self.root)

    def url_of(self, name: str) -> str:
        """`name` as a full URL."""
        return full_path(self.fs, self.path(name))

    def _tmp(self, name: str) -> str:
        return f"{self.staging_dir()}/{name.replace('/', '~')}.{uuid.uuid4().hex}"

    # -- writes ----------------------------------------------------------------------------------
    def publish(self, name: str, data: bytes, before_publish: Optional[Callable[[], None]] = None) -> Committed:
        """Make `name` appear with exactly `data`, replacing it (local: fsynced temp file + rename; object
        store: one PUT). before_publish: called once the bytes are complete, not yet visible."""
        final = self.path(name)
        if self.local:
            tmp = self._tmp(name)
            with _names(final), open(tmp, "wb") as f:
                _write_all(f, data)
            if before_publish:
                before_publish()
            parent = os.path.dirname(final)
            if parent != self.root:
                os.makedirs(parent, exist_ok=True)
            os.replace(tmp, final)
            fsync_dir(parent)
        else:
            if before_publish:
                before_publish()
            retry_io(lambda: self.fs.pipe_file(final, data), full_path(self.fs, final), "put")
        return Committed(final, len(data), hashlib.sha256(data).hexdigest(), name)

    def put_new(self, name: str, data: bytes, before_publish: Optional[Callable[[], None]] = None) -> bool:
        """Create `name` with `data` only if it does not exist; False if it already did. Local: an fsynced
        temp file hard-linked to the final name (FileNotFoundError if that temp file was removed: another
        run's ledger open emptied `_batchrun/tmp/`). Object stores: a create-only write (S3
        `If-None-Match: *`, s3fs mode="create"); a retry after a lost response that finds exactly `data`
        there was our own attempt, so it counts as created. Without conditional writes: fsspec's
        mode="create", a check then a write (not atomic)."""
        final = self.path(name)
        if self.local:
            tmp = self._tmp(name)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            with _names(final), open(tmp, "wb") as f:
                _write_all(f, data)
            if before_publish:
                before_publish()
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            except FileNotFoundError:       # our temp file was removed: a ledger open of another run
                raise
            except OSError:         # no hard links here (some network filesystems): exclusive create
                try:
                    fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    _write_all(f, data)
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            fsync_dir(os.path.dirname(final))
            return True
        url = full_path(self.fs, final)
        if before_publish:
            before_publish()
        try:
            retry_io(lambda: self.fs.pipe_file(final, data, mode="create"), url, "create-only put")
            return True
        except FileExistsError:
            try:
                return retry_io(lambda: self.fs.cat_file(final), url, "get") == data
            except FileNotFoundError:
                return False

    def staging_dir(self) -> str:
        """A local folder for files built before publish (under the output locally: one filesystem)."""
        d = self.path(TMP_DIR) if self.local else tempfile.gettempdir()
        os.makedirs(d, exist_ok=True)
        return d

    def publish_file(self, name: str, local_path: str) -> None:
        """publish() of a finished, fsynced local file: a rename, or one upload of the final key."""
        final = self.path(name)
        if self.local:
            os.replace(local_path, final)
            fsync_dir(os.path.dirname(final))
        else:
            retry_io(lambda: self.fs.put_file(local_path, final), full_path(self.fs, final), "put")

    def replace(self, name: str, data: bytes) -> None:
        """Rewrite the small record `name` atomically, without fsync (a heartbeat every few seconds).
        Local: the temp file sits beside it, out of `_batchrun/tmp/`, which a ledger open empties."""
        path = self.path(name)
        if self.local:
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with _names(path), open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:
            retry_io(lambda: self.fs.pipe_file(path, data), full_path(self.fs, path), "put")

    def remove_if(self, name: str, matches: Callable[[bytes], bool]) -> bool:
        """Remove `name` if its bytes pass `matches`; True if removed. Local: only a match is renamed
        aside (a name never goes missing for a moment because someone else checked it: a create-only
        put_new in that moment would succeed beside it), and the renamed bytes are checked again, so what
        is checked is exactly what is removed (put back when they changed in between). Object stores: a
        read, then a delete (the remaining window is between the two)."""
        path = self.path(name)
        try:
            if not matches(self.read(name)):
                return False
        except FileNotFoundError:
            return False
        if self.local:
            aside = f"{path}.{uuid.uuid4().hex}.del"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return False
            with open(aside, "rb") as f:
                ok = matches(f.read())
            if not ok:
                try:
                    os.link(aside, path)     # not the one checked: put it back (unless a new one exists)
                except FileExistsError:
                    pass
            os.unlink(aside)
            return ok
        try:
            retry_io(lambda: self.fs.rm(path), full_path(self.fs, path), "delete")
        except FileNotFoundError:
            return False
        return True

    def remove(self, names: list[str]) -> None:
        """Delete each of `names`; one already gone is fine."""
        for n in names:
            try:
                retry_io(lambda: self.fs.rm(self.path(n)), full_path(self.fs, self.path(n)), "delete")
            except FileNotFoundError:
                pass

    def clean_tmp(self) -> None:
        """Drop temporary files a killed writer left (never visible to readers)."""
        tmp = self.path(TMP_DIR)
        if self.local and os.path.exists(tmp):
            self.fs.rm(tmp, recursive=True)

    # -- reads ----------------------------------------------------------------------------------
    def _forget(self, path: str) -> None:
        try:        # another process may have written there since we listed
            self.fs.invalidate_cache(path)
        except Exception:   # noqa: BLE001 - not every filesystem keeps a listings cache
            pass

    def read(self, name: str) -> bytes:
        """The bytes of `name`; FileNotFoundError if it does not exist."""
        path = self.path(name)
        return retry_io(lambda: self.fs.cat_file(path), full_path(self.fs, path), "get")

    def read_many(self, names: list[str], folder: str = "") -> dict[str, bytes]:
        """{name: bytes} in one batched (concurrent) fetch; a name deleted meanwhile is left out, any other
        failure raises, so nothing is silently missed. folder names the batch in errors."""
        if not names:
            return {}
        paths = {self.fs._strip_protocol(self.path(n)): n for n in names}

        def fetch():
            got = self.fs.cat([self.path(n) for n in names], on_error="return")
            out = {}
            for p, v in got.items():
                if isinstance(v, FileNotFoundError):
                    continue
                if isinstance(v, BaseException):
                    raise v
                out[paths[self.fs._strip_protocol(p)]] = v
            return out
        return retry_io(fetch, self.url_of(folder), "get")

    def exists(self, name: str) -> bool:
        """Whether `name` exists now (the listings cache bypassed)."""
        path = self.path(name)
        self._forget(path)
        return retry_io(lambda: self.fs.exists(path), full_path(self.fs, path), "exists")

    def list(self, folder: str) -> list[str]:
        """Base names directly under `folder`; FileNotFoundError if it does not exist."""
        d = self.path(folder)
        self._forget(d)
        return [p.rsplit("/", 1)[-1] for p in retry_io(lambda: self.fs.ls(d, detail=False),
                                                       full_path(self.fs, d), "list")]

    def find(self) -> dict[str, int]:
        """{name relative to the root: size} of every file under the root (the listings cache bypassed)."""
        self._forget(self.root)
        try:
            found = retry_io(lambda: self.fs.find(self.root, detail=True), self.url, "list")
        except FileNotFoundError:
            return {}
        prefix = self.root.rstrip("/") + "/"
        return {(p[len(prefix):] if p.startswith(prefix) else p.rsplit("/", 1)[-1]): int(info.get("size") or 0)
                for p, info in found.items()}

    def modified(self, name: str) -> float:
        """`name`'s modification time (epoch seconds), 0.0 if it does not exist."""
        try:
            info = self.fs.info(self.path(name))
        except FileNotFoundError:
            return 0.0
        m = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
        return m.timestamp() if isinstance(m, datetime) else float(m)

    def open(self, name: str, mode: str = "rb"):
        """A file object for `name` (no read-ahead cache on object stores: footers are read by range)."""
        return self.fs.open(self.path(name), mode, **({} if self.local else {"cache_type": "none"}))
