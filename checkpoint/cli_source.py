"""Opening the checkpoint an ``fsdp-ckpt`` command reads, with the tool's checks and notes."""

from __future__ import annotations

import logging

from checkpoint.cli_report import PROG, CliError, human_bytes
from checkpoint.manifest import verify_files
from checkpoint.stream import CheckpointReader

__all__ = ["open_source"]

logger = logging.getLogger(__name__)


def open_source(path: str, *, warn: bool = True, check_sizes: bool = True) -> CheckpointReader:
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
