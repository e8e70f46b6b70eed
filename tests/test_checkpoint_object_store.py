"""Checkpoints at s3:// URLs, against a real S3-compatible server (moto_server on 127.0.0.1, reached through s3fs)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.object_commit import HEAD_NAME
from tests.distributed import PROCESSES, run_ranks
from tests.s3_server import apply, environment

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]


def _objects(url: str) -> list[str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def test_a_state_dict_saved_to_s3_loads_back_bit_exact_and_nothing_is_written_locally(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.randn(5, 7), "b": torch.arange(6, dtype=torch.bfloat16), "extra": {"step": 3, "name": "x"}}
    url = f"{s3_bucket}/run/step3"
    checkpoint.save_state_dict(state, url)
    target = {"w": torch.zeros(5, 7), "b": torch.zeros(6, dtype=torch.bfloat16), "extra": {"step": None, "name": None}}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["extra"] == {"step": 3, "name": "x"}
    assert os.listdir(tmp_path) == []  # no local directory named "s3:"
    names = _objects(url)
    assert HEAD_NAME in names and any(n.endswith("/manifest.json") for n in names)


def test_an_unsupported_scheme_and_a_mangled_url_are_clear_errors_and_write_nothing(tmp_path, monkeypatch):

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unsupported URL scheme 'nosuch://'"):
        checkpoint.save_state_dict({"w": torch.ones(2)}, "nosuch://bucket/x")
    with pytest.raises(ValueError, match="pass the URL as a string"):
        checkpoint.save_state_dict({"w": torch.ones(2)}, Path("s3://bucket/x"))
    with pytest.raises(ValueError, match="pass the URL as a string"):
        checkpoint.load_state_dict({"w": torch.ones(2)}, Path("s3://bucket/x"))
    assert os.listdir(tmp_path) == []


def _flat_state(rank: int, world_size: int, numel: int = 23) -> dict:
    """Rank ``rank``'s flat range of two global tensors (uneven ranges; a rank may hold nothing)."""
    full = {"a": torch.arange(numel, dtype=torch.float32).reshape(-1), "b": torch.arange(3 * 5).reshape(3, 5) * 0.5}
    state = {}
    for key, tensor in full.items():
        n = tensor.numel()
        start, end = n * rank // world_size, n * (rank + 1) // world_size
        state[key] = checkpoint.shard(tensor.reshape(-1)[start:end].clone(), tuple(tensor.shape), flat_start=start)
    return state, full


def _save_ranks(rank: int, world_size: int, env: dict, url: str) -> None:
    apply(env)
    state, _ = _flat_state(rank, world_size)
    checkpoint.save_state_dict({**state, "extra": {"step": 7}}, url)
    checkpoint.save_state_dict({**state, "extra": {"step": 7}}, f"{url}-scale", mode="scale")


def _load_ranks(rank: int, world_size: int, env: dict, url: str) -> bool:
    apply(env)
    state, full = _flat_state(rank, world_size)
    target = {
        k: checkpoint.shard(torch.zeros_like(v.local), v.shape, flat_start=v.spec.flat_start) for k, v in state.items()
    }
    target["extra"] = {"step": None}
    checkpoint.load_state_dict(target, url)
    return all(torch.equal(target[k].local, state[k].local) for k in state) and target["extra"]["step"] == 7


def test_two_gloo_ranks_save_to_s3_and_three_load_it_resharded(s3_bucket, s3_server):
    url = f"{s3_bucket}/dist/step7"
    env = environment(s3_server)
    run_ranks(_save_ranks, world_size=2, args=(env, url))
    assert all(run_ranks(_load_ranks, world_size=3, args=(env, url)))
    assert all(run_ranks(_load_ranks, world_size=1, args=(env, f"{url}-scale")))
    target = {"a": torch.zeros(23), "b": torch.zeros(3, 5), "extra": {"step": None}}
    checkpoint.load_state_dict(target, url)  # one process, the whole tensors
    _, full = _flat_state(0, 1)
    assert torch.equal(target["a"], full["a"]) and torch.equal(target["b"], full["b"])


def _model_and_optimizer(seed: int, hybrid: bool):
    from offload_fsdp import HybridDeviceOptimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if hybrid:
        opt = HybridDeviceOptimizer(opt, offload_fraction=1.0)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("hybrid", [False, True], ids=["AdamW", "HybridDeviceOptimizer"])
