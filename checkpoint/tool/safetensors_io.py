"""Hugging Face-style sharded safetensors: streaming export and a reader for import.

Export writes ``model-0000k-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
"weight_map": {name: file}}``), the layout ``transformers`` loads. The file
format is simple and public (8-byte little-endian header length, a JSON header
of ``dtype`` / ``shape`` / ``data_offsets``, then raw row-major bytes), so each
shard is written here directly: its header is known from shapes alone, and
tensors are appended one at a time. ``safetensors.torch.save_file`` would need
a whole shard (gigabytes) in memory at once.

Non-tensor values (optimizer hyper-parameters, ``extra`` entries) cannot live
in a safetensors file; when exported they go into the index under
``metadata.fsdp_ckpt_objects`` as JSON, and import reads them back.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from checkpoint.data_file import tensor_bytes
from checkpoint.durable import disk_full_is_clear, durable_write
from checkpoint.manifest import check_relative_name, open_regular
from checkpoint.tool.stream import Entry

__all__ = [
    "INDEX_NAME",
    "SafetensorsSource",
    "is_export",
    "is_export_file",
    "plan_shards",
    "write_index",
    "write_shards",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
OBJECTS_KEY = "fsdp_ckpt_objects"
KEYS_FIELD = "fsdp_ckpt_keys"

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_ALIGN = 8
_MAX_INDEX_BYTES = 1 << 30


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


_WEIGHT_FILE = re.compile(
    r"model(-\d{5,}-of-\d{5,})?\.safetensors|pytorch_model(-\d{5,}-of-\d{5,})?\.bin"
    r"|model\.safetensors\.index\.json|pytorch_model\.bin\.index\.json"
)


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a Hugging Face weight file or index, so a new export replaces it.

    What an export writes (shards, the index) and what ``from_pretrained`` would
    read beside or instead of it: ``model.safetensors`` (read before any index),
    ``pytorch_model*.bin`` and their indexes.
    """
    return _WEIGHT_FILE.fullmatch(name) is not None


def is_export(directory: Path) -> bool:
    """Whether ``directory`` holds a finished export: the index is its commit record."""
    return (directory / INDEX_NAME).is_file()


