"""``fsdp-ckpt diff``: two checkpoints compared key by key, streaming both in lockstep."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from checkpoint.manifest import dtype_name
from checkpoint.tool.cli_report import EXIT_FOUND_PROBLEMS, CliError, Progress
from checkpoint.tool.cli_source import open_source
from checkpoint.tool.stream import Entry

__all__ = ["cmd_diff"]


def cmd_diff(args: argparse.Namespace) -> int:
    a, b = open_source(args.a), open_source(args.b)
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
    # the CRC-32 of every file read: a difference must not come from a damaged file
    a.finish()
    b.finish()
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
    return f"{dtype_name(e.tensor_dtype)} {list(e.shape)}" if e.kind == "tensor" else "an object"


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
    return (
        f"{key}: {bad.shape[0]} of {va.numel()} elements differ (max |A-B| {worst:.6g}; "
        f"first at {list(first)}: {va[first].item()!r} vs {vb[first].item()!r})"
    )