def test_a_model_and_optimizer_saved_async_to_s3_resume_bit_exact(s3_bucket, hybrid):
    model, opt = _model_and_optimizer(0, hybrid)
    url = f"{s3_bucket}/train/step1"
    checkpoint.async_save(url, model=model, optimizer=opt, extra={"step": 1}).result(timeout=120)
    model2, opt2 = _model_and_optimizer(1, hybrid)
    extra = checkpoint.load(url, model=model2, optimizer=opt2)
    assert extra["step"] == 1
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    # one more identical step on both: the resumed optimizer state is the saved one, bit for bit
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(torch.ones(4, 6)).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_a_flipped_byte_or_a_truncated_object_is_an_error_naming_the_object(s3_bucket):
    import fsspec

    url = f"{s3_bucket}/flip/ck"
    checkpoint.save_state_dict({"w": torch.randn(64)}, url)
    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    data_file = next(p for p in fs.find(root) if p.endswith(".distcp"))
    raw = bytearray(fs.cat_file(data_file))
    raw[-100] ^= 0xFF  # inside the tensor's bytes
    fs.pipe_file(data_file, bytes(raw))
    with pytest.raises(checkpoint.CheckpointCorruptError, match=f"s3://{data_file}.*CRC-32"):
        checkpoint.load_state_dict({"w": torch.zeros(64)}, url)
    fs.pipe_file(data_file, bytes(raw[:-10]))  # truncated
    with pytest.raises(checkpoint.CheckpointCorruptError, match=f"s3://{data_file}.*truncated"):
        checkpoint.load_state_dict({"w": torch.zeros(64)}, url)


def test_a_missing_bucket_is_a_clear_error_and_storage_options_win_over_the_variables(
    s3_bucket, s3_server, monkeypatch
):
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket-x' .* does not exist"):
        checkpoint.save_state_dict({"w": torch.ones(2)}, "s3://no-such-bucket-x/ck")
    url = f"{s3_bucket}/creds/ck"
    checkpoint.save_state_dict({"w": torch.ones(2)}, url)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load_state_dict({"w": torch.ones(2)}, f"{s3_bucket}/creds/absent")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    target = {"w": torch.zeros(2)}
    checkpoint.load_state_dict(target, url, storage_options={"endpoint_url": s3_server})
    assert torch.equal(target["w"], torch.ones(2))


def test_wrong_credentials_are_a_clear_permission_error(monkeypatch):
    from tests.s3_server import authenticating_server, make_bucket

    server, env = authenticating_server()
    try:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        url = f"s3://{make_bucket(server.endpoint, env)}/ck"
        checkpoint.save_state_dict({"w": torch.ones(2)}, url)  # the right keys work
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(PermissionError, match=f"{url}.*AWS_SECRET_ACCESS_KEY"):
            checkpoint.load_state_dict({"w": torch.zeros(2)}, url)
        with pytest.raises(PermissionError, match="AWS_ACCESS_KEY_ID"):
            checkpoint.save_state_dict({"w": torch.ones(2)}, url)
    finally:
        server.stop()


def test_a_second_save_committing_first_wins_and_the_other_fails_clearly_without_mixing(s3_bucket, monkeypatch):
    import threading

    import checkpoint.storage as storage_module
    from checkpoint.object_commit import ConcurrentSaveError

    url = f"{s3_bucket}/race/ck"
    checkpoint.save_state_dict({"w": torch.zeros(8), "x": torch.zeros(3)}, url)
    real_write = storage_module.write_tensor
    started = []

    def write_then_let_another_save_commit(stream, tensor):
        if not started:  # once, while the first save is writing its data
            started.append(True)
            other = threading.Thread(
                target=checkpoint.save_state_dict, args=({"w": torch.full((8,), 2.0), "x": torch.full((3,), 2.0)}, url)
            )
            other.start()
            other.join()
        real_write(stream, tensor)

    monkeypatch.setattr(storage_module, "write_tensor", write_then_let_another_save_commit)
    with pytest.raises(ConcurrentSaveError, match="another save committed"):
        checkpoint.save_state_dict({"w": torch.ones(8), "x": torch.ones(3)}, url)
    monkeypatch.setattr(storage_module, "write_tensor", real_write)
    target = {"w": torch.zeros(8), "x": torch.zeros(3)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((8,), 2.0)) and torch.equal(target["x"], torch.full((3,), 2.0))
    assert len([n for n in _objects(url) if n.endswith("manifest.json")]) == 1  # the loser's objects are gone


def _stop_here(ready) -> None:
    ready.put("ready")
    time.sleep(600)  # killed here


def _killed_saver(point: str, url: str, env: dict, ready) -> None:
    """Save to ``url``, stopping for good at ``point`` (the test kills this process there)."""
    import checkpoint.object_commit as object_commit
    import checkpoint.storage as storage_module

    apply(env)
    if point == "data":
        real = storage_module.write_tensor

        def write(stream, tensor):
            real(stream, tensor)
            _stop_here(ready)

        storage_module.write_tensor = write
    elif point == "head":
        object_commit.ObjectCommit.publish = lambda self, staged: _stop_here(ready)
    elif point == "cleanup":
        object_commit.remove_replaced = lambda *args, **kwargs: _stop_here(ready)
    checkpoint.save_state_dict({"w": torch.full((16,), 2.0)}, url)


