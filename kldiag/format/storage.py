"""Where a run lives: a local directory, or a URI (s3://bucket/prefix, anything pyarrow.fs or fsspec opens).

`resolve(run_dir) -> Store`. Paths inside a store are relative POSIX strings
("tokens/rank-0/part-…parquet"). Publishing is atomic on both kinds:

- local: a dot-temp file in the final directory, fsync, rename, fsync of the directory;
- object storage: the whole object is serialised in memory and sent as one PUT (S3 has no
  rename; a PUT is all-or-nothing, and a killed writer leaves no object at all).

Credentials and the endpoint come only from the standard environment (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_DEFAULT_REGION / AWS_REGION, AWS_ENDPOINT_URL /
AWS_ENDPOINT_URL_S3) and the SDK's config files, never from kldiag options, so they never
reach run.json, logs or error messages (`redact` scrubs secrets from messages as a second guard).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from kldiag.errors import StorageError
from kldiag.format.schema import CACHE_DIR

URI_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
S3_CONNECT_TIMEOUT_S = 10.0
S3_REQUEST_TIMEOUT_S = 60.0
S3_MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Entry:
    """One listed file: its path relative to the store's root, size and modification time."""

    rel: str
    size: int
    mtime_ns: int

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1]


def is_uri(run_dir: Any) -> bool:
    """True for 'scheme://...' strings other than file://."""
    m = URI_RE.match(str(run_dir)) if isinstance(run_dir, str) else None
    return bool(m) and m.group(1).lower() != "file"


