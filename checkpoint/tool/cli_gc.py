"""``fsdp-ckpt gc``: remove what killed or failed saves left at a checkpoint path (local or URL)."""

from __future__ import annotations

import argparse

from checkpoint.object_commit import collect_garbage

__all__ = ["cmd_gc"]


def cmd_gc(args: argparse.Namespace) -> int:
    removed = collect_garbage(args.ckpt, force=args.force)
    for name in removed:
        print(f"removed {name}")
    print(f"{args.ckpt}: {len(removed)} unfinished save(s) removed; the committed checkpoint is untouched")
    return 0