@pytest.mark.parametrize("point", ["data", "head", "cleanup"])
def test_a_save_killed_at_any_point_leaves_the_old_or_the_new_checkpoint_whole_and_the_next_save_cleans_up(
    s3_bucket, s3_server, point
):
    url = f"{s3_bucket}/kill/ck"
    checkpoint.save_state_dict({"w": torch.full((16,), 1.0)}, url)
    ready = PROCESSES.Queue()
    proc = PROCESSES.Process(target=_killed_saver, args=(point, url, environment(s3_server), ready))
    proc.start()
    try:
        assert ready.get(timeout=120) == "ready"
    finally:
        proc.kill()  # SIGKILL: no cleanup runs in the saver
        proc.join()
    target = {"w": torch.zeros(16)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((16,), 2.0 if point == "cleanup" else 1.0))
    assert checkpoint.latest(f"{s3_bucket}/kill") is not None
    checkpoint.save_state_dict({"w": torch.full((16,), 3.0)}, url)
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((16,), 3.0))
    saves = {n.split("/")[0] for n in _objects(url) if n.startswith("fsdp-save-")}
    assert len(saves) == 1  # the killed save's objects and the replaced save are gone


def test_a_server_that_goes_away_mid_save_is_a_clear_error_and_no_hang(tmp_path, monkeypatch):
    import time

    import checkpoint.storage as storage_module
    from tests.s3_server import MotoServer, make_bucket

    server = MotoServer()
    try:
        for name, value in environment(server.endpoint).items():
            monkeypatch.setenv(name, value)
        url = f"s3://{make_bucket(server.endpoint)}/gone/ck"
        real_write = storage_module.write_tensor

        def write_then_lose_the_server(stream, tensor):
            server.stop()
            real_write(stream, tensor)

        monkeypatch.setattr(storage_module, "write_tensor", write_then_lose_the_server)
        start = time.monotonic()
        with pytest.raises(OSError, match="did not answer|Connect|connect"):
            checkpoint.save_state_dict({"w": torch.randn(1 << 20)}, url)  # 4 MiB: at least one part goes out
        assert time.monotonic() - start < 120
    finally:
        server.stop()


def test_latest_and_keep_last_see_only_committed_checkpoints_and_leave_user_objects(s3_bucket):
    import fsspec

    root = f"{s3_bucket}/ret"
    fs, key = fsspec.core.url_to_fs(root, use_listings_cache=False)
    fs.pipe_file(f"{key}/notes.txt", b"mine")
    fs.pipe_file(f"{key}/step9/fsdp-save-00000001-0123456789ab/.fsdp-ckpt-owned", b"partial")  # a killed save
    assert checkpoint.latest(root) is None
    for step in range(1, 4):
        checkpoint.save_state_dict({"w": torch.full((4,), float(step))}, f"{root}/step{step}", keep_last=2)
    assert str(checkpoint.latest(root)) == f"{root}/step3"
    assert [p.name for p in checkpoint.committed_checkpoints(root)] == ["step2", "step3"]
    assert fs.cat_file(f"{key}/notes.txt") == b"mine"
    assert fs.exists(f"{key}/step9/fsdp-save-00000001-0123456789ab/.fsdp-ckpt-owned")  # not committed: not counted
    with pytest.raises(FileNotFoundError):
        checkpoint.load_state_dict({"w": torch.zeros(4)}, f"{root}/step1")


