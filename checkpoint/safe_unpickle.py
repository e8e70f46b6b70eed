"""Reading pickled bytes from a checkpoint without running code from it.

A checkpoint is data from wherever it came from, so nothing read from one may
import or call anything but what DCP itself writes:

* ``.metadata`` (a pickled :class:`~torch.distributed.checkpoint.metadata.Metadata`)
  goes through :class:`MetadataUnpickler`, which admits only DCP's metadata
  dataclasses and the plain and torch types they hold (the idea of
  ``torch.load(weights_only=True)``, for DCP's metadata), hands the pickle
  sealed stand-ins for classes and functions (so a BUILD opcode can change
  only the fresh instances the file creates, never a class, function or
  shared object of the loading process), and is then checked
  field by field (:func:`check_metadata`), so a crafted file is one
  ``CheckpointCorruptError`` naming it, not an ``AttributeError`` later;
* non-tensor values (``extra`` entries, hyper-parameters) are ``torch.save``
  archives; :class:`SafeLoadPlanner` reads them with ``weights_only=True``
  (DCP's default planner uses ``weights_only=False``), and
  :func:`check_weights_only` makes ``save`` refuse a value that could not be
  read back that way.
"""

from __future__ import annotations

import contextlib
import io
import math
import pathlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,  # private, but it is what TensorProperties pickles; admitted by name only
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from checkpoint.errors import LoadTargetError
from checkpoint.manifest import CheckpointCorruptError, check_relative_name
from checkpoint.pickle_budget import value_problem

__all__ = [
    "MetadataUnpickler",
    "SafeLoadPlanner",
    "check_metadata",
    "check_saved_values",
    "check_weights_only",
    "load_metadata",
    "load_value",
]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
try:
    # where DCP's filesystem writer keeps each item's place (private, the name in DCP's pickles); absent in
    # other storage layers
    from torch.distributed.checkpoint.filesystem import _StorageInfo
except ImportError:  # pragma: no cover - torch without the filesystem layer
    _StorageInfo = None  # type: ignore[assignment,misc]

_DATA_CLASSES: dict[tuple[str, str], type] = {
    (_DCP_METADATA, cls.__name__): cls
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
    )
}
if _StorageInfo is not None:
    _DATA_CLASSES[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo


class _Sealed(type):
    """The type of every class or function stand-in :class:`MetadataUnpickler` hands a pickle.

    A pickle's BUILD opcode on a global runs ``setattr`` on it (or its
    ``__setstate__``): on a real class, ``PosixPath.exists = frozenset`` would
    change the loading program. A stand-in refuses both, so the only objects a
    BUILD can change are the fresh instances a pickle creates.
    """

    def __setattr__(cls, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"refused to set {name!r} on {cls.__name__}: .metadata holds data, not code")

    def __delattr__(cls, name: str) -> None:
        raise pickle.UnpicklingError(f"refused to delete {name!r} of {cls.__name__}: .metadata holds data, not code")

    def __setstate__(cls, state: Any) -> None:
        raise pickle.UnpicklingError(f"refused to change {cls.__name__}: .metadata holds data, not code")


def _stand_in(name: str, make: Any) -> type:
    """A sealed class standing for ``name``: calling it (REDUCE) or creating through it (NEWOBJ) gives ``make(*args)``.

    A class, because NEWOBJ accepts nothing else; ``make``'s result is not an
    instance of it, so Python returns that result as it is.
    """
    return _Sealed(name, (), {"__slots__": (), "__new__": staticmethod(lambda _cls, *args: make(*args))})


def _data_class_stand_in(cls: type) -> type:
    """A sealed class standing for DCP data class ``cls`` (see :func:`_stand_in`): a bare instance (NEWOBJ, then
    BUILD fills it), or a constructor call; one Python call per object (a ``.metadata`` holds a few per key)."""

    def new(_cls: type, *args: Any) -> Any:
        return cls(*args) if args else object.__new__(cls)

    return _Sealed(cls.__name__, (), {"__slots__": (), "__new__": staticmethod(new)})


class _MemoryFormatCode:
    """DCP's pickled memory-format code, as a fresh object instead of the shared enum member.

    ``TensorProperties.__setstate__`` only compares it with the members; the
    member itself, handed to the pickle, could be changed by a BUILD on it
    (its ``__dict__`` holds its value) for every later save of this process.
    """

    __slots__ = ("member",)
    member: _MEM_FORMAT_ENCODING

    def __init__(self, member: _MEM_FORMAT_ENCODING) -> None:
        object.__setattr__(self, "member", member)

    def __eq__(self, other: object) -> bool:
        return other is self.member

    __hash__ = None  # type: ignore[assignment]

    def __setattr__(self, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"refused to set {name!r} on a memory-format code: .metadata holds data")

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError("refused to change a memory-format code: .metadata holds data")


_ALLOWED: dict[tuple[str, str], Any] = {key: _data_class_stand_in(cls) for key, cls in _DATA_CLASSES.items()}
_ALLOWED[(_DCP_METADATA, "_MEM_FORMAT_ENCODING")] = _stand_in(
    "_MEM_FORMAT_ENCODING", lambda value: _MemoryFormatCode(_MEM_FORMAT_ENCODING(value))
)
# DCP pickles a layout as a call of this function on its name (it only looks the name up);
# private, but the name DCP's own pickles carry: renamed -> old metadata fails the allow-list
_ALLOWED[("torch.serialization", "_get_layout")] = _stand_in("_get_layout", torch.serialization._get_layout)
# plain dcp.save records the checkpoint id, often a Path (constructing one only stores a string; a BUILD
# on the new Path changes only that object)
_ALLOWED.update(
    {
        ("pathlib", c.__name__): _stand_in(c.__name__, c)
        for c in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)
    }
)
# The objects below are handed out as they are: immutable built-in types and torch's dtype / layout /
# memory-format constants have no __dict__ and refuse setattr, so a BUILD on them fails.
_ALLOWED[("torch", "Size")] = torch.Size
_ALLOWED.update(
    {("torch", str(d).removeprefix("torch.")): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
)
_ALLOWED.update(
    {
        ("torch", str(m).removeprefix("torch.")): m
        for m in vars(torch).values()
        if isinstance(m, (torch.layout, torch.memory_format))
    }
)
_ALLOWED[("builtins", "set")] = set
_ALLOWED[("builtins", "frozenset")] = frozenset


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only DCP's metadata classes and the types they hold."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"refused to load {module}.{name}: .metadata may hold only DCP's metadata classes"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: .metadata holds no external references")


