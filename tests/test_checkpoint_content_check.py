"""Bytes are verified by default: each file's CRC-32 is checked as load / export / reshard / diff read it."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.content_check import ContentCheck
from checkpoint.manifest import FileRecord
from checkpoint.storage_backend import LOCAL
from checkpoint.tool.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_MARK = 3.25  # every model weight holds it: its bytes are easy to find in the data file


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(_MARK)
    return model


def _saved(tmp_path: Path) -> Path:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(_MARK)
    checkpoint.save(tmp_path / "ck", model=model, optimizer=opt, extra={"step": 1})
    return tmp_path / "ck"


def _flip_weight_byte(ck: Path) -> None:
    data = bytearray((ck / "__0_0.distcp").read_bytes())
    at = data.find(torch.full((8,), _MARK).numpy().tobytes())
    assert at > 0
    data[at + 1] ^= 0x10  # one element of model.0.weight becomes another finite float
    (ck / "__0_0.distcp").write_bytes(bytes(data))


def test_a_flipped_weight_byte_fails_the_default_load_naming_the_file_and_sizes_opts_out(tmp_path):
    ck = _saved(tmp_path)
    _flip_weight_byte(ck)
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"__0_0\.distcp: CRC-32 does not match"):
        checkpoint.load(ck, model=_model())
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"__0_0\.distcp: CRC-32 does not match"):
        checkpoint.load_state_dict({"model": {"0.weight": torch.empty(8, 8)}}, ck, strict=False)
    # the opt-out, by name: sizes only, the damaged value loads
    model = _model()
    checkpoint.load(ck, model=model, verify="sizes")
    assert not torch.equal(model[0].weight, torch.full((8, 8), _MARK))


def test_a_model_only_load_checks_the_optimizer_bytes_of_the_files_it_reads(tmp_path):
    ck = _saved(tmp_path)
    data = bytearray((ck / "__0_0.distcp").read_bytes())
    data[-100] ^= 0xFF  # in the last chunk written: optimizer state, not read by a model-only load
    (ck / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"__0_0\.distcp"):
        checkpoint.load(ck, model=_model())


@pytest.mark.parametrize("command", ["export-safetensors", "export-torch", "reshard", "diff"])
def test_every_command_that_reads_bytes_refuses_a_flipped_byte_and_commits_nothing(command, tmp_path, capsys):
    ck = _saved(tmp_path)
    good = tmp_path / "good"
    import shutil

    shutil.copytree(ck, good)
    _flip_weight_byte(ck)
    out = tmp_path / "out"
    argv = {
        "export-safetensors": ["export", str(ck), str(out), "--format", "safetensors"],
        "export-torch": ["export", str(ck), str(out), "--format", "torch"],
        "reshard": ["reshard", str(ck), str(out), "--world-size", "2"],
        "diff": ["diff", str(ck), str(good)],
    }[command]
    code = cli_main(argv + ["-q"])
    err = capsys.readouterr().err
    assert code == 2 and "__0_0.distcp: CRC-32 does not match" in err, err
    assert not out.exists()  # nothing committed (a reshard's staging cleanup is the writer's concern)


def test_pieces_read_in_any_order_with_gaps_and_overlaps_add_up_to_the_file_crc(tmp_path):
    rng = random.Random(0)
    raw = bytes(rng.randrange(256) for _ in range(5000))
    (tmp_path / "f").write_bytes(raw)
    record = FileRecord(size=len(raw), crc32=zlib.crc32(raw))
    for _trial in range(20):
        check = ContentCheck(tmp_path, {"f": record}, LOCAL)
        cuts = sorted(rng.sample(range(1, len(raw)), 12))
        pieces = list(zip([0, *cuts], [*cuts, len(raw)]))
        rng.shuffle(pieces)
        for start, end in pieces[: rng.randrange(len(pieces) + 1)]:  # the rest are gaps
            check.add("f", start, raw[start:end])
        start = rng.randrange(len(raw) - 10)
        check.add("f", start, raw[start : start + 10])  # an overlapping re-read
        check.finish()
    bad = ContentCheck(tmp_path, {"f": FileRecord(size=len(raw), crc32=record.crc32 ^ 1)}, LOCAL)
    bad.add("f", 0, raw[:100])
    with pytest.raises(checkpoint.CheckpointCorruptError, match="CRC-32 does not match"):
        bad.finish()


def _full(v: float) -> dict:
    return {"w": torch.full((64, 16), v), "step": int(v)}


def test_a_load_racing_a_save_to_the_same_path_says_it_was_replaced_not_damaged(tmp_path, monkeypatch):
    from checkpoint import state_dict_io
    from checkpoint.tool.stream import CheckpointReader

    path = tmp_path / "ck"
    checkpoint.save_state_dict(_full(1.0), path)
    reader = CheckpointReader(path)  # opened: manifest and .metadata of save 1
    checkpoint.save_state_dict(_full(2.0), path)  # another save swaps in same-sized files
    with pytest.raises(checkpoint.CheckpointCorruptError, match="replaced by another save") as raised:
        reader.read("w")
        reader.finish()
    assert "not damaged" in str(raised.value)

    opened_then_saved = state_dict_io.open_checkpoint

    def open_then_save(*args, **kwargs):
        opened = opened_then_saved(*args, **kwargs)
        checkpoint.save_state_dict(_full(3.0), path)  # lands between the open and the reads of the load
        return opened

    monkeypatch.setattr(state_dict_io, "open_checkpoint", open_then_save)
    for verify in ("crc", "sizes"):  # without the streamed check the values could be a mix of both saves
        with pytest.raises(checkpoint.CheckpointCorruptError, match="replaced by another save"):
            checkpoint.load_state_dict({"w": torch.zeros(64, 16), "step": None}, path, verify=verify)
    monkeypatch.undo()
    loaded = {"w": torch.zeros(64, 16), "step": None}
    checkpoint.load_state_dict(loaded, path)  # loading again gives the newest save, whole
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.full((64, 16), 3.0))


def test_the_crc_is_isa_l_s_in_a_default_install():
    # isal is a base dependency (pyproject): verified loads are not CRC-bound by zlib's ~1-2.5 GB/s a core
    from isal import isal_zlib

    from checkpoint import content_check

    assert content_check.crc32 is isal_zlib.crc32 and content_check.crc32_combine is isal_zlib.crc32_combine
    data = bytes(range(256)) * 1000
    assert content_check.crc32(data) == zlib.crc32(data)


_FORKED_LOAD = textwrap.dedent(
    """
    import multiprocessing, os, sys
    import torch
    import checkpoint

    torch.set_num_threads(1)  # torch's own intra-op pool does not survive a fork: keep it out of the picture
    path = sys.argv[1]
    w = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)  # 4 MiB: summed on the helper thread
    checkpoint.save_state_dict({"w": w}, path)
    checkpoint.load_state_dict({"w": torch.zeros(1024, 1024)}, path)  # the parent's helper thread runs now

    def child():
        loaded = {"w": torch.zeros(1024, 1024)}
        checkpoint.load_state_dict(loaded, path)
        os._exit(0 if torch.equal(loaded["w"], w) else 3)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        sys.exit("the forked child's verified load hung")
    sys.exit(proc.exitcode)
    """
)


def test_a_verified_load_in_a_forked_child_finishes_after_one_in_the_parent(tmp_path):
    # A forked child has no copy of the parent's CRC helper thread: its sums must not wait on that thread.
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _FORKED_LOAD, str(tmp_path / "ck")],
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
