"""Damaged files never load silently: random byte flips and truncations of a real 2-rank checkpoint.

A model + AdamW checkpoint written by 2 FSDP2 ranks is damaged one way at a
time (a flipped byte or a truncation in each kind of file: ``manifest.json``,
``.metadata``, each rank's data file; deterministic seed), then read by
``checkpoint.load`` (default ``verify``), by ``fsdp-ckpt diff`` against the
pristine copy and by ``fsdp-ckpt verify``. Each read must end as one documented error naming the
checkpoint, or give exactly the pristine values; never other values, a raw
exception type, or a hang. The outcome counts are printed.
"""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.tool.cli import main as cli_main
from tests.bounded import run_bounded
from tests.distributed import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

_TIMEOUT_S = 60
_CASES_PER_FILE = 8  # 6 flips + 2 truncations, for each of the 4 files
_DOCUMENTED = (ValueError, FileNotFoundError)  # CheckpointCorruptError and NotACheckpointError are ValueErrors


def _net() -> torch.nn.Module:
    # tensor bytes are most of each data file (as in real checkpoints): most flips land in values
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 33), torch.nn.Linear(33, 5))


def _save_two_ranks(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _net()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in (1, 2):
        model(torch.randn(4, 48, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(Path(root) / "ck", model=model, optimizer=opt, extra={"step": 2, "tag": "run-a"})


def _load(path: Path) -> dict:
    """Everything a load gives, as plain tensors / values keyed by name."""
    model = _net()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-7.0)  # not the saved values: a skipped read shows
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    extra = checkpoint.load(path, model=model, optimizer=opt)
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, state in opt.state_dict()["state"].items():
        out.update({f"opt.{index}.{k}": v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    out["extra"] = dict(extra)
    return out


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, va in a.items():
        vb = b[k]
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and torch.equal(va, vb)):
                return False
        elif va != vb:
            return False
    return True


def _bounded(fn):
    return run_bounded(fn, _TIMEOUT_S)


def _damages(pristine: Path, rng: random.Random) -> list[tuple[str, str, int]]:
    """(file, "flip" | "truncate", position) for every file of the checkpoint."""
    cases = []
    for name in sorted(p.name for p in pristine.iterdir()):
        size = (pristine / name).stat().st_size
        cases += [(name, "flip", rng.randrange(size)) for _ in range(_CASES_PER_FILE - 2)]
        cases += [(name, "truncate", rng.randrange(size)) for _ in range(2)]
    return cases


def _damage(src: Path, dst: Path, name: str, how: str, pos: int) -> None:
    shutil.copytree(src, dst)
    raw = bytearray((dst / name).read_bytes())
    if how == "flip":
        raw[pos] ^= 1 << random.Random(pos).randrange(8)
    else:
        del raw[pos:]
    (dst / name).write_bytes(bytes(raw))


def _classify_load(case: Path, reference: dict) -> str:
    hung, value, exc = _bounded(lambda: _load(case))
    if hung:
        return "hang"
    if exc is None:
        return "equal" if _same(value, reference) else "WRONG DATA"
    if isinstance(exc, _DOCUMENTED) and str(case) in str(exc):
        return "clear error"
    return f"raw {type(exc).__name__}: {str(exc)[:200]}"


def _classify_diff(case: Path, pristine: Path, capsys) -> str:
    hung, code, exc = _bounded(lambda: cli_main(["diff", str(case), str(pristine), "-q"]))
    err = capsys.readouterr().err.strip()
    if hung:
        return "hang"
    if exc is not None:
        return f"raw {type(exc).__name__}"
    if code == 0:
        return "equal"
    if code == 1:
        return "WRONG DATA"  # read without an error, and different from the pristine copy
    one_line = len(err.splitlines()) == 1 and err.startswith("fsdp-ckpt: error: ") and str(case) in err
    return "clear error" if one_line and "unexpected" not in err else f"raw: {err[:200]}"


def _classify_verify(case: Path, capsys) -> str:
    hung, code, exc = _bounded(lambda: cli_main(["verify", str(case), "-q"]))
    err = capsys.readouterr().err.strip()
    if hung or exc is not None:
        return "hang" if hung else f"raw {type(exc).__name__}"
    if code == 0:
        return "equal"  # it says the checkpoint is whole: the load must then give the pristine values
    one_line = len(err.splitlines()) == 1 and err.startswith("fsdp-ckpt: error: ") and "unexpected" not in err
    return "clear error" if code in (1, 2) and one_line else f"raw: {err[:200]}"


def test_flipped_and_truncated_files_end_as_a_clear_error_or_the_exact_values(tmp_path, capsys):
    run_ranks(_save_two_ranks, 2, args=(str(tmp_path),))
    pristine = tmp_path / "ck"
    reference = _load(pristine)
    cases = _damages(pristine, random.Random(20261123))
    outcomes: dict[str, Counter] = {"load": Counter(), "diff": Counter(), "verify": Counter()}
    bad: list[str] = []
    for i, (name, how, pos) in enumerate(cases):
        case = tmp_path / f"case{i}"
        _damage(pristine, case, name, how, pos)
        results = {
            "load": _classify_load(case, reference),
            "diff": _classify_diff(case, pristine, capsys),
            "verify": _classify_verify(case, capsys),
        }
        for reader, outcome in results.items():
            outcomes[reader][outcome] += 1
            if outcome not in ("equal", "clear error"):
                bad.append(f"{reader} of {name} {how} at {pos}: {outcome}")
        if results["verify"] == "equal" and results["load"] != "equal":
            bad.append(f"verify passed {name} {how} at {pos}, but the load gave {results['load']}")
        shutil.rmtree(case)
    with capsys.disabled():
        print(f"\nfuzz, {len(cases)} damaged copies: " + "; ".join(f"{k}: {dict(v)}" for k, v in outcomes.items()))
    assert not bad, "\n".join(bad)
    assert sum(outcomes["load"].values()) == len(cases) >= 32
