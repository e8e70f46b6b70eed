"""End-to-end demo: FSDP2 + HybridDeviceOptimizer, async checkpoint, kill, resume, export.

Run it plainly and it launches its own ranks (2 by default)::

    python scripts/demo.py                    # or: bash scripts/demo.sh

What it does, each step checked and summarised at the end:

1. run A: trains a small GPT-style byte-level model under FSDP2 with
   ``HybridDeviceOptimizer(torch.optim.AdamW(...), offload_fraction=1)`` and a
   warm-up + cosine LR schedule, saves an async ``fsdp_dtensor`` checkpoint, and
   is killed with SIGKILL a few steps later;
2. run B: resumes from that checkpoint at the same world size; its losses must
   equal run A's bit for bit on the steps both ran;
3. run C: resumes from the same checkpoint in a single process; its losses
   must match run B's within a stated tolerance (reduction order differs);
4. exports run B's final checkpoint to HF-style safetensors with ``fsdp-ckpt``
   and reloads that export into a plain (unsharded) model for an inference
   check: same eval loss as the trained model, and a greedy sample.

A rank is any process started with ``RANK`` / ``WORLD_SIZE`` in its
environment, so ``torchrun --nproc-per-node 2 scripts/demo.py --phase train
--run A --out demo_out`` runs one phase under torchrun. On a machine with a GPU
per rank the ranks use CUDA and the summary reports the device memory the offload saves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # so a plain `python scripts/demo.py` finds the packages uninstalled

import checkpoint  # noqa: E402
from offload_fsdp import HybridDeviceOptimizer  # noqa: E402

# Single process vs 2-rank FSDP sums gradients in a different order; Adam
# turns those last-bit differences into small, slowly growing loss differences.
SINGLE_PROCESS_LOSS_RTOL = 1e-3
EXPORT_EVAL_LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Config:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 64
    global_batch: int = 8
    steps: int = 40
    save_at: int = 20
    kill_at: int = 30
    lr: float = 3e-3
    warmup: int = 5
    seed: int = 0

    @property
    def vocab(self) -> int:
        return 256  # bytes


# ---------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- data


def corpus() -> torch.Tensor:
    """Bytes of a few standard-library sources: text every machine has, no download."""
    import dataclasses
    import json as json_mod
    import pathlib
    import textwrap

    text = b"".join(Path(m.__file__).read_bytes() for m in (dataclasses, json_mod.decoder, pathlib, textwrap))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def global_batch(data: torch.Tensor, cfg: Config, step: int) -> torch.Tensor:
    """The same global batch for a step whatever the world size (indices drawn from the step number)."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.global_batch,), generator=gen)
    return torch.stack([data[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def local_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


# ----------------------------------------------------------------------- one rank


def lr_lambda(cfg: Config):
    def schedule(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def build(cfg: Config, device: torch.device, world_size: int):
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg).to(device)
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt = HybridDeviceOptimizer(inner, offload_fraction=1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return model, opt, sched


def run_phase(args: argparse.Namespace, cfg: Config) -> None:
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # One accelerator per rank (NCCL and its peers refuse two ranks on one device): with fewer
    # devices than ranks, run on the CPU over gloo. Any accelerator torch.accelerator reports.
    on_device = torch.accelerator.is_available() and torch.accelerator.device_count() >= world_size
    kind = torch.accelerator.current_accelerator().type if on_device else "cpu"
    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0))) if on_device else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if world_size > 1:
        import torch.distributed as dist

        if on_device:
            torch.accelerator.set_device_index(device.index)
        dist.init_process_group(dist.get_default_backend_for_device(device))
    out = Path(args.out)
    model, opt, sched = build(cfg, device, world_size)
    start = 0
    if args.resume:
        extra = checkpoint.load(args.resume, model=model, optimizer=opt)
        sched.load_state_dict(extra["scheduler"])
        start = int(extra["step"])
    data = corpus()
    log = open(out / f"{args.run}.jsonl", "a") if rank == 0 else None
    if log:  # what the summary reports about this run's setup
        setup = {
            "optimizer": type(opt).__name__,
            "offload_fraction": opt.offload_fraction,
            "scheduler": type(sched).__name__,
        }
        (out / f"{args.run}.setup.json").write_text(json.dumps(setup))
    pending = None
    for step in range(start, cfg.steps):
        batch = local_batch(global_batch(data, cfg, step), rank, world_size).to(device)
        loss = lm_loss(model, batch)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        loss_value = _mean_over_ranks(loss.detach(), world_size)
        if log:
            log.write(json.dumps({"step": step, "loss": loss_value, "lr": sched.get_last_lr()[0]}) + "\n")
            log.flush()
        done = step + 1
        if args.hold and done == cfg.kill_at:
            _hold_for_kill(out / f"{args.run}.held", pending, rank)
        if done == cfg.save_at or done == cfg.steps:
            if pending is not None:
                pending.result()
            pending = checkpoint.save(
                out / "ckpt" / args.run / f"step_{done}",
                model=model,
                optimizer=opt,
                extra={"step": done, "scheduler": sched.state_dict()},
                async_=True,
            )
            if log:  # an async save returns a Future once staged; a blocking one returns None
                with open(out / f"{args.run}.saves.jsonl", "a") as saves:
                    saves.write(json.dumps({"step": done, "async": isinstance(pending, Future)}) + "\n")
    if pending is not None:
        pending.result()
    eval_loss = _eval_loss(model, data, cfg, device)  # every rank: FSDP's forward all-gathers
    if rank == 0:
        stats = {"eval_loss": eval_loss, "world_size": world_size, "device": device.type, **_offload_memory(opt)}
        (out / f"{args.run}.final.json").write_text(json.dumps(stats))
    if world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


def _hold_for_kill(held: Path, pending: Future | None, rank: int) -> None:
    """Stop at the kill point: the save resumed from is committed, then wait to be SIGKILLed.

    Rank 0 says where it stands in ``held``; the launcher kills every rank once
    it is there (a run that went on would finish before a kill polled for it).
    """
    if pending is not None:
        pending.result()
    if rank == 0:
        held.write_text("waiting for SIGKILL\n")
    while True:
        time.sleep(3600)


def _mean_over_ranks(loss: torch.Tensor, world_size: int) -> float:
    if world_size > 1:
        import torch.distributed as dist

        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= world_size
    return loss.item()


@torch.no_grad()
def _eval_loss(model: nn.Module, data: torch.Tensor, cfg: Config, device: torch.device) -> float:
    batch = global_batch(data, cfg, step=10_000_000).to(device)  # a batch training never sees
    return lm_loss(model, batch).item()


def _offload_memory(opt: HybridDeviceOptimizer) -> dict:
    host = sum(t.numel() * t.element_size() for st in opt.state.values() for t in _local_tensors(st))
    return {"optimizer_state_host_bytes": host}


def _local_tensors(state: dict):
    from optim import local_tensor

    for value in state.values():
        if isinstance(value, torch.Tensor):
            yield local_tensor(value)


# ------------------------------------------------------------------- orchestration


def launch(
    args: argparse.Namespace,
    run: str,
    world_size: int,
    *,
    resume: str | None = None,
    kill_at: int | None = None,
    phases: Phases | None = None,
) -> None:
    """Start ``world_size`` ranks of this script as a torchrun would; optionally SIGKILL them at a step.

    ``phases``: says when the run's checkpoint is committed and when the ranks are killed.
    """
    port = _free_port()
    cmd = [sys.executable, __file__, "--phase", "train", "--run", run, "--out", args.out, *_config_args(args)]
    if resume:
        cmd += ["--resume", resume]
    if kill_at is not None:
        cmd += ["--hold"]  # the ranks stop at the kill step and wait there to be killed
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    held = Path(args.out) / f"{run}.held"
    deadline = time.monotonic() + args.timeout
    saved = False
    while any(p.poll() is None for p in procs):
        if phases is not None and not saved and _committed(args, run):
            saved = True
            phases.say("save", f"run {run}'s async checkpoint of step {args.save_at} is committed")
        # the ranks wait at the kill point until killed, so the kill lands there however slow this loop is
        if kill_at is not None and held.exists() and _committed(args, run):
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)  # no clean-up, no flush: a real crash
            for p in procs:
                p.wait()
            if phases is not None:
                phases.say("kill", f"SIGKILL to run {run}'s ranks at step {kill_at}")
            return
        if time.monotonic() > deadline:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise SystemExit(f"demo: run {run} did not finish within {args.timeout}s")
        time.sleep(0.05)
    failed = [p.returncode for p in procs if p.returncode != 0]
    if failed:
        raise SystemExit(f"demo: run {run} failed (exit codes {failed}); see the output above")


