"""Single-process behaviour of the fsdp_dtensor format: resume, determinism, errors, atomicity, interop."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint
from checkpoint.atomic import mark, old_path, staging_path
from checkpoint.manifest import NotACheckpointError, read_manifest
from tests.distributed import PROCESSES


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _train(model, opt, sched, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=gen)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _setup(seed=0, lr=1e-2):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def test_resume_is_bit_exact_with_adamw_and_lr_scheduler(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 3, seed=1)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt, extra={"step": 3, "sched": sched.state_dict()})
    _train(model, opt, sched, 3, seed=2)

    model2, opt2, sched2 = _setup(seed=5, lr=0.5)  # other weights, other lr: all must come from the checkpoint
    extra = checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    sched2.load_state_dict(extra["sched"])
    assert extra["step"] == 3
    _train(model2, opt2, sched2, 3, seed=2)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


def test_two_saves_of_the_same_state_are_byte_identical(tmp_path):
    model, opt, sched = _setup()
    _train(model, opt, sched, 1, seed=1)
    extra = {"step": 1, "rng": torch.get_rng_state()}
    checkpoint.save(tmp_path / "a", model=model, optimizer=opt, extra=extra)
    checkpoint.save(tmp_path / "b", model=model, optimizer=opt, extra=extra)
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(os.listdir(tmp_path / "b")) and ".metadata" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_loading_reports_missing_path_uncommitted_dir_and_damaged_files_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        checkpoint.load(tmp_path / "nowhere", model=_model())
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match="half"):
        checkpoint.load(tmp_path / "half", model=_model())

    model = _model()
    checkpoint.save(tmp_path / "c", model=model)
    data = tmp_path / "c" / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(checkpoint.CheckpointCorruptError, match="__0_0.distcp.*CRC"):
        checkpoint.load(tmp_path / "c", model=_model(), verify="full")
    data.write_bytes(bytes(blob[:-10]))
    with pytest.raises(checkpoint.CheckpointCorruptError, match="__0_0.distcp.*truncated"):
        checkpoint.load(tmp_path / "c", model=_model())


def test_strict_load_names_mis_shaped_missing_and_unexpected_keys_and_non_strict_returns_them(tmp_path):
    checkpoint.save(tmp_path / "c", model=_model())
    other = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError) as info:
        checkpoint.load(tmp_path / "c", model=other)
    message = str(info.value)
    assert "model.2.weight: saved (3, 5) vs local (4, 5)" in message
    assert "missing: model.3.weight" in message
    before = other[2].weight.detach().clone()
    result = checkpoint.load(tmp_path / "c", model=other, strict=False)
    assert sorted(result.missing_keys) == ["model.3.bias", "model.3.weight"]
    assert {k.split(":")[0] for k in result.mismatched_keys} == {"model.2.weight", "model.2.bias"}
    assert torch.equal(other[2].weight, before)  # mis-shaped keys are left alone
    assert torch.equal(other[0].weight, _model()[0].weight)

    smaller = torch.nn.Sequential(torch.nn.Linear(6, 5))
    result = checkpoint.load(tmp_path / "c", model=smaller, strict=False)
    assert sorted(result.unexpected_keys) == ["model.2.bias", "model.2.weight"]


def _holding(**tensors: torch.Tensor) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, value in tensors.items():
        module.register_parameter(name, torch.nn.Parameter(value))
    return module


def test_a_strict_load_error_says_how_to_load_anyway_and_the_tool_rewrite_it_names_fixes_it(tmp_path, cli):
    saved = _holding(w=torch.arange(12.0).reshape(3, 4), b=torch.ones(2))
    checkpoint.save(tmp_path / "c", model=saved)
    reshaped = _holding(w=torch.zeros(2, 6), b=torch.zeros(2))
    with pytest.raises(
        ValueError, match=r"mis-shaped: model\.w.*strict=False.*`fsdp-ckpt reshard SRC DST` and --reshape"
    ):
        checkpoint.load(tmp_path / "c", model=reshaped)
    cli("reshard", tmp_path / "c", tmp_path / "r", "--world-size", "1", "--reshape", "w", "2,6", "-q")
    checkpoint.load(tmp_path / "r", model=reshaped)
    assert torch.equal(reshaped.w, torch.arange(12.0).reshape(2, 6))

    renamed = _holding(weight=torch.zeros(3, 4), b=torch.zeros(2))
    with pytest.raises(ValueError, match=r"strict=False.*`fsdp-ckpt reshard SRC DST --rename REGEX REPLACEMENT`"):
        checkpoint.load(tmp_path / "c", model=renamed)
    cli("reshard", tmp_path / "c", tmp_path / "n", "--world-size", "1", "--rename", "^w$", "weight", "-q")
    checkpoint.load(tmp_path / "n", model=renamed)
    assert torch.equal(renamed.weight, saved.w)


def test_plain_dcp_reads_ours_and_ours_reads_plain_dcp(tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model, opt, sched = _setup()
    _train(model, opt, sched, 2, seed=1)
    checkpoint.save(tmp_path / "ours", model=model, optimizer=opt, extra={"step": 2})
    dcp_to_torch_save(tmp_path / "ours", tmp_path / "ours.pt")
    flat = torch.load(tmp_path / "ours.pt", weights_only=False)
    assert torch.equal(flat["model"]["0.weight"], model[0].weight)
    assert torch.equal(flat["optimizer"]["state"]["2.bias"]["exp_avg"], opt.state[model[2].bias]["exp_avg"])

    # ours -> plain DCP + torch's flattened optimizer state dict
    model2, opt2, _ = _setup(seed=3)
    checkpoint.load(tmp_path / "ours", model=model2, optimizer=opt2)  # materialise the state's shape
    msd, osd = get_state_dict(model2, opt2, options=StateDictOptions(flatten_optimizer_state_dict=True))
    for t in msd.values():
        t.zero_()
    with pytest.warns(UserWarning):
        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "ours", no_dist=True)
    assert torch.equal(msd["2.weight"], model[2].weight)
    assert torch.equal(osd["state.2.weight.exp_avg"], opt.state[model[2].weight]["exp_avg"])
    assert osd["param_groups.2.weight.lr"] == opt.param_groups[0]["lr"]


def test_a_plain_get_state_dict_dcp_save_loads_optimizer_state_and_groups_with_require_manifest_off(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt, sched = _setup()
    _train(model, opt, sched, 2, seed=1)
    msd, osd = get_state_dict(model, opt)  # torch's default, unflattened optimizer layout
    with pytest.warns(UserWarning):
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "plain", no_dist=True)

    model2, opt2, _ = _setup(seed=3, lr=0.7)
    with pytest.raises(NotACheckpointError):
        checkpoint.load(tmp_path / "plain", model=model2, optimizer=opt2)
    checkpoint.load(tmp_path / "plain", model=model2, optimizer=opt2, require_manifest=False)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])


def test_params_that_never_had_a_gradient_keep_no_state_after_a_load(tmp_path):
    model, opt, _ = _setup()
    model[0].weight.requires_grad_(False)  # gets no gradient, so AdamW never creates its state
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    model[0].weight.requires_grad_(True)
    model2, opt2, _ = _setup(seed=4)
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert not opt2.state.get(model2[0].weight)
    assert torch.equal(opt2.state[model2[2].weight]["exp_avg"], opt.state[model[2].weight]["exp_avg"])


def test_write_rank_then_commit_builds_a_checkpoint_for_m_ranks_from_one_process(tmp_path):
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    bounds = [0, 10, 10, 21]  # rank 1 holds an empty flat range
    for rank in range(3):
        local = full.reshape(-1)[bounds[rank] : bounds[rank + 1]].clone()
        checkpoint.write_rank(
            tmp_path / "c", rank, 3, {"w": checkpoint.shard(local, (7, 3), flat_start=bounds[rank]), "n": 5}
        )
    assert not (tmp_path / "c").exists()  # nothing visible before the commit
    checkpoint.commit(tmp_path / "c", 3)
    assert read_manifest(tmp_path / "c").world_size == 3
    # per-rank metadata merged away; rank 1's copy of the replicated "n" is unreferenced and pruned
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.distcp", "__2_0.distcp", "manifest.json"]
    target = {"w": torch.zeros(7, 3), "n": None}
    checkpoint.load_state_dict(target, tmp_path / "c")
    assert torch.equal(target["w"], full) and target["n"] == 5

    checkpoint.write_rank(tmp_path / "d", 0, 2, {"w": checkpoint.shard(full[:3].clone(), (7, 3), offsets=(0, 0))})
    with pytest.raises(ValueError, match="rank 1 did not finish"):
        checkpoint.commit(tmp_path / "d", 2)
    checkpoint.write_rank(tmp_path / "d", 1, 3, {"w": checkpoint.shard(full[4:].clone(), (7, 3), offsets=(4, 0))})
    with pytest.raises(ValueError, match="written for world size 3, not 2"):
        checkpoint.commit(tmp_path / "d", 2)
    checkpoint.write_rank(tmp_path / "d", 1, 2, {"w": checkpoint.shard(full[4:].clone(), (7, 3), offsets=(4, 0))})
    with pytest.raises(ValueError, match="w: chunks hold 18 of its 21"):
        checkpoint.commit(tmp_path / "d", 2)
    assert not (tmp_path / "d").exists()


def test_chunks_are_bounded_and_load_into_another_flat_layout(tmp_path):
    full = torch.randn(40, 8)
    checkpoint.save_state_dict({"w": full}, tmp_path / "c", max_chunk_bytes=5 * 8 * 4)
    opened = checkpoint.open_checkpoint(tmp_path / "c")
    chunks = opened.metadata.state_dict_metadata["w"].chunks
    assert len(chunks) == 8 and all(c.sizes[0] * 8 * 4 <= 160 for c in chunks)
    local = torch.zeros(100)
    checkpoint.load_state_dict({"w": checkpoint.shard(local, (40, 8), flat_start=123)}, tmp_path / "c")
    assert torch.equal(local, full.reshape(-1)[123:223])
    box = torch.zeros(13, 3)  # a column block: no contiguous run in the stored chunks
    checkpoint.load_state_dict({"w": checkpoint.shard(box, (40, 8), offsets=(6, 2))}, tmp_path / "c")
    assert torch.equal(box, full[6:19, 2:5])
    strided = torch.zeros(8, 40).t()  # a non-contiguous destination
    checkpoint.load_state_dict({"w": strided}, tmp_path / "c")
    assert torch.equal(strided, full)


def test_an_interrupted_swap_loads_the_previous_checkpoint_and_the_next_save_recovers(tmp_path):
    path = tmp_path / "c"
    checkpoint.save_state_dict({"w": torch.ones(3)}, path)
    mark(path)  # the swap marks the checkpoint it moves aside...
    os.replace(path, old_path(path))  # ...and this is what a kill between the two renames leaves
    target = {"w": torch.zeros(3)}
    checkpoint.load_state_dict(target, path)
    assert torch.equal(target["w"], torch.ones(3))
    checkpoint.save_state_dict({"w": torch.full((3,), 2.0)}, path)
    assert not old_path(path).exists() and not staging_path(path).exists()
    checkpoint.load_state_dict(target, path)
    assert torch.equal(target["w"], torch.full((3,), 2.0))


class _Killed(BaseException):
    pass


def test_a_save_interrupted_at_every_rename_leaves_old_or_new_never_a_mix(tmp_path, monkeypatch):
    real_replace = os.replace
    for kill_at in range(8):
        path = tmp_path / f"c{kill_at}"
        checkpoint.save_state_dict({"w": torch.zeros(4), "v": 0}, path)
        calls = []

        def replace(src, dst, calls=calls, kill_at=kill_at):
            calls.append(dst)
            if len(calls) == kill_at + 1:
                raise _Killed  # the process dies before this rename
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            checkpoint.save_state_dict({"w": torch.ones(4), "v": 1}, path)
            finished = True
        except _Killed:
            finished = False
        except checkpoint.CheckpointSaveError as exc:  # what DCP's coordinator step raised, as an Exception
            assert "_Killed" in str(exc)
            finished = False
        monkeypatch.setattr(os, "replace", real_replace)
        target = {"w": torch.full((4,), -1.0), "v": None}
        checkpoint.load_state_dict(target, path, verify="full")
        assert torch.equal(target["w"], torch.full((4,), float(target["v"])))
        if finished:
            assert target["v"] == 1
            break
        checkpoint.save_state_dict({"w": torch.full((4,), 2.0), "v": 2}, path)  # the next save recovers
        checkpoint.load_state_dict(target, path, verify="full")
        assert target["v"] == 2 and torch.equal(target["w"], torch.full((4,), 2.0))
    assert kill_at >= 3  # the manifest rename and both swap renames were each interrupted once


def _record_fsync_and_replace(monkeypatch) -> list[tuple[str, str]]:
    """Log ("fsync", path of the fd) and ("replace", destination path) in call order, every module and thread."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.abspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _reshard_two_ranks(state: dict, path: Path) -> None:
    from checkpoint.tool.rewrite import write_checkpoint
    from checkpoint.tool.transforms import Target

    targets = [Target(k, "tensor", v.dtype, tuple(v.shape), (k,)) for k, v in state.items()]
    write_checkpoint(path, 2, targets, [(t, state[t.name]) for t in targets], max_chunk_bytes=64)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fd's file through /proc")
