"""scripts/plot_offload_timeline.py draws a real profiled HybridDeviceOptimizer step, and fails cleanly on bad input."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_fsdp import HybridDeviceOptimizer

pytest.importorskip("matplotlib")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SCRIPT = SCRIPTS / "plot_offload_timeline.py"
SIZES = [300, 120, 500, 80, 260, 400, 90]  # uneven, like a real model


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def _load_script():
    return _load_module(SCRIPT)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def _profiled_trace(path: Path) -> HybridDeviceOptimizer:
    """Two profiled steps of a CPU HybridDeviceOptimizer with several buckets, exported as a Chrome trace."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen).requires_grad_() for n in SIZES]
    opt = HybridDeviceOptimizer(params, 1.0, lr=1e-3, bucket_numel=700)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
    prof.export_chrome_trace(str(path))
    return opt


def test_profiled_step_becomes_a_timeline_png_with_one_bar_per_bucket_and_stage(tmp_path):
    trace = tmp_path / "trace.json"
    opt = _profiled_trace(trace)
    n_buckets = len(opt.layout().buckets)
    assert n_buckets >= 3, "the test needs a multi-bucket pipeline"

    out = tmp_path / "timeline.png"
    result = _run(str(trace), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000  # a drawn figure, not an empty canvas
    assert f"{n_buckets} buckets" in result.stdout

    module = _load_script()
    for step in (0, -1):  # each of the two steps owns exactly its own ranges
        timeline = module.load_timeline(trace, step=step)
        for stage in module.STAGES:
            bars = timeline.bars[stage]
            assert sorted(b.bucket for b in bars) == [b.index for b in opt.layout().buckets], stage
            assert all(0 <= b.start <= b.end <= timeline.window[1] for b in bars)
        # the pipeline's order per bucket: grads in, update, params out
        for bucket in timeline.buckets:
            d2h, host, h2d = (next(b for b in timeline.bars[s] if b.bucket == bucket) for s in module.STAGES)
            assert d2h.end <= host.start and host.end <= h2d.start
        assert 0 < timeline.efficiency <= 1.0


def test_timings_json_busy_time_counts_overlapping_bars_once(tmp_path):
    timings = {
        "format": "offload_timeline", "version": 1, "device": "cpu", "unit": "ms", "step": [0.0, 10.0],
        "buckets": [
            {"index": i, "d2h": [i * 0.3, i * 0.3 + 0.4], "host_step": [2 + 2 * i, 3.9 + 2 * i], "h2d": [4 + 2 * i, 4.5 + 2 * i]}
            for i in range(3)
        ],
    }  # fmt: skip
    path = tmp_path / "timings.json"
    path.write_text(json.dumps(timings))
    timeline = _load_script().load_timeline(path)
    assert [len(timeline.bars[s]) for s in ("d2h", "host_step", "h2d")] == [3, 3, 3]
    # host step: 3 disjoint bars of 1.9 ms over a 10 ms step; D2H: overlapping bars [0, 0.4], [0.3, 0.7],
    # [0.6, 1.0] busy 1.0 ms (their union), not 1.2 ms (their sum)
    assert timeline.busy_ms("host_step") == pytest.approx(5.7)
    assert timeline.busy_ms("d2h") == pytest.approx(1.0)
    assert timeline.efficiency == pytest.approx(0.57)


def test_bench_timeline_json_of_a_real_step_is_drawn_with_every_bucket(tmp_path):
    bench = _load_module(SCRIPTS / "bench_offload.py")
    path = tmp_path / "timings.json"
    args = argparse.Namespace(numel=6000, tensors=7, bucket_numel=2000, repeats=1, timeline_json=str(path))
    bench.record_timeline(args)
    data = json.loads(path.read_text())
    assert data["format"] == "offload_timeline" and len(data["buckets"]) >= 3
    for bucket in data["buckets"]:  # stages of one bucket in pipeline order, inside the step
        assert 0 <= bucket["d2h"][0] <= bucket["d2h"][1] <= bucket["host_step"][0]
        assert bucket["host_step"][1] <= bucket["h2d"][0] <= bucket["h2d"][1] <= data["step"][1]

    result = _run(str(path))
    assert result.returncode == 0, result.stderr
    assert f"{len(data['buckets'])} buckets" in result.stdout
    assert (tmp_path / "timings.png").stat().st_size > 10_000


def test_missing_or_invalid_input_exits_nonzero_with_one_line_reason(tmp_path):
    missing = _run(str(tmp_path / "nope.json"))
    assert missing.returncode == 1
    assert missing.stderr.strip().count("\n") == 0 and "does not exist" in missing.stderr

    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    bad = _run(str(garbage))
    assert bad.returncode == 1 and "not valid JSON" in bad.stderr and bad.stderr.strip().count("\n") == 0

    no_ranges = tmp_path / "empty_trace.json"
    no_ranges.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::add", "ts": 1, "dur": 2}]}))
    empty = _run(str(no_ranges), "-o", str(tmp_path / "x.png"))
    assert empty.returncode == 1 and "HybridDeviceOptimizer" in empty.stderr
    assert not (tmp_path / "x.png").exists()


def test_timings_with_a_backward_lane_draw_host_steps_under_backward(tmp_path):
    timings = {
        "format": "offload_timeline", "version": 1, "device": "model", "unit": "ms", "step": [10.0, 14.0],
        "backward": [0.0, 10.0],
        "buckets": [
            {"index": i, "grads_ready": 3.0 * i + 2, "d2h": [3.0 * i + 2, 3.0 * i + 2.5],
             "host_step": [3.0 * i + 2.5, 3.0 * i + 5], "h2d": [3.0 * i + 5, 3.0 * i + 5.5]}
            for i in range(3)
        ],
    }  # fmt: skip
    path = tmp_path / "overlap.json"
    path.write_text(json.dumps(timings))
    module = _load_script()
    timeline = module.load_timeline(path)
    assert timeline.backward == (0.0, 10.0) and timeline.grads_ready == {0: 2.0, 1: 5.0, 2: 8.0}
    # backward 10 ms + host busy 7.5 ms over the 14 ms window (step() ends at 14)
    assert timeline.window == (0.0, 14.0)
    assert timeline.backward_overlap == pytest.approx(17.5 / 14.0)
    result = _run(str(path), "-o", str(tmp_path / "overlap.png"))
    assert result.returncode == 0, result.stderr
    assert "(backward + host busy) / step = 1.25" in result.stdout
    assert (tmp_path / "overlap.png").stat().st_size > 10_000

    timings["backward"] = [0.0]
    path.write_text(json.dumps(timings))
    bad = _run(str(path))
    assert bad.returncode == 1 and "backward" in bad.stderr and bad.stderr.strip().count("\n") == 0