def _committed(args: argparse.Namespace, run: str) -> bool:
    return (Path(args.out) / "ckpt" / run / f"step_{args.save_at}" / "manifest.json").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--{k.replace('_', '-')}={getattr(args, k)}" for k in asdict(Config()) if getattr(args, k, None) is not None
    ]


def read_losses(path: Path, field: str = "loss") -> dict[int, float]:
    """``step -> field`` (loss, or lr) of a run's log."""
    return {r["step"]: r[field] for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


MARKER = ".offload_fsdp_demo"
"""Written first into a demo's output folder: the folder is the demo's to clear on the next run."""


def _demo_files(name: str) -> bool:
    """Whether ``name`` (an entry of the output folder) is something the demo writes."""
    runs = {
        f"{r}{suffix}" for r in "ABC" for suffix in (".jsonl", ".setup.json", ".saves.jsonl", ".final.json", ".held")
    }
    from checkpoint.atomic import lock_path, old_path, staging_path

    # ckpt / export and the staging / swap / lock siblings a save or export cut short leaves (not export.tar.gz)
    folders = {f(Path(d)).name for d in ("ckpt", "export") for f in (Path, staging_path, old_path, lock_path)}
    return name in runs or name in folders or name in {MARKER, "summary.json", "loss_curve.png"}


def prepare_out(out: Path) -> None:
    """Make ``out`` ready for a fresh demo; never delete what the demo did not write.

    A new or empty folder is used as it is. A previous demo's output (it holds
    :data:`MARKER`) loses only the demo's own files; anything else in it stays.
    Any other non-empty folder is refused.
    """
    import shutil

    if out.exists() and not out.is_dir():
        raise SystemExit(f"demo: --out {out} is a file; pass a directory (it is created if absent)")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise SystemExit(
                f"demo: --out {out} is not empty and not a previous demo output; "
                "pass a new or empty directory (the demo never deletes files it did not write)"
            )
        for entry in out.iterdir():
            if _demo_files(entry.name) and entry.name != MARKER:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("output of scripts/demo.py: its own files here are replaced by the next run\n")


class Phases:
    """One line per phase as the demo reaches it (train, save, kill, resume, export), with the time so far."""

    NAMES = ("train", "save", "kill", "resume", "export")

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def say(self, phase: str, text: str) -> None:
        number = self.NAMES.index(phase) + 1
        elapsed = time.perf_counter() - self.start
        print(f"demo [{number}/{len(self.NAMES)}] {elapsed:6.1f} s  {phase}: {text}", flush=True)


def orchestrate(args: argparse.Namespace, cfg: Config) -> dict:
    out = Path(args.out)
    prepare_out(out)
    t0 = time.perf_counter()
    phases = Phases()
    phases.say(
        "train",
        f"run A, {args.world_size} ranks, FSDP2 + HybridDeviceOptimizer(offload_fraction=1), "
        f"{cfg.kill_at} of {cfg.steps} steps",
    )
    launch(args, "A", args.world_size, kill_at=cfg.kill_at, phases=phases)
    resume_from = str(out / "ckpt" / "A" / f"step_{cfg.save_at}")
    phases.say("resume", f"run B from step {cfg.save_at} on {args.world_size} ranks (losses must match A bit for bit)")
    launch(args, "B", args.world_size, resume=resume_from)
    phases.say("resume", f"run C from step {cfg.save_at} in one process (losses within {SINGLE_PROCESS_LOSS_RTOL})")
    launch(args, "C", 1, resume=resume_from)
    export_dir = out / "export"
    phases.say("export", f"fsdp-ckpt export of run B's step {cfg.steps} to safetensors, reloaded into a plain model")
    final = out / "ckpt" / "B" / f"step_{cfg.steps}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "checkpoint.tool.cli",
            "export",
            str(final),
            str(export_dir),
            "--format",
            "safetensors",
            "--model-only",
        ],
        check=True,
        cwd=REPO,
    )
    summary = summarise(out, cfg, export_dir)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(out, cfg)
    return summary


