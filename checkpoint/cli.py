"""``fsdp-ckpt``: inspect, verify, reshard, export, import and diff checkpoints.

Installed as the console script ``fsdp-ckpt``; also ``python -m checkpoint.cli``.
Works in one process without ``torchrun``. Every command streams tensor by
tensor, so memory stays near the largest tensor, never the whole checkpoint.

Exit codes: 0 success; 1 the command ran and found a problem (``verify``
problems, ``diff`` differences); 2 it could not run (bad arguments, missing
path, not a checkpoint, corrupt file, bad rule). Every non-zero exit ends with
one line ``fsdp-ckpt: error: <what>; <how to fix>`` on stderr; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from checkpoint.cli_parallel import SOLO, PeerFailed, join_group, leave_group
from checkpoint.manifest import NotACheckpointError, verify_files
from checkpoint.stream import CheckpointReader, Entry, dtype_name, parse_dtype, prefetch
from checkpoint.transforms import Rename, Rules, Split, Target, parse_part_list, plan, stream_targets

__all__ = ["CliError", "build_parser", "main"]

logger = logging.getLogger(__name__)

PROG = "fsdp-ckpt"
EXIT_FOUND_PROBLEMS = 1
EXIT_CANNOT_RUN = 2


class CliError(Exception):
    """A failure to report as one line; ``exit_code`` says which kind."""

    def __init__(self, message: str, exit_code: int = EXIT_CANNOT_RUN) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------- helpers


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, as Hugging Face reads it); ``"512MiB"`` -> binary."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return size


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Progress:
    """A one-line byte progress bar on stderr: only on a TTY, only on rank 0."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.enabled = enabled and sys.stderr.isatty() and _rank() == 0
        self.start = time.perf_counter()
        self._last = 0.0

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and (now - self._last > 0.2 or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            sys.stderr.write(
                f"\r{self.label} [{bar:<30}] {frac:6.1%} {human_bytes(self.done)} / "
                f"{human_bytes(self.total)} {human_bytes(rate)}/s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _open(path: str, *, warn: bool = True, check_sizes: bool = True) -> CheckpointReader:
    """Open a checkpoint; by default fail fast when a file's size differs from the manifest (cheap, no read)."""
    from checkpoint.atomic import resolve_for_load

    # the format's own lookup: falls back to <path>.old after a save killed mid-swap, and names
    # an unfinished <path>.tmp when nothing else is there
    reader = CheckpointReader(resolve_for_load(path))
    if reader.note and warn:
        # stdout, like the command's other output: stderr stays for the one error line
        print(f"note: {path}: {reader.note}", flush=True)
    if check_sizes and reader.manifest is not None:
        problems = verify_files(reader.path, reader.manifest, checksums=False)
        if problems:
            raise CliError(f"{problems[0]}; run `{PROG} verify {path}` for every problem, then restore or re-save it")
    logger.info("opened %s: %d keys, %s of tensors, world size %s", path, len(reader.entries),
                human_bytes(sum(e.nbytes for e in reader.entries.values())), reader.world_size)
    return reader


def _rules(args: argparse.Namespace) -> Rules:
    rules = Rules(
        renames=tuple(Rename(p, r) for p, r in args.rename or ()),
        splits=tuple(_split_rule(a, "--split") for a in args.split or ()),
        merges=tuple(_split_rule(a, "--merge") for a in args.merge or ()),
    )
    if args.rules:
        rules = Rules.from_file(args.rules).merged_with(rules)
    return rules


def _split_rule(values: Sequence[str], flag: str) -> Split:
    fused, dim, parts = values
    if not dim.lstrip("-").isdigit() or int(dim) < 0:
        raise CliError(f"{flag} {fused!r}: dim {dim!r} is not a non-negative integer; write e.g. {flag} NAME 0 A,B")
    names, sizes = parse_part_list(parts)
    return Split(fused=fused, dim=int(dim), parts=names, sizes=sizes)


def _check_fresh_output(path: Path, force: bool) -> None:
    if path.exists() and (path.is_file() or any(path.iterdir())) and not force:
        raise CliError(f"output {str(path)!r} already exists and is not empty; choose a new path or pass --force")


# --------------------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    reader = _open(args.ckpt, warn=False, check_sizes=False)
    rows = [_inspect_row(e) for e in reader.entries.values()]
    totals: dict[str, dict[str, int]] = {}
    for row in rows:
        group = row["key"].split(".", 1)[0] if "." in row["key"] else "other"
        t = totals.setdefault(group, {"keys": 0, "tensors": 0, "bytes": 0})
        t["keys"] += 1
        t["tensors"] += row["kind"] == "tensor"
        t["bytes"] += row["bytes"]
    info = {
        "path": str(reader.path),
        "format": reader.manifest.format if reader.manifest else "dcp",
        "version": reader.manifest.version if reader.manifest else None,
        "world_size": reader.world_size,
        "committed": reader.committed,
        "note": reader.note,
        "data_files": len(reader.data_files()),
        "totals": totals,
        "keys": rows,
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"checkpoint  {info['path']}")
    version = f" version {info['version']}" if info["version"] is not None else ""
    print(f"format      {info['format']}{version}")
    print(f"committed   {'yes (manifest.json)' if reader.committed else 'no: ' + (reader.note or '')}")
    print(f"world size  {info['world_size']}   data files {info['data_files']}")
    width = max([len(r["key"]) for r in rows] + [3])
    print(f"\n{'key':<{width}}  {'dtype':<9} {'shape':<20} {'chunks':>6} {'bytes':>12}")
    for r in rows:
        shape = "x".join(map(str, r["shape"])) if r["kind"] == "tensor" else "(object)"
        print(f"{r['key']:<{width}}  {r['dtype'] or '-':<9} {shape or '()':<20} {r['chunks']:>6} {r['bytes']:>12}")
    print()
    for group, t in sorted(totals.items()):
        print(f"{group:<10} {t['keys']:>6} keys {t['tensors']:>6} tensors {human_bytes(t['bytes']):>12}")
    return 0


def _inspect_row(e: Entry) -> dict[str, Any]:
    return {
        "key": e.key,
        "kind": e.kind,
        "dtype": dtype_name(e.dtype) if e.dtype is not None else None,
        "shape": list(e.shape),
        "chunks": len(e.chunks),
        "bytes": e.nbytes,
    }


# --------------------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace) -> int:
    reader = _open(args.ckpt, warn=False, check_sizes=False)
    problems: list[str] = []
    if reader.manifest is not None:
        problems += verify_files(reader.path, reader.manifest, checksums=not args.no_checksums)
        problems += _manifest_key_problems(reader)
    else:
        print(f"note: {reader.note}")
    reported = {p.split(":", 1)[0] for p in problems}
    # .metadata's own view of the data files: catches a file the manifest does not list
    problems += [p for p in _data_file_problems(reader) if p.split(":", 1)[0] not in reported]
    for entry in reader.entries.values():
        if entry.kind == "tensor":
            problems += _coverage_problems(entry)
    broken_files = {p.split(":", 1)[0] for p in problems}
    problems += _readability_problems(reader, skip_files=broken_files, progress=not args.quiet)
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        raise CliError(
            f"{len(problems)} problem(s) in {args.ckpt}; restore the damaged files from a copy or re-save the checkpoint",
            EXIT_FOUND_PROBLEMS,
        )
    nbytes = sum(e.nbytes for e in reader.entries.values())
    print(f"OK {args.ckpt}: {len(reader.entries)} keys, {len(reader.data_files())} data files, "
          f"{human_bytes(nbytes)} of tensors, every element covered once and readable")
    return 0


def _manifest_key_problems(reader: CheckpointReader) -> list[str]:
    assert reader.manifest is not None
    problems = []
    keys = reader.manifest.keys
    for key in sorted(set(keys) - set(reader.entries)):
        problems.append(f"{key}: listed in manifest.json but absent from .metadata")
    for key in sorted(set(reader.entries) - set(keys)):
        problems.append(f"{key}: in .metadata but not in manifest.json")
    for key in sorted(set(keys) & set(reader.entries)):
        rec, entry = keys[key], reader.entries[key]
        if rec.kind == "tensor" and entry.kind == "tensor":
            if rec.dtype != dtype_name(entry.dtype) or tuple(rec.shape or ()) != entry.shape:
                problems.append(
                    f"{key}: manifest says {rec.dtype} {list(rec.shape or ())}, "
                    f".metadata says {dtype_name(entry.dtype)} {list(entry.shape)}"
                )
        elif rec.kind == "tensor" or entry.kind == "tensor":
            problems.append(f"{key}: manifest kind {rec.kind!r} but .metadata kind {entry.kind!r}")
    return problems


def _data_file_problems(reader: CheckpointReader) -> list[str]:
    """Without a manifest: every referenced data file exists and is long enough for what it holds."""
    needed: dict[str, int] = {}
    for info in (reader.metadata.storage_data or {}).values():
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        path = reader.path / name
        if not path.exists():
            problems.append(f"{path}: missing (.metadata points into it)")
        elif path.stat().st_size < end:
            problems.append(f"{path}: {path.stat().st_size} bytes but .metadata needs {end} (truncated)")
    return problems


def _coverage_problems(entry: Entry) -> list[str]:
    """Chunks inside the tensor, pairwise disjoint, and their volumes adding up to the tensor's."""
    problems = []
    volume = 0
    boxes = sorted(entry.chunks)
    for offsets, sizes in boxes:
        if len(offsets) != len(entry.shape) or any(
            o < 0 or o + s > full for o, s, full in zip(offsets, sizes, entry.shape)
        ):
            problems.append(f"{entry.key}: chunk at {list(offsets)} of size {list(sizes)} leaves shape {list(entry.shape)}")
        volume += math.prod(sizes)
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if entry.shape and ob[0] >= oa[0] + sa[0]:
                break  # sorted by dim-0 offset: no later box can reach back into this one
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)) and math.prod(sa) and math.prod(sb):
                problems.append(f"{entry.key}: chunks at {list(oa)} and {list(ob)} overlap (elements stored twice)")
    if volume != entry.numel and not problems:
        problems.append(f"{entry.key}: chunks hold {volume} elements but the tensor has {entry.numel} (some never stored)")
    return problems


