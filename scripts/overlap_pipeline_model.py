"""Pipeline model of one training step with HybridDeviceOptimizer: no offload, after-backward, overlapped.

Predicts the step time of four modes from stated inputs, for the NeMo-RL Qwen3-0.6B
configuration and for a long-sequence case, and prints them next to the published
figures:

* **no offload**: ``T_fwd + T_bwd + T_device_adam`` (AdamW on the device).
* **after backward** (today's default): each bucket's grads go D2H as soon as they are
  final (the post-accumulate-grad hooks), but the host steps start only when ``step()``
  is called, after the whole backward; H2D follows each bucket's host step.
* **state-only** (``offload_state_only=True``, issue 22): the update stays on the device; each bucket's
  fp32 master + moments (12 B/param) come H2D as its grads become final, the device AdamW runs per bucket
  after backward, and the D2H write-back overlaps the next forward (:func:`simulate_state_only`).
* **overlapped** (the opt-in mode of issue 14): the host step of bucket ``i`` starts at
  ``max(its grads landed on the host, host worker free)``, during backward; its H2D is
  queued right after.

Both offload modes go through one simulation (:func:`simulate`): per bucket, in
gradient-arrival order, D2H on one serial copy queue at the PCIe rate, the host step on
one serial host worker at the host-step rate, H2D on one serial copy queue; the step
ends when backward has ended and the last H2D has landed (the next forward needs the
params). 100% offload, so there is no device share.

Inputs (every one is printed with the results):

1. **Grad-ready times** come from a real backward: a ``transformers`` Qwen3 model built
   from a scaled-down config (``--trace-*`` options) is run forward + backward on the
   CPU, and a post-accumulate-grad hook timestamps each parameter (the moment its grad
   is final: a tied embedding only at the very end). The backward is cut into segments
   (LM head + final norm, each decoder layer, the embedding); each segment's measured
   duration is scaled to the target config by its FLOPs ratio (decoder layer:
   ``4 * tokens * layer_params + 8 * tokens * seq * attn_dim``; LM head:
   ``4 * tokens * hidden * vocab``; embedding: ``tokens * hidden``, a scatter-add), then
   one common factor sets the target's whole backward to ``T_bwd``. Within a decoder
   layer a parameter keeps its measured position (as a fraction of the layer's span,
   averaged over the traced layers). ``--trace-json`` replays a saved trace instead.
2. **T_fwd, T_bwd**: NeMo-RL case: calibrated from the published no-offload step (0.752 s =
   T_fwd + T_bwd + T_device_adam, T_bwd = 2 T_fwd by FLOPs). Long-sequence case: FLOPs
   (``6 * active_params * tokens`` + causal attention ``6 * layers * seq * attn_dim`` per
   token) at a stated device rate (peak x MFU).
3. **Host-step rate**: bytes of host memory traffic per second of the host Adam step (28 B
   per param: bf16 grad in, fp32 master and moments read and written, bf16 param out).
   Two figures: the one measured here (the default compiled step on this machine,
   ``--measure``; a shared 2-core VM, so a low bound) and a stated real-GPU-host figure.
4. **PCIe**: a stated rate per direction; 2 B/param each way (bf16 grads down, bf16 params up).
5. **Buckets**: parameters packed in grad-arrival order into buckets of at most
   ``--bucket-numel`` elements (the optimizer's default 16M); a larger parameter is a
   bucket of its own.

Usage::

    python scripts/overlap_pipeline_model.py                 # both cases, trace recorded now
    python scripts/overlap_pipeline_model.py --measure       # also measure the host-step rate here
    python scripts/overlap_pipeline_model.py --case qwen3-0.6b --mode overlapped \\
        --timeline-json docs/overlap_timeline.json           # the simulated schedule, for
    python scripts/plot_offload_timeline.py docs/overlap_timeline.json -o docs/overlap_timeline.png

``main(argv)`` is the entry point (``scripts/bench_overlap.py --model`` calls it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Bucket", "Schedule", "Case", "main", "pack_buckets", "predict", "simulate", "simulate_state_only"]

DEFAULT_BUCKET_NUMEL = 1 << 24  # offload_fsdp.optimizer.DEFAULT_BUCKET_NUMEL (not imported: no torch needed here)
HOST_BYTES_PER_PARAM = 28  # bf16 grad 2 + fp32 master 4+4 + exp_avg 4+4 + exp_avg_sq 4+4 + bf16 param 2
DEVICE_ADAM_BYTES_PER_PARAM = 28  # the same update on the device, fp32 master and moments in HBM
PCIE_BYTES_PER_PARAM = 2  # each way: bf16 grad D2H, bf16 param H2D
STATE_BYTES_PER_PARAM = 12  # state-only offload, each way: fp32 master + exp_avg + exp_avg_sq (H2D, D2H)

# --------------------------------------------------------------------------- the simulation


@dataclass
class Bucket:
    """One host bucket of the model: its elements and when its last grad became final (s from backward start)."""

    numel: int
    ready: float
    names: list[str] = field(default_factory=list)


@dataclass
class Schedule:
    """Per-bucket stage spans (s from backward start) of one simulated step."""

    backward: tuple[float, float]
    d2h: list[tuple[float, float]]
    host: list[tuple[float, float]]
    h2d: list[tuple[float, float]]
    buckets: list[Bucket]
    settled: float = 0.0
    """state-only: the backward-relative time the step must not end before (its write-back tail)"""

    @property
    def end(self) -> float:
        """When the next forward can start: backward done and every param back on the device."""
        return max([self.backward[1], self.settled, *(e for _, e in self.h2d)])


def simulate(
    buckets: Sequence[Bucket],
    t_bwd: float,
    *,
    d2h_s_per_param: float,
    host_s_per_param: float,
    h2d_s_per_param: float,
    overlapped: bool,
) -> Schedule:
    """Schedule D2H -> host step -> H2D per bucket in ``buckets`` order, each stage one serial queue.

    D2H of a bucket starts when its grads are final (``Bucket.ready``) and the D2H queue is
    free; its host step when its D2H has landed and the host worker is free, and, unless
    ``overlapped``, not before backward ends (``t_bwd``: today's ``step()``); its H2D when
    its host step is done and the H2D queue is free.
    """
    d2h, host, h2d = [], [], []
    d2h_free = host_free = h2d_free = 0.0
    for b in buckets:
        start = max(b.ready, d2h_free)
        d2h_free = start + b.numel * d2h_s_per_param
        d2h.append((start, d2h_free))
        start = max(d2h_free, host_free, 0.0 if overlapped else t_bwd)
        host_free = start + b.numel * host_s_per_param
        host.append((start, host_free))
        start = max(host_free, h2d_free)
        h2d_free = start + b.numel * h2d_s_per_param
        h2d.append((start, h2d_free))
    return Schedule(backward=(0.0, t_bwd), d2h=d2h, host=host, h2d=h2d, buckets=list(buckets))


def simulate_state_only(
    buckets: Sequence[Bucket],
    t_bwd: float,
    t_fwd: float,
    *,
    h2d_s_per_param: float,
    device_s_per_param: float,
    d2h_s_per_param: float,
) -> Schedule:
    """State-only offload (``offload_state_only=True``, no budget bound): per bucket, the H2D of its master and
    state starts when its grads are final (one serial queue), its device update after backward ends and its H2D
    landed (the main stream, serial: spans in ``host``), its D2H write-back after the update (one serial queue).

    The step ends when the last device update is done; the write-back overlaps the next forward and must have
    landed when the next backward starts (its prefetches read those host buffers), so a write-back tail longer
    than ``t_fwd`` extends the step (``Schedule.end``: the later of the two, backward-relative).
    """
    h2d, device, d2h = [], [], []
    h2d_free, device_free, d2h_free = 0.0, t_bwd, 0.0
    for b in buckets:
        start = max(b.ready, h2d_free)
        h2d_free = start + b.numel * h2d_s_per_param
        h2d.append((start, h2d_free))
        start = max(h2d_free, device_free)
        device_free = start + b.numel * device_s_per_param
        device.append((start, device_free))
        start = max(device_free, d2h_free)
        d2h_free = start + b.numel * d2h_s_per_param
        d2h.append((start, d2h_free))
    return Schedule(backward=(0.0, t_bwd), d2h=d2h, host=device, h2d=h2d, buckets=list(buckets),
                    settled=max(device_free, d2h_free - t_fwd))  # fmt: skip


def pack_buckets(ready: Sequence[tuple[str, int, float]], bucket_numel: int) -> list[Bucket]:
    """Params ``(name, numel, ready s)`` packed in arrival order into buckets of at most ``bucket_numel``."""
    buckets: list[Bucket] = []
    for name, numel, t in sorted(ready, key=lambda x: x[2]):
        if not buckets or buckets[-1].numel + numel > bucket_numel:
            buckets.append(Bucket(0, 0.0))
        b = buckets[-1]
        b.numel, b.ready = b.numel + numel, max(b.ready, t)
        b.names.append(name)
    return buckets


@dataclass(frozen=True)
class Rates:
    """Stated or measured rates (bytes/s)."""

    host: float
    """host-step memory traffic, bytes/s (28 B per param moved)"""
    pcie: float
    """per direction"""
    hbm: float
    """device memory bandwidth reached by the device AdamW (no-offload mode)"""


@dataclass(frozen=True)
class Prediction:
    no_offload: float
    after_backward: float
    overlapped: float
    state_only: float
    """``offload_state_only=True``: the update on the device, master + state streamed (:func:`simulate_state_only`)"""
    t_fwd: float
    t_bwd: float
    t_host: float
    schedules: dict[str, Schedule]


def predict(buckets: Sequence[Bucket], t_fwd: float, t_bwd: float, rates: Rates) -> Prediction:
    """Step time of the three modes (s); ``buckets`` carry grad-ready times on a backward of ``t_bwd``."""
    n = sum(b.numel for b in buckets)
    per_param = {
        "d2h_s_per_param": PCIE_BYTES_PER_PARAM / rates.pcie,
        "host_s_per_param": HOST_BYTES_PER_PARAM / rates.host,
        "h2d_s_per_param": PCIE_BYTES_PER_PARAM / rates.pcie,
    }
    schedules = {
        mode: simulate(buckets, t_bwd, overlapped=mode == "overlapped", **per_param)
        for mode in ("after_backward", "overlapped")
    }
    schedules["state_only"] = simulate_state_only(
        buckets, t_bwd, t_fwd,
        h2d_s_per_param=STATE_BYTES_PER_PARAM / rates.pcie,
        device_s_per_param=DEVICE_ADAM_BYTES_PER_PARAM / rates.hbm,
        d2h_s_per_param=STATE_BYTES_PER_PARAM / rates.pcie,
    )  # fmt: skip
    no_offload = t_fwd + t_bwd + n * DEVICE_ADAM_BYTES_PER_PARAM / rates.hbm
    return Prediction(
        no_offload=no_offload,
        after_backward=t_fwd + schedules["after_backward"].end,
        overlapped=t_fwd + schedules["overlapped"].end,
        state_only=t_fwd + schedules["state_only"].end,
        t_fwd=t_fwd, t_bwd=t_bwd, t_host=n * per_param["host_s_per_param"], schedules=schedules,
    )  # fmt: skip


# --------------------------------------------------------------------------- model shapes and FLOPs


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs scaling needs of a Qwen3-style config."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attn = self.hidden * (2 * self.attn_dim + 2 * self.kv_heads * self.head_dim)
        mlp = 3 * self.hidden * (self.intermediate if not self.experts else self.moe_intermediate * self.experts)
        router = self.hidden * self.experts
        return attn + mlp + router + 2 * self.hidden + 2 * self.head_dim

    @property
    def layer_active_params(self) -> int:
        if not self.experts:
            return self.layer_params
        inactive = 3 * self.hidden * self.moe_intermediate * (self.experts - self.experts_per_token)
        return self.layer_params - inactive

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params + embed * (1 if self.tied else 2) + self.hidden

    @property
    def active_params(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_active_params + embed * (1 if self.tied else 2) + self.hidden

    def bwd_flops(self, segment: str, tokens: int, seq: int) -> float:
        """Backward FLOPs of one segment: ``head``, ``layer`` (one decoder layer) or ``embed``."""
        if segment == "head":
            return 4.0 * tokens * self.hidden * self.vocab
        if segment == "layer":
            return 4.0 * tokens * self.layer_active_params + 8.0 * tokens * seq * self.attn_dim
        return float(tokens * self.hidden)  # embedding: a scatter-add of the grad rows


QWEN3_0_6B = ModelShape(hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8, head_dim=128,
                        vocab=151936, tied=True)  # fmt: skip
"""Qwen/Qwen3-0.6B config.json (596M params, tied embeddings)."""
QWEN3_30B_A3B = ModelShape(hidden=2048, layers=48, intermediate=6144, heads=32, kv_heads=4, head_dim=128,
                           vocab=151936, tied=False, experts=128, experts_per_token=8, moe_intermediate=768)  # fmt: skip
"""Qwen/Qwen3-30B-A3B config.json (30.5B params, 3.3B active)."""


# --------------------------------------------------------------------------- the trace


def record_trace(shape: ModelShape, tokens: int, seq: int, repeats: int = 3) -> dict[str, Any]:
    """Forward + backward of a real ``transformers`` Qwen3 of ``shape`` on the CPU; per-param grad-ready times.

    Returns ``{"shape", "tokens", "seq", "fwd", "bwd", "params": [[name, numel, ready s], ...]}``,
    each the median over ``repeats`` runs (after a warm-up), in thread CPU seconds.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=shape.hidden, num_hidden_layers=shape.layers, intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, tie_word_embeddings=shape.tied, max_position_embeddings=max(seq, 128),
    )  # fmt: skip
    model = Qwen3ForCausalLM(config)
    named = list(model.named_parameters())  # a tied weight appears once
    # Thread CPU time, not wall time: on a shared machine other load would stretch random
    # segments. One torch thread, and CPU autograd runs on the calling thread (hooks too).
    clock = time.thread_time
    stamps: dict[str, float] = {}
    for name, p in named:
        p.register_post_accumulate_grad_hook(lambda _p, name=name: stamps.__setitem__(name, clock()))
    ids = torch.randint(0, shape.vocab, (max(1, tokens // seq), seq))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fwds, bwds, readies = [], [], []
    try:
        for run in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            stamps.clear()
            t0 = clock()
            loss = model(input_ids=ids, labels=ids).loss
            t1 = clock()
            loss.backward()
            t2 = clock()
            if run:  # the first run warms up
                fwds.append(t1 - t0)
                bwds.append(t2 - t1)
                readies.append({n: t - t1 for n, t in stamps.items()})
    finally:
        torch.set_num_threads(threads)
    return {
        "shape": shape.__dict__, "tokens": ids.numel(), "seq": seq,
        "fwd": statistics.median(fwds), "bwd": statistics.median(bwds),
        "params": [[n, p.numel(), statistics.median(r[n] for r in readies)] for n, p in named],
    }  # fmt: skip


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def _segments(trace: dict[str, Any]) -> tuple[list[tuple[str, float]], dict[str, float], dict[str, str]]:
    """Cut a trace into ordered (segment, measured s) spans; each layer param's position in its layer's span.

    Segments: ``head`` (ends at the last non-layer grad final before the first layer's), the
    decoder layers top-down, ``embed`` (to the end of backward). Returns the spans, the mean
    fractional position of each in-layer param name, and which segment each non-layer param is in.
    """
    params = trace["params"]
    layer_end: dict[int, float] = {}
    for name, _, t in params:
        m = _LAYER.search(name)
        if m:
            layer_end[int(m.group(1))] = max(layer_end.get(int(m.group(1)), 0.0), t)
    order = sorted(layer_end, reverse=True)  # backward runs the top layer first
    top = [t for name, _, t in params if (m := _LAYER.search(name)) and int(m.group(1)) == order[0]]
    first_layer_start = min(top)
    outer = {name: ("head" if t <= first_layer_start else "embed") for name, _, t in params if not _LAYER.search(name)}
    head_end = max([t for name, _, t in params if outer.get(name) == "head"], default=0.0)
    spans, prev = [("head", head_end)], head_end
    starts = {}
    for i in order:
        starts[i] = prev
        spans.append((f"layer{i}", layer_end[i] - prev))
        prev = layer_end[i]
    spans.append(("embed", trace["bwd"] - prev))
    position: dict[str, list[float]] = {}
    for name, _, t in params:
        m = _LAYER.search(name)
        if m:
            i = int(m.group(1))
            width = layer_end[i] - starts[i]
            position.setdefault(m.group(2), []).append((t - starts[i]) / width if width > 0 else 1.0)
    return spans, {k: statistics.fmean(v) for k, v in position.items()}, outer


def target_ready_times(
    trace: dict[str, Any], target: ModelShape, tokens: int, seq: int, t_bwd: float
) -> list[tuple[str, int, float]]:
    """(name, numel, ready s) of every param of ``target``, from the trace scaled by FLOPs to a backward of ``t_bwd``."""
    src = ModelShape(**trace["shape"])
    spans, position, _ = _segments(trace)
    layer_times = [s for name, s in spans if name.startswith("layer")]
    measured = {"head": spans[0][1], "layer": statistics.fmean(layer_times), "embed": spans[-1][1]}
    scaled = {
        seg: measured[seg] * target.bwd_flops(seg, tokens, seq) / src.bwd_flops(seg, trace["tokens"], trace["seq"])
        for seg in measured
    }
    total = scaled["head"] + target.layers * scaled["layer"] + scaled["embed"]
    k = t_bwd / total
    head, layer = scaled["head"] * k, scaled["layer"] * k
    out = []
    numel = _target_numels(target)
    for name, n in numel.items():
        m = _LAYER.search(name)
        if m:
            rank = target.layers - 1 - int(m.group(1))  # layers done before this one
            t = head + layer * (rank + _position(position, m.group(2)))
        elif "embed_tokens" in name:
            t = t_bwd  # the embedding (and a tied LM head) is final only at the end of backward
        else:
            t = head  # the final norm and an untied LM head: final once the head's backward is done
        out.append((name, n, t))
    return out


def _position(position: dict[str, float], name: str) -> float:
    """A target in-layer param's position; one the dense trace lacks (MoE experts, router) takes its block's mean."""
    if name in position:
        return position[name]
    block = [v for k, v in position.items() if k.split(".")[0] == name.split(".")[0]]
    return statistics.fmean(block) if block else 1.0


def _target_numels(target: ModelShape) -> dict[str, int]:
    """Parameter names and sizes of the target config, built on the meta device (no memory)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        hidden_size=target.hidden, num_hidden_layers=target.layers, num_attention_heads=target.heads,
        num_key_value_heads=target.kv_heads, head_dim=target.head_dim, vocab_size=target.vocab,
        tie_word_embeddings=target.tied,
    )  # fmt: skip
    with torch.device("meta"):
        if target.experts:
            model: torch.nn.Module = Qwen3MoeForCausalLM(Qwen3MoeConfig(
                **common, num_experts=target.experts, num_experts_per_tok=target.experts_per_token,
                moe_intermediate_size=target.moe_intermediate, intermediate_size=target.intermediate,
            ))  # fmt: skip
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=target.intermediate))
    return {n: p.numel() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """One configuration to predict, with its published figures."""

    name: str
    shape: ModelShape
    seq: int
    tokens: int
    """tokens per GPU per step (one micro-batch: the final backward is the one overlapped)"""
    shard: int
    """FSDP world size: each GPU's host steps 1/shard of every parameter"""
    t_fwd: float
    t_bwd: float
    published: str
    published_kept: float | None = None
    """published throughput kept with offload (no-offload step time / offload step time)"""
    published_mode: str = "overlapped"
    """the mode the published figure ran: its implied host rate is solved for in this mode"""


_NEMO_NO_OFFLOAD, _NEMO_OFFLOAD = 0.752, 1.678  # s/step, NVIDIA-NeMo/RL#3628 (1x H100, Qwen3-0.6B, 100% offload)
_PRIME_KEPT = {8192: 0.44, 16384: 0.90, 32768: 1.0, 65536: 1.0}  # PrimeIntellect-ai/prime-rl#3234, 8x H200


def cases(args: argparse.Namespace) -> list[Case]:
    out = []
    if args.case in ("all", "qwen3-0.6b"):
        shape = QWEN3_0_6B
        # calibrated: the published no-offload step is forward + backward + the device AdamW
        t_fb = _NEMO_NO_OFFLOAD - shape.params * DEVICE_ADAM_BYTES_PER_PARAM / (args.hbm_gbps * 1e9)
        out.append(Case("qwen3-0.6b", shape, args.nemo_seq, args.nemo_seq, 1, t_fb / 3, 2 * t_fb / 3,
                        f"NeMo-RL#3628: {_NEMO_NO_OFFLOAD} s no offload, {_NEMO_OFFLOAD} s at 100% offload "
                        f"(Megatron HybridDeviceOptimizer, host step after backward)",
                        _NEMO_NO_OFFLOAD / _NEMO_OFFLOAD, "after_backward"))  # fmt: skip
    if args.case in ("all", "qwen3-30b-a3b"):
        shape = QWEN3_30B_A3B
        rate = args.device_tflops * 1e12 * args.mfu
        for seq, kept in _PRIME_KEPT.items():
            flops = seq * (6.0 * shape.active_params + 6.0 * shape.layers * seq * shape.attn_dim)
            out.append(Case(f"qwen3-30b-a3b-{seq // 1024}k", shape, seq, seq, 8, flops / 3 / rate, 2 * flops / 3 / rate,
                            f"prime-rl#3234: {kept:.0%} of throughput kept at {seq // 1024}K tokens "
                            "(8x H200, CPU optimizer overlapped with backward)", kept))  # fmt: skip
    return out


def _case_buckets(case: Case, trace: dict[str, Any], bucket_numel: int) -> list[Bucket]:
    ready = target_ready_times(trace, case.shape, case.tokens, case.seq, case.t_bwd)
    return pack_buckets([(n, math.ceil(k / case.shard), t) for n, k, t in ready], bucket_numel)


def measure_host_rate(numel: int = 8_000_000, repeats: int = 5) -> float:
    """Bytes/s of the default host Adam step on this machine (bf16 params and grads, fp32 state), median run."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench_offload import _host_step_only, _params, _shapes  # the host step alone, as bench_offload times it

    from offload_fsdp import HybridDeviceOptimizer

    opt = HybridDeviceOptimizer(_params(_shapes(numel, 16), torch.bfloat16, "cpu"), 1.0, lr=1e-3)
    run = _host_step_only(opt)
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return HOST_BYTES_PER_PARAM * numel / statistics.median(times)


def timeline_json(case: Case, schedule: Schedule, mode: str) -> dict[str, Any]:
    """The simulated schedule in ``bench_offload.py --timeline-json``'s format, plus the backward lane."""
    ms = 1e3
    return {
        "format": "offload_timeline", "version": 1, "unit": "ms",
        "device": f"pipeline model: {case.name}, {mode.replace('_', ' ')}",
        "params": sum(b.numel for b in schedule.buckets),
        "step": [schedule.backward[1] * ms, schedule.end * ms],  # optimizer.step(): called when backward ends
        "backward": [schedule.backward[0] * ms, schedule.backward[1] * ms],
        "buckets": [
            {"index": i, "numel": b.numel, "grads_ready": b.ready * ms,
             "d2h": [d[0] * ms, d[1] * ms], "host_step": [h[0] * ms, h[1] * ms], "h2d": [u[0] * ms, u[1] * ms]}
            for i, (b, d, h, u) in enumerate(zip(schedule.buckets, schedule.d2h, schedule.host, schedule.h2d))
        ],
    }  # fmt: skip


def _implied_host_rate(buckets: list[Bucket], case: Case, rates: Rates) -> float | None:
    """The host rate (bytes/s) at which ``case.published_mode`` keeps ``case.published_kept`` (bisection).

    None when the published figure keeps ~all throughput (any fast enough host matches).
    """
    if case.published_kept is None or case.published_kept >= 0.99:
        return None
    lo, hi = 1e8, 1e13
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        p = predict(buckets, case.t_fwd, case.t_bwd, Rates(mid, rates.pcie, rates.hbm))
        kept = p.no_offload / getattr(p, case.published_mode)
        lo, hi = (mid, hi) if kept < case.published_kept else (lo, mid)
    return math.sqrt(lo * hi)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("all", "qwen3-0.6b", "qwen3-30b-a3b"), default="all")
    parser.add_argument("--host-gbps", type=float, default=50.0,
                        help="stated host-step memory traffic per GPU on a real GPU host, GB/s (default 50: "
                             "a 2-socket node's ~400 GB/s of achieved host bandwidth shared by 8 GPUs)")  # fmt: skip
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also predict with the host-step rate measured here (the compiled step, bf16 params)",
    )
    parser.add_argument(
        "--host-gbps-here",
        type=float,
        default=None,
        help="use this as the 'measured here' rate instead of measuring (GB/s)",
    )
    parser.add_argument("--pcie-gbps", type=float, default=50.0, help="PCIe per direction, GB/s (Gen5 x16: ~50)")
    parser.add_argument(
        "--hbm-gbps",
        type=float,
        default=2000.0,
        help="device memory bandwidth reached by the no-offload device AdamW, GB/s (H100: 3350 peak)",
    )
    parser.add_argument("--device-tflops", type=float, default=989.0, help="bf16 dense peak, TFLOP/s (H100/H200)")
    parser.add_argument(
        "--mfu", type=float, default=0.35, help="model FLOPs utilisation of fwd+bwd (long-sequence case)"
    )
    parser.add_argument(
        "--nemo-seq",
        type=int,
        default=4096,
        help="sequence length assumed for the NeMo-RL case (sets only the attention share of a layer)",
    )
    parser.add_argument("--bucket-numel", type=float, default=float(DEFAULT_BUCKET_NUMEL))
    parser.add_argument(
        "--trace-json",
        type=Path,
        default=None,
        help="replay this saved trace instead of recording one (see --save-trace)",
    )
    parser.add_argument("--save-trace", type=Path, default=None, help="write the recorded trace here")
    parser.add_argument("--trace-layers", type=int, default=4)
    parser.add_argument("--trace-hidden", type=int, default=128)
    parser.add_argument("--trace-seq", type=int, default=256)
    parser.add_argument("--trace-tokens", type=int, default=1024)
    parser.add_argument(
        "--timeline-json",
        type=Path,
        default=None,
        help="write the simulated schedule of --case/--mode (first case) for plot_offload_timeline.py",
    )
    parser.add_argument("--mode", choices=("after_backward", "overlapped"), default="overlapped")
    return parser.parse_args(argv)


def _trace(args: argparse.Namespace) -> dict[str, Any]:
    if args.trace_json is not None:
        return json.loads(args.trace_json.read_text())
    h = args.trace_hidden
    small = ModelShape(hidden=h, layers=args.trace_layers, intermediate=3 * h, heads=max(1, h // 32),
                       kv_heads=max(1, h // 64), head_dim=32, vocab=32 * h, tied=True)  # fmt: skip
    trace = record_trace(small, args.trace_tokens, args.trace_seq)
    if args.save_trace is not None:
        args.save_trace.write_text(json.dumps(trace) + "\n")
    return trace


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    trace = _trace(args)
    rates = {"stated GPU host": Rates(args.host_gbps * 1e9, args.pcie_gbps * 1e9, args.hbm_gbps * 1e9)}
    here = args.host_gbps_here * 1e9 if args.host_gbps_here else (measure_host_rate() if args.measure else None)
    if here:
        rates["measured here"] = Rates(here, args.pcie_gbps * 1e9, args.hbm_gbps * 1e9)
    src = ModelShape(**trace["shape"])
    print("Pipeline model of a training step with HybridDeviceOptimizer (100% offload); every input:")
    print(f"  grad-ready trace: transformers Qwen3 {src.layers} layers x hidden {src.hidden}, vocab {src.vocab}, "
          f"{trace['tokens']} tokens (seq {trace['seq']}), CPU, 1 thread: fwd {trace['fwd'] * 1e3:.1f} ms, "
          f"bwd {trace['bwd'] * 1e3:.1f} ms (thread CPU time, median of 3); segments scaled to the target by FLOPs")  # fmt: skip
    print(f"  host step {HOST_BYTES_PER_PARAM} B/param; PCIe {args.pcie_gbps:g} GB/s per direction, "
          f"{PCIE_BYTES_PER_PARAM} B/param each way; device AdamW {DEVICE_ADAM_BYTES_PER_PARAM} B/param at "
          f"{args.hbm_gbps:g} GB/s; buckets of <= {int(args.bucket_numel):,} elements in grad-arrival order")  # fmt: skip
    print(f"  state-only: {STATE_BYTES_PER_PARAM} B/param each way (fp32 master + 2 moments) over the same PCIe, "
          "H2D from each bucket's grad-ready time, device AdamW per bucket after backward, D2H write-back "
          "overlapping the next forward (no device-memory budget bound)")  # fmt: skip
    for label, r in rates.items():
        print(
            f"  host-step rate, {label}: {r.host / 1e9:.1f} GB/s = {r.host / HOST_BYTES_PER_PARAM / 1e9:.2f} Gparam/s"
        )
    print(f"  long-sequence case: {args.device_tflops:g} TFLOP/s x MFU {args.mfu:g}; FLOPs 6 x active params + "
          "causal attention 6 x layers x seq x attn_dim per token; fwd:bwd = 1:2; one micro-batch per step; "
          "FSDP over 8 GPUs (each host steps 1/8 of every param); NeMo-RL case: fwd+bwd calibrated from "
          f"the published no-offload step, seq {args.nemo_seq} assumed")  # fmt: skip
    timeline_written = False
    for case in cases(args):
        buckets = _case_buckets(case, trace, int(args.bucket_numel))
        n = sum(b.numel for b in buckets)
        print(f"\n{case.name}: {n / 1e6:.0f}M params per GPU in {len(buckets)} buckets; T_fwd {case.t_fwd:.3f} s, "
              f"T_bwd {case.t_bwd:.3f} s; last bucket {buckets[-1].numel / 1e6:.0f}M (final at the end of backward)")  # fmt: skip
        print(f"  published: {case.published}")
        for label, r in rates.items():
            p = predict(buckets, case.t_fwd, case.t_bwd, r)
            kept = {m: p.no_offload / getattr(p, m) for m in ("after_backward", "overlapped", "state_only")}
            print(f"  [{label}] T_host {p.t_host:.3f} s: no offload {p.no_offload:.3f} s | after backward "
                  f"{p.after_backward:.3f} s ({kept['after_backward']:.0%} kept) | overlapped {p.overlapped:.3f} s "
                  f"({kept['overlapped']:.0%} kept) | state-only {p.state_only:.3f} s "
                  f"({kept['state_only']:.0%} kept)")  # fmt: skip
            if args.timeline_json is not None and not timeline_written:
                data = timeline_json(case, p.schedules[args.mode], args.mode)
                data["device"] += f", host {r.host / 1e9:.0f} GB/s"
                args.timeline_json.write_text(json.dumps(data, indent=1) + "\n")
                timeline_written = True
                print(f"  wrote {args.timeline_json} ({args.mode}, {label})")
        r = rates["stated GPU host"]
        implied = _implied_host_rate(buckets, case, r)
        if implied is not None:
            p = predict(buckets, case.t_fwd, case.t_bwd, Rates(implied, r.pcie, r.hbm))
            print(f"  host rate at which {case.published_mode.replace('_', ' ')} matches the published figure: "
                  f"{implied / 1e9:.1f} GB/s ({implied / HOST_BYTES_PER_PARAM / 1e9:.2f} Gparam/s); there: "
                  f"after backward {p.after_backward:.3f} s ({p.no_offload / p.after_backward:.0%} kept), "
                  f"overlapped {p.overlapped:.3f} s ({p.no_offload / p.overlapped:.0%} kept)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
