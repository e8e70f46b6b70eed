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
(multipart upload), at most :data:`UPLOAD_PARTS` parts held per object (on S3;
other protocols through their own file objects). Reads are ranged GETs of exactly
the bytes asked for; the ranges a load plans to read whole are fetched ahead,
:data:`READ_PARALLEL` at once, within the load's ``max_read_bytes``.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import io
import json
import os
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import PurePosixPath
from typing import Any, BinaryIO, ClassVar, NoReturn

from checkpoint.content_check import crc32, crc32_combine
from checkpoint.errors import CheckpointCorruptError
from checkpoint.storage_backend import LOCAL, CrcStream, FileRecord, FileStat, VersionConflict

__all__ = ["PART_BYTES", "READ_PARALLEL", "UPLOAD_PARTS", "FsspecStorage", "url_path"]

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
        self._buckets: set[str] = set()  # buckets make_dir found
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
        if self._s3:
            return _S3Upload(self, path)
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
                # s3fs: FileExistsError for If-None-Match, EINVAL "pre-conditions ... did not hold" for If-Match,
                # FileNotFoundError for If-Match on an object deleted meanwhile
                gone = isinstance(exc, FileNotFoundError) and version is not None
                if gone or isinstance(exc, FileExistsError) or "condition" in str(exc).lower():
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
        """On S3 opening costs no request: a missing object is a ``FileNotFoundError`` at the first read (the
        ranged GET), and the size is asked for (one HEAD) only by a read to the end or a seek from it, so a
        load opens each object once, with its GETs. Elsewhere the object is looked up first."""
        if self._s3:
            return _RangedFile(self, path, None)  # type: ignore[return-value]  # a BinaryIO in what readers use
        found = self.stat(path)
        if found is None:
            raise FileNotFoundError(f"{self.url(path)} does not exist")
        if found.kind != "file":
            raise CheckpointCorruptError(f"{self.url(path)}: {found.description}, not an object; nothing was read")
        return _RangedFile(self, path, found.size)  # type: ignore[return-value]

    def read_versioned(self, path: str | os.PathLike, limit: int) -> tuple[bytes, Hashable] | None:
        """At most ``limit`` bytes of the object at ``path`` and its :meth:`version`, read together, or ``None``
        when it is absent. On S3 one GET: its ETag is the version a conditional put compares (a HEAD, then
        a GET would be two requests, and could see two versions)."""
        if not self._s3:
            version = self.version(path)
            if version is None:
                return None
            with self.open_read(path) as f:
                return f.read(limit), version
        bucket, key, _ = self.fs.split_path(self.key(path))
        try:
            with self._errors(path):
                answer = self.fs.call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit - 1}")
        except FileNotFoundError:
            return None
        except OSError as exc:
            if not _unsatisfiable(exc):
                raise
            version = self.version(path)  # an empty object: no byte range of it exists
            return None if version is None else (b"", version)
        from fsspec.asyn import sync  # the body is read on s3fs's event loop

        with self._errors(path):
            try:
                data = sync(self.fs.loop, answer["Body"].read)
            finally:
                answer["Body"].close()
        return data, str(answer["ETag"])

    def read_into(self, f: BinaryIO, buffers: list, offset: int) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        with self._errors(getattr(f, "path", "an object")):
            f.seek(offset)
            data = f.read(sum(len(v) for v in views))  # one ranged GET (or planned block) for head, data and tail
        done = 0
        for view in views:
            piece = data[done : done + len(view)]
            view[: len(piece)] = piece
            done += len(piece)
            if len(piece) < len(view):
                break
        return done

    def list(self, directory: str | os.PathLike) -> list[str]:
        """The names directly under ``directory``. ``FileNotFoundError`` when it holds nothing (an object store:
        a prefix without objects does not exist), ``NotADirectoryError`` when it is a file."""
        if self._s3:
            return self._list_prefix(directory)
        with self._errors(directory):
            found = self.fs.ls(self.key(directory), detail=True)
        if len(found) == 1 and found[0].get("type") == "file" and found[0]["name"].rstrip("/") == self.key(directory):
            raise NotADirectoryError(f"{self.url(directory)} is a file, not a directory")
        return [PurePosixPath(str(entry["name"]).rstrip("/")).name for entry in found]

    def _list_prefix(self, directory: str | os.PathLike) -> builtins.list[str]:
        """S3: one ListObjectsV2 request per 1,000 names (s3fs's ``ls`` of an absent prefix lists its parent too)."""
        bucket, key, _ = self.fs.split_path(self.key(directory))
        prefix = key.rstrip("/") + "/" if key else ""
        names: builtins.list[str] = []
        token: dict = {}
        while True:
            with self._errors(directory):
                page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, Delimiter="/", **token)
            names += [entry["Prefix"][len(prefix) :].rstrip("/") for entry in page.get("CommonPrefixes", [])]
            names += [entry["Key"][len(prefix) :] for entry in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                break
            token = {"ContinuationToken": page["NextContinuationToken"]}
        if not names:
            raise FileNotFoundError(f"{self.url(directory)}: nothing is stored under it")
        return names

    def stat(self, path: str | os.PathLike, *, follow_symlinks: bool = False) -> FileStat | None:
        info = self._info(path)
        if info is None:
            return None
        if info.get("type") == "directory":
            return FileStat("directory", 0, "a directory")
        return FileStat("file", int(info.get("size") or 0), "an object", modified=_modified(info))

    def version(self, path: str | os.PathLike) -> Hashable | None:
        if self._s3:  # one HEAD; s3fs's info() would also list the name as a prefix when it is absent
            bucket, key, _ = self.fs.split_path(self.key(path))
            try:
                with self._errors(path):
                    return str(self.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"])
            except FileNotFoundError:
                return None
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
        if bucket in self._buckets:
            return
        try:
            with self._errors(path):
                self.fs.info(bucket)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"bucket {bucket!r} of {self.url(path)} does not exist (or these credentials cannot see it); "
                "create it, or check AWS_ENDPOINT_URL and the credentials"
            ) from None
        self._buckets.add(bucket)  # checked once per process: a save's every directory is in one bucket

    def remove_dir(self, path: str | os.PathLike) -> None:
        if self._directories:
            with self._errors(path):
                self.fs.rmdir(self.key(path))

    def abort_uploads(self, directory: str | os.PathLike) -> None:
        """Abort the multipart uploads begun under ``directory`` and never completed (a killed save's): no
        listing shows them, yet the store keeps (and bills) their parts until they are aborted. S3 only."""
        if not hasattr(self.fs, "call_s3"):
            return
        bucket, prefix, _ = self.fs.split_path(self.key(directory))
        with self._errors(directory):
            markers: dict = {}
            while True:
                answer = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/", **markers)
                for upload in answer.get("Uploads", []):
                    self.fs.call_s3(
                        "abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
                if not answer.get("IsTruncated"):
                    return
                markers = {"KeyMarker": answer["NextKeyMarker"], "UploadIdMarker": answer["NextUploadIdMarker"]}

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


READ_BLOCK_BYTES = 8 << 20
"""A planned read is fetched in ranged GETs of about this many bytes (an item cut in even blocks)"""
_MERGE_BYTES = 1 << 20
"""Adjacent planned ranges are fetched in one GET while together at most this size (small tensors)"""
READ_PARALLEL = 8
"""Ranged GETs of one object in flight at once, at most"""

_read_pool: ThreadPoolExecutor | None = None


class _RangedFile(io.RawIOBase):
    """One object opened for reading: each read is a ranged GET of exactly what was asked for, unless the
    reader planned its reads (:meth:`plan_reads`): then they are fetched ahead, concurrently."""

    def __init__(self, store: FsspecStorage, path: Any, size: int | None) -> None:
        self._store = store
        self.path = store.url(path)
        self._key = store.key(path)
        self._known_size = size
        self._pos = 0
        self._planned: deque[tuple[int, int]] = deque()  # blocks (start, end) not fetched yet, in order
        self._blocks: deque[tuple[int, int, Future]] = deque()  # blocks fetched or being fetched, in order
        self._budget: Any = None

    @property
    def _size(self) -> int:
        """The object's size, asked for (one HEAD) the first time a read to its end or a seek from it needs it."""
        if self._known_size is None:
            found = self._store.stat(self.path)
            if found is None or found.kind != "file":
                raise FileNotFoundError(f"{self.path} does not exist")
            self._known_size = found.size
        return self._known_size

    def _end(self, offset: int, length: int) -> int:
        """Where a read of ``length`` bytes from ``offset`` stops: at the object's end where known (a read past
        the end of an object of unknown size gets the bytes there are)."""
        return offset + length if self._known_size is None else min(offset + length, self._known_size)

    def plan_reads(self, ranges: list[tuple[int, int]], budget: Any) -> None:
        """The ``(offset, length)`` ranges the caller will read next, in increasing order: fetched ahead,
        :data:`READ_PARALLEL` ranged GETs at once, each block (about :data:`READ_BLOCK_BYTES`) held in
        ``budget`` (a :class:`checkpoint.reader.ReadBudget`: a block is fetched only while it fits under the
        cap, and released once read past). Reads outside the plan are ranged GETs of their own."""
        self._budget = budget
        for offset, length in ranges:
            end = self._end(offset, length)
            step = -(
                -(end - offset) // max(round((end - offset) / READ_BLOCK_BYTES), 1)
            )  # even blocks, no tiny last one
            while offset < end:
                stop = min(offset + step, end)
                if self._planned and self._planned[-1][1] == offset and stop - self._planned[-1][0] <= _MERGE_BYTES:
                    offset = self._planned.pop()[0]  # adjacent and small: one GET
                self._planned.append((offset, stop))
                offset = stop
        self._fetch_ahead()

    def _fetch_ahead(self) -> None:
        global _read_pool
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(max_workers=READ_PARALLEL, thread_name_prefix="checkpoint-s3-read")
        while self._planned and len(self._blocks) < READ_PARALLEL:
            start, end = self._planned[0]
            cap = self._budget.cap
            if self._blocks and cap is not None and self._budget.held + end - start > cap:
                return  # fetched when an earlier block is read past
            self._budget.hold(end - start)
            self._planned.popleft()
            self._blocks.append((start, end, _read_pool.submit(self._fetch, start, end)))

    def _fetch(self, start: int, end: int) -> bytes:
        """One ranged GET of ``[start, end)`` (keywords: s3fs's third positional parameter is a version id);
        short, or empty from the object's end on (S3 answers a range that starts there "not satisfiable")."""
        try:
            return self._store.fs.cat_file(self._key, start=start, end=end)
        except OSError as exc:
            if self._known_size is not None or not _unsatisfiable(exc):
                raise
            return b""

    def _drop_before(self, position: int) -> None:
        if self._budget is None:
            return  # nothing planned
        while self._blocks and self._blocks[0][1] <= position:
            start, end, fetched = self._blocks.popleft()
            wait([fetched])
            self._budget.done(end - start, [])
        while self._planned and self._planned[0][1] <= position:
            self._planned.popleft()  # skipped by the reader
        self._fetch_ahead()

    def _planned_bytes(self, start: int, end: int) -> bytes | None:
        """``[start, end)`` from the fetched blocks, or ``None`` when they do not hold all of it."""
        pieces = []
        at = start
        for first, last, fetched in self._blocks:
            if last <= at or first > at:
                if first > at:
                    return None
                continue
            data = fetched.result()
            pieces.append(memoryview(data)[at - first : min(end, last) - first])
            at = min(end, last)
            if at == end:
                return data if len(pieces) == 1 and len(pieces[0]) == len(data) else b"".join(pieces)
        return None

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else self._end(self._pos, size)
        if end <= self._pos:
            return b""
        with self._store._errors(self.path):
            self._drop_before(self._pos)
            data = self._planned_bytes(self._pos, end)
            if data is None:
                data = self._fetch(self._pos, end)
        self._pos += len(data)
        self._drop_before(self._pos)
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            self._pos = self._size + offset
        else:
            self._pos = (self._pos if whence == io.SEEK_CUR else 0) + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed and self._budget is not None:
            self._planned.clear()
            self._drop_before(1 << 62)  # the blocks' bytes leave the budget
        super().close()


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


class _S3Upload(_UploadStream):
    """An S3 object uploaded as its bytes come: :data:`UPLOAD_PARTS` parts in flight at once, each
    :data:`PART_BYTES`; one ``PUT`` when the object is smaller than a part.

    s3fs's own file object sends its parts one after another, and each part is held three times
    (its buffer, the part read out of it, and the request body botocore wraps in a ``BytesIO``
    that aiohttp then un-shares). Here a part is copied once, into a ``BytesIO`` that owns its
    bytes and becomes the request body as it is: at most :data:`UPLOAD_PARTS` parts are held,
    the one being filled included.
    """

    def __init__(self, store: FsspecStorage, path: Any) -> None:
        super().__init__(None, store, path)
        self._bucket, self._key, _ = store.fs.split_path(store.key(path))
        self._part = io.BytesIO()
        self._upload_id: str | None = None
        self._sending: list[Future] = []  # part requests in flight, in part order

    def _write_all(self, view: memoryview) -> None:
        while view:
            room = PART_BYTES - self._part.tell()
            self._part.write(view[:room])
            view = view[room:]
            if self._part.tell() == PART_BYTES:
                self._send_part()

    def _send_part(self) -> None:
        with self._store._errors(self._path):
            if self._upload_id is None:
                self._upload_id = self._call("create_multipart_upload")["UploadId"]
            # at most UPLOAD_PARTS - 1 parts in flight: the one being filled next is the other one held
            while len(pending := [f for f in self._sending if not f.done()]) >= UPLOAD_PARTS - 1:
                wait(pending, return_when=FIRST_COMPLETED)
            for sent in self._sending:
                if sent.done():
                    sent.result()  # a part that failed fails the upload now, not at its end
            _return_freed_memory()
        body, self._part = self._part, io.BytesIO()
        body.seek(0)
        number = len(self._sending) + 1
        self._sending.append(
            _upload_pool().submit(self._call, "upload_part", PartNumber=number, UploadId=self._upload_id, Body=body)
        )

    def _call(self, method: str, **kwargs: Any) -> dict:
        return self._store.fs.call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)

    def finish(self) -> FileRecord:
        with self._store._errors(self._path):
            if self._upload_id is None:  # smaller than a part: one PUT
                self._part.seek(0)
                self._call("put_object", Body=self._part)
            else:
                if self._part.tell():
                    self._send_part()
                parts = [_part_record(number, sent.result()) for number, sent in enumerate(self._sending, 1)]
                self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
        self._part = io.BytesIO()
        io.RawIOBase.close(self)
        return FileRecord(size=self.size, crc32=self.crc)

    def abort(self) -> None:
        wait(self._sending)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=self._upload_id)
        self._part = io.BytesIO()
        io.RawIOBase.close(self)


