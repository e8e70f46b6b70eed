"""Checkpoints at URLs: a :class:`~checkpoint.storage_backend.Storage` over any fsspec file system.

``checkpoint.save("s3://bucket/run/step100", ...)`` reaches this module
through :func:`checkpoint.storage_backend.locate`, once per operation: the URL
becomes a path bound to its :class:`FsspecStorage`, and every helper below the
entry point reads the storage from the path. ``s3://`` goes through ``s3fs``
(the ``[s3]`` extra), any other fsspec protocol (``gs://``, ``memory://``,
``file://``) through its own fsspec package. Credentials and endpoint come from
the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``) and ``storage_options``
(passed to the fsspec file system, as DCP's fsspec writer does).

Object stores have no rename, ``flock`` or ``fsync``: saves to a URL use the
object-store commit protocol (:mod:`checkpoint.object_commit`). Writes stream:
an object is uploaded in parts of :data:`PART_BYTES` as its bytes are produced
(multipart upload), so a rank holds about one part per open object; reads are
ranged GETs of exactly the bytes asked for.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import PurePosixPath
from typing import Any, BinaryIO, ClassVar, NoReturn

from checkpoint.content_check import crc32, crc32_combine
from checkpoint.errors import CheckpointCorruptError
from checkpoint.storage_backend import LOCAL, CrcStream, FileRecord, FileStat, VersionConflict

__all__ = ["PART_BYTES", "FsspecStorage", "url_path"]

PART_BYTES = 16 << 20
"""Bytes per uploaded part (S3's minimum is 5 MiB); one part per object in flight is held in memory."""

_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
"""Protocols without real directories: ``make_dir`` checks the bucket instead of creating anything."""

_EXTRAS = {"s3": "s3", "s3a": "s3"}
"""protocol -> the extra of this package that installs its fsspec implementation"""

_put_if_lock = threading.Lock()  # put_if's check and write, on stores without a conditional write
_stores: dict[str, FsspecStorage] = {}  # protocol + options -> storage (and its fsspec instance), made once


class _UrlPath(PurePosixPath):
    """A path inside one :class:`FsspecStorage`: joins, ``parent`` and ``with_name`` keep the storage.

    ``str()`` is the URL. ``pathlib.Path(url_path)`` would make it a local path: the library never
    converts one (helpers receive it as it is).
    """

    storage: ClassVar[FsspecStorage]

    def __str__(self) -> str:
        return self.storage.url(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __fspath__(self) -> str:
        return str(self)


def url_path(url: str, storage_options: dict | None = None) -> PurePosixPath:
    """``url`` as a path bound to the storage of its protocol and options (see the module docstring)."""
    if "://" not in url:  # Path("s3://b/x") is s3:/b/x: pathlib already dropped a slash
        scheme = url.split("/", 1)[0]
        raise ValueError(
            f"{url!r} looks like a URL that pathlib.Path turned into a local path (a directory named "
            f"{scheme!r}); pass the URL as a string ({scheme}//...), not as a pathlib.Path"
        )
    protocol, _, rest = url.partition("://")
    protocol = protocol.lower()
    store = _storage(protocol, storage_options or {})
    return store.path(rest)


def _storage(protocol: str, given: dict) -> FsspecStorage:
    options = _with_environment(protocol, given)
    key = json.dumps([protocol, options], sort_keys=True, default=repr)
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = FsspecStorage(_filesystem(protocol, options), protocol)
    return store


def _with_environment(protocol: str, given: dict) -> dict:
    """``given`` plus what the standard AWS variables say (explicit options win)."""
    options = dict(given)
    if protocol in ("s3", "s3a"):
        env = os.environ
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint and "endpoint_url" not in options and "endpoint_url" not in options.get("client_kwargs", {}):
            options["endpoint_url"] = endpoint
        if "key" not in options and env.get("AWS_ACCESS_KEY_ID"):
            options["key"] = env["AWS_ACCESS_KEY_ID"]
        if "secret" not in options and env.get("AWS_SECRET_ACCESS_KEY"):
            options["secret"] = env["AWS_SECRET_ACCESS_KEY"]
        region = env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION")
        if region:
            options.setdefault("client_kwargs", {}).setdefault("region_name", region)
        # A save lists what it just wrote: no listing cache. Bounded waits: a server that went away
        # is an error within seconds, never a hang.
        options.setdefault("use_listings_cache", False)
        options.setdefault("config_kwargs", {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}})
    return options


def _filesystem(protocol: str, options: dict) -> Any:
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"saving to or loading from {protocol}:// URLs needs fsspec: pip install 'offload-fsdp[{_EXTRAS.get(protocol, 's3')}]'"
        ) from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(
            f"unsupported URL scheme {protocol + '://'!r}: a checkpoint path is a local path or a URL of an "
            f"fsspec protocol (s3://, gs://, memory://, file://, ...); none is installed for {protocol!r}"
        ) from None
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        fix = f"pip install 'offload-fsdp[{extra}]'" if extra else f"install the fsspec package for {protocol}://"
        raise ImportError(f"{protocol}:// URLs need a package that is not installed ({exc}); {fix}") from None
    return cls(**options)