def _readability_problems(reader: CheckpointReader, *, skip_files: set[str], progress: bool) -> list[str]:
    problems = []
    bar = Progress("verify", sum(e.nbytes for e in reader.entries.values()), progress)
    keys = [
        key for key in reader.entries
        # already reported as missing / truncated: reading it would only repeat that
        if not {str(reader.path / f) for f in reader.files_of(key)} & skip_files
    ]
    for batch in reader.batches(keys):
        problems += _read_problems(reader, batch)
        bar.add(sum(reader.entries[k].nbytes for k in batch))
    bar.close()
    return problems


def _read_problems(reader: CheckpointReader, keys: list[str]) -> list[str]:
    """Read ``keys`` in one pass; on failure, one by one so that each unreadable key is named."""
    try:
        reader.read_many(keys)
        return []
    except ValueError as exc:
        if len(keys) == 1:
            return [f"{keys[0]}: cannot be read: {exc}"]
    return [problem for key in keys for problem in _read_problems(reader, [key])]


# --------------------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = _open(args.a), _open(args.b)
    differences: list[str] = []
    for key in sorted(set(a.entries) - set(b.entries)):
        differences.append(f"only in A: {key}")
    for key in sorted(set(b.entries) - set(a.entries)):
        differences.append(f"only in B: {key}")
    common = []
    for key in (k for k in a.entries if k in b.entries):
        ea, eb = a.entries[key], b.entries[key]
        if ea.kind != eb.kind or ea.dtype != eb.dtype or ea.shape != eb.shape:
            differences.append(f"{key}: A is {_describe(ea)}, B is {_describe(eb)}")
        else:
            common.append(key)
    same = 0
    bar = Progress("diff", sum(a.entries[k].nbytes for k in common), not args.quiet)
    # both sides in lockstep, small keys in batches: one tensor pair (plus a batch) in memory
    for (key, va), (_, vb) in zip(a.iter_values(common), b.iter_values(common)):
        found = _value_difference(key, va, vb, args.atol, args.rtol)
        del va, vb
        if found:
            differences.append(found)
        else:
            same += 1
        bar.add(a.entries[key].nbytes)
    bar.close()
    for line in differences:
        print(line)
    if differences:
        raise CliError(
            f"{len(differences)} difference(s) between {args.a} and {args.b} ({same} keys equal); "
            "loosen --atol/--rtol if these are expected",
            EXIT_FOUND_PROBLEMS,
        )
    print(f"equal: {same} keys (atol={args.atol}, rtol={args.rtol})")
    return 0


