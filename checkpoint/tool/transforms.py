"""Key transforms shared by ``fsdp-ckpt`` reshard / export / import.

Three kinds of rule act on a key's *parameter name* (its fqn), so one rule
moves a weight and its optimizer state together:

* **split** a fused tensor along a dim into named parts
  (SwiGLU ``mlp.linear_fc1.weight`` -> ``mlp.linear_fc1_w.weight``, ``..._v``; QKV),
* **merge** named parts back into one tensor (the exact inverse of a split with
  the same arguments),
* **rename** by regular expression (``re.sub`` on the fqn),
* **stack** per-index tensors along a new dim 0 (mixture-of-experts:
  ``experts.#.down_proj.weight`` for ``#`` = 0, 1, ... -> ``experts.down_proj``
  of shape ``[experts, ...]``; with several parts, each index's parts are first
  concatenated along ``dim``, as ``gate_proj`` and ``up_proj`` make ``gate_up_proj``),
* **unstack** a stacked tensor back into per-index parts (the inverse of a
  stack with the same arguments),
* **reshape** a tensor (and its same-shaped optimizer state) to a given shape.

Split, merge, stack and unstack match the names as stored; reshapes apply to
their results; renames run last.
Names in split / merge rules are templates in which ``*`` stands for any text
(``layers.*.mlp.linear_fc1.weight``); every ``*`` of a part name takes the
value its position matched in the fused name. In stack rules each part holds
one ``#``, the index along the new dim (0, 1, ... with none missing).

Where the fqn sits in a key follows ``torch.distributed.checkpoint.state_dict``:
``model.<fqn>``, ``optimizer.state.<fqn>.<state>``,
``optimizer.param_groups.<fqn>.<option>``. Other keys (``extra.*``) pass
through unchanged. A tensor whose shape cannot be split (a scalar ``step``)
is copied to every part; merging such parts keeps the first one.

Planning uses shapes only (:func:`plan`), so a writer knows every output's
size before reading a byte; :func:`materialize` then builds one output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint.tool.stream import Entry
from checkpoint.training_state import SAVED_WITHOUT_STATE, TIED_SECTION

__all__ = [
    "Rename",
    "Reshape",
    "Rules",
    "Split",
    "Stack",
    "Target",
    "materialize",
    "parse_part_list",
    "plan",
    "split_key",
    "stream_targets",
]

_PREFIXES = ("model.", "optimizer.state.", "optimizer.param_groups.")


def split_key(key: str) -> tuple[str, str, str] | None:
    """``optimizer.state.a.b.exp_avg`` -> ``("optimizer.state.", "a.b", ".exp_avg")``; None for other keys."""
    if key.startswith("model."):
        return "model.", key[len("model.") :], ""
    for prefix in _PREFIXES[1:]:
        if key.startswith(prefix):
            fqn, dot, last = key[len(prefix) :].rpartition(".")
            if dot and fqn:
                return prefix, fqn, "." + last
    return None


def _template_regex(template: str) -> re.Pattern[str]:
    return re.compile("(.+?)".join(re.escape(p) for p in template.split("*")) + r"\Z")


def _fill(template: str, values: Sequence[str]) -> str:
    pieces = template.split("*")
    out = pieces[0]
    for value, piece in zip(values, pieces[1:]):
        out += value + piece
    return out


@dataclass(frozen=True)
class Rename:
    pattern: str
    """a Python regular expression, searched in the fqn"""
    replacement: str
    """``re.sub`` replacement (``\\1`` refers to groups)"""
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = re.compile(self.pattern)
            compiled.sub(self.replacement, "")  # a bad group reference only shows up when substituting
        except re.error as exc:
            raise ValueError(f"bad rename rule {self.pattern!r} -> {self.replacement!r}: {exc}; fix the regex") from exc
        object.__setattr__(self, "_regex", compiled)

    def apply(self, fqn: str) -> str:
        try:
            return self._regex.sub(self.replacement, fqn)
        except (re.error, IndexError) as exc:
            raise ValueError(f"rename rule {self.pattern!r} -> {self.replacement!r} fails on {fqn!r}: {exc}") from exc


@dataclass(frozen=True)
class Split:
    """One fused tensor <-> its named parts: a split rule, and (in ``Rules.merges``) the merge that undoes it."""

    fused: str
    """name template of the fused tensor, e.g. ``layers.*.mlp.linear_fc1.weight``"""
    dim: int
    parts: tuple[str, ...]
    """name templates of the parts, in order along ``dim``"""
    sizes: tuple[int, ...] | None = None
    """part sizes along ``dim``; None splits evenly"""
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _first_part_regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        if len(self.parts) < 2:
            raise ValueError(f"rule for {self.fused!r} needs at least two part names, got {list(self.parts)}")
        stars = self.fused.count("*")
        for part in self.parts:
            if part.count("*") != stars:
                raise ValueError(
                    f"part {part!r} has {part.count('*')} '*' but {self.fused!r} has {stars}; "
                    "give every name the same number of '*'"
                )
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
            if len(self.sizes) != len(self.parts) or any(s < 0 for s in self.sizes):
                raise ValueError(
                    f"rule for {self.fused!r}: sizes {list(self.sizes)} must be one non-negative size per part"
                )
        # compiled once here: planning matches every key against every rule
        object.__setattr__(self, "_regex", _template_regex(self.fused))
        object.__setattr__(self, "_first_part_regex", _template_regex(self.parts[0]))

    def match_fused(self, fqn: str) -> tuple[str, ...] | None:
        m = self._regex.match(fqn)
        return None if m is None else m.groups()

    def match_first_part(self, fqn: str) -> tuple[str, ...] | None:
        """The ``*`` values when ``fqn`` names the first part (where a merge starts), else ``None``."""
        m = self._first_part_regex.match(fqn)
        return None if m is None else m.groups()

    def part_sizes(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Sizes along ``dim`` for a fused tensor of ``shape`` (``key`` names it in errors)."""
        if self.dim >= len(shape):
            raise ValueError(f"cannot split {key!r} of shape {list(shape)} along dim {self.dim}; fix the rule's dim")
        total = shape[self.dim]
        if self.sizes is None:
            if total % len(self.parts):
                raise ValueError(
                    f"{key!r} has {total} along dim {self.dim}, not divisible into {len(self.parts)} parts; "
                    "give explicit sizes (name:size)"
                )
            return (total // len(self.parts),) * len(self.parts)
        if sum(self.sizes) != total:
            raise ValueError(
                f"split sizes {list(self.sizes)} add up to {sum(self.sizes)} but {key!r} has {total} "
                f"along dim {self.dim}; fix the sizes"
            )
        return self.sizes


@dataclass(frozen=True)
class Stack:
    """Stack per-index tensors along a new dim 0 (``unstack``: the inverse, same fields)."""

    fused: str
    """name template of the stacked tensor, e.g. ``layers.*.mlp.experts.gate_up_proj``"""
    dim: int
    """the dim of one index's tensor along which its parts are concatenated"""
    parts: tuple[str, ...]
    """name templates with one ``#`` each, e.g. ``layers.*.mlp.experts.#.gate_proj.weight``"""
    sizes: tuple[int, ...] | None = None
    """part sizes along ``dim`` (unstack); None splits evenly"""
    _part_regexes: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        if not self.parts:
            raise ValueError(f"stack rule for {self.fused!r} needs at least one part name")
        stars = self.fused.count("*")
        for part in self.parts:
            if part.count("#") != 1 or part.count("*") != stars:
                raise ValueError(
                    f"stack part {part!r} must hold one '#' (the index) and as many '*' as {self.fused!r} ({stars})"
                )
        if "#" in self.fused:
            raise ValueError(f"stacked name {self.fused!r} must not hold '#'; put the index in the part names")
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(x) for x in self.sizes))
        object.__setattr__(self, "_regex", _template_regex(self.fused))
        object.__setattr__(self, "_part_regexes", tuple(_indexed_regex(p) for p in self.parts))

    def part_name(self, part: int, values: Sequence[str], index: int) -> str:
        return _fill(self.parts[part].replace("#", str(index)), values)

    def match_part(self, part: int, fqn: str) -> tuple[tuple[str, ...], int] | None:
        """``(* values, index)`` when ``fqn`` names part ``part`` at some index."""
        m = self._part_regexes[part].match(fqn)
        return None if m is None else _stars_and_index(m)

    def match_fused(self, fqn: str) -> tuple[str, ...] | None:
        m = self._regex.match(fqn)
        return None if m is None else m.groups()

    def part_sizes(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Sizes along ``dim`` of the parts of one index's tensor of ``shape`` (the split rule's checks)."""
        if len(self.parts) == 1:
            if self.dim >= len(shape):
                raise ValueError(
                    f"cannot unstack {key!r}: an entry of shape {list(shape)} has no dim {self.dim}; fix the rule's dim"
                )
            return (shape[self.dim],)
        return Split(self.fused, self.dim, self.parts, self.sizes).part_sizes(key, shape)


@dataclass(frozen=True)
class Reshape:
    name: str
    """name template (``*`` = any text) of the tensors to reshape"""
    shape: tuple[int, ...]
    """the new shape (same number of elements)"""
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        object.__setattr__(self, "_regex", _template_regex(self.name))

    def matches(self, fqn: str) -> bool:
        return self._regex.match(fqn) is not None


def _indexed_regex(template: str) -> re.Pattern[str]:
    pieces = []
    for i, piece in enumerate(template.split("#")):
        if i:
            pieces.append(r"(?P<index>0|[1-9][0-9]*)")
        pieces.append("(.+?)".join(re.escape(p) for p in piece.split("*")))
    return re.compile("".join(pieces) + r"\Z")


def _stars_and_index(m: re.Match[str]) -> tuple[tuple[str, ...], int]:
    index_pos = m.re.groupindex["index"]
    stars = tuple(g for i, g in enumerate(m.groups(), start=1) if i != index_pos)
    return stars, int(m.group("index"))


@dataclass(frozen=True)
class Rules:
    renames: tuple[Rename, ...] = ()
    splits: tuple[Split, ...] = ()
    merges: tuple[Split, ...] = ()
    stacks: tuple[Stack, ...] = ()
    unstacks: tuple[Stack, ...] = ()
    reshapes: tuple[Reshape, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.renames or self.splits or self.merges or self.stacks or self.unstacks or self.reshapes)

    def rename(self, fqn: str) -> str:
        for rule in self.renames:
            fqn = rule.apply(fqn)
        return fqn

    @classmethod
    def from_file(cls, path: str | Path) -> Rules:
        """Rules from JSON: ``{"rename": [[pat, repl]], "split": [{fused, dim, parts, sizes?}], "merge": [...],
        "stack": [{fused, dim, parts}], "unstack": [...], "reshape": [[name, [sizes]]]}``."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(
                renames=tuple(Rename(p, r) for p, r in data.get("rename", [])),
                splits=tuple(Split(**s) for s in data.get("split", [])),
                merges=tuple(Split(**s) for s in data.get("merge", [])),
                stacks=tuple(Stack(**s) for s in data.get("stack", [])),
                unstacks=tuple(Stack(**s) for s in data.get("unstack", [])),
                reshapes=tuple(Reshape(n, shape) for n, shape in data.get("reshape", [])),
            )
        except FileNotFoundError:
            raise FileNotFoundError(f"rules file {str(path)!r} does not exist; check the path") from None
        except (json.JSONDecodeError, TypeError, AttributeError) as exc:
            raise ValueError(f"rules file {str(path)!r} is not valid: {exc}; see `fsdp-ckpt export --help`") from exc

    def merged_with(self, other: Rules) -> Rules:
        return Rules(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))