def test_latest_and_keep_last_on_local_paths(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for step in range(1, 4):
        checkpoint.save_state_dict({"w": torch.full((4,), float(step))}, tmp_path / f"step{step}", keep_last=1)
    assert checkpoint.latest(tmp_path) == tmp_path / "step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "step3"]
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.retain(tmp_path, keep_last=0)


def _coarse_clock(root, names, *, when=1_700_000_000, drop_commit_time=False):
    """Give the heads of ``names`` under ``root`` one whole-second modification time, as an object store's
    LastModified does for commits within one second; optionally strip the head's own commit time (heads
    written before it was recorded)."""
    import json

    for name in names:
        head = root / name / HEAD_NAME
        if drop_commit_time:
            fields = json.loads(head.read_text())
            del fields["committed_ns"]
            head.write_text(json.dumps(fields))
        os.utime(head, (when, when))


def test_latest_and_keep_last_order_commits_within_one_second_by_the_heads_commit_time(tmp_path):
    root = tmp_path / "nfs"
    checkpoint.mount(root, checkpoint.SharedFileSystemStorage())  # the head protocol, as on an object store
    try:
        for step in (9, 10):  # "step10" sorts before "step9" by name: the name must not decide
            checkpoint.save_state_dict({"w": torch.full((4,), float(step))}, root / f"step{step}")
        _coarse_clock(root, ["step9", "step10"])
        assert checkpoint.latest(root) == root / "step10"
        assert checkpoint.retain(root, keep_last=1) == [root / "step9"]
        loaded = {"w": torch.zeros(4)}
        checkpoint.load_state_dict(loaded, checkpoint.latest(root))
        assert torch.equal(loaded["w"], torch.full((4,), 10.0))
    finally:
        checkpoint.unmount(root)


def test_keep_last_deletes_nothing_whose_order_against_a_kept_checkpoint_is_unknown(tmp_path, caplog):
    root = tmp_path / "nfs"
    checkpoint.mount(root, checkpoint.SharedFileSystemStorage())
    try:
        for step in (8, 9, 10):
            checkpoint.save_state_dict({"w": torch.full((4,), float(step))}, root / f"step{step}")
        _coarse_clock(root, ["step8"], when=1_600_000_000, drop_commit_time=True)  # older than both below
        _coarse_clock(root, ["step9", "step10"], drop_commit_time=True)  # same second, no finer record
        with caplog.at_level(logging.WARNING, logger="checkpoint.retention"):
            newest = checkpoint.latest(root)
            deleted = checkpoint.retain(root, keep_last=1)
        assert newest in (root / "step9", root / "step10")
        assert "same time" in caplog.text and "step10" in caplog.text and "step9" in caplog.text
        assert deleted == [root / "step8"]  # "step10" sorts before "step9": by name alone it would go
        assert (root / "step9").exists() and (root / "step10").exists()
    finally:
        checkpoint.unmount(root)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_dcp_save_and_load_through_our_storage_classes_write_a_checkpoint_checkpoint_load_reads(
    where, tmp_path, request
):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ck") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/dcp/ck"
    state = {"w": torch.randn(4, 3), "b": torch.arange(5), "step": 9}
    dcp.save(state, storage_writer=checkpoint.FsdpStorageWriter(path), no_dist=True)
    dcp.save({**state, "w": state["w"] * 2}, storage_writer=checkpoint.FsdpStorageWriter(path), no_dist=True)
    target = {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64), "step": None}
    checkpoint.load_state_dict(target, path)  # our reader, all checks
    assert torch.equal(target["w"], state["w"] * 2) and torch.equal(target["b"], state["b"]) and target["step"] == 9
    again = {"w": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}
    dcp.load(again, storage_reader=checkpoint.FsdpStorageReader(path), no_dist=True)
    assert torch.equal(again["w"], state["w"] * 2)


def test_every_cli_command_reads_s3_and_writes_local_and_reshard_writes_s3(s3_bucket, tmp_path, cli):
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}, "extra": {"step": 5}}
    url = f"{s3_bucket}/cli/ck"
    checkpoint.save_state_dict(state, url)
    assert "model.w" in cli("inspect", url).stdout
    cli("verify", url)
    cli("reshard", url, str(tmp_path / "local"), "--world-size", "3")
    cli("diff", url, str(tmp_path / "local"))
    cli("export", url, str(tmp_path / "hf"), "--format", "safetensors")
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "hf").iterdir())
    cli("reshard", str(tmp_path / "local"), f"{s3_bucket}/cli/back", "--world-size", "2")  # local -> s3
    cli("diff", url, f"{s3_bucket}/cli/back")
    target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "extra": {"step": None}}
    checkpoint.load_state_dict(target, f"{s3_bucket}/cli/back")
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["extra"]["step"] == 5
    assert "0 unfinished" in cli("gc", url).stdout
    bad = cli("inspect", "nosuch://bucket/ck", check=2)
    assert "unsupported URL scheme" in bad.stderr
    assert not (Path.cwd() / "s3:").exists()


def test_export_writes_to_s3_and_import_reads_from_s3_bit_exact(s3_bucket, tmp_path, cli, monkeypatch):
    import tempfile

    from safetensors.torch import load_file, save_file

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the local stand-ins, checked below to be gone
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4)}, "extra": {"step": 5}}
    url = f"{s3_bucket}/cli/ck"
    checkpoint.save_state_dict(state, url)
    cli("export", url, f"{s3_bucket}/hf", "--format", "safetensors", "--model-only", "--max-shard-size", "64")
    names = _objects(f"{s3_bucket}/hf")
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    for name in names[:2]:  # read back with safetensors itself
        cli_copy = tmp_path / name
        cli_copy.write_bytes(_read(f"{s3_bucket}/hf/{name}"))
        for key, value in load_file(cli_copy).items():
            assert torch.equal(value, state["model"][key])
    assert "already exists" in cli("export", url, f"{s3_bucket}/hf", "--format", "safetensors", check=2).stderr
    cli("export", url, f"{s3_bucket}/ck.pt", "--format", "torch")
    (tmp_path / "ck.pt").write_bytes(_read(f"{s3_bucket}/ck.pt"))
    loaded = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert torch.equal(loaded["model.w"], state["model"]["w"]) and loaded["extra.step"] == 5

    # import: an HF directory at a URL, and one safetensors file at a URL
    cli("import", f"{s3_bucket}/hf", str(tmp_path / "from_dir"))
    save_file({"w": state["model"]["w"]}, tmp_path / "one.safetensors")
    _write(f"{s3_bucket}/single/one.safetensors", (tmp_path / "one.safetensors").read_bytes())
    cli("import", f"{s3_bucket}/single/one.safetensors", f"{s3_bucket}/from_file", "--world-size", "2")
    for where in (str(tmp_path / "from_dir"), f"{s3_bucket}/from_file"):
        target = {"model": {"w": torch.zeros(6, 4)}}
        checkpoint.load_state_dict(target, where, strict=False)
        assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert "does not exist" in cli("import", f"{s3_bucket}/nothing", str(tmp_path / "x"), check=2).stderr
    assert [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("fsdp-ckpt-")] == []  # stand-ins removed


