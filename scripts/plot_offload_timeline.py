"""Timeline PNG of HybridDeviceOptimizer's pipeline: D2H / host step / H2D, one bar per bucket.

Input, either:

* a torch profiler Chrome trace (``prof.export_chrome_trace(path)``) of a run
  with at least one ``HybridDeviceOptimizer.step``: the optimizer's per-bucket
  ranges ``HybridDeviceOptimizer.<d2h|host_step|h2d>[bucket <i>]`` are read
  (on CUDA traces the device-side ``gpu_user_annotation`` of a range is
  preferred to its CPU issue time); or
* the timings json of ``python scripts/bench_offload.py --timeline-json PATH``
  (per-bucket start/end of each stage in ms from the step's start; CUDA events
  on a GPU, synchronous copies timed on the host otherwise), or of
  ``python scripts/overlap_pipeline_model.py --timeline-json PATH`` (a simulated
  schedule). Optional fields draw a backward lane above the pipeline: ``backward``
  ([start, end] in ms) and each bucket's ``grads_ready`` (ms: when its last grad
  became final), so host steps running under backward show.

Usage::

    python scripts/plot_offload_timeline.py trace.json -o timeline.png
    python scripts/plot_offload_timeline.py timings.json --step 0
    python scripts/overlap_pipeline_model.py --case qwen3-0.6b --timeline-json docs/overlap_timeline.json
    python scripts/plot_offload_timeline.py docs/overlap_timeline.json -o docs/overlap_timeline.png

The title gives the overlap efficiency: the busiest stage's busy time over the
step's wall time (1.0 = the step costs only its slowest stage; a serial
pipeline scores max/sum). The step's window is the optimizer's
``Optimizer.step`` range widened to every bar, so D2H copies started by
post-accumulate-grad hooks during backward are shown (and counted) too. With a
backward lane the title also gives ``(T_backward + host busy) / window`` (2.0 when a
host step as long as the backward hides under it completely).
Exits 1 with a one-line reason on a missing or invalid input.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "Bar", "Timeline", "InputError", "load_timeline", "main", "plot_timeline"]

STAGES = ("d2h", "host_step", "h2d")
STAGE_LABELS = {"d2h": "D2H (grads)", "host_step": "host step", "h2d": "H2D (params)"}
TIMINGS_FORMAT = "offload_timeline"
_RANGE = re.compile(r"^HybridDeviceOptimizer\.(d2h|host_step|h2d)\[bucket (\d+)\]$")
_STEP_PREFIX = "Optimizer.step#HybridDeviceOptimizer"
_DEVICE_CAT = "gpu_user_annotation"


class InputError(ValueError):
    """The input file cannot be turned into a timeline (the message says why)."""


@dataclass(frozen=True)
class Bar:
    bucket: int
    start: float
    """ms from the window start"""
    end: float


@dataclass
class Timeline:
    """Per-stage bars over one optimizer step; times in ms from the window's start."""

    bars: dict[str, list[Bar]]
    window: tuple[float, float]
    source: str
    step_range: tuple[float, float] | None = None
    """the optimizer's own step() range, when the input has one"""
    notes: list[str] = field(default_factory=list)
    backward: tuple[float, float] | None = None
    """the backward's span, when the input has one (the backward lane)"""
    grads_ready: dict[int, float] = field(default_factory=dict)
    """bucket -> when its last grad became final (ticks on the backward lane)"""

    @property
    def buckets(self) -> list[int]:
        return sorted({b.bucket for bars in self.bars.values() for b in bars})

    @property
    def step_ms(self) -> float:
        return self.window[1] - self.window[0]

    def busy_ms(self, stage: str) -> float:
        """Length of the union of the stage's bars (overlapping bars count once)."""
        total, reach = 0.0, float("-inf")
        for bar in sorted(self.bars.get(stage, []), key=lambda b: b.start):
            start = max(bar.start, reach)
            if bar.end > start:
                total += bar.end - start
            reach = max(reach, bar.end)
        return total

    @property
    def efficiency(self) -> float:
        busiest = max(self.busy_ms(s) for s in STAGES)
        return busiest / self.step_ms if self.step_ms > 0 else float("nan")

    @property
    def backward_overlap(self) -> float | None:
        """``(T_backward + host busy) / window``: 1.0 when the host step runs after backward, 2.0 at best."""
        if self.backward is None or self.step_ms <= 0:
            return None
        return (self.backward[1] - self.backward[0] + self.busy_ms("host_step")) / self.step_ms


def _read_json(path: Path) -> Any:
    if not path.exists():
        raise InputError(f"input file {str(path)!r} does not exist")
    if not path.is_file():
        raise InputError(f"input {str(path)!r} is not a file")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{str(path)!r} is not valid JSON ({exc}); pass a Chrome trace or a --timeline-json file"
        ) from exc


