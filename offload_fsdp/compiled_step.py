"""The host Adam(W) step as one compiled C loop per piece (the default where a C compiler is found).

``OFFLOAD_FSDP_HOST_STEP`` chooses: ``auto`` (default) uses this loop for the
buckets it covers when it builds, else torch's fused kernel; ``compiled`` insists
on it (building at construction, warning if it cannot); ``fused`` never uses it.

The fused path (:mod:`offload_fsdp.fused_step`) runs torch's fused kernel on
fp32 views, so a bf16 grad is first upcast into scratch, bf16 moments are upcast and
cast back, and the bf16 param staging is written by a separate downcast: several
extra passes over each piece. This module does all of it in one loop that reads the
bf16 (or fp32) grad and the fp32 master and moments once and writes the master, the
moments (fp32, bf16 round-to-nearest or bf16 stochastic rounding) and the bf16 param
staging once: the 28 B/param of the roofline and nothing else (the staging with
streaming stores, so its cache lines are not read in first).

The loop mirrors the arithmetic of torch's CPU fused Adam kernel operation for
operation (same fp32 roundings, the same ``lerp`` with a fused multiply-add, no
other contraction), and the stochastic rounding reads the same counter-based noise
windows of :class:`~offload_fsdp.fused_step.PieceScratch` over the same piece grid
(as uint16: the same 16-bit values in half the bytes of the fused path's int32),
so results are bit-identical to the fused path (checked by
``tests/test_offload_fastpath.py``): state dicts and resumes are interchangeable.

It is plain C (no torch headers, no torch.compile), compiled with the system C
compiler (``$CC``, else ``cc``) at the first step that needs it (at construction
with ``compiled``): about
4-10 s on a busy 2-core host, then cached per user (``$OFFLOAD_FSDP_CACHE_DIR``,
else ``~/.cache/offload_fsdp``, keyed by source, flags, compiler and CPU) so later
processes load it in ~0.1 s. The build happens once per machine: it runs under an
exclusive file lock beside the cached library, so when every rank of a fresh node
starts at once one compiles and the others wait and load its result; a WARNING
line announces it. ``python -m offload_fsdp.compiled_step --build`` builds it ahead
of time (node setup), so the first training step pays nothing. Before first use it checks itself against torch's
kernel on a small problem (the vector width of torch's scalar tail is found
there). It is loaded with :mod:`ctypes` and called once per bucket; with more than
one torch thread (``torch.get_num_threads()``) the call spreads the bucket's pieces
over that many threads (torch's OpenMP threads; pthreads of its own where the compiler has no OpenMP). Buckets it does not cover (fp16
anything, a bf16 master with ``param_update_in_fp32=False``, all-fp32 buckets that
the fused kernel already steps at the roofline) and any failure to compile or load
fall back to :func:`~offload_fsdp.fused_step.adam_bucket_step`. A failure is reported once
per process: a ``RuntimeWarning`` with ``compiled``, a log warning with ``auto``.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no advisory locks (see _exclusive)
    fcntl = None  # type: ignore[assignment]

from offload_fsdp.buckets import HostBucket
from offload_fsdp.fused_step import (
    _SR_BELOW,
    AdamHyper,
    PieceScratch,
    adam_bucket_step,
    fused_adam,
    noise_counter,
    noise_offset,
    pieces,
)
from offload_fsdp.records import ParamShard

__all__ = [
    "HOST_STEP_ENV",
    "HostStep",
    "choose_host_step",
    "compiled_adam_bucket_step",
    "compiled_step_available",
    "select_host_step",
]

logger = logging.getLogger(__name__)

HOST_STEP_ENV = "OFFLOAD_FSDP_HOST_STEP"
"""Environment variable read at optimizer construction: ``auto`` (default), ``compiled`` or ``fused``."""

HostStep = Callable[[HostBucket, list[ParamShard], AdamHyper, PieceScratch], None]

_CHOSEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("offload_fsdp_host_step", default=None)
"""the choice an optimizer under construction was given (``OffloadOptions.host_step``), over the environment"""


@contextlib.contextmanager
def choose_host_step(choice: str | None) -> Iterator[None]:
    """Kernels built inside take ``choice`` (``auto`` / ``compiled`` / ``fused``) instead of ``$OFFLOAD_FSDP_HOST_STEP``.

    ``None``: the environment variable decides, as without this context. (A kernel factory takes
    no arguments, so an optimizer's own choice reaches the Adam kernel it builds this way.)
    """
    token = _CHOSEN.set(choice)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


_MOMENT_FP32, _MOMENT_BF16_RNE, _MOMENT_BF16_SR = 0, 1, 2

_SOURCE = (Path(__file__).parent / "host_adam.c").read_text()
"""The C source (``host_adam.c`` beside this module, shipped as package data)."""

_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
"""``-ffp-contract=off``: only the explicit ``fmaf`` of lerp fuses, as in torch's kernel;
``-fno-math-errno`` lets ``sqrtf`` vectorise (no errno to set, results unchanged)."""

_OPENMP_FLAGS = ["-fopenmp"]
"""Tried first (the batch entry point then runs on torch's OpenMP threads); a compiler
without OpenMP support builds the pthread variant instead."""


class _AdamArgs(ctypes.Structure):
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("param", "grad", "exp_avg", "exp_avg_sq", "stage", "noise_m", "noise_v")],
        ("n", ctypes.c_int64), ("vec_width", ctypes.c_int64),
        *[(name, ctypes.c_float) for name in ("gsign", "decay", "wd", "lerp_w", "beta2", "c2", "bc2_sqrt", "eps", "step_size")],
        *[(name, ctypes.c_int32) for name in ("grad_bf16", "m_mode", "v_mode", "has_stage", "l2", "lerp_small")],
    ]  # fmt: skip


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False
_vec_width = 8


def _cache_dir() -> Path:
    base = os.environ.get("OFFLOAD_FSDP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "offload_fsdp"
    )
    return Path(base)


def _build_key(compiler: str) -> str:
    """Hash of everything the binary depends on: source, flags, compiler, and the CPU (``-march=native``)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = "\n".join(sorted({line for line in Path("/proc/cpuinfo").read_text().splitlines()
                                 if line.startswith(("model name", "flags"))}))  # fmt: skip
    text = "\0".join([_SOURCE, " ".join(_CFLAGS), version, platform.machine(), cpu])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def library_path(compiler: str | None = None) -> Path:
    """Where the compiled step for this machine, source and compiler is cached."""
    compiler = compiler or os.environ.get("CC") or "cc"
    return _cache_dir() / f"host_adam-{_build_key(compiler)}.so"


def _compile(compiler: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="offload_fsdp_step_") as tmp:
        src, lib = Path(tmp, "host_adam.c"), Path(tmp, "host_adam.so")
        src.write_text(_SOURCE)
        for extra in (_OPENMP_FLAGS, []):
            command = [compiler, *_CFLAGS, *extra, str(src), "-o", str(lib), "-lm"]
            proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if proc.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        shutil.copyfile(lib, staged)
        os.replace(staged, out)  # atomic: a concurrent process sees the old file or the whole new one


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if missing) for the block.

    Where ``fcntl`` does not exist (Windows) there is no lock: concurrent builds then
    each write their own temporary file and replace the target atomically, so the
    result is still whole, only paid more than once.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        if fcntl is None:
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process builds
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ensure_built(compiler: str, path: Path) -> bool:
    """Build ``path`` unless it exists, once per machine: concurrent processes wait for one builder.

    Returns True if this process built it. Raises ``OSError`` when the cache is not writable.
    """
    if path.exists():
        return False
    with _exclusive(path.with_name(path.name + ".lock")):
        if path.exists():  # another process built it while this one waited for the lock
            return False
        logger.warning(
            "building the host Adam step once for this machine (~5-20 s, %s); later processes load it from %s. "
            "`python -m offload_fsdp.compiled_step --build` does this ahead of time",
            compiler, path,
        )  # fmt: skip
        _compile(compiler, path)
        return True


def _compile_and_load() -> ctypes.CDLL:
    """The C loop as a shared library: from the per-user cache, else compiled into it (or a temp dir)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"C compiler {compiler!r} not found; install gcc or set CC")
    path = library_path(compiler)
    if not path.exists():
        try:
            _ensure_built(compiler, path)
        except OSError as exc:  # cache not writable: build a private copy for this process only
            logger.warning(
                "building the host Adam step for this process only (~5-20 s, %s): the cache %s is not writable "
                "(%s), so every process pays this again; set OFFLOAD_FSDP_CACHE_DIR to a writable directory "
                "and run `python -m offload_fsdp.compiled_step --build` once",
                compiler, path.parent, exc,
            )  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="offload_fsdp_step_") as tmp:
                private = Path(tmp, "host_adam.so")
                _compile(compiler, private)
                library = ctypes.CDLL(str(private))  # mapped now: the file may go with the directory
                return _declare(library)
    return _declare(ctypes.CDLL(str(path)))


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    library.offload_fsdp_adam.argtypes = [ctypes.POINTER(_AdamArgs)]
    library.offload_fsdp_adam.restype = ctypes.c_int
    library.offload_fsdp_adam_batch.argtypes = [ctypes.POINTER(_AdamArgs), ctypes.c_int64, ctypes.c_int]
    library.offload_fsdp_adam_batch.restype = ctypes.c_int
    return library


def _probe_vec_width(library: ctypes.CDLL) -> int:
    """The vector width at which torch's fused kernel switches to its scalar tail, found by agreement.

    Runs torch's kernel and the C loop (fp32 everything) on a small problem whose
    tensors end in partial vectors, for Adam with L2, AdamW and a large lerp weight,
    and returns the width at which all results are bit-identical. Raises if none is:
    this torch build rounds differently, and the fused path must be used.
    """
    gen = torch.Generator().manual_seed(0)
    cases = [(False, 0.1, 0.9), (True, 0.1, 0.9), (True, 0.0, 0.3)]  # (decoupled, weight_decay, beta1)
    for width in (8, 16, 4, 32):
        agree = True
        for decoupled, wd, beta1 in cases:
            ref = [torch.randn(45, generator=gen) for _ in range(3)] + [torch.rand(45, generator=gen)]
            ours = [t.clone() for t in ref]
            hyper = AdamHyper(
                lr=0.01, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=wd, maximize=False, decoupled=decoupled
            )
            for step in (1.0, 2.0, 3.0):
                fused_adam(hyper, ([t] for t in ref), [torch.tensor(step)])  # the fused path's own kernel call
                p, g, m, v = ours
                args = _AdamArgs(param=p.data_ptr(), grad=g.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(),
                                 n=p.numel(), vec_width=width, **_scalars(hyper, step), grad_bf16=0, m_mode=0, v_mode=0, has_stage=0)  # fmt: skip
                library.offload_fsdp_adam(ctypes.byref(args))
            agree = agree and all(torch.equal(a, b) for a, b in zip(ref, ours))
        if agree:
            return width
    raise RuntimeError("its arithmetic does not reproduce this torch build's fused Adam kernel bit for bit")


def compiled_step_available(*, warn: bool = True) -> bool:
    """Compile, load and self-check the C step once per process; False if that fails.

    The first failure is reported once: a ``RuntimeWarning`` if ``warn`` (the user
    asked for ``compiled``), else a log warning (``auto`` quietly uses the fused path).
    """
    global _library, _load_failed, _vec_width
    with _lock:
        if _library is None and not _load_failed:
            try:
                library = _compile_and_load()
                _vec_width = _probe_vec_width(library)
                _library = library
                logger.info("compiled host Adam step loaded (torch kernel vector width %d)", _vec_width)
            except Exception as exc:  # any failure means: use the fused path, and say so once
                _load_failed = True
                message = (
                    f"could not build the compiled host step ({exc}); falling back to torch's fused kernel "
                    f"(same results, slower for bf16); set {HOST_STEP_ENV}=fused to skip the attempt"
                )
                if warn:
                    warnings.warn(f"{HOST_STEP_ENV}=compiled: {message}", RuntimeWarning, stacklevel=3)
                else:
                    logger.warning(message)
        return _library is not None


def _moment_mode(flat: torch.Tensor, beta: float) -> int | None:
    if flat.dtype == torch.float32:
        return _MOMENT_FP32
    if flat.dtype == torch.bfloat16:
        return _MOMENT_BF16_SR if 1.0 - beta < _SR_BELOW else _MOMENT_BF16_RNE
    return None


def _covered(bucket: HostBucket) -> bool:
    """Whether the C loop steps this bucket (else the fused path does, with the same results)."""
    m, v = bucket.state["exp_avg"], bucket.state["exp_avg_sq"]
    master, grads = bucket.master, bucket.grad_stage
    assert master is not None and grads is not None, "a host bucket has its master and grad staging"
    needs_cast = bucket.param_stage is not None or any(t.dtype != torch.float32 for t in (grads, m, v))
    return (
        needs_cast
        and master.dtype == torch.float32
        and grads.dtype in (torch.float32, torch.bfloat16)
        and m.dtype in (torch.float32, torch.bfloat16)
        and v.dtype in (torch.float32, torch.bfloat16)
        and (bucket.param_stage is None or bucket.param_stage.dtype == torch.bfloat16)
    )


def _scalars(hyper: AdamHyper, step: float) -> dict[str, float | int]:
    """Per-step scalars computed in double as torch's kernel does, rounded to fp32 by ctypes."""
    l2 = not hyper.decoupled and hyper.weight_decay != 0
    lerp_w = 1.0 - hyper.beta1
    return {
        "gsign": -1.0 if hyper.maximize else 1.0,
        "decay": 1.0 - hyper.lr * hyper.weight_decay if hyper.decoupled else 1.0,
        "wd": hyper.weight_decay, "l2": int(l2),
        "lerp_w": lerp_w, "lerp_small": int(abs(ctypes.c_float(lerp_w).value) < 0.5),
        "beta2": hyper.beta2, "c2": 1.0 - hyper.beta2,
        "bc2_sqrt": math.sqrt(1.0 - hyper.beta2**step), "eps": hyper.eps,
        "step_size": hyper.lr / (1.0 - hyper.beta1**step),
    }  # fmt: skip


def _run(items: list[_AdamArgs] | ctypes.Array[_AdamArgs], threads: int = 1) -> None:
    """Step ``items`` in one C call, spread over ``threads`` threads; ctypes drops the GIL for the whole call.

    Built with OpenMP (``_OPENMP_FLAGS``), the call runs on torch's own OpenMP pool (the
    loader hands the library the ``libgomp`` torch already loaded); a build without it
    starts pthreads per call and joins them before returning.
    """
    if not items:
        return
    batch = items if isinstance(items, ctypes.Array) else (_AdamArgs * len(items))(*items)
    assert _library is not None, "compiled_step_available() loads the library before any step"
    if _library.offload_fsdp_adam_batch(batch, len(items), threads) != 0:
        raise AssertionError("compiled host step: unknown dtype combination")  # _covered() admits none


_PER_STEP = struct.Struct("<QQqq9f6i")
"""An item's fields from ``noise_m`` to ``lerp_small`` (contiguous in :class:`_AdamArgs`): the noise
pointers, length and width (written with them), and the scalars and flags, in declaration order."""
_PER_STEP_OFFSET = _AdamArgs.noise_m.offset
_SCALAR_FIELDS = [field[0] for field in _AdamArgs._fields_[9:]]  # gsign .. lerp_small
assert _PER_STEP_OFFSET + _PER_STEP.size == _AdamArgs.lerp_small.offset + 4, "_PER_STEP must match _AdamArgs"


class _CallItems:
    """A bucket's C-call items, built once and reused while its active records and buffers are unchanged.

    The pointers into the bucket's buffers are fixed by the layout; per step only the
    scalars (step count, lr, ...) and the noise windows (tied to the step count)
    change. They are packed into the item array by one ``struct`` call per item: a
    step runs this right after the previous bucket's C loop streamed hundreds of MB
    through the caches, so what counts is how little code and data it touches (each
    torch op there costs tens of microseconds cold).
    """

    def __init__(self, key: tuple, records: list[ParamShard], batch: ctypes.Array[_AdamArgs],
                 rows: list[tuple[int, int, int, int, int]], piece_starts: list[int], piece_first: list[int]) -> None:  # fmt: skip
        self.key = key
        self.records = records
        """the active records the key names by id, held so that no other object can take their ids"""
        self.batch = batch
        self.view = memoryview(batch).cast("B")  # raw bytes, for struct.pack_into
        self.rows = rows
        """per item: (byte offset of its per-step fields, length, bucket offset, piece index, record index)"""
        self.piece_starts, self.piece_first = piece_starts, piece_first
        self.noise_base = 0
        """address of the scratch's uint16 noise table, set at the first step with stochastic rounding"""


_call_items: weakref.WeakKeyDictionary[PieceScratch, dict[int, _CallItems]] = weakref.WeakKeyDictionary()
"""Per optimizer (its scratch), bucket index -> its C-call items; items whose key no longer matches is rebuilt."""


def _build_call_items(key: tuple, bucket: HostBucket, active: list[ParamShard], scratch: PieceScratch) -> _CallItems:
    m_flat, v_flat = bucket.state["exp_avg"], bucket.state["exp_avg_sq"]
    master, stage, grads = bucket.master, bucket.param_stage, bucket.grad_stage
    assert master is not None and grads is not None, "a host bucket has its master and grad staging"
    sizes = {name: t.element_size() for name, t in (("p", master), ("g", grads), ("m", m_flat), ("v", v_flat))}
    bases = {"p": master.data_ptr(), "g": grads.data_ptr(), "m": m_flat.data_ptr(), "v": v_flat.data_ptr()}
    index = {id(r): i for i, r in enumerate(active)}
    items, rows, piece_starts, piece_first = [], [], [], []
    for start, _stop, segs in pieces(active, scratch.numel):
        piece_starts.append(start)
        piece_first.append(index[id(segs[0][2])])
        for b, e, record in segs:
            items.append(_AdamArgs(param=bases["p"] + b * sizes["p"], grad=bases["g"] + b * sizes["g"],
                                   exp_avg=bases["m"] + b * sizes["m"], exp_avg_sq=bases["v"] + b * sizes["v"],
                                   stage=stage.data_ptr() + b * 2 if stage is not None else 0))  # fmt: skip
            offset = (len(items) - 1) * ctypes.sizeof(_AdamArgs) + _PER_STEP_OFFSET
            rows.append((offset, e - b, b, len(piece_starts) - 1, index[id(record)]))
    return _CallItems(key, active, (_AdamArgs * len(items))(*items), rows, piece_starts, piece_first)


@torch.no_grad()
def compiled_adam_bucket_step(
    bucket: HostBucket, active: list[ParamShard], hyper: AdamHyper, scratch: PieceScratch
) -> None:
    """Drop-in for :func:`~offload_fsdp.fused_step.adam_bucket_step` (same preconditions and side effects).

    Walks the same piece grid as the fused path (pieces of ``scratch.numel`` from the
    first active record) so the stochastic-rounding noise windows are the same, and
    calls the C loop once per (piece, active record) overlap: each call covers one
    record, so one step count and one set of bias corrections. The items are built
    once per layout (:class:`_CallItems`); each step rewrites only their scalars and noise pointers.
    """
    if not _covered(bucket) or not compiled_step_available(warn=False):  # `compiled` already warned at construction
        adam_bucket_step(bucket, active, hyper, scratch)
        return
    active = sorted(active, key=lambda r: r.offset)
    m_flat, v_flat = bucket.state["exp_avg"], bucket.state["exp_avg_sq"]
    master, stage, grads = bucket.master, bucket.param_stage, bucket.grad_stage
    assert master is not None and grads is not None, "a host bucket has its master and grad staging"
    m_mode, v_mode = _moment_mode(m_flat, hyper.beta1), _moment_mode(v_flat, hyper.beta2)
    sr_m, sr_v = m_mode == _MOMENT_BF16_SR, v_mode == _MOMENT_BF16_SR
    # Everything the items' fixed fields depend on; the records are held by the items, so their ids stay theirs.
    key = (tuple(map(id, active)), scratch.numel,
           *((t.data_ptr(), t.dtype) for t in (master, grads, m_flat, v_flat)), stage.data_ptr() if stage is not None else 0)  # fmt: skip
    per_bucket = _call_items.setdefault(scratch, {})
    calls = per_bucket.get(bucket.index)
    if calls is None or calls.key != key:
        calls = per_bucket[bucket.index] = _build_call_items(key, bucket, active, scratch)
    if (sr_m or sr_v) and not calls.noise_base:
        # the noise table's start (counter 0's window starts there; an empty window's data_ptr() would be 0);
        # the scratch allocates it once and never replaces it
        calls.noise_base = scratch.noise(1, 0, torch.uint16).data_ptr()
    noise_base = calls.noise_base
    flags = {"grad_bf16": int(grads.dtype == torch.bfloat16), "m_mode": m_mode, "v_mode": v_mode,
             "has_stage": int(stage is not None)}  # fmt: skip
    steps = [float(r.created_state["step"]) for r in active]
    scalars = {}
    for step in set(steps):
        fields = {**_scalars(hyper, step), **flags}
        scalars[step] = [fields[name] for name in _SCALAR_FIELDS]
    # noise_counter's windows (as uint16: 2 B/element), shifted so that element b of the bucket reads [b - start]
    windows = [
        (noise_base + 2 * (noise_offset(counter) - start) if sr_m else 0,
         noise_base + 2 * (noise_offset(counter + 1) - start) if sr_v else 0)
        for start, first in zip(calls.piece_starts, calls.piece_first)
        for counter in (noise_counter(int(steps[first]), start, scratch),)
    ]  # fmt: skip
    pack, view = _PER_STEP.pack_into, calls.view
    for offset, n, b, piece, record in calls.rows:
        noise_m, noise_v = windows[piece]
        pack(
            view,
            offset,
            noise_m + 2 * b if sr_m else 0,
            noise_v + 2 * b if sr_v else 0,
            n,
            _vec_width,
            *scalars[steps[record]],
        )
    _run(calls.batch, torch.get_num_threads())


def select_host_step() -> HostStep:
    """The host Adam step chosen by ``$OFFLOAD_FSDP_HOST_STEP`` (read once, at optimizer construction),
    or by the optimizer's ``OffloadOptions.host_step`` (:func:`choose_host_step`).

    ``auto`` or unset: :func:`compiled_adam_bucket_step`, which builds the C loop at the
    first step with a bucket it covers (an all-fp32 model never builds it) and steps
    with torch's fused kernel if that fails. ``compiled``: the same, built now so that
    its cost and any failure warning come at construction. ``fused``:
    :func:`~offload_fsdp.fused_step.adam_bucket_step` only.
    """
    choice = _CHOSEN.get() or os.environ.get(HOST_STEP_ENV, "").strip().lower() or "auto"
    if choice == "fused":
        return adam_bucket_step
    if choice == "compiled":
        compiled_step_available()
    elif choice != "auto":
        raise ValueError(f"{HOST_STEP_ENV}={choice!r} is not a host step; use 'auto' (default), 'compiled' or 'fused'")
    return compiled_adam_bucket_step


def main(argv: list[str] | None = None) -> int:
    """``python -m offload_fsdp.compiled_step --build``: build (or find) and self-check the step now.

    Run it once per machine (e.g. in the image or node setup, before launching ranks)
    so that no training process pays the build at its first step.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m offload_fsdp.compiled_step", description=main.__doc__)
    parser.add_argument("--build", action="store_true", help="build the host Adam step into the cache and check it")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # the CLI's own output, not the library's
    if not compiled_step_available(warn=False):
        print("error: the compiled host step could not be built (see the warning above); "
              f"training will use torch's fused kernel ({HOST_STEP_ENV}=fused skips the attempt)", file=sys.stderr)  # fmt: skip
        return 1
    print(f"compiled host step ready: {library_path()} (vector width {_vec_width})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