@pytest.mark.parametrize("writer", ["save_state_dict", "reshard"])
def test_every_data_file_is_fsynced_before_the_manifest_commit_and_the_swap(tmp_path, monkeypatch, writer):
    state = {"a": torch.randn(8, 4), "b": torch.arange(10.0)}
    path = (tmp_path / "ckpt").resolve()
    events = _record_fsync_and_replace(monkeypatch)
    if writer == "reshard":
        _reshard_two_ranks(state, path)
    else:
        checkpoint.save_state_dict(state, path)
    monkeypatch.undo()
    commit = events.index(("replace", str(staging_path(path) / "manifest.json")))
    swap = events.index(("replace", str(path)))
    data_files = sorted(p.name for p in path.glob("*.distcp"))
    assert data_files and (writer == "save_state_dict" or len(data_files) == 2)
    for name in data_files:
        synced = ("fsync", str(staging_path(path) / name))
        assert synced in events[:commit], f"{name} was not fsynced before the manifest was committed: {events}"
    assert commit < swap


def test_async_save_returns_before_its_write_starts_and_saves_the_state_at_call_time(tmp_path, monkeypatch):
    import threading

    from checkpoint import state_dict_io

    release, real_save = threading.Event(), state_dict_io.save_state_dict

    def held_back(*args, **kwargs):  # the background write waits until the caller has returned and moved on
        if not release.wait(timeout=10):
            raise AssertionError("async_save waited for its own write (the caller never got control back)")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(state_dict_io, "save_state_dict", held_back)
    model = _model()
    expected = model[0].weight.detach().clone()
    future = checkpoint.async_save(tmp_path / "c", model=model, extra={"step": 7})
    assert not future.done() and not (tmp_path / "c").exists()  # staged only: nothing written yet
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training goes on while the save is written
    release.set()
    assert future.result(timeout=60) is None
    model2 = _model(seed=9)
    extra = checkpoint.load(tmp_path / "c", model=model2)
    assert torch.equal(model2[0].weight, expected) and extra["step"] == 7