def summarise(out: Path, cfg: Config, export_dir: Path) -> dict:
    a, b, c = (read_losses(out / f"{r}.jsonl") for r in "ABC")
    overlap = sorted(set(a) & set(b))
    single = sorted(set(b) & set(c))
    max_rel = max(abs(b[s] - c[s]) / abs(b[s]) for s in single)
    final = json.loads((out / "B.final.json").read_text())
    export_loss = export_eval_loss(export_dir, cfg)
    lrs = {r: read_losses(out / f"{r}.jsonl", "lr") for r in "ABC"}
    setups = {r: json.loads((out / f"{r}.setup.json").read_text()) for r in "ABC"}
    return {
        "steps_run_A_before_kill": len(a),
        "resume_step": cfg.save_at,
        "bit_exact_steps_compared": len(overlap),
        "first_step_after_resume": {r: min(lrs[r]) for r in "BC"},
        # the resumed runs' learning rates on the steps run A also ran (before its kill)
        "lr_steps_compared": {r: len(set(lrs[r]) & set(lrs["A"])) for r in "BC"},
        "lr_schedule_restored": all(lrs[r][s] == lrs["A"][s] for r in "BC" for s in set(lrs[r]) & set(lrs["A"]))
        and len(overlap) > 0,
        "optimizer": {r: setups[r]["optimizer"] for r in "ABC"},
        "offload_fraction": {r: setups[r]["offload_fraction"] for r in "ABC"},
        "saves": {r: [json.loads(line) for line in (out / f"{r}.saves.jsonl").read_text().splitlines()] for r in "AB"},
        "resume_bit_exact": all(a[s] == b[s] for s in overlap) and len(overlap) > 0,
        "single_process_steps_compared": len(single),
        "single_process_max_rel_diff": max_rel,
        "single_process_within_tolerance": max_rel <= SINGLE_PROCESS_LOSS_RTOL,
        "first_loss": a[0],
        "final_loss": b[cfg.steps - 1],
        "eval_loss_trained": final["eval_loss"],
        "eval_loss_from_export": export_loss["eval_loss"],
        "export_matches": math.isclose(final["eval_loss"], export_loss["eval_loss"], rel_tol=EXPORT_EVAL_LOSS_RTOL),
        "sample": export_loss["sample"],
        # On a GPU this is device memory the offload saves on rank 0.
        "optimizer_state_on_host_bytes_rank0": final["optimizer_state_host_bytes"],
        "device": final["device"],
    }