class FsspecStorage:
    """:class:`~checkpoint.storage_backend.Storage` over one fsspec file system (see the module docstring)."""

    renames_atomically = False

    def __init__(self, fs: Any, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol
        self._directories = protocol not in _OBJECT_STORES
        self._rooted = fs.root_marker == "/"
        self._s3 = protocol in ("s3", "s3a")
        self.conditional_put = self._s3
        """S3's conditional PUT makes :meth:`put_if` one atomic step; elsewhere it checks, then writes"""
        self.path_type = type(f"{protocol.capitalize()}Path", (_UrlPath,), {"storage": self})

    def path(self, rest: str) -> PurePosixPath:
        """The path of ``<protocol>://<rest>`` in this storage."""
        return self.path_type("/" + self.fs._strip_protocol(f"{self.protocol}://{rest}").lstrip("/"))

    def key(self, path: str | os.PathLike) -> str:
        """What fsspec calls the object at ``path``."""
        posix = PurePosixPath(path).as_posix() if isinstance(path, PurePosixPath) else os.fspath(path)
        if "://" in posix:
            return self.fs._strip_protocol(posix)
        return posix if self._rooted else posix.lstrip("/")

    def url(self, path: str | os.PathLike) -> str:
        return f"{self.protocol}://{self.key(path)}"

    # -- writes --

    def create(self, path: str | os.PathLike) -> CrcStream:
        with self._errors(path):
            raw = self.fs.open(self.key(path), "wb", block_size=PART_BYTES)
        return _UploadStream(raw, self, path)

    def write_file(
        self, path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], object], *, sync_dir: bool = False
    ) -> None:
        with self._errors(path):
            self.fs.pipe_file(self.key(path), _bytes_of(data))

    def put_if(self, path: str | os.PathLike, data: bytes, *, version: Hashable | None) -> None:
        """S3: a conditional PUT (``If-Match`` the version read, ``If-None-Match: *`` for a new object), so
        of two commits racing on one URL exactly one lands. ``file://``: a new object is created by an exclusive
        link. Other cases: the version is checked, then the object written, atomically only between this
        process's threads (``conditional_put`` is ``False``: the object-store protocol orders committers with an
        exclusively created claim, see :mod:`checkpoint.object_commit`)."""
        key = self.key(path)
        if self._s3:
            condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": str(version)}
            try:
                with self._errors(path):
                    self.fs.pipe_file(key, data, **condition)
            except OSError as exc:
                # s3fs: FileExistsError for If-None-Match, EINVAL "pre-conditions ... did not hold" for If-Match
                if isinstance(exc, FileExistsError) or "condition" in str(exc).lower():
                    raise VersionConflict(f"{self.url(path)} was written by another save meanwhile") from None
                raise
            return
        if version is None and self.protocol == "file":  # a local file system: created by an exclusive link
            LOCAL.put_if(self.key(path), data, version=None)
            return
        with _put_if_lock:  # other stores: atomic between this process's threads only
            if self.version(path) != version:
                raise VersionConflict(f"{self.url(path)} was written by another save meanwhile")
            self.write_file(path, data)

    # -- reads --

    def open_read(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> BinaryIO:
        found = self.stat(path)
        if found is None:
            raise FileNotFoundError(f"{self.url(path)} does not exist")
        if found.kind != "file":
            raise CheckpointCorruptError(f"{self.url(path)}: {found.description}, not an object; nothing was read")
        known = {"size": found.size} if self._s3 else {}  # s3fs would ask the server for it again
        with self._errors(path):
            # no read-ahead cache: every read is one ranged GET of exactly what the reader asked for
            return self.fs.open(self.key(path), "rb", cache_type="none", **known)

    def read_into(self, f: BinaryIO, buffers: list, offset: int) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        with self._errors(getattr(f, "path", "an object")):
            f.seek(offset)
            data = f.read(sum(len(v) for v in views))  # one ranged GET for head, data and tail
        done = 0
        for view in views:
            piece = data[done : done + len(view)]
            view[: len(piece)] = piece
            done += len(piece)
            if len(piece) < len(view):
                break
        return done

    def list(self, directory: str | os.PathLike) -> list[str]:
        with self._errors(directory):
            names = self.fs.ls(self.key(directory), detail=False)
        return [PurePosixPath(str(name).rstrip("/")).name for name in names]

    def stat(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> FileStat | None:
        info = self._info(path)
        if info is None:
            return None
        if info.get("type") == "directory":
            return FileStat("directory", 0, "a directory")
        return FileStat("file", int(info.get("size") or 0), "an object", modified=_modified(info))

    def version(self, path: str | os.PathLike) -> Hashable | None:
        info = self._info(path)
        if info is None or info.get("type") == "directory":
            return None
        etag = info.get("ETag") or info.get("etag")
        if etag:
            return str(etag)
        return repr((info.get("size"), info.get("mtime"), info.get("created"), info.get("ino")))

    def _info(self, path: str | os.PathLike) -> dict | None:
        try:
            with self._errors(path):
                return self.fs.info(self.key(path))
        except FileNotFoundError:
            return None

    # -- removal and directories --

    def delete(self, path: str | os.PathLike, *, missing_ok: bool = False) -> None:
        try:
            with self._errors(path):
                self.fs.rm_file(self.key(path))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def make_dir(self, path: str | os.PathLike) -> None:
        """Directories: made. Object stores have none; the bucket is checked instead (a clear error now,
        not a failed upload later)."""
        if self._directories:
            with self._errors(path):
                self.fs.makedirs(self.key(path), exist_ok=True)
            return
        bucket = self.key(path).split("/", 1)[0]
        try:
            with self._errors(path):
                self.fs.info(bucket)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"bucket {bucket!r} of {self.url(path)} does not exist (or these credentials cannot see it); "
                "create it, or check AWS_ENDPOINT_URL and the credentials"
            ) from None

    def remove_dir(self, path: str | os.PathLike) -> None:
        if self._directories:
            with self._errors(path):
                self.fs.rmdir(self.key(path))

    def remove_tree(self, path: str | os.PathLike, *, ignore_errors: bool = False) -> None:
        try:
            with self._errors(path):
                self.fs.rm(self.key(path), recursive=True)
        except OSError:
            if not ignore_errors:
                raise

    def rename(self, src: str | os.PathLike, dst: str | os.PathLike) -> NoReturn:
        raise OSError(f"{self.url(src)}: object stores have no atomic rename (saves here never rename)")

    def sync_dir(self, path: str | os.PathLike) -> None:
        pass  # an object is durable once its upload completed

    def lock(self, path: str | os.PathLike, *, timeout: float | None = None) -> contextlib.AbstractContextManager[None]:
        raise OSError(f"{self.url(path)}: object stores have no lock (saves here commit with put_if)")

    @contextlib.contextmanager
    def _errors(self, path: Any) -> Iterator[None]:
        """Errors name the URL and the fix; a transport failure is a ``ConnectionError``, never a hang."""
        where = self.url(path) if not isinstance(path, str) or "://" not in path else path
        try:
            yield
        except VersionConflict:
            raise
        except PermissionError as exc:
            raise PermissionError(
                f"{where}: access denied ({_short(exc)}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                "or the storage_options credentials"
            ) from None
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{where}: not found ({_short(exc)})") from None
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore / aiohttp transport errors: one clear type
            raise ConnectionError(
                f"{where}: the storage did not answer ({_short(exc)}); check AWS_ENDPOINT_URL / the network"
            ) from exc


class _UploadStream(CrcStream):
    """An object being uploaded in parts as its bytes come; whole and durable on :meth:`finish`, absent after
    :meth:`abort` (a multipart upload is aborted, never completed)."""

    def __init__(self, raw: Any, store: FsspecStorage, path: Any) -> None:
        super().__init__(raw)
        self._store = store
        self._path = path

    def _write_all(self, view: memoryview) -> None:
        # In parts: the file object's buffer then holds at most about one part, whatever the tensor's size.
        with self._store._errors(self._path):
            for start in range(0, len(view), PART_BYTES):
                self.raw.write(view[start : start + PART_BYTES])

    def write_uncounted(self, b) -> int:
        view = memoryview(b).cast("B")
        self._write_all(view)  # no writeback hint: there is no page cache to start on
        piece_crc = crc32(view)
        self.crc = crc32_combine(self.crc, piece_crc, len(view))
        self.size += len(view)
        return piece_crc

    def finish(self) -> FileRecord:
        with self._store._errors(self._path):
            self.raw.close()  # completes the upload
        super().close()
        return FileRecord(size=self.size, crc32=self.crc)

    def abort(self) -> None:
        discard = getattr(self.raw, "discard", None)
        with contextlib.suppress(Exception):
            if discard is not None:
                discard()
                self.raw.closed = True  # type: ignore[misc]  # fsspec files have a setter; closing would complete the upload
        super().close()

    def close(self) -> None:
        io.RawIOBase.close(self)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("an upload has no file descriptor")

    def flush(self) -> None:
        pass  # parts go out as they fill; the last one on finish


def _bytes_of(data: bytes | str | Callable[[BinaryIO], object]) -> bytes:
    if callable(data):
        buffer = io.BytesIO()
        data(buffer)
        return buffer.getvalue()
    return data.encode() if isinstance(data, str) else bytes(data)


def _modified(info: dict) -> float | None:
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
    if stamp is None:
        return None
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