def _save_loop(path: str, told) -> None:
    """Save ever new values to ``path``, saying ``("started", -1)`` and then ``("saved", i)`` after each on ``told``."""
    torch.set_num_threads(1)
    told.send(("started", -1))
    for i in range(10_000):
        checkpoint.save_state_dict(
            {"a": torch.full((256, 1024), float(i)), "b": torch.full((300,), float(i)), "i": i}, path
        )
        told.send(("saved", i))


class _SaveLoop:
    """:func:`_save_loop` in a process of its own, forked from the fork server (torch imported once)."""

    def __init__(self, path: Path) -> None:
        self.told, telling = PROCESSES.Pipe(duplex=False)
        self.proc = PROCESSES.Process(target=_save_loop, args=(str(path), telling))
        self.proc.start()
        telling.close()  # the child's end: a child that exits makes recv raise EOFError here

    def wait_for(self, what: str) -> int:
        while True:
            try:
                said, i = self.told.recv()
            except EOFError:
                raise AssertionError("the save loop exited early") from None
            if said == what:
                return i

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_kill_9_during_saves_leaves_a_loadable_unmixed_checkpoint(tmp_path):
    delays = [0.0, 0.017, 0.06]
    procs = [_SaveLoop(tmp_path / f"c{i}") for i in range(len(delays))]
    fresh = _SaveLoop(tmp_path / "fresh")
    fresh.wait_for("started")
    for proc, _delay in zip(procs, delays):
        proc.wait_for("saved")
    time.sleep(0.05)
    fresh.kill()
    for proc, delay in zip(procs, delays):
        time.sleep(delay)
        proc.kill()
    for proc in procs + [fresh]:
        proc.proc.join()
    for i in range(len(delays)):
        target = {"a": torch.zeros(256, 1024), "b": torch.zeros(300), "i": None}
        checkpoint.load_state_dict(target, tmp_path / f"c{i}", verify="full")
        value = float(target["i"])
        assert bool((target["a"] == value).all()) and bool((target["b"] == value).all())
    target = {"a": torch.zeros(256, 1024), "b": torch.zeros(300), "i": None}
    try:
        checkpoint.load_state_dict(target, tmp_path / "fresh", verify="full")
    except FileNotFoundError as exc:
        assert "fresh" in str(exc)
    else:
        assert bool((target["a"] == float(target["i"])).all())


def test_loading_into_a_tensor_of_another_dtype_converts_values_instead_of_copying_bytes(tmp_path):
    full = torch.randn(16, 4)
    checkpoint.save_state_dict({"w": full, "m": full.clone()}, tmp_path / "c")
    as_bf16 = torch.zeros(16, 4, dtype=torch.bfloat16)  # e.g. fp32 moments into bf16 host moments
    as_fp64 = torch.zeros(16, 4, dtype=torch.float64)
    checkpoint.load_state_dict({"w": as_bf16, "m": as_fp64}, tmp_path / "c")
    assert torch.equal(as_bf16, full.to(torch.bfloat16))
    assert torch.equal(as_fp64, full.double())