def redact(text: str) -> str:
    """`text` with every credential of the environment replaced by '***'."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", text)  # user:password@ in a URI


def display_uri(uri: str) -> str:
    """The URI without a query string or user info: safe for logs, manifests and errors."""
    parts = urlsplit(uri)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{parts.path}".rstrip("/")


class Store:
    """A run's root: `fs` is None for a local directory, else a pyarrow FileSystem."""

    def __init__(self, uri: str, fs: pafs.FileSystem | None, root: str):
        self.uri, self.fs, self.root = uri, fs, root.rstrip("/") if fs is not None else root

    @property
    def local(self) -> bool:
        return self.fs is None

    def full(self, rel: str = "") -> str:
        """The path to open: an OS path (local) or the filesystem's path (remote)."""
        if not rel:
            return self.root
        return os.path.join(self.root, *rel.split("/")) if self.local else f"{self.root}/{rel}"

    def display(self, rel: str = "") -> str:
        """What messages show: the local path, or the URI of the object."""
        return self.full(rel) if self.local else (f"{self.uri}/{rel}" if rel else self.uri)

    # ---- reading -------------------------------------------------------------------------

    def list_files(self, rel_dir: str, recursive: bool = False) -> list[Entry]:
        """Files under rel_dir (none when it does not exist), paths relative to the root."""
        if self.local:
            return _list_local(Path(self.full(rel_dir)), rel_dir, recursive)
        sel = pafs.FileSelector(self.full(rel_dir), allow_not_found=True, recursive=recursive)
        infos = self._call("list", rel_dir, self.fs.get_file_info, sel)
        root = self.root.lstrip("/") + "/"  # fsspec filesystems may answer with a leading slash
        return [Entry(p[len(root):], int(i.size or 0), int(i.mtime_ns or 0)) for i in infos
                if i.type == pafs.FileType.File and (p := i.path.lstrip("/")).startswith(root)]

    def read_bytes(self, rel: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        if self.local:
            try:
                return Path(self.full(rel)).read_bytes()
            except FileNotFoundError:
                return None
        info = self._call("read", rel, self.fs.get_file_info, self.full(rel))
        if info.type != pafs.FileType.File:
            return None
        with self._call("read", rel, self.fs.open_input_stream, self.full(rel)) as f:
            return f.read()

    def open_parquet(self, rel: str) -> pq.ParquetFile:
        """A ParquetFile reading the part (remote: ranged reads through the filesystem)."""
        if self.local:
            return pq.ParquetFile(self.full(rel))
        # pre_buffer coalesces a row group's column chunks into few ranged GETs: 10% faster
        # from a local S3 server (bench/analyze.py --s3-only), more where each request costs latency.
        return pq.ParquetFile(self.fs.open_input_file(self.full(rel)), pre_buffer=True)

    def exists(self, rel: str = "") -> bool:
        if self.local:
            return os.path.exists(self.full(rel))
        info = self._call("check", rel, self.fs.get_file_info, self.full(rel))
        return info.type != pafs.FileType.NotFound

    def check(self) -> None:
        """Raise StorageError naming the URI when its bucket is missing or unreachable
        (object stores; listing a missing bucket would otherwise look like an empty run)."""
        if self.local or self.fs.type_name not in ("s3", "gcs"):
            return
        bucket = self.root.split("/", 1)[0]
        info = self._call("open", "", self.fs.get_file_info, bucket)
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"cannot open {self.uri}: the bucket {bucket!r} does not exist (or these credentials "
                               "cannot see it): create it, or fix the bucket name in the URI")

    # ---- writing -------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes) -> int:
        """Publish `data` atomically under rel; returns its size."""
        if self.local:
            path = Path(self.full(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(path.parent)
            return len(data)
        self._put(rel, data)
        return len(data)

    def write_parquet(self, rel: str, table: pa.Table, **options: Any) -> int:
        """Publish `table` as a Parquet file under rel atomically; returns its size in bytes."""
        if not self.local:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, **options)
            return self.write_bytes(rel, sink.getvalue().to_pybytes())
        path = Path(self.full(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            pq.write_table(table, f, **options)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
        fsync_dir(path.parent)
        return size

    def remove(self, rel: str) -> None:
        if self.local:
            os.unlink(self.full(rel))
        else:
            self._call("delete", rel, self.fs.delete_file, self.full(rel))

    def _put(self, rel: str, data: bytes) -> None:
        # One write of the whole body, then close: pyarrow sends a body under its part size as
        # a single PutObject at close. Without close (a killed process) no object appears.
        stream = self._call("write", rel, self.fs.open_output_stream, self.full(rel))
        try:
            stream.write(data)
        finally:
            self._call("write", rel, stream.close)

    def _call(self, what: str, rel: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (OSError, pa.ArrowException) as e:
            raise storage_error(what, self.display(rel), e) from None

    def cache_dir(self) -> Path:
        """Where derived results of this run are cached: RUN/.kldiag locally, else a local
        directory keyed by the URI (KLDIAG_CACHE_DIR, else $XDG_CACHE_HOME/kldiag)."""
        if self.local:
            return Path(self.root) / CACHE_DIR
        base = os.environ.get("KLDIAG_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kldiag")
        return Path(base) / "runs" / hashlib.sha1(self.uri.encode()).hexdigest()[:20]

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def __reduce__(self) -> tuple:  # pickled into worker processes and Ray tasks
        return (Store, (self.uri, self.fs, self.root))


def _list_local(path: Path, rel_dir: str, recursive: bool) -> list[Entry]:
    out: list[Entry] = []
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for e in entries:
        rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
        if e.is_file():
            try:
                st = e.stat()
            except FileNotFoundError:
                continue  # a writer renamed or removed it between the listing and the stat
            out.append(Entry(rel, st.st_size, st.st_mtime_ns))
        elif recursive and e.is_dir():
            out.extend(_list_local(Path(e.path), rel, True))
    return out


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def storage_error(what: str, where: str, e: BaseException) -> StorageError:
    """A StorageError naming the URI and the likely fix, never the credentials."""
    text = redact(str(e))
    low = text.lower()
    if "no_such_bucket" in low or "bucket does not exist" in low or "nosuchbucket" in low:
        fix = "the bucket does not exist: create it, or fix the bucket name in the URI"
    elif "access_denied" in low or "accessdenied" in low or "forbidden" in low or "invalidaccesskeyid" in low \
            or "signaturedoesnotmatch" in low:
        fix = ("access was refused: check the credentials in the standard AWS environment "
               "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and the bucket policy")
    elif "network_connection" in low or "could not resolve" in low or "connection refused" in low \
            or "couldn't connect" in low or "timed out" in low or "timeout" in low:
        fix = "the endpoint cannot be reached: check AWS_ENDPOINT_URL / AWS_DEFAULT_REGION and the network"
    else:
        fix = "check the URI, the credentials in the environment and the network"
    return StorageError(f"cannot {what} {where}: {fix} ({text})")


def _env_key() -> str:
    """What in the environment configures a client (hashed: the values are secrets)."""
    names = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ACCESS_KEY_ID",
             "AWS_PROFILE", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
    return hashlib.sha1("\0".join(os.environ.get(n, "") for n in names).encode()).hexdigest()


def _filesystem(scheme: str, netloc: str, query: str) -> pafs.FileSystem:
    return _cached_filesystem(scheme, netloc, query, _env_key())


@functools.lru_cache(maxsize=64)
def _cached_filesystem(scheme: str, netloc: str, query: str, env_key: str) -> pafs.FileSystem:
    if query:  # pyarrow's own URI options (endpoint_override=..., region=...)
        return pafs.FileSystem.from_uri(f"{scheme}://{netloc}/?{query}")[0]
    if scheme in ("s3", "s3a"):
        return _s3()
    if scheme in ("gs", "gcs"):
        return pafs.GcsFileSystem()
    if scheme in ("hdfs", "viewfs"):
        return pafs.FileSystem.from_uri(f"{scheme}://{netloc}")[0]
    return _fsspec(scheme)


def _s3() -> pafs.FileSystem:
    """pyarrow's S3 client, configured from the standard AWS environment only."""
    kw: dict[str, Any] = {"connect_timeout": S3_CONNECT_TIMEOUT_S, "request_timeout": S3_REQUEST_TIMEOUT_S,
                          "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS)}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kw["endpoint_override"] = parts.netloc
        kw["scheme"] = parts.scheme or "https"
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    if region:
        kw["region"] = region
    return pafs.S3FileSystem(**kw)


def _fsspec(scheme: str) -> pafs.FileSystem:
    try:
        import fsspec
    except ImportError:
        raise StorageError(f"kldiag cannot open {scheme}:// run URIs: it reads s3:// and gs:// itself and any "
                           "other scheme through fsspec; install it with pip install 'kldiag[fsspec]' plus "
                           f"the fsspec package for {scheme}://") from None
    try:
        fs = fsspec.filesystem(scheme)
    except (ValueError, ImportError) as e:
        raise StorageError(f"kldiag cannot open {scheme}:// run URIs: fsspec does not know the scheme or its "
                           f"package is missing ({redact(str(e))}); install the fsspec implementation for "
                           f"{scheme}:// (for example pip install gcsfs, adlfs or s3fs)") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def printable_path(path: str | os.PathLike) -> str:
    """A path for a message or a label: bytes that are not UTF-8 (kept by Python as surrogates)
    shown as backslash escapes (`bad\\xffname`), so printing it never raises."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _check_utf8(path: str) -> None:
    """Parquet reads and writes paths as UTF-8: a local path holding other bytes is refused up front,
    named and with the fix, instead of failing inside pyarrow with an encoding error."""
    try:
        os.path.abspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise StorageError(f"the path {printable_path(os.path.abspath(path))} is not valid UTF-8, which Parquet "
                           "needs: rename it, or link it under a UTF-8 name (ln -s 'OLD' run_link) and pass "
                           "that") from None


def resolve(run_dir: str | os.PathLike | Store) -> Store:
    """The Store of a run directory: a local path (as given) or a URI."""
    if isinstance(run_dir, Store):
        return run_dir
    text = os.fspath(run_dir)
    if not is_uri(text):
        if isinstance(text, str) and text.lower().startswith("file://"):
            text = urlsplit(text).path
        text = os.fsdecode(text)
        _check_utf8(text)
        return Store(text, None, text)
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    fs = _filesystem(scheme, parts.netloc, parts.query)
    root = f"{parts.netloc}{parts.path}".rstrip("/")
    if not parts.netloc:
        raise StorageError(f"{display_uri(text)} names no bucket or host; write {scheme}://BUCKET/PREFIX")
    return Store(display_uri(text), fs, root)
