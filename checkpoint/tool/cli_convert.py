"""``fsdp-ckpt export`` (to safetensors / a torch file), ``import`` (from them) and ``reshard``.

All three plan their outputs from the command-line key transforms
(``--rename`` / ``--split`` / ``--merge`` / ``--rules``) and stream the source
tensor by tensor, read ahead on a background thread while the writer writes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePath
from typing import Any

import torch

from checkpoint.atomic import (
    MARKER_NAME,
    make_staging,
    recover_interrupted_swap,
    remove_staging,
    staging_path,
    swap_into_place,
    write_lock,
)
from checkpoint.durable import durable_replace
from checkpoint.manifest import open_regular
from checkpoint.storage_backend import locate
from checkpoint.tool.cli_report import CliError, Progress, human_bytes
from checkpoint.tool.cli_source import open_source
from checkpoint.tool.remote_copy import check_output, download, remove, stand_in, upload
from checkpoint.tool.rewrite import write_checkpoint
from checkpoint.tool.safetensors_io import (
    SafetensorsSource,
    is_export,
    is_export_file,
    plan_shards,
    write_index,
    write_shards,
)
from checkpoint.tool.stream import Entry, parse_dtype, prefetch
from checkpoint.tool.torchfile_io import TorchFileSource, fill_tensors, reserve_space, write_skeleton
from checkpoint.tool.transforms import (
    Rename,
    Reshape,
    Rules,
    Split,
    Stack,
    Target,
    parse_part_list,
    plan,
    stream_targets,
)
from checkpoint.training_state import TIED_SECTION

__all__ = ["OVERLAP_BYTES", "cmd_export", "cmd_import", "cmd_reshard"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- key transforms and outputs


def _rules(args: argparse.Namespace) -> Rules:
    rules = Rules(
        renames=tuple(Rename(p, r) for p, r in args.rename or ()),
        splits=tuple(_split_rule(a, "--split") for a in args.split or ()),
        merges=tuple(_split_rule(a, "--merge") for a in args.merge or ()),
        stacks=tuple(_stack_rule(a, "--stack") for a in args.stack or ()),
        unstacks=tuple(_stack_rule(a, "--unstack") for a in args.unstack or ()),
        reshapes=tuple(_reshape_rule(name, shape) for name, shape in args.reshape or ()),
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


def _stack_rule(values: Sequence[str], flag: str) -> Stack:
    fused, dim, parts = values
    if not dim.isdigit():
        raise CliError(f"{flag} {fused!r}: dim {dim!r} is not a non-negative integer; write e.g. {flag} NAME 0 'a.#.w'")
    names, sizes = parse_part_list(parts)
    return Stack(fused=fused, dim=int(dim), parts=names, sizes=sizes)


def _reshape_rule(name: str, shape: str) -> Reshape:
    if not all(s.strip().isdigit() for s in shape.split(",")):
        raise CliError(
            f"--reshape {name!r}: shape {shape!r} is not comma-separated sizes; write e.g. --reshape NAME 8,64,32"
        )
    return Reshape(name, tuple(int(s) for s in shape.split(",")))


def _check_fresh_output(path: Path, force: bool) -> None:
    if path.exists() and (path.is_file() or any(path.iterdir())) and not force:
        raise CliError(f"output {str(path)!r} already exists and is not empty; choose a new path or pass --force")


# --------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    reader = open_source(args.src)
    targets = plan(reader.entries, _rules(args))
    logger.info("planned %d outputs from %d keys", len(targets), len(reader.entries))
    if not args.keep_tied:
        targets = _without_tied_aliases(reader, targets)
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
        if dtype is not None and t.tensor_dtype.is_floating_point and t.name.startswith("model."):
            return dtype
        return t.tensor_dtype

    def cast(t: Target, v: Any) -> Any:
        return v.to(out_dtype(t)) if isinstance(v, torch.Tensor) and v.dtype != out_dtype(t) else v

    group = args.group
    # objects are small: rank 0 reads them for the index / the torch file's skeleton
    object_values = {}
    if objects and group.rank == 0:
        object_values = {out_name(t): v for t, v in stream_targets(reader, objects)}
        reader.finish()  # their bytes' CRC-32, before they reach the output
    specs = [(out_name(t), out_dtype(t), t.shape) for t in tensors]
    total = sum(Entry(n, "tensor", d, s).nbytes for n, d, s in specs)
    dst, remote = _export_output(args)
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as held:
            # one writer per output path, held by process 0 until the output is committed
            group.together(lambda: held.enter_context(write_lock(dst)), only_rank0=True)
            if args.format == "safetensors":
                where, bar = _export_safetensors(args, reader, dst, specs, tensors, object_values, out_name, cast)
            else:
                where, bar = _export_torch_file(args, reader, dst, specs, tensors, object_values, out_name, cast)
            if remote is not None:
                group.together(lambda: upload(dst, remote, force=args.force), only_rank0=True)
                where = where.replace(str(dst), str(remote))
    finally:
        if remote is not None and group.rank == 0:
            remove(dst.parent)
    bar.close()
    seconds = time.perf_counter() - start
    if group.rank == 0:
        print(
            f"exported {len(specs)} tensors ({human_bytes(total)}) and {len(object_values)} objects to {where} "
            f"in {seconds:.1f} s ({human_bytes(total / max(seconds, 1e-9))}/s)"
            + (f" with {group.size} processes" if group.size > 1 else "")
        )
    return 0


def _export_output(args: argparse.Namespace) -> tuple[Path, PurePath | None]:
    """Where the export is written: ``args.dst``, or for a URL a local stand-in uploaded after (and the URL)."""
    located = locate(args.dst)
    if isinstance(located, Path):
        return located, None
    local = stand_in(located, "export")

    def prepare() -> None:
        check_output(located, args.force)
        remove(local)  # what a killed export to this URL left
        local.mkdir(parents=True)

    args.group.together(prepare, only_rank0=True)
    return local / located.name, located


def _without_tied_aliases(reader: Any, targets: list[Target]) -> list[Target]:
    """``targets`` less the second name of each tied weight ``checkpoint.save`` recorded (HF ties it on load)."""
    keys = [k for k in reader.entries if k.startswith(f"{TIED_SECTION}.")]
    if not keys:
        return targets
    aliases = {f"model.{k[len(TIED_SECTION) + 1 :]}" for k in keys}
    dropped = [t for t in targets if t.op == "copy" and t.sources[0] in aliases]
    logger.info("left out %d tied alias(es) (--keep-tied writes them): %s", len(dropped), [t.name for t in dropped])
    return [t for t in targets if t not in dropped]


def _export_safetensors(args, reader, dst: Path, specs, tensors, object_values, out_name, cast) -> tuple[str, Progress]:
    group = args.group
    # written whole under the staging dir, then swapped in: a crash leaves DST absent or as it was
    staging = staging_path(dst)
    replaced = group.together(lambda: _prepare_safetensors_dir(dst, args.force), only_rank0=True)
    by_name = {n: (n, d, s) for n, d, s in specs}
    names = plan_shards([(n, Entry(n, "tensor", d, s).nbytes) for n, d, s in specs], args.max_shard_size)
    shards = [[by_name[n] for n in g] for g in names]
    mine = group.share([sum(Entry(n, "tensor", d, s).nbytes for n, d, s in sh) for sh in shards])
    my_names = {n for i, g in enumerate(names) if mine[i] for n in g}
    my_targets = [t for t in tensors if out_name(t) in my_names]
    logger.info(
        "writing %d of %d safetensors shard(s) of at most %s", sum(mine), len(shards), human_bytes(args.max_shard_size)
    )
    bar = Progress(f"export {args.format}", sum(t.nbytes for t in my_targets), not args.quiet)
    values = _renamed_values(_overlapped(reader, my_targets, cast), out_name)
    try:
        group.together(
            lambda: write_shards(
                staging, shards, values, full_keys=not args.model_only, on_bytes=bar.add, which=mine.__getitem__
            )
        )
        objects_json = _json_objects(object_values)
        group.together(lambda: _commit_safetensors(staging, dst, shards, objects_json, args.force), only_rank0=True)
    except BaseException:
        if group.rank == 0:  # every process has stopped writing (together() agreed on the failure)
            remove_staging(dst)
        raise
    where = f"{len(shards)} file(s) + model.safetensors.index.json in {dst}"
    if replaced:  # rank 0 only
        where += f", replacing its earlier weight files ({', '.join(replaced)}; its other files were kept)"
    return where, bar


def _export_torch_file(args, reader, dst: Path, specs, tensors, object_values, out_name, cast) -> tuple[str, Progress]:
    group = args.group
    tmp = staging_path(dst)  # a name no user would pick: a user's DST.tmp is never overwritten
    try:
        group.together(lambda: _prepare_torch_file(dst, tmp, specs, object_values, args.force), only_rank0=True)
        mine = group.share([Entry(n, "tensor", d, s).nbytes for n, d, s in specs])
        my_targets = [t for i, t in enumerate(tensors) if mine[i]]
        my_specs = [spec for i, spec in enumerate(specs) if mine[i]]
        bar = Progress(f"export {args.format}", sum(t.nbytes for t in my_targets), not args.quiet)
        values = _renamed_values(_overlapped(reader, my_targets, cast), out_name)
        group.together(lambda: fill_tensors(tmp, my_specs, values, on_bytes=bar.add))
        group.together(lambda: durable_replace(tmp, dst), only_rank0=True)
    except BaseException:
        if group.rank == 0:  # every process has stopped writing (together() agreed on the failure)
            tmp.unlink(missing_ok=True)
        raise
    return str(dst), bar


def _prepare_safetensors_dir(dst: Path, force: bool) -> list[str]:
    """Make an empty staging dir for an export to ``dst``; with ``force``, other files of ``dst`` go in first.

    Weight files and indexes already in ``dst`` (an earlier export's shards, a
    ``model.safetensors`` or ``pytorch_model*.bin`` of ``save_pretrained``) are
    left out: beside the new ones ``from_pretrained`` could read them instead.
    Anything else there (``config.json``, a tokenizer) is hard-linked (else
    copied) so the swap keeps it. Returns the names left out (replaced by the swap).
    """
    recover_interrupted_swap(dst, complete=is_export)  # an export killed mid-swap left it in the swap dir
    _check_fresh_output(dst, force)
    if dst.exists() and not dst.is_dir():
        raise CliError(f"output {str(dst)!r} is a file; --format safetensors writes a directory: give a directory")
    staging = make_staging(dst)  # an unfinished export to this path (marked as ours) is removed
    replaced = []
    if force and dst.is_dir():
        for entry in dst.iterdir():
            if is_export_file(entry.name):
                replaced.append(entry.name)
            elif entry.name != MARKER_NAME:
                _link_or_copy(entry, staging / entry.name)
    return sorted(replaced)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    src, dst = Path(src), Path(dst)
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:  # another file system, or links not supported
        shutil.copy2(src, dst, follow_symlinks=False)


def _commit_safetensors(staging: Path, dst: Path, shards, objects: dict[str, Any], force: bool) -> None:
    """Index last (the export's commit record), then the crash-safe swap of ``staging`` into ``dst``."""
    write_index(staging, shards, objects=objects)
    # with --force the user asked to replace DST whatever it holds (its other files were carried over)
    swap_into_place(staging, dst, complete=(lambda p: p.is_dir()) if force else is_export)


def _prepare_torch_file(dst: Path, tmp: Path, specs, objects: dict[str, Any], force: bool) -> None:
    if dst.is_dir():
        raise CliError(f"output {str(dst)!r} is a directory; --format torch writes one file: give a file name")
    _check_fresh_output(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_skeleton(tmp, specs, objects)
    reserve_space(tmp)


OVERLAP_BYTES = 128 << 20
"""How far reading may run ahead of writing, beyond the largest tensor (peak ~ largest + this + a chunk)."""


def _overlapped(
    source: Any, targets: list[Target], cast: Callable[[Target, Any], Any] | None = None
) -> Iterator[tuple[Target, Any]]:
    """:func:`stream_targets`, read on a background thread while the caller writes; CRC-checked before the last."""
    sizes = [t.nbytes for t in targets]
    limit = max(sizes, default=0) + OVERLAP_BYTES
    return prefetch(
        _checked(source, stream_targets(source, targets, cast=cast), len(targets)), sizes, limit_bytes=limit
    )


def _checked(source: Any, stream: Iterator[Any], count: int) -> Iterator[Any]:
    """``stream``, with the source's content check (``finish``: the CRC-32 of every file read) run before
    its last item is handed out, so a damaged file fails the command before the writer commits."""
    for i, item in enumerate(stream):
        if i == count - 1 and hasattr(source, "finish"):  # import sources (safetensors, torch files) have none
            source.finish()
        yield item


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
    located = locate(args.src)
    if isinstance(located, Path):
        return _import_from(located, args)
    local = stand_in(located, "import")  # a URL: its weight files are downloaded first
    try:
        args.group.together(lambda: download(located, local), only_rank0=True)
        return _import_from(local / located.name, args)
    finally:
        if args.group.rank == 0:
            remove(local)


def _import_from(src: Path, args: argparse.Namespace) -> int:
    if not src.exists():
        raise FileNotFoundError(f"import source {str(src)!r} does not exist; check the path")
    if not src.is_dir():
        open_regular(src, follow_symlinks=True).close()  # a FIFO or device as the source: a clear error, not a hang
    if src.is_dir() or src.suffix == ".safetensors":
        source: Any = SafetensorsSource(src, prefix=args.key_prefix if args.key_prefix is not None else "model.")
    else:
        source = TorchFileSource(src, prefix=args.key_prefix)
    return _write_from(source, args, verb="imported")


def cmd_reshard(args: argparse.Namespace) -> int:
    return _write_from(open_source(args.src), args, verb="resharded")


def _write_from(source: Any, args: argparse.Namespace, *, verb: str) -> int:
    if args.world_size < 1:
        raise CliError(f"--world-size {args.world_size} must be at least 1")
    targets = plan(source.entries, _rules(args))
    logger.info("planned %d keys from %d; writing for %d rank(s)", len(targets), len(source.entries), args.world_size)
    dst = locate(args.dst)  # a local path, or a URL (s3://...)
    total = sum(t.nbytes for t in targets)
    bar = Progress(verb.removesuffix("ed"), total, not args.quiet)
    start = time.perf_counter()
    write_checkpoint(
        dst,
        args.world_size,
        targets,
        _overlapped(source, targets),
        max_chunk_bytes=args.max_chunk_size,
        on_bytes=bar.add,
        replace=args.force,
        group=args.group,
        paths=getattr(getattr(source, "metadata", None), "planner_data", None),
    )
    bar.close()
    seconds = time.perf_counter() - start
    if args.group.rank == 0:
        print(
            f"{verb} {len(targets)} keys ({human_bytes(total)}) into {dst} for {args.world_size} rank(s) "
            f"in {seconds:.1f} s ({human_bytes(total / max(seconds, 1e-9))}/s)"
        )
    return 0