UPLOAD_PARTS = 3
"""Parts of one object held at once by an S3 upload: the one being filled and those being sent."""

_pool: ThreadPoolExecutor | None = None


def _upload_pool() -> ThreadPoolExecutor:
    """Threads that wait for part requests (s3fs runs them on its event loop; each call blocks its caller)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=4 * UPLOAD_PARTS, thread_name_prefix="checkpoint-s3-upload")
    return _pool


def _return_freed_memory() -> None:
    """Hand the memory of sent parts back to the OS. glibc raises its mmap threshold to the size of the
    first part freed, so later parts come from the heap and stay resident once freed: at 8 parts the
    process held one part more than the parts in use. ``malloc_trim`` releases them (a no-op elsewhere)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _trim = False
    if _trim:
        _trim(0)


_trim: Any = None


def _part_record(number: int, answer: dict) -> dict:
    """What ``complete_multipart_upload`` needs of one part: its number, ETag and checksum if the server sent one."""
    record = {"PartNumber": number, "ETag": answer["ETag"]}
    record.update({k: v for k, v in answer.items() if k.startswith("Checksum") and k != "ChecksumType"})
    return record


def _bytes_of(data: bytes | str | Callable[[BinaryIO], object]) -> bytes:
    if callable(data):
        buffer = io.BytesIO()
        data(buffer)
        return buffer.getvalue()
    return data.encode() if isinstance(data, str) else bytes(data)


def _unsatisfiable(exc: OSError) -> bool:
    """Whether s3fs's ``exc`` is S3's answer to a byte range past an object's end (HTTP 416, as ``EINVAL``)."""
    return "range is not satisfiable" in str(exc).lower() or "invalidrange" in str(exc).lower()


def _modified(info: dict) -> float | None:
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
    if stamp is None:
        return None
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
