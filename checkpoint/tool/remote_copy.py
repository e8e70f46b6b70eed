"""``fsdp-ckpt export`` outputs and ``import`` sources at URLs (``s3://...``), through a local copy.

Safetensors and torch files are local-disk formats (``safetensors`` maps them,
a torch export fills a reserved file at offsets), so an export to a URL is
made in a local stand-in directory, with all of the local export's checks,
then uploaded; an import from a URL first downloads the source's weight files
and indexes. The stand-in lives under the system temp directory (``TMPDIR``),
is named by the URL (the same for every process of one run) and is removed
afterwards: it needs local space for the export or the source, once.

An upload keeps the export's commit order: the shards first, the index
(``model.safetensors.index.json``, what makes a directory a finished export)
last; a torch file is one object, whole once its upload completed. With
``--force`` the old index goes first and the old weight files the new export
does not name go last, so a reader never finds an index naming a mix.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path, PurePath

from checkpoint.storage_backend import storage_for
from checkpoint.tool.cli_report import CliError
from checkpoint.tool.safetensors_io import INDEX_NAME, is_export_file

__all__ = ["check_output", "download", "remove", "stand_in", "upload"]

_PIECE_BYTES = 16 << 20
"""Bytes copied at a time (an upload part)"""


def stand_in(url: PurePath, role: str) -> Path:
    """The local directory standing in for ``url`` (``role``: "export" or "import"): the same path on every
    process of a run."""
    digest = hashlib.sha256(str(url).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"fsdp-ckpt-{role}-{digest}"


def remove(local: Path) -> None:
    """Remove a stand-in directory (what a killed run left there included)."""
    shutil.rmtree(local, ignore_errors=True)


def check_output(url: PurePath, force: bool) -> None:
    """An export to ``url`` writes a fresh output, or replaces one with ``--force`` (as for a local path)."""
    store = storage_for(url)
    found = store.stat(url)
    if found is not None and (found.kind != "directory" or store.list(url)) and not force:
        raise CliError(f"output {str(url)!r} already exists and is not empty; choose a new path or pass --force")


def download(src: PurePath, into: Path) -> Path:
    """Copy the import source at ``src`` (one file, or a directory's ``*.safetensors`` / ``*.bin`` files and
    indexes) to ``into / src.name``; returns that path."""
    store = storage_for(src)
    found = store.stat(src)
    if found is None:
        raise FileNotFoundError(f"import source {str(src)!r} does not exist; check the URL")
    remove(into)
    into.mkdir(parents=True)
    local = into / src.name
    if found.kind == "file":
        _copy_down(src, local)
        return local
    names = sorted(n for n in store.list(src) if is_export_file(n) or n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(
            f"{str(src)!r} holds no *.safetensors files; pass a safetensors file or HF model directory"
        )
    local.mkdir()
    for name in names:
        _copy_down(src / name, local / name)
    return local


def upload(local: Path, dst: PurePath, *, force: bool) -> None:
    """Upload the finished export at ``local`` (a directory, or one file) to ``dst`` (see the module docstring)."""
    store = storage_for(dst)
    if local.is_file():
        _copy_up(local, dst)
        return
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    old = store.list(dst) if force and store.stat(dst) is not None else []
    if INDEX_NAME in old:
        store.delete(dst / INDEX_NAME)  # no index naming a mix of old and new shards, ever
    for name in names:
        if name != INDEX_NAME:
            _copy_up(local / name, dst / name)
    if INDEX_NAME in names:
        _copy_up(local / INDEX_NAME, dst / INDEX_NAME)  # the commit record, last
    for name in old:
        if is_export_file(name) and name not in names:
            store.delete(dst / name, missing_ok=True)  # a weight file from_pretrained could read instead


def _copy_down(src: PurePath, dst: Path) -> None:
    with storage_for(src).open_read(src) as f, open(dst, "wb") as out:
        while piece := f.read(_PIECE_BYTES):
            out.write(piece)


def _copy_up(src: Path, dst: PurePath) -> None:
    stream = storage_for(dst).create(dst)
    try:
        with open(src, "rb") as f:
            while piece := f.read(_PIECE_BYTES):
                stream.write(piece)
        stream.finish()
    except BaseException:
        stream.abort()
        raise
