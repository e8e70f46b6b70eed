"""fsdp-ckpt in process (the ``cli`` fixture): inspect, verify, export, import, reshard, split/merge, diff;
under ``torchrun`` as real processes.

The source checkpoint is written at 2 ranks by the format's own single-process
writer (``checkpoint.write_rank`` + ``checkpoint.commit``) with row blocks, an
uneven split, a flat-range shard and an empty shard; the reference is the
plain dict of full tensors it was cut from.
"""

import json
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint
from checkpoint.tool.stream import CheckpointReader
from tests.distributed import run_ranks

FC1 = "layers.0.mlp.linear_fc1.weight"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _reference() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        f"model.{FC1}": torch.randn(6, 4, generator=g),
        "model.emb.weight": torch.randn(5, 3, generator=g),
        "model.tiny": torch.randn(1, 4, generator=g),
        "model.norm": torch.randn(4, generator=g).bfloat16(),
        f"optimizer.state.{FC1}.exp_avg": torch.randn(6, 4, generator=g),
        f"optimizer.state.{FC1}.step": torch.tensor(3.0),
        f"optimizer.param_groups.{FC1}.lr": 0.01,
        "extra.step": 7,
    }


def _rank_state(ref: dict, rank: int) -> dict:
    """Rank ``rank``'s part of ``ref`` at world size 2 (uneven rows, a flat range, an empty shard)."""
    rows = (0, 4) if rank == 0 else (4, 6)
    out = {}
    for key in (f"model.{FC1}", f"optimizer.state.{FC1}.exp_avg"):
        out[key] = checkpoint.shard(ref[key][rows[0] : rows[1]].clone(), (6, 4), offsets=(rows[0], 0))
    flat = ref["model.emb.weight"].reshape(-1)
    start, end = (0, 7) if rank == 0 else (7, 15)
    out["model.emb.weight"] = checkpoint.shard(flat[start:end].clone(), (5, 3), flat_start=start)
    tiny = ref["model.tiny"] if rank == 0 else ref["model.tiny"][1:]  # rank 1: no rows at all
    out["model.tiny"] = checkpoint.shard(tiny.clone(), (1, 4), offsets=(rank, 0))
    out["model.norm"] = checkpoint.shard(ref["model.norm"][2 * rank : 2 * rank + 2].clone(), (4,), offsets=(2 * rank,))
    for key in (f"optimizer.state.{FC1}.step", f"optimizer.param_groups.{FC1}.lr", "extra.step"):
        out[key] = ref[key]  # replicas: written once
    return out


def _write(path, ref: dict) -> None:
    for rank in range(2):
        checkpoint.write_rank(path, rank, 2, _rank_state(ref, rank))
    checkpoint.commit(path, 2)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "src"
    _write(path, _reference())
    return path


def _load_full(path, keys: dict) -> dict:
    """Plain DCP, single process: every key as a full tensor (the reader every tool has)."""
    state = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in keys.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
        else:
            assert got[key] == value, key


def test_inspect_json_reports_keys_shapes_chunks_world_size_and_commit(cli, src):
    info = json.loads(cli("inspect", src, "--json").stdout)
    ref = _reference()
    assert info["committed"] and info["world_size"] == 2 and info["format"] == "fsdp_dtensor"
    rows = {r["key"]: r for r in info["keys"]}
    assert sorted(rows) == sorted(ref)
    assert rows[f"model.{FC1}"]["shape"] == [6, 4] and rows[f"model.{FC1}"]["chunks"] == 2
    assert rows["model.norm"]["dtype"] == "bfloat16" and rows["model.norm"]["bytes"] == 8
    assert info["totals"]["model"]["bytes"] == sum(
        v.numel() * v.element_size() for k, v in ref.items() if k.startswith("model.")
    )
    assert "model.tiny" in cli("inspect", src).stdout