def _read(url: str) -> bytes:
    import fsspec

    fs, key = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return fs.cat_file(key)


def _write(url: str, data: bytes) -> None:
    import fsspec

    fs, key = fsspec.core.url_to_fs(url, use_listings_cache=False)
    fs.pipe_file(key, data)


def test_a_shared_file_system_mount_saves_by_the_object_store_protocol_without_renames(tmp_path):
    root = tmp_path / "nfs"
    checkpoint.mount(root, checkpoint.SharedFileSystemStorage())
    try:
        for step in (1, 2):
            checkpoint.save_state_dict({"w": torch.full((3,), float(step))}, root / "ck")
        target = {"w": torch.zeros(3)}
        checkpoint.load_state_dict(target, root / "ck")
    finally:
        checkpoint.unmount(root)
    assert torch.equal(target["w"], torch.full((3,), 2.0))
    names = sorted(p.name for p in (root / "ck").iterdir())
    assert names[0] == HEAD_NAME and len(names) == 2 and names[1].startswith("fsdp-save-00000002-")
    assert sorted(p.name for p in root.iterdir()) == ["ck"]  # no staging, swap or lock names beside it


def test_gc_and_retention_wait_for_an_async_save_in_flight_and_delete_nothing_it_writes(s3_bucket, monkeypatch):
    import logging
    import threading

    import checkpoint.storage as storage_module
    from checkpoint.async_save import async_save_state_dict

    root = f"{s3_bucket}/inflight"
    url = f"{root}/ck"
    # saved first and named first: the older one even where commit times tie (S3 keeps whole seconds)
    checkpoint.save_state_dict({"w": torch.full((8,), 1.0)}, f"{root}/a-old")
    checkpoint.save_state_dict({"w": torch.full((8,), 1.0)}, url)
    writing, release = threading.Event(), threading.Event()
    real_write = storage_module.write_tensor

    def write_when_released(stream, tensor):
        writing.set()  # the save directory and its marker exist, not yet named by the head
        release.wait(timeout=120)
        real_write(stream, tensor)

    monkeypatch.setattr(storage_module, "write_tensor", write_when_released)
    waited = {}

    class Waits(logging.Handler):
        def emit(self, record):
            waited[record.getMessage().rsplit("before ", 1)[-1]] = threading.current_thread().name

    handler = Waits(level=logging.WARNING)
    logging.getLogger("checkpoint.async_save").addHandler(handler)
    try:
        future = async_save_state_dict({"w": torch.full((8,), 2.0)}, url)
        assert writing.wait(timeout=120)
        results = {}
        gc = threading.Thread(target=lambda: results.update(gc=checkpoint.collect_garbage(url)), name="gc")
        keep = threading.Thread(target=lambda: results.update(kept=checkpoint.retain(root, keep_last=1)), name="keep")
        for thread in (gc, keep):
            thread.start()
        # each one either says it waits, or (the bug) runs to its end while the save is held mid-write
        while not (len(waited) == 2 or not gc.is_alive() or not keep.is_alive()):
            time.sleep(0.01)
        assert waited == {"gc removes unfinished saves": "gc", "retention deletes old checkpoints": "keep"}
        release.set()
        future.result(timeout=120)
        gc.join(timeout=120)
        keep.join(timeout=120)
    finally:
        release.set()
        logging.getLogger("checkpoint.async_save").removeHandler(handler)
    target = {"w": torch.zeros(8)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((8,), 2.0))
    assert results["gc"] == [] and [str(p) for p in results["kept"]] == [f"{root}/a-old"]


class _WatchedFileSystem:
    """The storage's own fsspec file system, counting the ranged GETs of data objects in flight at once (and
    their bytes); the first two meet at a barrier, so a reader that fetches one at a time fails here."""

    def __init__(self, fs, *, meet: bool = True) -> None:
        import threading

        self._fs = fs
        self._lock = threading.Lock()
        self._meet = threading.Barrier(2, timeout=60) if meet else None
        self.calls = self.active = self.most = self.active_bytes = self.most_bytes = self.total_bytes = 0

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def cat_file(self, path, start=None, end=None, **kwargs):
        if not str(path).endswith(".distcp"):
            return self._fs.cat_file(path, start=start, end=end, **kwargs)
        with self._lock:
            self.calls += 1
            first_two = self.calls <= 2 and self._meet is not None
            self.total_bytes += end - start
            self.active += 1
            self.active_bytes += end - start
            self.most, self.most_bytes = max(self.most, self.active), max(self.most_bytes, self.active_bytes)
        try:
            if first_two:
                self._meet.wait()  # type: ignore[union-attr]
            return self._fs.cat_file(path, start=start, end=end, **kwargs)
        finally:
            with self._lock:
                self.active -= 1
                self.active_bytes -= end - start