def load_metadata(path: pathlib.Path, data: bytes) -> Metadata:
    """``data`` (the bytes of ``path``, a ``.metadata`` file) as checked DCP metadata; nothing is executed.

    Raises :class:`~checkpoint.manifest.CheckpointCorruptError` naming ``path``
    for anything else: a class outside DCP's metadata (a crafted payload), a
    truncated or damaged pickle, fields of the wrong type.
    """
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - a truncated / flipped pickle raises anything from EOFError to KeyError
        raise CheckpointCorruptError(
            f"{path}: cannot be read as DCP metadata ({type(exc).__name__}: {_one_line(exc)}); "
            "nothing from it was run; restore the file from a copy or re-save the checkpoint"
        ) from None
    try:
        problem = check_metadata(metadata)
    except AttributeError as exc:  # a record created without its fields (NEWOBJ with no BUILD after it)
        problem = f"a record lacks a field ({_one_line(exc)})"
    if problem is not None:
        raise CheckpointCorruptError(f"{path}: {problem}; restore the file from a copy or re-save the checkpoint")
    return metadata


def check_metadata(md: Any) -> str | None:
    """What makes ``md`` not the metadata DCP writes (wrong types, negative sizes, paths), or ``None``."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        return "does not hold DCP metadata"
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"has a key of type {type(key).__name__}"
        if type(item) is BytesStorageMetadata:  # most keys at scale (a group's options, per parameter): no fields
            continue
        problem = _item_problem(item)
        if problem is not None:
            return f"key {key!r}: {problem}"
    if md.planner_data is not None and not _key_paths(md.planner_data):
        return "planner_data is not a dict of key paths"
    storage = md.storage_data
    if storage is None:
        return None
    if not isinstance(storage, dict):
        return "storage_data is not a dict"
    names: dict[Any, str | None] = {}  # each file name's problem, once: a few files among 100,000s of records
    # A record shared by several keys (an equal value stored once: a param group's options, keyed per
    # parameter, are one object in the pickle) is checked once; md holds every record, so no id is reused.
    checked: set[int] = set()
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return "storage_data has a key that is not a MetadataIndex"
        if id(info) in checked:
            continue
        checked.add(id(info))
        problem = _storage_problem(info, names)
        if problem is not None:
            return f"storage of {index.fqn!r}: {problem}"
    return None


def _key_paths(paths: Any) -> bool:
    """Whether ``paths`` is a dict of tuples of names (str) and positions (int); by the types met, not per
    element (a key path per key)."""
    if not isinstance(paths, dict):
        return False
    kinds = {type(p) for p in paths.values()}
    if not all(issubclass(kind, tuple) for kind in kinds):
        return False
    return all(issubclass(kind, (str, int)) for kind in {type(x) for p in paths.values() for x in p})


def _is_count(x: Any) -> bool:
    # type(x) is int: an int, never a bool (nor an int subclass, which the restricted unpickler cannot make)
    return type(x) is int and 0 <= x < 1 << 62


def _item_problem(item: Any) -> str | None:
    if isinstance(item, BytesStorageMetadata):
        return None
    if not isinstance(item, TensorStorageMetadata):
        return f"storage metadata of type {type(item).__name__}"
    props = item.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        return "tensor properties without a dtype"
    if not isinstance(item.size, tuple) or not all(_is_count(s) for s in item.size):
        return f"shape {item.size!r} is not a tuple of sizes"
    if math.prod(item.size) * props.dtype.itemsize >= 1 << 62 or not isinstance(item.chunks, list):
        return f"shape {list(item.size)} is out of range"
    for chunk in item.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return "a chunk that is not ChunkStorageMetadata"
        for field in (chunk.offsets, chunk.sizes):
            if not isinstance(field, tuple) or len(field) != len(item.size) or not all(_is_count(x) for x in field):
                return f"chunk {chunk.offsets!r} / {chunk.sizes!r} does not match shape {list(item.size)}"
    return None


def _storage_problem(info: Any, names: dict[Any, str | None]) -> str | None:
    if _StorageInfo is None or not isinstance(info, _StorageInfo):
        return f"record of type {type(info).__name__}"
    if not (_is_count(info.offset) and _is_count(info.length)):
        return f"offset {info.offset!r} / length {info.length!r} are not byte counts"
    name = info.relative_path
    if type(name) is not str:  # only strings are remembered (hashable, compared by value)
        return check_relative_name(name)
    if name not in names:
        names[name] = check_relative_name(name)
    problem = names[name]
    if problem is not None:
        return problem
    if info.transform_descriptors is not None and not (
        isinstance(info.transform_descriptors, (list, tuple))
        and all(isinstance(t, str) for t in info.transform_descriptors)
    ):
        return "transform_descriptors is not a list of names"
    return None


def load_value(data: io.BytesIO | bytes, *, where: str) -> Any:
    """A non-tensor value stored by DCP (a ``torch.save`` archive), read weights-only."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    problem = value_problem(stream.getvalue())
    if problem is not None:
        raise CheckpointCorruptError(
            f"{where}: refused to load: {problem}; nothing was built from it; a value checkpoint.save wrote never "
            "does this: restore the file from a copy or re-save the checkpoint"
        )
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a refused global or a damaged archive: one clear error
        raise CheckpointCorruptError(
            f"{where}: cannot be read weights-only ({_weights_only_reason(exc)}); nothing from it was "
            "run; a value of a type weights-only loading refuses cannot come from checkpoint.save: restore the "
            "file from a copy or re-save the checkpoint"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values weights-only (DCP's own uses ``weights_only=False``).

    ``where`` names the checkpoint in errors. A failure in what it does with the
    caller's values (planning reads into them, finding the tensor a chunk goes
    to) is a :class:`~checkpoint.errors.LoadTargetError` naming the key, so it is
    never taken for damaged files.
    """

    def __init__(self, *args: Any, where: str = "checkpoint", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.where = where

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        with _target_errors("the state dict being loaded into"):
            super().set_up_planner(state_dict, metadata, is_coordinator)

    def create_local_plan(self):
        with _target_errors("the state dict being loaded into"):
            return super().create_local_plan()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        try:  # not `with _target_errors(...)`: a context manager per chunk costs more than the lookup
            return super().resolve_tensor(read_item)
        except LoadTargetError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the caller's value raised
            raise _target_error(repr(read_item.dest_index.fqn), exc) from exc

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_value(value, where=f"{self.where}: value {fqn!r}")
        # the same placement DefaultLoadPlanner.load_bytes does, with the safely loaded value
        if self.flatten_state_dict:
            # DefaultLoadPlanner's own private helper (no public name): renamed -> flattened loads fail here
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


@contextlib.contextmanager
def _target_errors(what: str) -> Iterator[None]:
    try:
        yield
    except LoadTargetError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the caller's value raised
        raise _target_error(what, exc) from exc


def _target_error(what: str, exc: Exception) -> LoadTargetError:
    return LoadTargetError(
        f"{what}: the value loaded into cannot take the stored data ({type(exc).__name__}: {_one_line(exc)}); "
        "the checkpoint's files are not at fault: load into plain tensors, DTensors or checkpoint.shard(...) values"
    )


def _weights_only_reason(exc: BaseException) -> str:
    """The one informative sentence of torch's long weights-only refusal (which global it refused)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        # drop torch's advice to allow the global: for a file from elsewhere that is the wrong fix
        return " ".join(text.split(marker, 1)[1].split(" Please use", 1)[0].split())[:200]
    return f"{type(exc).__name__}: {_one_line(exc)[:200]}"


def check_weights_only(key: str, value: Any) -> None:
    """Raise ``ValueError`` naming ``key`` when ``value`` would not load back with ``torch.load(weights_only=True)``,
    or a load would refuse it as too costly to read (:func:`~checkpoint.pickle_budget.value_problem`).

    Called by ``save`` for every non-tensor value, so a checkpoint it writes always loads safely.
    """
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        problem = value_problem(buffer.getvalue())  # first: the round trip below would pay that cost
        if problem is None:
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch.save / weights-only loading refuses
        raise ValueError(
            f"{key!r} holds a {type(value).__name__}, which torch.load(weights_only=True) cannot read back "
            f"({_weights_only_reason(exc)}); save plain values (numbers, strings, lists, dicts, tensors) instead, "
            "e.g. an object's state_dict()"
        ) from None
    if problem is not None:
        raise ValueError(
            f"{key!r} holds a {type(value).__name__} that a load would refuse to read back ({problem}); "
            "save a flatter value (e.g. an object's state_dict())"
        )


_PLAIN = (int, float, str, bool, type(None), torch.Tensor)
_LEAVES = frozenset({int, float, str, bool, type(None), torch.Tensor})


def check_saved_values(state_dict: dict[str, Any]) -> None:
    """:func:`check_weights_only` on every non-tensor leaf of a state dict about to be saved.

    Precondition: Stateful values are resolved to their ``state_dict()`` (what is written;
    :func:`~checkpoint.convert.resolve_stateful`). Walked as ``convert_tree`` walks. A list referenced
    from several keys is checked once (torch's flattened optimizer layout references a group's
    ``param_names`` from each parameter's key: O(N^2) if checked per reference).
    """
    _check_leaves(state_dict, "", set())


def _check_leaves(tree: Any, prefix: str, checked: set[int]) -> None:
    """``checked``: ids of the lists checked already (the state dict keeps them alive meanwhile)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if type(v) not in _LEAVES:  # a scalar or tensor loads weights-only: no key name built per leaf
                _check_leaves(v, f"{prefix}{k}.", checked)
        return
    if isinstance(tree, list):
        if id(tree) in checked:
            return
        checked.add(id(tree))
        if any(isinstance(v, (torch.Tensor, dict)) for v in tree):
            for i, v in enumerate(tree):
                _check_leaves(v, f"{prefix}{i}.", checked)
            return
    if not _is_plain(tree):  # plain scalars and tensors always load weights-only
        check_weights_only(prefix.rstrip("."), tree)


_PLAIN_SEQUENCE_LEN = 16
"""A tuple / list of at most this many plain scalars and tensors skips the round trip (one of scalars only
skips it at any length); a longer or nested one goes through :func:`check_weights_only` and its cost budget (shared references make a short
nested value a huge one to walk: a billion-laughs list)"""


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _is_plain(value: Any) -> bool:
    """A plain scalar or tensor, a short flat tuple / list of them (a param group's ``betas``), or a flat one
    of plain scalars of any length (a group's ``param_names``): loads weights-only without the torch.save +
    torch.load round trip per value. Each scalar of a flat sequence is spelled out in the pickle (no nested
    shared references), so its load costs no more than its bytes (:mod:`~checkpoint.pickle_budget`)."""
    if type(value) in (tuple, list):
        if all(type(v) in _SCALARS for v in value):
            return True
        return len(value) <= _PLAIN_SEQUENCE_LEN and all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