def test_export_safetensors_equals_full_tensors_with_hf_index_and_shard_limit(cli, src, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    ref = {k.removeprefix("model."): v for k, v in _reference().items() if k.startswith("model.")}
    limit = 100
    cli("export", src, tmp_path / "hf", "--format", "safetensors", "--model-only", "--max-shard-size", f"{limit}B")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got = {}
    for name in files:
        tensors = load_file(tmp_path / "hf" / name)
        assert all(index["weight_map"][k] == name for k in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, f"{name} holds {size} bytes"
        with safe_open(str(tmp_path / "hf" / name), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
        got.update(tensors)
    _assert_equal(got, ref)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in ref.values())

    cli("export", src, tmp_path / "bf16", "--format", "safetensors", "--model-only", "--dtype", "bf16")
    got = load_file(tmp_path / "bf16" / "model-00001-of-00001.safetensors")
    _assert_equal(got, {k: v.bfloat16() for k, v in ref.items()})


def test_export_torch_writes_one_file_with_every_key(cli, src, tmp_path):
    cli("export", src, tmp_path / "full.pt", "--format", "torch")
    _assert_equal(torch.load(tmp_path / "full.pt", weights_only=True), _reference())


def test_import_of_a_full_safetensors_export_restores_every_key(cli, src, tmp_path):
    cli("export", src, tmp_path / "hf", "--format", "safetensors")
    cli("import", tmp_path / "hf", tmp_path / "back", "--world-size", "2")
    state = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in _reference().items()}
    checkpoint.load_state_dict(state, tmp_path / "back", verify="full")
    _assert_equal(state, _reference())
    assert json.loads(cli("inspect", tmp_path / "back", "--json").stdout)["world_size"] == 2


def test_import_of_a_torch_model_state_dict_prefixes_model(cli, tmp_path):
    sd = {"lin.weight": torch.randn(3, 2), "lin.bias": torch.randn(3)}
    torch.save(sd, tmp_path / "w.pt")
    cli("import", tmp_path / "w.pt", tmp_path / "ck")
    want = {f"model.{k}": v for k, v in sd.items()}
    _assert_equal(_load_full(tmp_path / "ck", want), want)
    cli("verify", tmp_path / "ck")


def test_import_reads_dcp_to_torch_save_output_and_a_single_safetensors_file(cli, src, tmp_path):
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, tmp_path / "d.pt")
    cli("import", tmp_path / "d.pt", tmp_path / "from_torch")
    _assert_equal(_load_full(tmp_path / "from_torch", _reference()), _reference())
    w = torch.randn(3, 5).bfloat16()
    save_file({"head.weight": w}, tmp_path / "one.safetensors")
    cli("import", tmp_path / "one.safetensors", tmp_path / "from_st", "--world-size", "4")
    _assert_equal(_load_full(tmp_path / "from_st", {"model.head.weight": w}), {"model.head.weight": w})