@pytest.mark.parametrize("max_read_bytes", [(5 << 20) // 2, None], ids=["capped", "uncapped"])
def test_a_load_fetches_ranges_in_parallel_within_max_read_bytes_and_exactly(s3_bucket, monkeypatch, max_read_bytes):
    from checkpoint.storage_backend import locate

    state = {f"w{i}": torch.randn(1 << 18) for i in range(6)}  # 1 MiB each
    state["small"] = torch.arange(7)
    url = f"{s3_bucket}/parallel/ck"
    checkpoint.save_state_dict(state, url)
    store = locate(url).storage
    watched = _WatchedFileSystem(store.fs)
    monkeypatch.setattr(store, "fs", watched)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    checkpoint.load_state_dict(target, url, max_read_bytes=max_read_bytes)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert watched.most >= 2
    if max_read_bytes is not None:
        assert watched.most_bytes <= max_read_bytes


def test_a_load_of_part_of_a_chunk_from_s3_gets_only_the_bytes_it_needs(s3_bucket, monkeypatch):
    from checkpoint.storage_backend import locate

    full = torch.randn(64, 4096)  # 1 MiB, one chunk
    url = f"{s3_bucket}/part/ck"
    checkpoint.save_state_dict({"w": full}, url)
    store = locate(url).storage
    watched = _WatchedFileSystem(store.fs, meet=False)
    monkeypatch.setattr(store, "fs", watched)
    rows = checkpoint.shard(torch.zeros(8, 4096), (64, 4096), offsets=(40, 0))  # 8 of its 64 rows (128 KiB)
    # verify="sizes": the default ("crc") also reads the rest of the object, to check its CRC-32
    checkpoint.load_state_dict({"w": rows}, url, verify="sizes")
    assert torch.equal(rows.local, full[40:48])
    assert 8 * 4096 * 4 <= watched.total_bytes < 8 * 4096 * 4 + (16 << 10)  # those rows and the archive's directory


_WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # an import of it fails as if it were not installed
import torch, checkpoint
try:
    checkpoint.save_state_dict({"w": torch.ones(2)}, "s3://bucket/ck")
except ImportError as exc:
    print(exc)
    raise SystemExit(3)
"""


@pytest.mark.parametrize("missing", ["s3fs", "fsspec,s3fs"])
def test_an_s3_url_without_the_s3_extra_is_an_import_error_naming_the_extra(tmp_path, missing):
    import subprocess
    import sys

    from tests.cli import REPO

    # a fresh interpreter without the module: this one has it imported already
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT, missing],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr
    assert "pip install 'offload-fsdp[s3]'" in proc.stdout
    assert os.listdir(tmp_path) == []  # nothing written locally


def _held_save(path: str, env: dict, value: float, told, go) -> None:
    """Save ``value`` to ``path`` from another process, stopped just before its commit (every object written)
    until ``go`` is set; exit 0 when it committed, 3 after putting its error on ``told``."""
    import checkpoint.object_commit as object_commit

    apply(env)
    for protocol in (object_commit.ObjectCommit, object_commit.RenameCommit):

        def publish(self, staged, real=protocol.publish):
            told.put("committing")
            go.wait(timeout=300)
            real(self, staged)

        protocol.publish = publish
    try:
        checkpoint.save_state_dict({"w": torch.full((16,), value)}, path)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        told.put(f"{type(exc).__name__}: {exc}")
        told.close()
        told.join_thread()
        os._exit(3)
    os._exit(0)


class _HeldSaver:
    def __init__(self, path: str, env: dict, value: float) -> None:
        self.told, self.go = PROCESSES.Queue(), PROCESSES.Event()
        self.proc = PROCESSES.Process(target=_held_save, args=(path, env, value, self.told, self.go))
        self.proc.start()
        assert self.told.get(timeout=300) == "committing"  # its objects are all written, the head is not

    def outcome(self) -> str:
        self.go.set()
        self.proc.join(timeout=300)
        return "ok" if self.proc.exitcode == 0 else self.told.get(timeout=10)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_gc_from_another_process_deletes_nothing_of_a_save_in_flight_and_removes_it_once_its_saver_is_killed(
    where, s3_server, tmp_path, cli, request
):
    url = f"{request.getfixturevalue('s3_bucket')}/lease/ck" if where == "s3" else str(tmp_path / "ck")
    env = environment(s3_server)
    checkpoint.save_state_dict({"w": torch.full((16,), 1.0)}, url)
    saver = _HeldSaver(url, env, 2.0)
    try:
        assert "0 unfinished save(s) removed" in cli("gc", url).stdout  # this test's process is not the saver's
    finally:
        outcome = saver.outcome()
    assert outcome == "ok"
    target = {"w": torch.zeros(16)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((16,), 2.0))

    killed = _HeldSaver(url, env, 3.0)
    killed.proc.kill()  # SIGKILL at that point: its lease (or lock) dies with it
    killed.proc.join()
    assert "1 unfinished save(s) removed" in cli("gc", url).stdout
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((16,), 2.0))
    if where == "s3":
        assert len({n.split("/")[0] for n in _objects(url) if n.startswith("fsdp-save-")}) == 1


def test_gc_keeps_a_save_whose_lease_another_host_renewed_lately_and_removes_a_stale_one(s3_bucket, cli):
    import json

    from checkpoint.object_commit import LEASE_S

    url = f"{s3_bucket}/hosts/ck"
    checkpoint.save_state_dict({"w": torch.full((4,), 1.0)}, url)
    now = time.time_ns()
    for name, renewed in (("fsdp-save-00000002-00000000000a", now), ("fsdp-save-00000002-00000000000b", 0)):
        lease = {"save": name, "pid": 1, "host": "another-host", "renewed_ns": renewed, "lease_s": LEASE_S}
        _write(f"{url}/{name}/.fsdp-ckpt-owned", json.dumps(lease).encode())
        _write(f"{url}/{name}/__0_0.distcp", b"being written")
    assert "1 unfinished save(s) removed" in cli("gc", url).stdout
    assert [n for n in _objects(url) if n.startswith("fsdp-save-00000002-")] == [
        "fsdp-save-00000002-00000000000a/.fsdp-ckpt-owned",
        "fsdp-save-00000002-00000000000a/__0_0.distcp",
    ]
    assert "1 unfinished save(s) removed" in cli("gc", url, "--force").stdout  # no save runs: the user says so
    target = {"w": torch.zeros(4)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((4,), 1.0))


class _Requests:
    """The S3 requests the storage of ``url`` sends while in use, as (operation, key): botocore's own
    ``before-parameter-build`` event on s3fs's client, so every request on the wire is seen, whichever call made it."""

    def __init__(self, url: str) -> None:
        from checkpoint.storage_backend import locate

        self.client = locate(url).storage.fs.s3  # connected by a save before
        self.sent: list[tuple[str, str]] = []

    def _seen(self, model, params, **kwargs) -> None:
        self.sent.append((model.name, params.get("Key", "")))

    def __enter__(self) -> list[tuple[str, str]]:
        self.client.meta.events.register("before-parameter-build.s3", self._seen, unique_id="test-requests")
        return self.sent

    def __exit__(self, *exc) -> None:
        self.client.meta.events.unregister("before-parameter-build.s3", unique_id="test-requests")


def test_a_first_save_to_s3_looks_up_only_one_listing_and_the_head_and_writes_each_object_once(s3_bucket):
    from collections import Counter

    state = {"w": torch.randn(64), "b": torch.arange(5)}
    checkpoint.save_state_dict(state, f"{s3_bucket}/warm/ck")  # the client connects, the bucket is checked
    with _Requests(s3_bucket) as sent:
        checkpoint.save_state_dict(state, f"{s3_bucket}/first/ck")
    ops = Counter(op for op, _ in sent)
    assert ops["ListObjectsV2"] == 1 and ops["GetObject"] == 1 and ops["HeadObject"] == 0, sent
    puts = [key for op, key in sent if op == "PutObject"]
    assert len(puts) == len(set(puts)) == len(_objects(f"{s3_bucket}/first/ck")), sent


def test_a_load_from_s3_opens_each_object_once(s3_bucket):
    from collections import Counter

    state = {"w": torch.randn(64), "b": torch.arange(5), "extra": {"step": 3}}
    url = f"{s3_bucket}/once/ck"
    checkpoint.save_state_dict(state, url)
    target = {"w": torch.zeros(64), "b": torch.zeros(5, dtype=torch.int64), "extra": {"step": None}}
    with _Requests(url) as sent:
        checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], state["w"]) and target["extra"]["step"] == 3
    looked_up = Counter(key for op, key in sent if op == "HeadObject")
    assert looked_up and max(looked_up.values()) == 1, sent
    assert "ListObjectsV2" not in {op for op, _ in sent}, sent