def _describe(e: Entry) -> str:
    return f"{dtype_name(e.dtype)} {list(e.shape)}" if e.kind == "tensor" else "an object"


def _value_difference(key: str, va: Any, vb: Any, atol: float, rtol: float) -> str | None:
    if not isinstance(va, torch.Tensor):
        return None if va == vb else f"{key}: {va!r} != {vb!r}"
    if va.is_floating_point() or va.is_complex():
        close = torch.isclose(va, vb, atol=atol, rtol=rtol, equal_nan=True)
    else:
        close = va == vb
    if bool(close.all()):
        return None
    bad = (~close).nonzero()
    first = tuple(bad[0].tolist())
    worst = (va.double() - vb.double()).abs().max().item() if va.numel() else 0.0
    return (f"{key}: {bad.shape[0]} of {va.numel()} elements differ (max |A-B| {worst:.6g}; "
            f"first at {list(first)}: {va[first].item()!r} vs {vb[first].item()!r})")


# --------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    reader = _open(args.src)
    targets = plan(reader.entries, _rules(args))
    logger.info("planned %d outputs from %d keys", len(targets), len(reader.entries))
    if args.model_only:
        targets = [t for t in targets if t.name.startswith("model.")]
    if not targets:
        raise CliError(f"{args.src} has nothing to export{' under model.' if args.model_only else ''}; check the path")
    dtype = parse_dtype(args.dtype) if args.dtype else None
    out_name = (lambda t: t.name.removeprefix("model.")) if args.model_only else (lambda t: t.name)
    tensors = [t for t in targets if t.kind == "tensor"]
    objects = [t for t in targets if t.kind == "object"]

    def out_dtype(t: Target) -> torch.dtype:
        # model weights only: a bf16 optimizer state (or step count) would silently lose precision
        cast_it = dtype is not None and t.dtype.is_floating_point and t.name.startswith("model.")
        return dtype if cast_it else t.dtype

    def cast(t: Target, v: Any) -> Any:
        return v.to(out_dtype(t)) if isinstance(v, torch.Tensor) and v.dtype != out_dtype(t) else v

    group = args.group
    # objects are small: rank 0 reads them for the index / the torch file's skeleton
    object_values = {}
    if objects and group.rank == 0:
        object_values = {out_name(t): v for t, v in stream_targets(reader, objects)}
    specs = [(out_name(t), out_dtype(t), t.shape) for t in tensors]
    total = sum(Entry(n, "tensor", d, s).nbytes for n, d, s in specs)
    dst = Path(args.dst)
    start = time.perf_counter()
    if args.format == "safetensors":
        from checkpoint.safetensors_io import plan_shards, write_index, write_shards

        group.together(lambda: _prepare_safetensors_dir(dst, args.force), only_rank0=True)
        by_name = {n: (n, d, s) for n, d, s in specs}
        names = plan_shards([(n, Entry(n, "tensor", d, s).nbytes) for n, d, s in specs], args.max_shard_size)
        shards = [[by_name[n] for n in g] for g in names]
        mine = group.share([sum(Entry(n, "tensor", d, s).nbytes for n, d, s in sh) for sh in shards])
        my_names = {n for i, g in enumerate(names) if mine[i] for n in g}
        my_targets = [t for t in tensors if out_name(t) in my_names]
        logger.info("writing %d of %d safetensors shard(s) of at most %s", sum(mine), len(shards),
                    human_bytes(args.max_shard_size))
        bar = Progress(f"export {args.format}", sum(t.nbytes for t in my_targets), not args.quiet)
        values = _renamed_values(_overlapped(reader, my_targets, cast), out_name)
        group.together(lambda: write_shards(dst, shards, values, full_keys=not args.model_only,
                                            on_bytes=bar.add, which=mine.__getitem__))
        objects_json = _json_objects(object_values)
        group.together(lambda: write_index(dst, shards, objects=objects_json), only_rank0=True)
        where = f"{len(shards)} file(s) + model.safetensors.index.json in {dst}"
    else:
        from checkpoint.torchfile_io import fill_tensors, finish, staging_file

        tmp = staging_file(dst)
        group.together(lambda: _prepare_torch_file(dst, tmp, specs, object_values, args.force), only_rank0=True)
        mine = group.share([Entry(n, "tensor", d, s).nbytes for n, d, s in specs])
        my_targets = [t for i, t in enumerate(tensors) if mine[i]]
        my_specs = [spec for i, spec in enumerate(specs) if mine[i]]
        bar = Progress(f"export {args.format}", sum(t.nbytes for t in my_targets), not args.quiet)
        values = _renamed_values(_overlapped(reader, my_targets, cast), out_name)
        group.together(lambda: fill_tensors(tmp, my_specs, values, on_bytes=bar.add))
        group.together(lambda: finish(tmp, dst), only_rank0=True)
        where = str(dst)
    bar.close()
    seconds = time.perf_counter() - start
    if group.rank == 0:
        print(f"exported {len(specs)} tensors ({human_bytes(total)}) and {len(object_values)} objects to {where} "
              f"in {seconds:.1f} s ({human_bytes(total / max(seconds, 1e-9))}/s)"
              + (f" with {group.size} processes" if group.size > 1 else ""))
    return 0


