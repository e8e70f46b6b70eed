"""Where a save or a tool writes: ``..`` in the output path, and what the user keeps inside a checkpoint.

An output path is normalised once at the entry point (``sub/..`` is the directory it
resolves to); the current directory or one holding it is refused as ``.`` is, and
nothing is created anywhere. A save over a committed checkpoint that holds files
the checkpoint does not list (notes, a ``reshard`` output) is refused naming them:
the save replaces the whole directory and would delete them.
"""

import os
from pathlib import Path

import pytest
import torch

import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(value: float = 1.0) -> dict:
    return {"w": torch.full((4, 3), value), "b": torch.arange(5.0) * value}


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _users_folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    return root


@pytest.mark.parametrize("target", [".", "sub/..", "sub/../", "./sub/..", ".."])
def test_a_save_to_the_current_directory_by_any_spelling_is_refused_and_creates_nothing(tmp_path, target):
    user = _users_folder(tmp_path / "user")
    before = _tree(tmp_path)
    cwd = os.getcwd()
    os.chdir(user)
    try:
        with pytest.raises(ValueError, match=r"is the current directory or holds it.*name a directory of its own"):
            checkpoint.save_state_dict(_state(), target)
        with pytest.raises(ValueError, match=r"is the current directory or holds it"):
            checkpoint.async_save(target, extra={"step": 1})
    finally:
        os.chdir(cwd)
    assert _tree(tmp_path) == before


def test_a_save_to_a_path_ending_in_dotdot_writes_the_directory_it_names_and_nothing_inside_it(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1.0), ck)
    checkpoint.save_state_dict(_state(2.0), ck / "no_such_dir" / "..")  # is ck itself
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert not [n for n in os.listdir(ck) if "fsdp-ckpt" in n]
    got = _state(0.0)
    checkpoint.load_state_dict(got, ck)
    assert torch.equal(got["w"], _state(2.0)["w"])


def test_write_rank_and_commit_normalise_a_dotdot_path_too(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.write_rank(ck / "x" / "..", 0, 1, _state(3.0))
    checkpoint.commit(ck / "y" / "..", 1)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    got = _state(0.0)
    checkpoint.load_state_dict(got, ck)
    assert torch.equal(got["b"], _state(3.0)["b"])


@pytest.mark.parametrize("target", [".", "sub/.."])
def test_the_tool_refuses_an_output_that_resolves_to_the_current_directory_and_creates_nothing(
    cli, tmp_path, monkeypatch, target
):
    checkpoint.save_state_dict({"model": _state()}, tmp_path / "ck")
    user = _users_folder(tmp_path / "user")
    monkeypatch.chdir(user)
    before = _tree(tmp_path)
    for args in (
        ["export", tmp_path / "ck", target, "--format", "safetensors", "--force"],
        ["reshard", tmp_path / "ck", target, "--world-size", "2", "--force"],
    ):
        result = cli(*args, check=2)
        assert "is the current directory or holds it" in result.stderr and "Traceback" not in result.stderr
        assert _tree(tmp_path) == before


def test_the_tool_writes_a_dotdot_output_into_the_directory_it_names(cli, tmp_path):
    checkpoint.save_state_dict({"model": _state()}, tmp_path / "ck")
    cli("export", tmp_path / "ck", tmp_path / "hf" / "sub" / "..", "--format", "safetensors", "-q")
    assert sorted(os.listdir(tmp_path)) == ["ck", "hf"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]


def _committed_with_user_files(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1.0), ck)
    (ck / "NOTES.md").write_text("run 7: lr 3e-4")
    (ck / "analysis").mkdir()
    (ck / "analysis" / "loss.csv").write_text("1,2")
    return ck


def _assert_untouched(ck: Path) -> None:
    assert (ck / "NOTES.md").read_text() == "run 7: lr 3e-4" and (ck / "analysis" / "loss.csv").is_file()
    got = _state(0.0)
    checkpoint.load_state_dict(got, ck)
    assert torch.equal(got["w"], _state(1.0)["w"])
    assert not [n for n in os.listdir(ck.parent) if "fsdp-ckpt" in n]  # no staging or swap left behind


def test_a_save_over_a_checkpoint_holding_the_users_files_is_refused_naming_them(tmp_path):
    ck = _committed_with_user_files(tmp_path)
    with pytest.raises(FileExistsError, match=r"not part of the checkpoint \(NOTES\.md, analysis\).*move them out"):
        checkpoint.save_state_dict(_state(2.0), ck)
    with pytest.raises(FileExistsError, match=r"NOTES\.md"):
        checkpoint.save(ck, extra={"step": 2})
    _assert_untouched(ck)


def test_a_reshard_output_inside_a_checkpoint_blocks_the_next_save_over_it(cli, tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1.0), ck)
    cli("reshard", ck, ck / "sub", "--world-size", "2", "-q")
    with pytest.raises(FileExistsError, match=r"\(sub\)"):
        checkpoint.save_state_dict(_state(2.0), ck)
    got = _state(0.0)
    checkpoint.load_state_dict(got, ck / "sub")
    assert torch.equal(got["w"], _state(1.0)["w"])


def test_the_tool_refuses_to_replace_a_checkpoint_holding_the_users_files(cli, tmp_path):
    ck = _committed_with_user_files(tmp_path)
    checkpoint.save_state_dict(_state(5.0), tmp_path / "other")
    result = cli("reshard", tmp_path / "other", ck, "--world-size", "1", "--force", check=2)
    assert "NOTES.md" in result.stderr
    _assert_untouched(ck)


def test_a_checkpoint_with_a_damaged_manifest_and_only_its_own_files_can_still_be_replaced(tmp_path):
    ck = tmp_path / "ck"
    checkpoint.save_state_dict(_state(1.0), ck)
    (ck / "manifest.json").write_text("{not json")
    checkpoint.save_state_dict(_state(2.0), ck)
    got = _state(0.0)
    checkpoint.load_state_dict(got, ck)
    assert torch.equal(got["w"], _state(2.0)["w"])
