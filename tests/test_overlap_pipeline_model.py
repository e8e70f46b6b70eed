"""scripts/overlap_pipeline_model.py: the schedule arithmetic, and a run end to end on a recorded trace."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


model = _load("overlap_pipeline_model")


def _uniform(n_buckets: int, numel: int, t_bwd: float) -> list:
    """Buckets whose grads become final evenly over a backward of ``t_bwd`` s."""
    return [model.Bucket(numel, t_bwd * (i + 1) / n_buckets) for i in range(n_buckets)]


def test_with_equal_backward_and_host_time_overlapped_costs_about_the_max_plus_one_bucket():
    n, numel, t_bwd = 20, 1000, 1.0
    buckets = _uniform(n, numel, t_bwd)
    host = t_bwd / (n * numel)  # the whole host step takes exactly T_bwd
    kw = {"d2h_s_per_param": 0.0, "h2d_s_per_param": 0.0, "host_s_per_param": host}
    overlapped = model.simulate(buckets, t_bwd, overlapped=True, **kw)
    after = model.simulate(buckets, t_bwd, overlapped=False, **kw)
    one_bucket = numel * host
    assert after.end == pytest.approx(2 * t_bwd)  # today: the sum
    assert overlapped.end == pytest.approx(t_bwd + one_bucket)  # max + the last bucket's host step
    # the host worker starts the first bucket as soon as its grads are final, during backward
    assert overlapped.host[0][0] == pytest.approx(buckets[0].ready) and overlapped.host[0][0] < t_bwd


def test_with_zero_host_and_copy_time_all_modes_cost_the_no_offload_step():
    buckets = _uniform(7, 500, 0.3)
    rates = model.Rates(host=float("inf"), pcie=float("inf"), hbm=float("inf"))
    p = model.predict(buckets, 0.1, 0.3, rates)
    assert p.no_offload == p.after_backward == p.overlapped == pytest.approx(0.4)


def test_state_only_streams_state_during_backward_and_its_write_back_tail_past_the_next_forward_costs():
    # 2 buckets of 100 params, grads final at 0.1 and 0.2 s of a 0.2 s backward; H2D 1 ms/param, device
    # update 0.1 ms/param, D2H 1 ms/param: fetches end 0.2 and 0.3, updates 0.2-0.21 and 0.3-0.31,
    # write-backs 0.21-0.31 and 0.31-0.41; with a 0.05 s forward the tail (0.41 - 0.05) ends the step
    buckets = [model.Bucket(100, 0.1), model.Bucket(100, 0.2)]
    kw = {"h2d_s_per_param": 1e-3, "device_s_per_param": 1e-4, "d2h_s_per_param": 1e-3}
    s = model.simulate_state_only(buckets, 0.2, 0.05, **kw)
    flat = lambda spans: [t for span in spans for t in span]  # noqa: E731
    assert flat(s.h2d) == pytest.approx([0.1, 0.2, 0.2, 0.3])
    assert flat(s.host) == pytest.approx([0.2, 0.21, 0.3, 0.31])
    assert flat(s.d2h) == pytest.approx([0.21, 0.31, 0.31, 0.41])
    assert s.end == pytest.approx(0.36)
    assert model.simulate_state_only(buckets, 0.2, 0.5, **kw).end == pytest.approx(0.31)  # hidden by the forward
    rates = model.Rates(host=1.0, pcie=float("inf"), hbm=1e9)  # free copies: exactly the no-offload step
    p = model.predict(_uniform(5, 1000, 0.3), 0.1, 0.3, rates)
    assert p.state_only == pytest.approx(p.no_offload)


def test_stages_are_serial_queues_in_pipeline_order():
    # copies slower than grads arrive: D2H queues up; host and H2D follow each bucket in order
    buckets = [model.Bucket(100, 0.0), model.Bucket(100, 0.01), model.Bucket(300, 0.02)]
    s = model.simulate(
        buckets, 0.02, d2h_s_per_param=1e-3, host_s_per_param=2e-3, h2d_s_per_param=1e-3, overlapped=True
    )
    flat = lambda spans: [t for span in spans for t in span]  # noqa: E731  (approx compares flat lists)
    assert flat(s.d2h) == pytest.approx([0.0, 0.1, 0.1, 0.2, 0.2, 0.5])
    assert flat(s.host) == pytest.approx([0.1, 0.3, 0.3, 0.5, 0.5, 1.1])
    assert flat(s.h2d) == pytest.approx([0.3, 0.4, 0.5, 0.6, 1.1, 1.4])
    assert s.end == pytest.approx(1.4)


def test_buckets_are_packed_in_grad_arrival_order_and_ready_at_their_last_grad():
    ready = [("a", 6, 0.5), ("b", 3, 0.1), ("c", 4, 0.2), ("huge", 50, 0.9), ("d", 1, 0.3)]
    buckets = model.pack_buckets(ready, 8)
    assert [b.names for b in buckets] == [["b", "c", "d"], ["a"], ["huge"]]
    assert [b.ready for b in buckets] == [0.3, 0.5, 0.9]
    assert [b.numel for b in buckets] == [8, 6, 50]


def test_run_on_a_recorded_trace_prints_every_mode_and_writes_a_drawable_timeline(tmp_path, capsys):
    trace, timeline = tmp_path / "trace.json", tmp_path / "timeline.json"
    argv = ["--case", "qwen3-0.6b", "--trace-layers", "2", "--trace-hidden", "64", "--trace-seq", "64",
            "--trace-tokens", "128", "--save-trace", str(trace), "--timeline-json", str(timeline)]  # fmt: skip
    assert model.main(argv) == 0
    out = capsys.readouterr().out
    assert "no offload" in out and "after backward" in out and "overlapped" in out and "0.752" in out
    assert "state-only" in out
    data = json.loads(timeline.read_text())
    assert data["format"] == "offload_timeline" and data["backward"][0] == 0.0
    buckets = data["buckets"]
    total = sum(b["numel"] for b in buckets)
    assert total == model.QWEN3_0_6B.params  # every target param lands in exactly one bucket
    for b in buckets:
        assert b["grads_ready"] <= b["d2h"][0] <= b["d2h"][1] <= b["host_step"][0] <= b["host_step"][1] <= b["h2d"][0]
    # the tied embedding's grad is final only when backward ends
    assert max(b["grads_ready"] for b in buckets) == pytest.approx(data["backward"][1])
    # overlapped: some host step ran under backward
    assert min(b["host_step"][0] for b in buckets) < data["backward"][1]
    plot = _load("plot_offload_timeline")
    pytest.importorskip("matplotlib")
    assert plot.main([str(timeline), "-o", str(tmp_path / "t.png")]) == 0
    # replaying the saved trace gives the same schedule
    again = tmp_path / "again.json"
    assert model.main(["--case", "qwen3-0.6b", "--trace-json", str(trace), "--timeline-json", str(again)]) == 0
    assert json.loads(again.read_text())["buckets"] == buckets


def test_an_untied_lm_head_is_final_after_the_head_and_the_embedding_only_at_the_end():
    small = model.ModelShape(
        hidden=64, layers=2, intermediate=192, heads=2, kv_heads=1, head_dim=32, vocab=256, tied=True
    )
    layer = ["self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"]
    params = [["model.norm.weight", 64, 0.01]]  # a synthetic trace: head, layer 1, layer 0, embedding
    params += [[f"model.layers.1.{n}", 10, 0.02 + 0.01 * k] for k, n in enumerate(layer)]
    params += [[f"model.layers.0.{n}", 10, 0.05 + 0.01 * k] for k, n in enumerate(layer)]
    params += [["model.embed_tokens.weight", 256 * 64, 0.08]]
    trace = {"shape": small.__dict__, "tokens": 128, "seq": 64, "fwd": 0.04, "bwd": 0.08, "params": params}
    target = model.ModelShape(**{**small.__dict__, "tied": False, "layers": 3})
    ready = {name: t for name, _, t in model.target_ready_times(trace, target, 128, 64, 1.0)}
    head = ready["lm_head.weight"]
    assert head == ready["model.norm.weight"] and 0 < head < min(t for n, t in ready.items() if ".layers." in n)
    assert ready["model.embed_tokens.weight"] == 1.0
    # top layer first; inside a layer the measured order is kept
    assert ready["model.layers.2.mlp.down_proj.weight"] < ready["model.layers.1.mlp.down_proj.weight"]
    assert ready["model.layers.0.self_attn.o_proj.weight"] < ready["model.layers.0.mlp.down_proj.weight"]