def _prepare_safetensors_dir(dst: Path, force: bool) -> None:
    _check_fresh_output(dst, force)
    if force and dst.is_dir():
        # shards of an earlier export would otherwise sit beside the new ones, unindexed
        for stale in [*dst.glob("model-*-of-*.safetensors"), dst / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)
    dst.mkdir(parents=True, exist_ok=True)


def _prepare_torch_file(dst: Path, tmp: Path, specs, objects: dict[str, Any], force: bool) -> None:
    from checkpoint.torchfile_io import write_skeleton

    if dst.is_dir():
        raise CliError(f"output {str(dst)!r} is a directory; --format torch writes one file: give a file name")
    _check_fresh_output(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_skeleton(tmp, specs, objects)


OVERLAP_BYTES = 128 << 20
"""How far reading may run ahead of writing, beyond the largest tensor (peak ~ largest + this + a chunk)."""


def _overlapped(source: Any, targets: list[Target], cast: Callable[[Target, Any], Any] | None = None) -> Iterator[tuple[Target, Any]]:
    """:func:`stream_targets`, read on a background thread while the caller writes."""
    sizes = [t.nbytes for t in targets]
    limit = max(sizes, default=0) + OVERLAP_BYTES
    return prefetch(stream_targets(source, targets, cast=cast), sizes, limit_bytes=limit)


def _renamed_values(stream: Iterator[tuple[Target, Any]], name: Callable[[Target], str]) -> Iterator[tuple[str, Any]]:
    for target, value in stream:
        yield name(target), value
        del value  # a generator expression would keep it alive while the next tensor is read


def _json_objects(objects: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in objects.items():
        try:
            json.dumps(value)
        except TypeError:
            raise CliError(
                f"{name!r} holds a {type(value).__name__}, which safetensors export cannot store; "
                "use --model-only, or --format torch"
            ) from None
        out[name] = value
    return out


# --------------------------------------------------------------------------- import / reshard


def cmd_import(args: argparse.Namespace) -> int:
    src = Path(args.src)
    if not src.exists():
        raise FileNotFoundError(f"import source {str(src)!r} does not exist; check the path")
    if src.is_dir() or src.suffix == ".safetensors":
        from checkpoint.safetensors_io import SafetensorsSource

        source: Any = SafetensorsSource(src, prefix=args.key_prefix if args.key_prefix is not None else "model.")
    else:
        from checkpoint.torchfile_io import TorchFileSource

        source = TorchFileSource(src, prefix=args.key_prefix)
    return _write_from(source, args, verb="imported")


def cmd_reshard(args: argparse.Namespace) -> int:
    return _write_from(_open(args.src), args, verb="resharded")


def _write_from(source: Any, args: argparse.Namespace, *, verb: str) -> int:
    from checkpoint.rewrite import write_checkpoint

    if args.world_size < 1:
        raise CliError(f"--world-size {args.world_size} must be at least 1")
    targets = plan(source.entries, _rules(args))
    logger.info("planned %d keys from %d; writing for %d rank(s)", len(targets), len(source.entries), args.world_size)
    dst = Path(args.dst)
    total = sum(t.nbytes for t in targets)
    bar = Progress(verb.removesuffix("ed"), total, not args.quiet)
    start = time.perf_counter()
    write_checkpoint(
        dst, args.world_size, targets, _overlapped(source, targets),
        max_chunk_bytes=args.max_chunk_size, on_bytes=bar.add, replace=args.force, group=args.group,
    )
    bar.close()
    seconds = time.perf_counter() - start
    if args.group.rank == 0:
        print(f"{verb} {len(targets)} keys ({human_bytes(total)}) into {dst} for {args.world_size} rank(s) "
              f"in {seconds:.1f} s ({human_bytes(total / max(seconds, 1e-9))}/s)")
    return 0


# --------------------------------------------------------------------------- argument parsing


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, like every other failure."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message}; see `{self.prog} --help`")


def _add_rule_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("key transforms (split/merge match stored names; renames run last)")
    g.add_argument("--rename", nargs=2, action="append", metavar=("REGEX", "REPLACEMENT"),
                   help="re.sub on each parameter name (model weights and their optimizer state alike)")
    g.add_argument("--split", nargs=3, action="append", metavar=("FUSED", "DIM", "PARTS"),
                   help="split FUSED (name, '*' = any text) along DIM into comma-separated PARTS, "
                        "each optionally NAME:SIZE (default: equal sizes)")
    g.add_argument("--merge", nargs=3, action="append", metavar=("FUSED", "DIM", "PARTS"),
                   help="the inverse of --split with the same arguments")
    g.add_argument("--rules", metavar="JSON",
                   help='rules file: {"rename": [[regex, repl]], "split": [{"fused", "dim", "parts", "sizes"}], "merge": [...]}')


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log milestones (INFO) to stderr")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")


