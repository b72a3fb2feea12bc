"""Source and sink basics shared by every connector: units, errors, fsspec resolution."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import fsspec
import pyarrow as pa

from batchrun.connectors.retry import retry_io
from batchrun.connectors.secrets import MissingEnvVar, expand, redact


class InputError(ValueError):
    """A problem with the input that stops the job before weights load; names the file or column."""


class OutputError(ValueError):
    """output.uri cannot hold results (a file stands where its directory must be, or it lies inside the
    input); the message names the path. A bad job file: exit 2."""


@dataclass(frozen=True)
class Unit:
    """A fixed slice of the input: rows [row_start, row_start + num_rows) of one file.

    index: position in the deterministic enumeration (the checkpoint key).
    first_row: the slice's row number over the whole input (the default id).
    row_groups: Parquet row groups covering the slice (empty for line-based formats).
    byte_offset: JSONL / CSV: where the slice's first line (record) starts (-1 when not applicable).
    byte_end: JSONL / CSV: where the slice's bytes end (the next unit's start, or the file's size).
    """

    index: int
    path: str
    row_start: int
    num_rows: int
    first_row: int
    row_groups: tuple[int, ...] = ()
    byte_offset: int = -1
    byte_end: int = -1


@dataclass
class FileInfo:
    path: str
    size: int
    version: Optional[str]   # mtime or ETag: a change between submit and resume is detected


@dataclass
class Listing:
    files: list[FileInfo] = field(default_factory=list)

    def fingerprint(self) -> list[list[Any]]:
        return [[f.path, f.size, f.version] for f in self.files]


EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
          "adl": "azure"}


def filesystem(uri: str, storage_options: Optional[dict] = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path without protocol) for any fsspec URL or local path.

    storage_options: keyword arguments of the filesystem; `${ENV_VAR}` references are expanded here,
    at use time, so the job spec never holds the values (connectors/secrets.py)."""
    proto = uri.split("://", 1)[0] if "://" in uri else "file"
    try:
        options = expand(storage_options or {}, "storage_options")
    except MissingEnvVar as e:
        raise InputError(f"{uri}: {e}") from None
    try:
        fs, path = _url_to_fs(proto, uri, options)
    except ImportError as e:
        extra = EXTRAS.get(proto)
        hint = f"; install it with: pip install 'batchrun[{extra}]'" if extra else ""
        raise InputError(redact(f"{uri}: no filesystem for {proto}://{hint} ({e})")) from None
    except (ValueError, TypeError) as e:     # unknown protocol, an option the filesystem does not take
        raise InputError(redact(f"{uri}: cannot open: {e}")) from None
    return fs, path


AZURE = ("az", "abfs", "abfss")


def _url_to_fs(proto: str, uri: str, options: dict) -> tuple[fsspec.AbstractFileSystem, str]:
    """fsspec's url_to_fs, with two fixes for the cloud filesystems:

    gs:// on a custom endpoint (`endpoint_url`, or STORAGE_EMULATOR_HOST): gcsfs's plain filesystem,
    not its experimental default, which first asks the endpoint over gRPC for each bucket's layout (no
    emulator or gateway answers; each probe waits 60 s, and a failed one is not remembered).
    az:// with `client_kwargs`: keyword arguments of the Azure SDK's BlobServiceClient (its retry
    policy: retry_total, initial_backoff, increment_base, ...), which adlfs does not pass on; the client
    is rebuilt with them from the connection string or account URL adlfs resolved."""
    if proto in ("gs", "gcs") and (options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST")):
        import gcsfs.core
        fs = gcsfs.core.GCSFileSystem(**options)
        return fs, fs._strip_protocol(uri)
    client_kwargs = options.pop("client_kwargs", None) if proto in AZURE else None
    fs, path = fsspec.core.url_to_fs(uri, **options)
    if client_kwargs:
        from azure.storage.blob.aio import BlobServiceClient
        if getattr(fs, "connection_string", None):
            fs.service_client = BlobServiceClient.from_connection_string(fs.connection_string, **client_kwargs)
        else:
            cred = getattr(fs, "credential", None) or getattr(fs, "account_key", None)
            fs.service_client = BlobServiceClient(account_url=fs.account_url, credential=cred, **client_kwargs)
    return fs, path


def list_files(uri: str, storage_options: Optional[dict], suffixes: tuple[str, ...]) -> tuple[Any, list[FileInfo]]:
    """Expand a path, a directory or a glob into a sorted file listing (sizes and versions from metadata).

    The version is the object's ETag where the store has one (S3, GCS, Azure), else its mtime: with the
    size it enters the job fingerprint, so an input changed between submit and resume is refused."""
    fs, path = filesystem(uri, storage_options)
    try:
        fs.invalidate_cache()       # a resume in the same process must see the store as it is now
    except Exception:   # noqa: BLE001 - not every filesystem keeps a listings cache
        pass
    return fs, retry_io(lambda: _list(fs, uri, path, suffixes), uri, "list")


def _list(fs, uri: str, path: str, suffixes: tuple[str, ...]) -> list[FileInfo]:
    if any(ch in path for ch in "*?["):
        paths = sorted(fs.glob(path))
    elif fs.isdir(path):
        paths = sorted(p for p in fs.find(path) if p.endswith(suffixes)
                       and not any(part.startswith(("_", ".")) for part in p[len(path):].split("/") if part))
    elif fs.exists(path):
        paths = [path]
    else:
        raise InputError(f"{uri}: no such file or directory")
    if not paths:
        raise InputError(f"{uri}: matches no input files ({', '.join(suffixes)})")
    infos = []
    for p in paths:
        info = fs.info(p)
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") \
            or info.get("created")
        infos.append(FileInfo(p, int(info.get("size") or 0), None if version is None else str(version)))
    return infos


def full_path(fs, path: str) -> str:
    """The URL of `path` on `fs`, for messages and the listing fingerprint."""
    proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return path if proto in ("file", "local") else f"{proto}://{path.lstrip('/')}"


class Source:
    """A readable input: enumerate units cheaply, then read one unit's rows as an Arrow table."""

    fs: Any
    listing: Listing
    schema: pa.Schema

    def units(self, unit_rows: int) -> list[Unit]:
        raise NotImplementedError

    def read(self, unit: Unit, columns: Optional[list[str]] = None) -> pa.Table:
        raise NotImplementedError

    @property
    def num_rows(self) -> int:
        raise NotImplementedError
