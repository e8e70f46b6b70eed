"""kill -9 at deterministic points of a save over an existing checkpoint: the path loads whole, the next save works."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import storage as storage_module
from checkpoint.atomic import staging_path
from tests.distributed import run_process


def _save_killing_itself_in_cleanup(path: str, kill_at: int) -> None:
    """Save ``new`` over the checkpoint at ``path`` and SIGKILL this process at the ``kill_at``-th file or directory
    removal made after the new checkpoint was renamed into place (the tail of the swap: the old copy's removal).
    Run in a process of its own: it patches ``os`` and the storage class."""
    from checkpoint import storage_backend

    torch.set_num_threads(1)
    state = {"swapped": False, "removals": 0}
    rename = storage_backend.LocalStorage.rename

    def tracking_rename(self, src, dst):
        rename(self, src, dst)
        state["swapped"] = state["swapped"] or os.path.abspath(dst) == os.path.abspath(path)

    def counting(original):
        def removal(*args, **kwargs):
            if state["swapped"]:
                state["removals"] += 1
                if state["removals"] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return removal

    storage_backend.LocalStorage.rename = tracking_rename
    for name in ("unlink", "rmdir"):
        setattr(os, name, counting(getattr(os, name)))
    checkpoint.save_state_dict({"w": torch.full((8, 4), 2.0), "b": torch.arange(5.0) * 2}, path)


def _save_killed_in_cleanup(path: Path, kill_at: int) -> bool:
    """Whether the child finished (``kill_at`` beyond the removals of the save); else it was killed there."""
    code = run_process(_save_killing_itself_in_cleanup, (str(path), kill_at), f"the save killed at removal {kill_at}")
    assert code in (0, -signal.SIGKILL), code  # else it raised: its traceback is on stderr
    return code == 0


@pytest.mark.slow
def test_a_kill_while_the_replaced_checkpoint_is_removed_leaves_the_new_one_and_the_next_save_works(tmp_path):
    old = {"w": torch.full((8, 4), 1.0), "b": torch.arange(5.0)}
    new = {"w": torch.full((8, 4), 2.0), "b": torch.arange(5.0) * 2}
    after = {"w": torch.full((8, 4), 3.0), "b": torch.arange(5.0) * 3}
    kill_at, finished = 1, False
    while not finished:
        path = tmp_path / f"k{kill_at}" / "ck"
        checkpoint.save_state_dict(old, path)
        finished = _save_killed_in_cleanup(path, kill_at)
        got = {"w": torch.zeros(8, 4), "b": torch.zeros(5)}
        checkpoint.load_state_dict(got, path, no_dist=True)
        assert torch.equal(got["w"], new["w"]) and torch.equal(got["b"], new["b"]), kill_at
        # The leftover of the killed removal must not block the next save (it is ours, and removed by it).
        checkpoint.save_state_dict(after, path)
        checkpoint.load_state_dict(got, path, no_dist=True)
        assert torch.equal(got["w"], after["w"]) and torch.equal(got["b"], after["b"]), kill_at
        assert sorted(os.listdir(path.parent)) == ["ck"], kill_at
        kill_at += 1
    assert kill_at > 4  # the marker's removal from the new checkpoint, then each file of the old one and its dir


def test_a_rank_whose_rewrite_failed_is_not_committed_from_its_record_of_an_earlier_uncommitted_save(
    tmp_path, monkeypatch
):
    path = tmp_path / "ck"
    checkpoint.save_state_dict({"w": torch.full((8, 3), 9.0)}, path)  # the committed checkpoint to keep

    def part(rank: int, value: float) -> dict:
        return {"w": checkpoint.shard(torch.full((4, 3), value), (8, 3), offsets=(4 * rank, 0))}

    checkpoint.write_rank(path, 0, 2, part(0, 1.0))
    checkpoint.write_rank(path, 1, 2, part(1, 1.0))  # a save written whole but never committed
    checkpoint.write_rank(path, 0, 2, part(0, 2.0))  # the next one: rank 1's rewrite fails

    def failing_write(*args, **kwargs):
        raise OSError("rank 1's write failed")

    monkeypatch.setattr(storage_module, "write_tensor", failing_write)
    with pytest.raises(OSError, match="rank 1's write failed"):
        checkpoint.write_rank(path, 1, 2, part(1, 2.0))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="rank 1 did not finish writing"):
        checkpoint.commit(path, 2)
    got = {"w": torch.zeros(8, 3)}
    checkpoint.load_state_dict(got, path, no_dist=True)
    assert torch.equal(got["w"], torch.full((8, 3), 9.0))  # the committed checkpoint is untouched


def test_commit_refuses_a_rank_record_naming_a_file_outside_the_checkpoint_and_keeps_the_previous_one(tmp_path):
    path = tmp_path / "ck"
    checkpoint.save_state_dict({"w": torch.full((8, 3), 9.0)}, path)
    for rank in range(2):
        local = torch.full((4, 3), 1.0)
        checkpoint.write_rank(path, rank, 2, {"w": checkpoint.shard(local, (8, 3), offsets=(4 * rank, 0))})
    record_path = staging_path(path) / "__1.rank.json"
    record = json.loads(record_path.read_text())
    for chunk in record["tensors"]["w"]["chunks"]:
        chunk[2] = "../elsewhere"  # a tampered record: its manifest would be refused by every reader
    record["files"] = {"../elsewhere": [10, 0]}
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"__1\.rank\.json is not a valid rank record: file '\.\./elsewhere'"):
        checkpoint.commit(path, 2)
    got = {"w": torch.zeros(8, 3)}
    checkpoint.load_state_dict(got, path, no_dist=True)
    assert torch.equal(got["w"], torch.full((8, 3), 9.0))


def test_a_link_at_the_lock_name_is_refused_and_nothing_is_created_where_it_points(tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / ".ck.fsdp-ckpt-lock").symlink_to(tmp_path / "user" / "would_be_created")
    with pytest.raises(FileExistsError, match=r"\.ck\.fsdp-ckpt-lock.*symbolic link"):
        checkpoint.save_state_dict({"w": torch.ones(3)}, tmp_path / "ck")
    assert os.listdir(tmp_path / "user") == [] and not (tmp_path / "ck").exists()
    assert (tmp_path / ".ck.fsdp-ckpt-lock").is_symlink()