def _load_rows_at_3_ranks(rank: int, world_size: int, path: str) -> tuple[list[str], int]:
    """Each rank loads its FSDP2-style row block (empty past the last row) through checkpoint.load_state_dict.

    Compares with the reference here and returns (mismatches, elements checked): tensors
    sent back through a queue would need the sending process alive.
    """
    ref = _reference()
    state, boxes = {}, {}
    for key, value in ref.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            state[key] = torch.empty_like(value) if isinstance(value, torch.Tensor) else None
            continue
        per = -(-value.shape[0] // world_size)
        start = min(rank * per, value.shape[0])
        rows = min(per, value.shape[0] - start)
        local = torch.full((rows, *value.shape[1:]), float("nan"), dtype=value.dtype)
        state[key] = checkpoint.shard(local, tuple(value.shape), offsets=(start,) + (0,) * (value.dim() - 1))
        boxes[key] = (start, rows, local)
    checkpoint.load_state_dict(state, path)
    mismatches, checked = [], 0
    for key, value in ref.items():
        if key in boxes:
            start, rows, local = boxes[key]
            got, want = local, value[start : start + rows]
        else:
            got, want = state[key], value
        if isinstance(want, torch.Tensor):
            checked += want.numel()
            if not torch.equal(got, want):
                mismatches.append(f"rank {rank}: {key}")
        elif got != want:
            mismatches.append(f"rank {rank}: {key} = {got!r}")
    return mismatches, checked


def _assert_row_block_layout(path, world_size: int) -> None:
    """Each tensor's chunks in rank r's data file (per the written .metadata) tile exactly FSDP2's row block r.

    FSDP2's block of a rank is ``torch.chunk`` of the rows (a rank past the last chunk has none);
    every element is stored once, in the file of the rank that owns its row.
    """
    metadata = pickle.loads((path / ".metadata").read_bytes())
    owners = {}
    for index, info in metadata.storage_data.items():
        if index.offset is None or not metadata.state_dict_metadata[index.fqn].size:
            continue  # objects, and 0-d tensors (stored whole by rank 0)
        shape = metadata.state_dict_metadata[index.fqn].size
        owner = owners.setdefault(index.fqn, torch.full(tuple(shape), -1))
        chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
        box = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        assert (owner[box] == -1).all(), f"{index.fqn}: chunk at {list(chunk.offsets)} overlaps another"
        owner[box] = int(re.fullmatch(r"__(\d+)_0\.distcp", info.relative_path).group(1))
    assert owners, "no chunked tensor in the metadata"
    for key, owner in owners.items():
        want = torch.empty_like(owner)
        for rank, rows in enumerate(torch.arange(owner.shape[0]).chunk(world_size)):
            want[rows] = rank
        assert torch.equal(owner, want), f"{key}: ranks per element {owner.tolist()}, FSDP2 row blocks {want.tolist()}"


def test_reshard_2_to_3_loads_equal_at_3_ranks(cli, src, tmp_path):
    dst = tmp_path / "w3"
    cli("reshard", src, dst, "--world-size", "3", "--max-chunk-size", "32B")
    assert sorted(p.name for p in dst.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    _assert_row_block_layout(dst, 3)  # FC1 2+2+2 rows in 2-row chunks, emb 2+2+1, tiny and norm leave rank 2 empty
    results = run_ranks(_load_rows_at_3_ranks, 3, args=(str(dst),))
    assert [m for mismatches, _ in results for m in mismatches] == []
    total = sum(v.numel() for v in _reference().values() if isinstance(v, torch.Tensor) and v.dim())
    scalars = sum(1 for v in _reference().values() if isinstance(v, torch.Tensor) and not v.dim())
    assert sum(checked for _, checked in results) == total + 3 * scalars  # every element once, scalars per rank


def test_split_then_merge_round_trips_weights_and_optimizer_state(cli, src, tmp_path):
    parts = "layers.*.mlp.w.weight,layers.*.mlp.v.weight"
    rule = ("layers.*.mlp.linear_fc1.weight", "0", parts)
    cli("reshard", src, tmp_path / "split", "--world-size", "2", "--split", *rule)
    ref = _reference()
    fc1, m = ref[f"model.{FC1}"], ref[f"optimizer.state.{FC1}.exp_avg"]
    want = {k: v for k, v in ref.items() if FC1 not in k}
    for part, rows in (("w", slice(0, 3)), ("v", slice(3, 6))):
        want[f"model.layers.0.mlp.{part}.weight"] = fc1[rows]
        want[f"optimizer.state.layers.0.mlp.{part}.weight.exp_avg"] = m[rows]
        want[f"optimizer.state.layers.0.mlp.{part}.weight.step"] = ref[f"optimizer.state.{FC1}.step"]
        want[f"optimizer.param_groups.layers.0.mlp.{part}.weight.lr"] = ref[f"optimizer.param_groups.{FC1}.lr"]
    _assert_equal(_load_full(tmp_path / "split", want), want)
    assert sorted(CheckpointReader(tmp_path / "split").entries) == sorted(want)
    cli("reshard", tmp_path / "split", tmp_path / "merged", "--world-size", "3", "--merge", *rule)
    _assert_equal(_load_full(tmp_path / "merged", ref), ref)


def test_rename_renames_a_weight_and_its_optimizer_state_and_groups_in_an_export(cli, src, tmp_path):
    cli("export", src, tmp_path / "renamed.pt", "--format", "torch", "--rename", r"\.linear_fc1\.", ".fc_in.")
    want = {k.replace(".linear_fc1.", ".fc_in."): v for k, v in _reference().items()}
    assert sum(".fc_in." in k for k in want) == 4  # weight, exp_avg, step, lr
    _assert_equal(torch.load(tmp_path / "renamed.pt", weights_only=True), want)


def test_diff_exits_nonzero_on_a_one_element_change_and_honours_tolerances(cli, src, tmp_path):
    ref = _reference()
    ref["model.emb.weight"] = ref["model.emb.weight"].clone()
    ref["model.emb.weight"][3, 1] += 1e-3
    _write(tmp_path / "changed", ref)
    proc = cli("diff", src, tmp_path / "changed", check=1)
    assert "model.emb.weight: 1 of 15 elements differ" in proc.stdout and "[3, 1]" in proc.stdout
    assert proc.stderr.strip().startswith("fsdp-ckpt: error: 1 difference(s)")
    cli("diff", src, tmp_path / "changed", "--atol", "1e-2")


def test_verify_passes_then_catches_a_truncated_and_a_missing_file(cli, src, tmp_path):
    assert cli("verify", src).stdout.startswith("OK")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = bad / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    proc = cli("verify", bad, check=1)
    assert "__1_0.distcp" in proc.stdout and "truncated" in proc.stdout
    shutil.copy(src / "__1_0.distcp", data)
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # same size, one byte flipped
    data.write_bytes(bytes(raw))
    assert "CRC-32 does not match" in cli("verify", bad, check=1).stdout
    data.unlink()
    proc = cli("verify", bad, check=1)
    assert "__1_0.distcp: missing" in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_plain_dcp_directory_is_verified_and_exported_with_a_note(cli, tmp_path):
    sd = {"model.w": torch.randn(4, 2), "extra.step": 3}
    dcp.save(sd, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    proc = cli("verify", tmp_path / "plain")
    assert "note: no manifest.json" in proc.stdout and "OK" in proc.stdout
    proc = cli("export", tmp_path / "plain", tmp_path / "p.pt", "--format", "torch")
    assert "manifest checks" in proc.stdout
    _assert_equal(torch.load(tmp_path / "p.pt", weights_only=True), sd)
    (tmp_path / "plain" / "__0_0.distcp").write_bytes(b"garbage")
    assert "truncated" in cli("verify", tmp_path / "plain", check=1).stdout


@pytest.mark.slow  # a real torchrun launch: three interpreters
def test_reshard_under_torchrun_splits_the_work_and_equals_one_process(src, tmp_path):
    # --standalone: torchrun binds its rendezvous port itself (a port picked here could be
    # taken by a concurrently running suite before torchrun binds it)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "checkpoint.tool.cli",
            "reshard",
            str(src),
            str(tmp_path / "w3"),
            "--world-size",
            "3",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("resharded") == 1  # process 0 reports, once
    ref = _reference()
    _assert_equal(_load_full(tmp_path / "w3", ref), ref)
    assert sorted(p.name for p in (tmp_path / "w3").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(3)]
    _assert_row_block_layout(tmp_path / "w3", 3)  # process 1 wrote rank 1's file: same layout


def _export_safetensors_in_each_rank(rank: int, world_size: int, src: str, dst: str) -> int:
    from checkpoint.tool.cli import main

    # WORLD_SIZE is set and the gloo group is up, as under torchrun: main joins it and splits the shards
    return main(["export", src, dst, "--format", "safetensors", "--model-only", "--max-shard-size", "64B", "-q"])


def test_export_over_two_processes_splits_the_shards_and_equals_one_process(src, tmp_path):
    from safetensors.torch import load_file

    assert run_ranks(_export_safetensors_in_each_rank, 2, args=(str(src), str(tmp_path / "hf"))) == [0, 0]
    ref = _reference()
    got = {k: v for f in (tmp_path / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    _assert_equal(got, {k.removeprefix("model."): v for k, v in ref.items() if k.startswith("model.")})
