"""The README's demo, at tiny sizes: every claim it prints is checked here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_demo_kills_resumes_bit_exactly_and_exports_a_loadable_model(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--quick", "--out", str(out), "--timeout", "300"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    # run A was really killed before finishing, after the checkpoint it resumes from
    assert summary["resume_step"] < summary["steps_run_A_before_kill"] < 12
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