def _merge(spans: dict[tuple[str, int], list[tuple[float, float]]]) -> dict[tuple[str, int], tuple[float, float]]:
    """One (first start, last end) per stage and bucket: a bucket's D2H is one range per staged grad."""
    return {key: (min(s for s, _ in v), max(e for _, e in v)) for key, v in spans.items()}


def _build(
    spans: dict[tuple[str, int], tuple[float, float]],
    step: tuple[float, float] | None,
    source: str,
    backward: tuple[float, float] | None = None,
    grads_ready: dict[int, float] | None = None,
) -> Timeline:
    extra = [x for x in (step, backward) if x is not None]
    starts = [s for s, _ in spans.values()] + [x[0] for x in extra]
    ends = [e for _, e in spans.values()] + [x[1] for x in extra]
    origin, finish = min(starts), max(ends)
    bars: dict[str, list[Bar]] = {s: [] for s in STAGES}
    for (stage, bucket), (start, end) in sorted(spans.items(), key=lambda kv: (kv[0][1], kv[1][0])):
        bars[stage].append(Bar(bucket, start - origin, end - origin))
    step_rel = (step[0] - origin, step[1] - origin) if step else None
    return Timeline(
        bars=bars, window=(0.0, finish - origin), source=source, step_range=step_rel,
        backward=(backward[0] - origin, backward[1] - origin) if backward else None,
        grads_ready={b: t - origin for b, t in (grads_ready or {}).items()},
    )  # fmt: skip


def _from_chrome_trace(events: list[Any], step_index: int, path: Path) -> Timeline:
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in complete
                   if str(e.get("name", "")).startswith(_STEP_PREFIX) and e.get("cat") != _DEVICE_CAT)  # fmt: skip
    ranges = []
    for e in complete:
        m = _RANGE.match(str(e.get("name", "")))
        if m:
            start = float(e["ts"])
            ranges.append(
                (m.group(1), int(m.group(2)), start, start + float(e.get("dur", 0)), e.get("cat") == _DEVICE_CAT)
            )
    if not ranges:
        raise InputError(
            f"{str(path)!r} has no 'HybridDeviceOptimizer.<stage>[bucket i]' ranges; profile a step of "
            "HybridDeviceOptimizer (offload_fraction > 0) and export it with prof.export_chrome_trace"
        )
    step = None
    if steps:
        try:
            step = steps[step_index]
        except IndexError:
            raise InputError(f"--step {step_index}: the trace holds {len(steps)} optimizer steps") from None
        position = steps.index(step)
        # A step owns the ranges after the previous step ended (hook-driven D2H runs during backward).
        lo = steps[position - 1][1] if position > 0 else float("-inf")
        ranges = [r for r in ranges if lo < r[2] <= step[1]]
    cpu: dict[tuple[str, int], list[tuple[float, float]]] = {}
    device: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for stage, bucket, start, end, on_device in ranges:
        (device if on_device else cpu).setdefault((stage, bucket), []).append((start / 1e3, end / 1e3))
    spans = _merge(cpu)
    spans.update(_merge(device))  # the copy's time on the device beats the time its launch took on the CPU
    if not spans:
        raise InputError(f"{str(path)!r}: optimizer step {step_index} has no per-bucket ranges")
    source = "profiler trace" + (" (device-side copies)" if device else "")
    timeline = _build(spans, (step[0] / 1e3, step[1] / 1e3) if step else None, source)
    if not steps:
        timeline.notes.append("no Optimizer.step range in the trace: window = the bars' extent")
    return timeline


def _from_timings(data: dict[str, Any], step_index: int, path: Path) -> Timeline:
    if data.get("version") != 1:
        raise InputError(f"{str(path)!r}: timings version {data.get('version')!r} is not supported (expected 1)")
    if step_index not in (0, -1):
        raise InputError(f"--step {step_index}: a timings file holds one step (use 0)")
    try:
        spans, ready = {}, {}
        for bucket in data["buckets"]:
            for stage in STAGES:
                span = bucket.get(stage)
                if span is not None:
                    start, end = (float(x) for x in span)
                    spans[(stage, int(bucket["index"]))] = (start, end)
            if bucket.get("grads_ready") is not None:
                ready[int(bucket["index"])] = float(bucket["grads_ready"])
        step = tuple(float(x) for x in data["step"])
        backward = tuple(float(x) for x in data["backward"]) if data.get("backward") is not None else None
        if backward is not None and len(backward) != 2:
            raise ValueError(f"'backward' must be [start, end], got {data['backward']!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{str(path)!r} is not a valid {TIMINGS_FORMAT} file: {exc!r}") from exc
    if not spans:
        raise InputError(f"{str(path)!r} holds no bucket timings")
    return _build(spans, step, f"timings: {data.get('device', '?')}", backward, ready)  # type: ignore[arg-type]