def test_retention_from_another_process_deletes_nothing_of_a_save_in_flight(s3_bucket, s3_server):
    root = f"{s3_bucket}/keep"
    checkpoint.save_state_dict({"w": torch.full((16,), 1.0)}, f"{root}/a")
    checkpoint.save_state_dict({"w": torch.full((16,), 1.0)}, f"{root}/b")  # committed later: "a" is the oldest
    saver = _HeldSaver(f"{root}/a", environment(s3_server), 2.0)
    try:
        in_flight = [n for n in _objects(f"{root}/a") if n.startswith("fsdp-save-00000002-")]
        assert [p.name for p in checkpoint.retain(root, keep_last=1)] == ["a"]  # its committed save is gone
        assert [n for n in _objects(f"{root}/a") if n.startswith("fsdp-save-00000002-")] == in_flight
    finally:
        outcome = saver.outcome()
    # the checkpoint it was replacing was deleted under it: it does not commit, says so, and removes its objects
    assert outcome.startswith("ConcurrentSaveError: another save committed"), outcome
    assert checkpoint.latest(root).name == "b" and not [n for n in _objects(root) if n.startswith("a/")]


def test_a_save_renews_its_lease_while_it_runs(s3_bucket, monkeypatch):
    import json
    import threading

    import checkpoint.object_commit as object_commit
    import checkpoint.storage as storage_module

    monkeypatch.setattr(object_commit, "LEASE_S", 0.6)  # renewed every 0.2 s
    url = f"{s3_bucket}/renew/ck"
    writing, release = threading.Event(), threading.Event()
    real_write = storage_module.write_tensor

    def write_when_released(stream, tensor):
        writing.set()
        release.wait(timeout=120)
        real_write(stream, tensor)

    monkeypatch.setattr(storage_module, "write_tensor", write_when_released)
    saving = threading.Thread(target=checkpoint.save_state_dict, args=({"w": torch.full((4,), 5.0)}, url))
    saving.start()
    try:
        assert writing.wait(timeout=120)
        (marker,) = [n for n in _objects(url) if n.endswith("/.fsdp-ckpt-owned")]
        first = json.loads(_read(f"{url}/{marker}"))["renewed_ns"]
        deadline = time.monotonic() + 120
        while json.loads(_read(f"{url}/{marker}"))["renewed_ns"] == first:  # until the renewal thread wrote it
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
    finally:
        release.set()
        saving.join(timeout=120)
    target = {"w": torch.zeros(4)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((4,), 5.0))