_EXAMPLES = {
    "inspect": """examples:
  fsdp-ckpt inspect ckpt/step_500
  fsdp-ckpt inspect ckpt/step_500 --json | jq '.totals'""",
    "verify": """examples:
  fsdp-ckpt verify ckpt/step_500            # exit 0: complete; exit 1: problems listed
  fsdp-ckpt verify ckpt/step_500 --no-checksums""",
    "reshard": """examples:
  fsdp-ckpt reshard ckpt/step_500 ckpt/step_500_w64 --world-size 64
  fsdp-ckpt reshard a b --world-size 8 --rename '^decoder\\.' 'model.'""",
    "export": """examples:
  fsdp-ckpt export ckpt/step_500 hf/ --format safetensors --model-only --max-shard-size 5GB
  fsdp-ckpt export ckpt/step_500 hf/ --format safetensors --model-only --dtype bf16 \\
      --split 'layers.*.mlp.linear_fc1.weight' 0 'layers.*.mlp.gate_proj.weight,layers.*.mlp.up_proj.weight'
  fsdp-ckpt export ckpt/step_500 full.pt --format torch""",
    "import": """examples:
  fsdp-ckpt import hf/ ckpt/init --world-size 8            # HF directory (index json) -> fsdp_dtensor
  fsdp-ckpt import model.safetensors ckpt/init
  fsdp-ckpt import weights.pt ckpt/init \\
      --merge 'layers.*.mlp.linear_fc1.weight' 0 'layers.*.mlp.gate_proj.weight,layers.*.mlp.up_proj.weight'""",
    "diff": """examples:
  fsdp-ckpt diff ckpt/a ckpt/b                 # exact; exit 1 on any difference
  fsdp-ckpt diff ckpt/a ckpt/b --atol 1e-6 --rtol 1e-5""",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Inspect, verify, reshard, export, import and diff fsdp_dtensor / DCP checkpoints, "
                    "streaming one tensor at a time.",
        epilog="run `fsdp-ckpt <command> --help` for the options and examples of each command",
    )
    sub = parser.add_subparsers(dest="command", metavar="{inspect,verify,reshard,export,import,diff}", parser_class=_Parser)
    sub.required = True

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(p)
        return p

    p = add("inspect", "keys with dtype, global shape, chunk count and bytes; totals; format, world size, commit")
    p.add_argument("ckpt")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = add("verify", "check coverage, files against the manifest, and that every chunk reads")
    p.add_argument("ckpt")
    p.add_argument("--no-checksums", action="store_true", help="check file sizes only (faster)")
    p.set_defaults(func=cmd_verify)

    for name, verb in (("reshard", "rewrite a checkpoint for --world-size ranks (no model code needed)"),
                       ("import", "safetensors file / HF directory / torch file -> fsdp_dtensor checkpoint")):
        p = add(name, verb)
        p.add_argument("src")
        p.add_argument("dst")
        p.add_argument("--world-size", type=int, default=1 if name == "import" else None,
                       required=name == "reshard", help="ranks to lay the checkpoint out for")
        p.add_argument("--max-chunk-size", type=parse_size, default=parse_size("64MiB"),
                       help="largest stored chunk (default 64MiB, as checkpoint.save; at least one dim-0 row), "
                            "so later reshards read small pieces")
        p.add_argument("--force", action="store_true", help="write into an existing non-empty output")
        if name == "import":
            p.add_argument("--key-prefix", default=None,
                           help="prefix for imported names (default 'model.'; '' keeps names as they are)")
        _add_rule_args(p)
        p.set_defaults(func=cmd_reshard if name == "reshard" else cmd_import, parallel=True)

    p = add("export", "checkpoint -> HF-style sharded safetensors or one torch file")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--format", required=True, choices=("safetensors", "torch"))
    p.add_argument("--model-only", action="store_true", help="model weights only, named by fqn (no 'model.' prefix)")
    p.add_argument("--dtype", help="cast floating model weights, e.g. bf16 (optimizer state keeps its dtype)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="safetensors shard limit (default 5GB; a larger tensor gets its own shard)")
    p.add_argument("--force", action="store_true", help="write into an existing non-empty output")
    _add_rule_args(p)
    p.set_defaults(func=cmd_export, parallel=True)

    p = add("diff", "key-by-key comparison; exit 1 on any difference")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.set_defaults(func=cmd_diff)
    return parser


def _error_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) if str(exc) else type(exc).__name__
    if isinstance(exc, KeyError):
        text = text.strip("\"'")
    if ";" in text and not isinstance(exc, (RuntimeError, AssertionError)):
        return text
    if isinstance(exc, (CliError, ValueError, TypeError, NotACheckpointError, KeyError)):
        return f"{text}; check the arguments (see `{PROG} --help`)"
    if isinstance(exc, FileNotFoundError):
        return f"{text}; check the path"
    if isinstance(exc, OSError):
        return f"{text}; check the path, permissions and free space"
    return f"unexpected {type(exc).__name__}: {text}; rerun with --debug and report the traceback"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fsdp-ckpt``; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    group = SOLO
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose and _rank() == 0 else logging.WARNING,
            format=f"{PROG}: %(message)s" if not debug else "%(asctime)s %(name)s %(levelname)s: %(message)s",
        )
        args.group = group = join_group()  # SOLO unless run under torchrun
        if group.rank != 0 and not getattr(args, "parallel", False):
            return 0  # commands that do not split their work run on process 0 only
        code = args.func(args)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except SystemExit:
        raise  # --help
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted; outputs may be incomplete, delete them and rerun", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`fsdp-ckpt inspect ... | head`): not our failure, so no
        # error line; point stdout at /dev/null so the interpreter's final flush is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except BaseException as exc:
        if debug:
            raise
        code = exc.exit_code if isinstance(exc, CliError) else EXIT_CANNOT_RUN
        sys.stdout.flush()
        if group.rank == 0 or not isinstance(exc, PeerFailed):  # a peer's failure is reported once, by process 0
            print(f"{PROG}: error: {_error_line(exc)}", file=sys.stderr)
        return code
    finally:
        leave_group(group)


if __name__ == "__main__":
    sys.exit(main())