@torch.no_grad()
def export_eval_loss(export_dir: Path, cfg: Config) -> dict:
    """Reload the safetensors export into a plain model: eval loss and a greedy sample."""
    from safetensors.torch import load_file

    index = json.loads((export_dir / "model.safetensors.index.json").read_text())
    weights = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(load_file(export_dir / shard))
    model = TinyGPT(cfg)
    model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()}, strict=True)
    model.eval()
    loss = lm_loss(model, global_batch(corpus(), cfg, step=10_000_000)).item()
    idx = torch.tensor([list(b"def ")])
    for _ in range(min(40, cfg.seq_len - 4)):
        idx = torch.cat([idx, model(idx)[:, -1:].argmax(-1)], dim=1)
    return {"eval_loss": loss, "sample": bytes(idx[0].tolist()).decode("utf-8", "replace")}


def plot(out: Path, cfg: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {
        "A": ("run A (killed)", "-"),
        "B": ("run B (resumed, same world size)", "--"),
        "C": ("run C (resumed, 1 process)", ":"),
    }
    for run, (label, style) in styles.items():
        losses = read_losses(out / f"{run}.jsonl")
        ax.plot(list(losses), list(losses.values()), style, label=label)
    ax.axvline(cfg.save_at - 0.5, color="grey", lw=0.8)
    ax.annotate("async checkpoint", (cfg.save_at - 0.5, ax.get_ylim()[1]), ha="right", va="top", fontsize=8)
    killed = read_losses(out / "A.jsonl")
    last = max(killed)
    ax.plot([last], [killed[last]], "rx", label="run A killed (SIGKILL)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("offload-fsdp demo: FSDP2 + HybridDeviceOptimizer, kill and resume")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png", dpi=100)


# ------------------------------------------------------------------------------ CLI


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        default=str(REPO / "demo_out"),
        help="output folder: new, empty, or a previous demo's (only the demo's own files are replaced)",
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks for runs A and B")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (what the test suite runs)")
    parser.add_argument("--phase", choices=["all", "train"], default="all", help=argparse.SUPPRESS)
    parser.add_argument("--run", default="A", help=argparse.SUPPRESS)
    parser.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    for field, default in asdict(Config()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=None)
    args = parser.parse_args(argv)
    base = (
        Config(d_model=64, n_layers=2, seq_len=32, global_batch=4, steps=12, save_at=6, kill_at=9)
        if args.quick
        else Config()
    )
    overrides = {k: getattr(args, k) for k in asdict(base) if getattr(args, k) is not None}
    cfg = Config(**{**asdict(base), **overrides})
    for k, v in asdict(cfg).items():
        setattr(args, k, v)  # ranks get the resolved config, whatever flags the parent had
    if not 0 < cfg.save_at < cfg.kill_at < cfg.steps:
        parser.error(f"need 0 < --save-at ({cfg.save_at}) < --kill-at ({cfg.kill_at}) < --steps ({cfg.steps})")
    if cfg.global_batch % args.world_size:
        parser.error(f"--global-batch {cfg.global_batch} must be divisible by --world-size {args.world_size}")
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    if args.phase == "train":
        run_phase(args, cfg)
        return 0
    summary = orchestrate(args, cfg)
    print(json.dumps(summary, indent=1))
    ok = summary["resume_bit_exact"] and summary["single_process_within_tolerance"] and summary["export_matches"]
    print(f"demo {'OK' if ok else 'FAILED'}: outputs in {args.out} (loss_curve.png, summary.json)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
