"""What reading a pickled value may cost: a budget checked on its bytes before anything is built from them.

``torch.load(weights_only=True)`` runs no code from a file, but it builds what
the file describes, and a small file can describe a lot: ``bytearray(2**32)``
is a pickle of a few dozen bytes asking for 4 GiB, and a "billion laughs" of
~300 bytes nests lists of ten references to one list nine deep, a billion
elements to whatever walks the value (an export, a comparison, a print).

:func:`value_problem` first unpickles the archive's ``data.pkl`` as a dry
run: Python's C unpickler with every global replaced by an inert stand-in
that calls nothing, only checks the integers handed to it (a size to
allocate: at most what the file's own length could describe) and keeps its
arguments. What that builds costs no more than the file (shared references
stay shared); a walk of it then counts the elements a walk of the real value
would meet (each shared reference again, as a walker meets it) and its
nesting, stopping at a budget linear in the file's length. Only then does
``torch.load`` build the real value. ``save`` checks the values it writes
the same way, so what it writes always loads.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

__all__ = ["MAX_DEPTH", "value_problem"]

MAX_DEPTH = 200
"""Deepest nesting of a value (lists in lists ...): every walker of a value recurses once per level."""
_ELEMENTS_PER_BYTE = 4
"""Elements a value may hold per byte of its archive: a pickle spends at least one byte per element it
spells out, so only shared references (a list of ten references to one list, nested) exceed this."""
_MIN_ELEMENTS = 1 << 16


class _TooCostly(Exception):
    pass


def value_problem(archive: bytes) -> str | None:
    """What makes the ``torch.save`` archive ``archive`` too costly to load, or ``None``; runs nothing from it."""
    pickled = _pickle_of(archive)
    if isinstance(pickled, str):
        return pickled
    budget = max(_MIN_ELEMENTS, _ELEMENTS_PER_BYTE * len(archive))
    try:
        value = _DryRun(io.BytesIO(pickled), budget).load()
    except _TooCostly as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything; torch.load would refuse it too
        return f"its pickle cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    return _walk_problem(value, budget)


def _pickle_of(archive: bytes) -> bytes | str:
    """The ``data.pkl`` record of a ``torch.save`` archive, or what is wrong with the archive."""
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as zipped:
            records = [r for r in zipped.infolist() if r.filename.rsplit("/", 1)[-1] == "data.pkl"]
            if len(records) != 1:
                return f"a torch.save archive holds one data.pkl, this one {len(records)}"
            (record,) = records
            # torch.save stores records uncompressed: a compressed one could inflate past the file's own size
            if record.compress_type != zipfile.ZIP_STORED or record.file_size > len(archive):
                return f"its data.pkl claims {record.file_size} bytes in an archive of {len(archive)}"
            return zipped.read(record)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        return f"it is not a torch.save archive ({type(exc).__name__}: {exc})"


class _Built:
    """What a call (or a storage reference) in the dry run stands for: its arguments and what was put into it."""

    __slots__ = ("held",)

    def __init__(self, held: list) -> None:
        self.held = held

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.held.append(state)

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEMS into an OrderedDict, a Counter
        self.held += (key, value)

    def append(self, item: Any) -> None:
        self.held.append(item)

    def extend(self, items: Any) -> None:
        self.held.extend(items)

    def add(self, item: Any) -> None:
        self.held.append(item)


class _DryRun(pickle.Unpickler):
    """Unpickles with inert stand-ins for every global: nothing is imported or called."""

    def __init__(self, file: io.BytesIO, budget: int) -> None:
        super().__init__(file)
        self.budget = budget

    def find_class(self, module: str, name: str) -> Any:
        # a class (NEWOBJ takes nothing else), fresh for each global: a BUILD on it changes nothing shared
        return type(name, (), {"__new__": staticmethod(lambda _cls, *args: self.built(f"{module}.{name}", args))})

    def persistent_load(self, pid: Any) -> Any:
        return self.built("a storage record", (pid,))

    def built(self, called: str, args: tuple) -> _Built:
        for arg in args:
            for value in arg if isinstance(arg, (tuple, list)) else (arg,):
                if isinstance(value, int) and value > self.budget:
                    raise _TooCostly(
                        f"it asks {called} for {value} (a size), more than its "
                        f"{self.budget // _ELEMENTS_PER_BYTE} bytes could describe"
                    )
        return _Built(list(args))


_CONTAINERS = (list, tuple, dict, set, frozenset, _Built)


def _walk_problem(value: Any, budget: int) -> str | None:
    """Whether a walk of ``value`` meets at most ``budget`` elements, :data:`MAX_DEPTH` levels deep."""
    todo = [(value, 1)] if isinstance(value, _CONTAINERS) else []
    met = 0
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            return f"it is nested more than {MAX_DEPTH} levels deep"
        items: Any = node.held if isinstance(node, _Built) else node
        if isinstance(node, dict):
            items = [*node.keys(), *node.values()]
        met += len(items)
        if met > budget:
            return f"a walk of it meets more than {budget} elements (shared references nested in each other)"
        todo += [(item, depth + 1) for item in items if isinstance(item, _CONTAINERS)]
    return None
