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
    assert summary["resume_bit_exact"] and summary["bit_exact_steps_compared"] >= 1
    assert summary["single_process_within_tolerance"] and summary["single_process_steps_compared"] == 12 - 6
    assert summary["export_matches"]
    assert summary["final_loss"] < summary["first_loss"]
    assert (out / "loss_curve.png").stat().st_size > 10_000
    assert "demo OK" in proc.stdout