def _fsdp2_optimizer(model, hybrid: bool, lr: float):
    from offload_fsdp import HybridDeviceOptimizer

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return HybridDeviceOptimizer(opt, offload_fraction=1.0) if hybrid else opt


def _fsdp2_save_to_s3(rank: int, world_size: int, env: dict, url: str) -> dict:
    """FSDP2 on ``world_size`` ranks: train 2 steps, async save to S3 (then train on: not in the checkpoint);
    the states saved, gathered."""
    from tests.test_checkpoint_dist import _fsdp, _full_state, _net, _portable, _train

    apply(env)
    saved = {}
    for kind in ("adamw", "hybrid"):
        model = _fsdp(_net(0), world_size)
        opt = _fsdp2_optimizer(model, kind == "hybrid", 1e-2)
        _train(model, opt, [1, 2])
        saved[kind] = _portable(_full_state(model, opt))
        saving = checkpoint.async_save(f"{url}-{kind}", model=model, optimizer=opt, extra={"step": 2})
        _train(model, opt, [3])  # while the save runs: it wrote the staged state
        saving.result(timeout=120)
    return saved


def _fsdp2_load_from_s3(rank: int, world_size: int, env: dict, url: str, saved: dict) -> dict:
    from tests.test_checkpoint_dist import _fsdp, _mismatches, _net, _tensors

    apply(env)
    out = {}
    for kind in ("adamw", "hybrid"):
        model = _fsdp(_net(5), world_size)
        opt = _fsdp2_optimizer(model, kind == "hybrid", 0.3)
        extra = checkpoint.load(f"{url}-{kind}", model=model, optimizer=opt)
        lr = opt.param_groups[0]["lr"]  # the checkpoint's, not the 0.3 given here
        out[kind] = (extra["step"], lr, _mismatches(model, opt, _tensors(saved[kind])))
    return out


def test_fsdp2_with_adamw_and_hybrid_saved_async_to_s3_on_2_ranks_loads_bit_exact_on_3(s3_bucket, s3_server):
    url = f"{s3_bucket}/fsdp2/step2"
    env = environment(s3_server)
    saved = run_ranks(_fsdp2_save_to_s3, world_size=2, args=(env, url))[0]
    for result in run_ranks(_fsdp2_load_from_s3, world_size=3, args=(env, url, saved)):
        assert result == {"adamw": (2, 1e-2, []), "hybrid": (2, 1e-2, [])}


def test_two_processes_saving_to_one_s3_url_never_mix_and_the_later_committer_fails_clearly(s3_bucket, s3_server):
    url = f"{s3_bucket}/two/ck"
    checkpoint.save_state_dict({"w": torch.full((16,), 1.0)}, url)
    other = _HeldSaver(url, environment(s3_server), 2.0)  # every object written, about to commit
    try:
        checkpoint.save_state_dict({"w": torch.full((16,), 3.0)}, url)  # commits first (and cleans up)
    finally:
        outcome = other.outcome()
    assert outcome.startswith("ConcurrentSaveError: another save committed"), outcome
    target = {"w": torch.zeros(16)}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], torch.full((16,), 3.0))
    assert len({n.split("/")[0] for n in _objects(url) if n.startswith("fsdp-save-")}) == 1