def load_timeline(path: str | Path, *, step: int = -1) -> Timeline:
    """Parse a Chrome trace or a ``--timeline-json`` file into a :class:`Timeline`; ``InputError`` if invalid."""
    path = Path(path)
    data = _read_json(path)
    if isinstance(data, dict) and data.get("format") == TIMINGS_FORMAT:
        return _from_timings(data, step, path)
    if isinstance(data, dict) and isinstance(data.get("traceEvents"), list):
        return _from_chrome_trace(data["traceEvents"], step, path)
    if isinstance(data, list):  # the bare-array form of the trace event format
        return _from_chrome_trace(data, step, path)
    raise InputError(
        f"{str(path)!r} is neither a Chrome trace (no 'traceEvents') nor a bench_offload --timeline-json file"
    )


def _title(t: Timeline) -> str:
    busy = {s: t.busy_ms(s) for s in STAGES}
    busiest = max(busy, key=busy.get)
    title = (
        f"HybridDeviceOptimizer step, {len(t.buckets)} buckets ({t.source})\n"
        f"step {t.step_ms:.2f} ms; busiest stage {STAGE_LABELS[busiest]} {busy[busiest]:.2f} ms; "
        f"overlap efficiency {t.efficiency:.2f} (1.00 = step costs only its slowest stage)"
    )
    if t.backward is not None:
        title += (
            f"\nbackward {t.backward[1] - t.backward[0]:.2f} ms + host step {busy['host_step']:.2f} ms over "
            f"{t.step_ms:.2f} ms = {t.backward_overlap:.2f} (1.00 = host step after backward, 2.00 = fully hidden)"
        )
    return title


def plot_timeline(t: Timeline, output: Path) -> None:
    """Write the PNG: one row per stage (D2H on top), one bar per bucket, coloured by bucket."""
    try:
        import matplotlib
    except ImportError as exc:
        raise InputError("matplotlib is needed to draw the timeline: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10").colors
    lanes = len(STAGES) + (t.backward is not None)
    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.6 * lanes), dpi=110)
    span = max(t.window[1], 1e-9)
    rows = list(reversed(STAGES))  # D2H at the top, in pipeline order downwards
    labels = [STAGE_LABELS[s] for s in rows]
    if t.backward is not None:  # a lane above D2H: the backward, a tick where each bucket's grads became final
        y = len(rows)
        start, end = t.backward
        ax.broken_barh([(start, end - start)], (y - 0.35, 0.7), facecolors="0.8", edgecolor="black", linewidth=0.5)
        for bucket, ready in t.grads_ready.items():
            ax.vlines(ready, y - 0.35, y + 0.35, colors=[colors[bucket % len(colors)]], linewidth=1.2)
        ax.text(span * 1.005, y, f"{end - start:.2f} ms", va="center", fontsize=8)
        labels.append("backward\n(| grads final)")
    for y, stage in enumerate(rows):
        for bar in t.bars.get(stage, []):
            width = max(bar.end - bar.start, span * 4e-3)  # a copy of a few microseconds stays visible
            ax.broken_barh([(bar.start, width)], (y - 0.35, 0.7), facecolors=colors[bar.bucket % len(colors)],
                           edgecolor="black", linewidth=0.5)  # fmt: skip
            if width > span * 0.035:
                ax.text(bar.start + width / 2, y, f"b{bar.bucket}", ha="center", va="center", fontsize=8)
        ax.text(span * 1.005, y, f"busy {t.busy_ms(stage):.2f} ms", va="center", fontsize=8)
    if t.step_range is not None:
        ax.axvspan(*t.step_range, color="0.92", zorder=0, label="optimizer.step()")
        ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.6, len(labels) - 0.4 + (0.5 if t.step_range is not None else 0))
    ax.set_xlim(0, span * 1.12)
    ax.set_xlabel("time since the first stage or step() started (ms)")
    ax.set_title(_title(t), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="Chrome trace json, or a bench_offload.py --timeline-json file")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (default: INPUT with .png)")
    parser.add_argument(
        "--step", type=int, default=-1, help="which optimizer step of a trace to draw (default: the last)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    output = args.output if args.output is not None else args.input.with_suffix(".png")
    try:
        timeline = load_timeline(args.input, step=args.step)
        plot_timeline(timeline, output)
    except (InputError, OSError) as exc:
        print(f"plot_offload_timeline: error: {exc}", file=sys.stderr)
        return 1
    busy = ", ".join(f"{s} {timeline.busy_ms(s):.3f}" for s in STAGES)
    per_stage = ", ".join(f"{s} {len(timeline.bars[s])}" for s in STAGES)
    print(f"wrote {output}: {len(timeline.buckets)} buckets (bars: {per_stage}); step {timeline.step_ms:.3f} ms; "
          f"busy ms: {busy}; overlap efficiency {timeline.efficiency:.2f}")  # fmt: skip
    if timeline.backward_overlap is not None:
        print(f"backward lane: (backward + host busy) / step = {timeline.backward_overlap:.2f}")
    for note in timeline.notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
