"""Cost of the manifest at N keys: commit side (build + write) and open side (read + consistency check).

    python scripts/bench_manifest.py --keys 10000

A synthetic ``.metadata`` of N bf16 tensors of two chunks each (no data files:
only the manifest's own cost is measured). Rounds interleave a manifest with
each key's ``identity`` (what a save writes now) and the same manifest without
(what a checkpoint written before identities holds, which the open check
skips), so a loaded machine still gives a usable ratio; process CPU time is
shown beside wall time. ``identities`` is ``key_identities`` alone, the part of
``build`` that the identities add.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from checkpoint.commit import build_manifest
from checkpoint.data_file import StorageInfo
from checkpoint.dcp_metadata import MetadataBuilder, key_identities
from checkpoint.manifest import FileRecord, read_manifest, write_manifest
from checkpoint.opener import consistency_problems


def _metadata(keys: int):
    builder = MetadataBuilder()
    pos = 0
    for i in range(keys):
        key = f"model.layers.{i // 10}.block.weight{i % 10}"
        builder.tensor(key, torch.bfloat16, (64, 32))
        for row in (0, 32):
            builder.chunk(key, (row, 0), (32, 32), StorageInfo("__0_0.distcp", pos, 2748))
            pos += 2748
        builder.path(key, (key,))
    files = {"__0_0.distcp": FileRecord(size=pos, crc32=1), ".metadata": FileRecord(size=10, crc32=2)}
    return builder.build(), files


def _round(metadata, files, directory: Path, with_identities: bool) -> dict[str, tuple[float, float]]:
    times: dict[str, tuple[float, float]] = {}

    def timed(name, fn):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        times[name] = (time.perf_counter() - wall, time.process_time() - cpu)
        return out

    timed("identities", lambda: key_identities(metadata))
    manifest = timed("build", lambda: build_manifest(metadata, files, 1))
    if not with_identities:
        manifest.keys.update({k: dataclasses.replace(r, identity=None) for k, r in manifest.keys.items()})
    timed("write", lambda: write_manifest(directory, manifest))
    opened = timed("read", lambda: read_manifest(directory))
    problems = timed("check", lambda: consistency_problems(metadata, opened))
    assert not problems, problems[:3]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    metadata, files = _metadata(args.keys)
    results: dict[bool, list[dict[str, tuple[float, float]]]] = {True: [], False: []}
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for with_identities in (True, False):
                directory = Path(tmp) / str(with_identities)
                directory.mkdir(exist_ok=True)
                results[with_identities].append(_round(metadata, files, directory, with_identities))
                sizes[with_identities] = (directory / "manifest.json").stat().st_size
    for with_identities, rounds in results.items():
        label = "with identities   " if with_identities else "without identities"
        parts = ", ".join(
            f"{name} {statistics.median(r[name][0] for r in rounds) * 1e3:.0f}"
            f"/{statistics.median(r[name][1] for r in rounds) * 1e3:.0f}"
            for name in rounds[0]
        )
        print(
            f"{args.keys} keys, {label}: manifest {sizes[with_identities]} bytes "
            f"({sizes[with_identities] / args.keys:.0f}/key); median ms wall/cpu: {parts}"
        )


if __name__ == "__main__":
    main()
