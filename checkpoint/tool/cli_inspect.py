"""``fsdp-ckpt inspect`` (what a checkpoint holds) and ``fsdp-ckpt verify`` (whether all of it is there and reads)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from checkpoint.manifest import dtype_name
from checkpoint.opener import consistency_problems, file_problems
from checkpoint.storage_backend import storage_for
from checkpoint.tool.cli_report import EXIT_FOUND_PROBLEMS, CliError, Progress, human_bytes
from checkpoint.tool.cli_source import open_source
from checkpoint.tool.stream import CheckpointReader, Entry

__all__ = ["cmd_inspect", "cmd_verify"]


def cmd_inspect(args: argparse.Namespace) -> int:
    reader = open_source(args.ckpt, warn=False, check_sizes=False)
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
    shown, summarised = _summarise_group_options(rows)
    width = max([len(r["key"]) for r in shown] + [3])
    print(f"\n{'key':<{width}}  {'dtype':<9} {'shape':<20} {'chunks':>6} {'bytes':>12}")
    for r in shown:
        shape = "x".join(map(str, r["shape"])) if r["kind"] == "tensor" else "(object)"
        print(f"{r['key']:<{width}}  {r['dtype'] or '-':<9} {shape or '()':<20} {r['chunks']:>6} {r['bytes']:>12}")
    if summarised:
        print(f"({summarised} per-parameter optimizer options shown once per option; --json lists every key)")
    print()
    for group, t in sorted(totals.items()):
        print(f"{group:<10} {t['keys']:>6} keys {t['tensors']:>6} tensors {human_bytes(t['bytes']):>12}")
    return 0


_GROUP_OPTION = re.compile(r"optimizer\.param_groups\.(?P<fqn>.+)\.(?P<option>[^.]+)")


def _summarise_group_options(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``rows`` with the per-parameter optimizer options (``optimizer.param_groups.<fqn>.<option>``,
    the same few options repeated for every parameter) folded into one row per option; and how many were folded.

    Torch's numbered groups (``optimizer.param_groups.0.lr``) stay as they are.
    """
    shown: list[dict[str, Any]] = []
    folded: dict[str, dict[str, Any]] = {}
    count = 0
    for row in rows:
        m = _GROUP_OPTION.fullmatch(row["key"])
        if row["kind"] != "object" or m is None or m["fqn"].isdigit():
            shown.append(row)
            continue
        count += 1
        option = folded.get(m["option"])
        if option is None:
            option = folded[m["option"]] = {**row, "params": 0}
            shown.append(option)
        option["params"] += 1
        option["key"] = f"optimizer.param_groups.<{option['params']} params>.{m['option']}"
    return shown, count


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
    reader = open_source(args.ckpt, warn=False, check_sizes=False)
    problems: list[str] = []
    if reader.manifest is not None:
        problems += file_problems(reader.path, reader.manifest, checksums=not args.no_checksums)
    else:
        print(f"note: {reader.note}")
    reported = {p.split(": ", 1)[0] for p in problems}  # ": ": a URL's "://" is not the end of its name
    # .metadata's own view of the data files: catches a file the manifest does not list
    problems += [p for p in _data_file_problems(reader) if p.split(": ", 1)[0] not in reported]
    # what a load checks when it opens the checkpoint, the same function: verify refuses all a load refuses
    problems += consistency_problems(reader.metadata, reader.manifest)
    broken_files = {p.split(": ", 1)[0] for p in problems}
    problems += _readability_problems(reader, skip_files=broken_files, progress=not args.quiet)
    if problems:
        for p in problems:
            print(f"PROBLEM {p}")
        raise CliError(
            f"{len(problems)} problem(s) in {args.ckpt}; restore the damaged files from a copy or re-save the checkpoint",
            EXIT_FOUND_PROBLEMS,
        )
    nbytes = sum(e.nbytes for e in reader.entries.values())
    print(
        f"OK {args.ckpt}: {len(reader.entries)} keys, {len(reader.data_files())} data files, "
        f"{human_bytes(nbytes)} of tensors, every element covered once and readable"
    )
    return 0


def _data_file_problems(reader: CheckpointReader) -> list[str]:
    """Without a manifest: every referenced data file exists and is long enough for what it holds."""
    needed: dict[str, int] = {}
    for info in (reader.metadata.storage_data or {}).values():
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        path = reader.path / name
        found = storage_for(path).stat(path, follow_symlinks=True)
        if found is None:
            problems.append(f"{path}: missing (.metadata points into it)")
        elif found.size < end:
            problems.append(f"{path}: {found.size} bytes but .metadata needs {end} (truncated)")
    return problems


def _readability_problems(reader: CheckpointReader, *, skip_files: set[str], progress: bool) -> list[str]:
    problems = []
    bar = Progress("verify", sum(e.nbytes for e in reader.entries.values()), progress)
    keys = [
        key
        for key in reader.entries
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