def parse_part_list(text: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """``"a.*.w:4,a.*.v:4"`` -> ``(("a.*.w", "a.*.v"), (4, 4))``; sizes None when none are given."""
    names, sizes = [], []
    for item in text.split(","):
        name, colon, size = item.strip().rpartition(":")
        if not colon:
            name, size = item.strip(), ""
        names.append(name)
        if size:
            if not size.isdigit():
                raise ValueError(f"part {item!r}: size {size!r} is not a whole number; write name:size")
            sizes.append(int(size))
    if sizes and len(sizes) != len(names):
        raise ValueError(f"parts {text!r}: give a size for every part or for none")
    return tuple(names), (tuple(sizes) if sizes else None)


@dataclass(frozen=True)
class Target:
    """One output value and how to build it from source keys."""

    name: str
    kind: str
    """"tensor" or "object\""""
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    op: str = "copy"
    """"copy" (one source), "slice" (``sources[0]`` narrowed), "cat" (sources concatenated), "first",
    "stack" (per index, ``length`` sources concatenated along ``dim``, the results stacked along a new
    dim 0), "unstack" (``sources[0][index]`` narrowed), "rename_names" (a parameter name or a list of them, renamed)"""
    dim: int = 0
    start: int = 0
    length: int = 0
    index: int = 0
    """the index along dim 0 an "unstack" takes"""
    reshape: tuple[int, ...] | None = None
    """the shape the built value is reshaped to (``shape`` holds it too)"""
    renames: tuple[Rename, ...] = ()
    """for "rename_names" (a param group's list of parameter names): the rename rules to apply to each"""

    @property
    def tensor_dtype(self) -> torch.dtype:
        """``dtype``, for a tensor target (always set there)."""
        assert self.dtype is not None, f"{self.name}: not a tensor (kind {self.kind!r})"
        return self.dtype

    @property
    def nbytes(self) -> int:
        return Entry(self.name, self.kind, self.dtype, self.shape).nbytes


def plan(entries: dict[str, Entry], rules: Rules) -> list[Target]:
    """The outputs of applying ``rules`` to ``entries``, in a stable order (parts of one source adjacent).

    Raises ``ValueError`` naming the key when a rule cannot apply (bad dim,
    sizes that do not add up, a missing part, two outputs with one name).
    """
    # Merges first: a merge consumes its parts wherever they sort, and is emitted at its first part.
    merged: dict[str, Target] = {}
    consumed: set[str] = set()
    stacked = _stack_targets(entries, rules, consumed)
    for key in entries:
        if key not in consumed:
            target = _merge_target(key, entries, rules, consumed)
            if target is not None:
                merged[key] = target
    merged.update(stacked)
    targets: list[Target] = []
    for key, entry in entries.items():
        if key in merged:
            targets.append(merged[key])
        elif key not in consumed:
            targets.extend(
                _split_targets(key, entry, entries, rules)
                or _unstack_targets(key, entry, entries, rules)
                or [_copy_target(key, entry)]
            )
    renamed = [_renamed(_reshaped(t, rules), rules) for t in targets]
    seen: dict[str, str] = {}
    for t, original in zip(renamed, targets):
        if t.name in seen:
            raise ValueError(
                f"rules map both {seen[t.name]!r} and {original.sources[0]!r} to {t.name!r}; "
                "make the rename rules one-to-one"
            )
        seen[t.name] = original.sources[0]
    return renamed


# values that are parameter names: torch's per-group lists, checkpoint.save's list of params saved
# without optimizer state, and its record of tied weights (model_tied.<alias> -> its twin's name)
_GROUP_NAME_LISTS = re.compile(rf"optimizer\.(param_groups\.[0-9]+\.(params|param_names)|{SAVED_WITHOUT_STATE})\Z")
_TIED_PREFIX = f"{TIED_SECTION}."


def _copy_target(key: str, entry: Entry) -> Target:
    if entry.kind == "object" and (_GROUP_NAME_LISTS.match(key) or key.startswith(_TIED_PREFIX)):
        # renames must reach these names too
        return Target(key, entry.kind, entry.dtype, entry.shape, (key,), "rename_names")
    return Target(key, entry.kind, entry.dtype, entry.shape, (key,))


def _renamed(target: Target, rules: Rules) -> Target:
    if target.op == "rename_names":
        name = target.name
        if name.startswith(_TIED_PREFIX):
            name = _TIED_PREFIX + rules.rename(name[len(_TIED_PREFIX) :])
        return dataclasses.replace(target, name=name, renames=rules.renames)
    parts = split_key(target.name)
    if parts is None or not rules.renames or (parts[0] == "optimizer.param_groups." and parts[1].isdigit()):
        return target  # torch's per-group layout: the number is a group's, not a parameter name
    prefix, fqn, suffix = parts
    return dataclasses.replace(target, name=prefix + rules.rename(fqn) + suffix)


def _split_targets(key: str, entry: Entry, entries: dict[str, Entry], rules: Rules) -> list[Target] | None:
    parts = split_key(key)
    if parts is None:
        return None
    prefix, fqn, suffix = parts
    for rule in rules.splits:
        values = rule.match_fused(fqn)
        if values is None:
            continue
        names = [prefix + _fill(p, values) + suffix for p in rule.parts]
        weight = entries.get(f"model.{fqn}")
        if prefix == "optimizer.state." and entry.shape and weight is not None and entry.shape != weight.shape:
            # e.g. a factored second moment: cutting it along the weight's dim would be wrong
            raise ValueError(
                f"cannot split {key!r}: its shape {list(entry.shape)} differs from the weight's "
                f"{list(weight.shape)}; split the weight without this optimizer state (export --model-only)"
            )
        if entry.kind != "tensor" or len(entry.shape) <= rule.dim or entry.shape == ():
            # A per-parameter scalar (step, lr): every part gets the same value.
            if entry.kind == "tensor" and entry.shape and prefix == "model.":
                rule.part_sizes(key, entry.shape)  # raises the helpful "bad dim" error for weights
            return [Target(n, entry.kind, entry.dtype, entry.shape, (key,)) for n in names]
        sizes = rule.part_sizes(key, entry.shape)
        out, start = [], 0
        for name, size in zip(names, sizes):
            shape = entry.shape[: rule.dim] + (size,) + entry.shape[rule.dim + 1 :]
            out.append(Target(name, "tensor", entry.dtype, shape, (key,), "slice", rule.dim, start, size))
            start += size
        return out
    return None


def _reshaped(target: Target, rules: Rules) -> Target:
    parts = split_key(target.name)
    if parts is None or target.kind != "tensor" or not target.shape:
        return target
    for rule in rules.reshapes:
        if rule.matches(parts[1]):
            if math.prod(rule.shape) != math.prod(target.shape):
                raise ValueError(
                    f"cannot reshape {target.name!r} of shape {list(target.shape)} to {list(rule.shape)}: "
                    "the element counts differ; fix the rule's shape"
                )
            return dataclasses.replace(target, shape=rule.shape, reshape=rule.shape)
    return target


def _stack_targets(entries: dict[str, Entry], rules: Rules, consumed: set[str]) -> dict[str, Target]:
    """Stacked targets by the key they are emitted at (index 0 of the first part); marks their sources consumed."""
    out: dict[str, Target] = {}
    for rule in rules.stacks:
        # one pass over the keys per rule: (prefix, * values, suffix) -> indices of the first part
        groups: dict[tuple[str, tuple[str, ...], str], list[int]] = {}
        for key in entries:
            parts = split_key(key)
            if parts is None:
                continue
            hit = rule.match_part(0, parts[1])
            if hit:
                groups.setdefault((parts[0], hit[0], parts[2]), []).append(hit[1])
        for (prefix, values, suffix), indices in groups.items():
            target = _stack_target(rule, prefix, values, suffix, sorted(indices), entries)
            consumed.update(target.sources)
            out[target.sources[0]] = target
    return out


def _stack_target(rule: Stack, prefix: str, values, suffix: str, indices: list[int], entries) -> Target:
    name = prefix + _fill(rule.fused, values) + suffix
    if indices != list(range(len(indices))):
        raise ValueError(f"cannot stack into {name!r}: the indices found are {indices}, not 0..{len(indices) - 1}")
    sources = [prefix + rule.part_name(p, values, i) + suffix for i in indices for p in range(len(rule.parts))]
    missing = [s for s in sources if s not in entries]
    if missing:
        raise ValueError(f"cannot stack into {name!r}: {missing[:3]} not found; fix the stack rule")
    first = entries[sources[0]]
    if first.kind != "tensor" or not first.shape:
        return Target(name, first.kind, first.dtype, first.shape, tuple(sources), "first")  # a step count
    for s in sources:
        e = entries[s]
        if e.dtype != first.dtype or len(e.shape) != len(first.shape) or len(e.shape) <= rule.dim:
            raise ValueError(
                f"cannot stack {s!r} ({e.dtype}, {list(e.shape)}) with {sources[0]!r} ({first.dtype}, {list(first.shape)})"
            )
    width = len(rule.parts)
    per_index = [entries[s].shape for s in sources[:width]]
    for i in indices:
        shapes = [entries[s].shape for s in sources[i * width : (i + 1) * width]]
        if shapes != per_index:
            raise ValueError(f"cannot stack into {name!r}: index {i} has shapes {shapes}, index 0 {per_index}")
    cat = list(first.shape)
    cat[rule.dim] = sum(shape[rule.dim] for shape in per_index)
    return Target(name, "tensor", first.dtype, (len(indices), *cat), tuple(sources), "stack", rule.dim, length=width)


def _unstack_targets(key: str, entry: Entry, entries: dict[str, Entry], rules: Rules) -> list[Target] | None:
    parts = split_key(key)
    if parts is None:
        return None
    prefix, fqn, suffix = parts
    for rule in rules.unstacks:
        values = rule.match_fused(fqn)
        if values is None:
            continue
        if entry.kind != "tensor" or not entry.shape:
            # a per-parameter scalar (step): every part of every index gets it
            weight = entries.get(f"model.{fqn}")
            if weight is None or not weight.shape:
                raise ValueError(
                    f"cannot unstack {key!r}: no stacked weight model.{fqn} says how many indices; export --model-only"
                )
            names = [rule.part_name(p, values, i) for i in range(weight.shape[0]) for p in range(len(rule.parts))]
            return [Target(prefix + n + suffix, entry.kind, entry.dtype, entry.shape, (key,)) for n in names]
        inner = entry.shape[1:]
        sizes = rule.part_sizes(key, inner)
        out = []
        for index in range(entry.shape[0]):
            start = 0
            for p, size in enumerate(sizes):
                shape = inner[: rule.dim] + (size,) + inner[rule.dim + 1 :]
                name = prefix + rule.part_name(p, values, index) + suffix
                out.append(Target(name, "tensor", entry.dtype, shape, (key,), "unstack", rule.dim, start, size, index))
                start += size
        return out
    return None


def _merge_target(key: str, entries: dict[str, Entry], rules: Rules, consumed: set[str]) -> Target | None:
    parts = split_key(key)
    if parts is None:
        return None
    prefix, fqn, suffix = parts
    for rule in rules.merges:
        values = rule.match_first_part(fqn)
        if values is None:
            continue
        sources = [prefix + _fill(p, values) + suffix for p in rule.parts]
        missing = [s for s in sources if s not in entries]
        if missing:
            raise ValueError(
                f"cannot merge into {prefix + _fill(rule.fused, values) + suffix!r}: {missing} not found; fix the merge rule"
            )
        consumed.update(sources)
        name = prefix + _fill(rule.fused, values) + suffix
        first = entries[sources[0]]
        if first.kind != "tensor" or len(first.shape) <= rule.dim:
            return Target(name, first.kind, first.dtype, first.shape, tuple(sources), "first")
        shapes = [entries[s].shape for s in sources]
        for s, shape in zip(sources, shapes):
            other = shape[: rule.dim] + shape[rule.dim + 1 :]
            if len(shape) != len(first.shape) or other != first.shape[: rule.dim] + first.shape[rule.dim + 1 :]:
                raise ValueError(
                    f"cannot merge {s!r} of shape {list(shape)} with {sources[0]!r} of shape {list(first.shape)} along dim {rule.dim}"
                )
            if entries[s].dtype != first.dtype:
                raise ValueError(
                    f"cannot merge {s!r} ({entries[s].dtype}) with {sources[0]!r} ({first.dtype}): dtypes differ"
                )
        total = sum(shape[rule.dim] for shape in shapes)
        shape = first.shape[: rule.dim] + (total,) + first.shape[rule.dim + 1 :]
        return Target(name, "tensor", first.dtype, shape, tuple(sources), "cat", rule.dim)
    return None


def materialize(target: Target, fetch: Callable[[str], Any]) -> Any:
    """Build ``target``'s value; ``fetch(key)`` returns a source's full value."""
    value = _built(target, fetch)
    return value.reshape(target.reshape) if target.reshape is not None else value


def _built(target: Target, fetch: Callable[[str], Any]) -> Any:
    if target.op == "rename_names":
        names, rules = fetch(target.sources[0]), Rules(renames=target.renames)
        return rules.rename(names) if isinstance(names, str) else [rules.rename(name) for name in names]
    if target.op == "stack":
        groups = [target.sources[i : i + target.length] for i in range(0, len(target.sources), target.length)]
        return torch.stack([torch.cat([fetch(s) for s in group], dim=target.dim) for group in groups])
    if target.op == "unstack":
        # clone: a view would keep the whole stacked tensor alive after the caller drops it
        return fetch(target.sources[0])[target.index].narrow(target.dim, target.start, target.length).clone()
    if target.op == "copy":
        return fetch(target.sources[0])
    if target.op == "first":
        return fetch(target.sources[0])
    if target.op == "slice":
        # clone: a view would keep the whole fused tensor alive after the caller drops it
        return fetch(target.sources[0]).narrow(target.dim, target.start, target.length).clone()
    if target.op == "cat":
        return torch.cat([fetch(s) for s in target.sources], dim=target.dim)
    raise AssertionError(f"unknown op {target.op!r}")


def stream_targets(
    source: Any,
    targets: Sequence[Target],
    *,
    cast: Callable[[Target, Any], Any] | None = None,
    batch_bytes: int = 64 << 20,
) -> Iterator[tuple[Target, Any]]:
    """``(target, value)`` for each target in order, reading each source key once.

    A source value is held only until the last target built from it is
    yielded, so memory stays near the largest tensor (or the largest merge).
    ``source`` may offer ``iter_values(keys, batch_bytes=)`` to read small keys
    in batches; otherwise ``read(key)`` is called per key.
    """
    last_use: dict[str, int] = {}
    order: list[str] = []
    for i, target in enumerate(targets):
        for key in target.sources:
            if key not in last_use:
                order.append(key)
            last_use[key] = i
    if hasattr(source, "iter_values"):
        values = source.iter_values(order, batch_bytes=batch_bytes)
    else:
        values = ((key, source.read(key)) for key in order)
    held: dict[str, Any] = {}
    for i, target in enumerate(targets):
        for key in target.sources:
            while key not in held:
                got, fetched = next(values)
                held[got] = fetched
                del fetched
        value = materialize(target, held.__getitem__)
        for key in target.sources:
            if last_use[key] == i:
                del held[key]
        if cast is not None:
            value = cast(target, value)
        yield target, value
        # drop our reference before reading the next source: otherwise two large tensors are alive at once
        del value
