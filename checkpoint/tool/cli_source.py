"""Opening the checkpoint an ``fsdp-ckpt`` command reads, with the tool's checks and notes."""

from __future__ import annotations

import logging

from checkpoint.manifest import CheckpointCorruptError
from checkpoint.object_commit import resolve_for_load
from checkpoint.tool.cli_report import PROG, CliError, human_bytes
from checkpoint.tool.stream import CheckpointReader

__all__ = ["open_source"]

logger = logging.getLogger(__name__)


def open_source(path: str, *, warn: bool = True, check_sizes: bool = True) -> CheckpointReader:
    """Open a checkpoint; by default fail fast when a file's size differs from the manifest (cheap, no read)
    and check each file's CRC-32 as it is read (the command calls ``reader.finish()`` before it commits)."""
    # the format's own lookup: a URL's committed save (its head), the swap directory after a save killed
    # mid-swap, and names an unfinished save's staging directory when nothing else is there
    resolved = resolve_for_load(path)
    try:
        reader = CheckpointReader(resolved, verify="crc" if check_sizes else "none")
    except CheckpointCorruptError as exc:
        if not check_sizes:
            raise
        raise CliError(f"{exc}; run `{PROG} verify {path}` for every problem, then restore or re-save it") from None
    if reader.note and warn:
        # stdout, like the command's other output: stderr stays for the one error line
        print(f"note: {path}: {reader.note}", flush=True)
    logger.info(
        "opened %s: %d keys, %s of tensors, world size %s",
        path,
        len(reader.entries),
        human_bytes(sum(e.nbytes for e in reader.entries.values())),
        reader.world_size,
    )
    return reader
