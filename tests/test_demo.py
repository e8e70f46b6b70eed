"""The README's demo, at tiny sizes: every claim it prints is checked here."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.atomic import staging_path

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_kills_resumes_bit_exactly_and_exports_a_loadable_model(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--quick", "--out", str(out), "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # run A was really killed before finishing, after the checkpoint it resumes from, exactly
    # at --kill-at (its ranks wait there to be killed: the kill cannot come late)
    assert summary["resume_step"] < summary["steps_run_A_before_kill"] == 9  # --quick: --kill-at 9 of 12 steps
    # every step A ran after the checkpoint it was resumed from is compared, bit for bit
    assert summary["bit_exact_steps_compared"] == summary["steps_run_A_before_kill"] - summary["resume_step"]
    assert summary["resume_bit_exact"]
    assert summary["first_step_after_resume"] == {"B": summary["resume_step"], "C": summary["resume_step"]}
    # the schedule resumed where it was: same LR per step as the killed run (a fresh one restarts warm-up)
    assert summary["lr_schedule_restored"]
    assert summary["lr_steps_compared"] == {r: summary["bit_exact_steps_compared"] for r in "BC"}
    # HybridDeviceOptimizer with offload_fraction=1 in every run, and async saves (the resumed one included)
    assert summary["optimizer"] == dict.fromkeys("ABC", "HybridDeviceOptimizer")
    assert summary["offload_fraction"] == dict.fromkeys("ABC", 1)
    assert summary["saves"]["A"] == [{"step": summary["resume_step"], "async": True}]
    assert summary["saves"]["B"] == [{"step": 12, "async": True}]
    assert summary["single_process_within_tolerance"] and summary["single_process_steps_compared"] == 12 - 6
    assert summary["export_matches"]
    assert summary["final_loss"] < summary["first_loss"]
    assert (out / "loss_curve.png").stat().st_size > 10_000
    assert "demo OK" in proc.stdout
    # progress as each phase is reached, in order, before the summary
    phases = re.findall(r"^demo \[\d/5\] +[0-9.]+ s  (\w+):", proc.stdout, flags=re.MULTILINE)
    assert phases == ["train", "save", "kill", "resume", "resume", "export"]


def _demo_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_demo_out_refuses_a_folder_it_did_not_write_and_keeps_a_users_file_in_its_own(tmp_path):
    demo = _demo_module()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="not a previous demo output"):
        demo.prepare_out(mine)
    assert (mine / "notes.txt").read_text() == "keep me"

    out = tmp_path / "demo"
    demo.prepare_out(out)  # new: created and marked
    leftover = staging_path(Path("export")).name  # an export cut short
    for name in ("A.jsonl", "summary.json", "ckpt/A/step_6/x", f"{leftover}/y"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old run")
    for name in ("notes.txt", "export.tar.gz", "ckpt.backup", "export.tmp"):  # the user's, though named like the demo's
        (out / name).write_text("keep me")
    demo.prepare_out(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [demo.MARKER, "notes.txt", "export.tar.gz", "ckpt.backup", "export.tmp"]
    )