def plan_shards(items: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group ``(name, nbytes)`` in order into shards of at most ``max_shard_bytes``.

    A tensor larger than the limit gets a shard of its own (as ``transformers`` does).
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in items:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return [s for s in shards if s] or [[]]


def _header(specs: list[tuple[str, torch.dtype, tuple[int, ...], int]], full_keys: bool) -> bytes:
    # KEYS_FIELD tells import whether names are whole checkpoint keys or bare model fqns
    header: dict[str, Any] = {"__metadata__": {"format": "pt", KEYS_FIELD: "full" if full_keys else "model"}}
    offset = 0
    for name, dtype, shape, nbytes in specs:
        if dtype not in _DTYPES:
            raise ValueError(f"{name!r} has dtype {dtype}, which safetensors cannot store; export with --format torch")
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # pad with spaces so the data starts 8-byte aligned (readers may mmap it)
    raw += b" " * (-(len(raw) + 8) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


def write_shards(
    directory: Path,
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]],
    values: Iterator[tuple[str, torch.Tensor]],
    *,
    full_keys: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    which: Callable[[int], bool] = lambda index: True,
) -> None:
    """Write the shards whose index ``which`` accepts (names, dtypes, shapes per file), fsynced.

    ``values`` yields those shards' tensors in order. Raises ``ValueError``
    when a value's dtype or shape differs from its planned spec.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for index, shard in enumerate(shards):
        if not which(index):
            continue
        file_name = shard_file_name(index, len(shards))
        specs = [(n, d, s, Entry(n, "tensor", d, s).nbytes) for n, d, s in shard]
        with disk_full_is_clear(directory / file_name), open(directory / file_name, "wb") as f:
            f.write(_header(specs, full_keys))
            for name, dtype, shape, nbytes in specs:
                got_name, tensor = next(values)
                if got_name != name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                    raise ValueError(
                        f"{got_name!r} arrived as {tensor.dtype} {list(tensor.shape)} where {name!r} "
                        f"{dtype} {list(shape)} was planned (internal error; report it)"
                    )
                f.write(tensor_bytes(tensor.detach().contiguous()))
                del tensor  # before next(values) reads the next one
                if on_bytes is not None:
                    on_bytes(nbytes)
            f.flush()
            os.fsync(f.fileno())
        logger.info("wrote %s (%d tensors)", file_name, len(specs))


def write_index(
    directory: Path,
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]],
    *,
    objects: dict[str, Any] | None = None,
) -> list[str]:
    """Write ``model.safetensors.index.json`` durably (fsynced, then the directory); returns the shard names.

    Written last: a directory with an index is a complete export (:func:`is_export`).
    """
    names = [shard_file_name(i, len(shards)) for i in range(len(shards))]
    weight_map = {n: file_name for file_name, shard in zip(names, shards) for n, _, _ in shard}
    total = sum(Entry(n, "tensor", d, s).nbytes for shard in shards for n, d, s in shard)
    index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if objects:
        index["metadata"][OBJECTS_KEY] = objects
    # sync_dir: the shards' directory entries, created before, become durable with the index's
    durable_write(directory / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n", sync_dir=True)
    return names


class SafetensorsSource:
    """Tensors of one ``.safetensors`` file or an HF directory (index json, or every ``*.safetensors``).

    Keys are the file's names, prefixed by ``prefix`` (``"model."`` by default,
    so HF weights become model keys), except in files that ``fsdp-ckpt export``
    marked as holding whole checkpoint keys. Reads one tensor at a time.

    With an index, the index is the truth (as for ``transformers``): each tensor is
    taken from the file its ``weight_map`` names, and only from there. A tensor of
    the same name in another file (e.g. a stale shard of an earlier export) is
    ignored, with a warning naming it; a tensor the index names but its file lacks
    is a ``ValueError``.
    """

    def __init__(self, path: str | Path, *, prefix: str = "model.") -> None:
        from safetensors import safe_open  # optional dependency: imported where used

        self._safe_open = safe_open
        path = Path(path)
        self.objects: dict[str, Any] = {}
        self._weight_map: dict[str, str] | None = None  # name -> file, from the index when there is one
        if path.is_dir():
            files = self._files_of_dir(path)
        else:
            files = [path]
        self._where: dict[str, tuple[Path, str]] = {}
        self.entries: dict[str, Entry] = {}
        for file in files:
            open_regular(file, follow_symlinks=True).close()  # a FIFO or device: a clear error, never a hang
            try:
                with safe_open(str(file), framework="pt") as f:
                    full = (f.metadata() or {}).get(KEYS_FIELD) == "full"
                    for name in self._indexed(file, f.keys()):
                        piece = f.get_slice(name)
                        key = name if full else prefix + name
                        dtype = _from_safetensors_dtype(piece.get_dtype(), name)
                        self.entries[key] = Entry(key, "tensor", dtype, tuple(piece.get_shape()))
                        self._where[key] = (file, name)
            except Exception as exc:
                raise ValueError(f"{str(file)!r} is not a readable safetensors file ({exc}); check the file") from exc
        if self._weight_map is not None:
            self._check_index_complete(path)
        for key in self.objects:
            self.entries[key] = Entry(key, "object")
        self.entries = dict(sorted(self.entries.items()))

    def _indexed(self, file: Path, names: list[str]) -> list[str]:
        """The names of ``file`` to take: with an index, only those it maps to this very file."""
        if self._weight_map is None:
            return list(names)
        taken = [name for name in names if self._weight_map.get(name) == file.name]
        stale = sorted(set(names) - set(taken))
        if stale:
            logger.warning(
                "%s: ignoring %d tensor(s) that %s does not map to this file (%s): the index is what is imported",
                file,
                len(stale),
                INDEX_NAME,
                ", ".join(stale[:5]) + (", ..." if len(stale) > 5 else ""),
            )
        return taken

    def _check_index_complete(self, path: Path) -> None:
        assert self._weight_map is not None
        found = {name for _, name in self._where.values()}
        missing = sorted(set(self._weight_map) - found)
        if missing:
            where = ", ".join(f"{name!r} in {self._weight_map[name]}" for name in missing[:5])
            raise ValueError(
                f"{str(path / INDEX_NAME)!r} names tensors its files do not hold ({where}); "
                "fix the index or re-export the model"
            )

    def _files_of_dir(self, path: Path) -> list[Path]:
        index = path / INDEX_NAME
        if index.exists():
            try:
                with open_regular(index, follow_symlinks=True) as f:
                    data = json.loads(f.read(_MAX_INDEX_BYTES).decode("utf-8"))
                weight_map = data["weight_map"]
                if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                    raise TypeError("weight_map is not an object of names to file names")
                files = sorted(set(weight_map.values()))
                self.objects = dict(data.get("metadata", {}).get(OBJECTS_KEY, {}))
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
                raise ValueError(f"{str(index)!r} is not a valid safetensors index ({exc}); re-export it") from exc
            for name in files:
                # weight_map names files beside the index: never a path that leaves the directory
                problem = check_relative_name(name)
                if problem is not None:
                    raise ValueError(f"{str(index)!r}: weight_map entry {problem}; fix the index or re-export it")
            self._weight_map = dict(weight_map)
            missing = [f for f in files if not (path / f).exists()]
            if missing:
                raise FileNotFoundError(
                    f"{str(index)!r} lists {missing} but they are not in {str(path)!r}; copy them there"
                )
            return [path / f for f in files]
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"{str(path)!r} holds no *.safetensors files; pass a safetensors file or HF model directory"
            )
        return files

    def read(self, key: str) -> Any:
        if key in self.objects:
            return self.objects[key]
        file, name = self._where[key]
        try:
            with self._safe_open(str(file), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{str(file)!r}: tensor {name!r} cannot be read ({exc}); check the file") from None


def _from_safetensors_dtype(code: str, name: str) -> torch.dtype:
    by_code = {v: k for k, v in _DTYPES.items()}
    if code not in by_code:
        raise ValueError(f"tensor {name!r} has safetensors dtype {code}, which fsdp-ckpt does not import")
    return by_code[code]
