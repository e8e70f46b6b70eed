"""``HybridDeviceOptimizer``: a share of the optimizer's work on the host, over local shards.

Construction decides, once and deterministically, where each parameter's
update runs (:func:`offload_fsdp.records.partition`):

* **offloaded** records: a host master (fp32 for low-precision params), host
  grad staging and host optimizer state in flat per-bucket buffers
  (:mod:`offload_fsdp.buckets`). A step copies grads D2H (their own dtype),
  runs the update bucket by bucket on the host with the class's host kernel
  (:mod:`offload_fsdp.host_kernels`: Adam(W), SGD) or, for other classes, one
  ``cpu_optimizer_cls`` instance per bucket, and copies the updated params H2D
  (:mod:`offload_fsdp.copy_engine`).
* **device** records: one ``gpu_optimizer_cls`` instance updates the local
  params (or their device fp32 masters) in place.

Without an accelerator every parameter lives on the CPU and the same code runs
with a synchronous copy engine: offloaded records still go through separate
host masters, staging and the bucketed step, so ``offload_fraction`` 0, 0.5
and 1 exercise different code everywhere.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any

import torch
from torch.profiler import record_function

from offload_fsdp.buckets import HostBucket, HostBuffers, build_buckets
from offload_fsdp.compiled_step import choose_host_step
from offload_fsdp.copy_engine import CopyEngine
from offload_fsdp.core_binding import HostCores
from offload_fsdp.defaults import DeviceDefaults, class_defaults, same_value
from offload_fsdp.delegate import DelegatedOptimizer, hyperparameters
from offload_fsdp.forward_waits import owners_of_buckets, register_forward_waits
from offload_fsdp.fused_step import FusedScratch
from offload_fsdp.grad import get_grad, local_tensor
from offload_fsdp.grad import (
    zero_grad as zero_grads,  # both slots: .grad and decoupled_grad
)
from offload_fsdp.graph_safe import GraphSafeGrads
from offload_fsdp.graph_safe import graph_safe_grads as pin_grads
from offload_fsdp.host_kernels import HostKernel, first_update_replaces_state, host_kernel_for, init_fresh_state
from offload_fsdp.master import MASTER_KEY, adopt_written, canonical_state, master_dtype, policy_with_fp32_update
from offload_fsdp.options import DEFAULT_BUCKET_NUMEL, OffloadOptions, Schedule
from offload_fsdp.overlap import OverlappedStep
from offload_fsdp.per_element import check_per_element, check_steps_without_closure
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard, build_records, grad_key, param_name, partition
from offload_fsdp.speculative import SpeculationCounts, SpeculativeClip
from offload_fsdp.state_io import (
    check_groups_fit_class,
    check_groups_match,
    check_record_state,
    load_record_state,
)
from offload_fsdp.transfer import copy_engine_for, engine_device

__all__ = ["DEFAULT_BUCKET_NUMEL", "HybridDeviceOptimizer", "OffloadOptions"]

logger = logging.getLogger(__name__)


def _refuse_repeated_params(groups: list[dict[str, Any]], first_index: int = 0) -> None:
    """``ValueError`` naming a param listed twice in one group (torch only warns; it would get two records).

    ``first_index``: the index in ``param_groups`` of ``groups[0]`` (for the message).
    """
    for index, group in enumerate(groups, start=first_index):
        first: dict[int, int] = {}
        for position, p in enumerate(group["params"]):
            if id(p) in first:
                raise ValueError(
                    f"param group {index} lists parameter {param_name(group, index, position)!r} twice (positions "
                    f"{first[id(p)]} and {position}); list each parameter once"
                )
            first[id(p)] = position


def _wrapped_use(optimizer: torch.optim.Optimizer, call: str) -> ValueError:
    return ValueError(
        f"this {type(optimizer).__name__} is wrapped by a HybridDeviceOptimizer, which holds its state and "
        f"updates its params; call {call} on the HybridDeviceOptimizer (e.g. pass the wrapper, not the "
        "wrapped optimizer, to your trainer and to checkpoint.save / checkpoint.load)"
    )


def _refuse_wrapped_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook on a wrapped optimizer: ``ValueError`` instead of a second, divergent update."""
    raise _wrapped_use(optimizer, "step()")


def _refuse_wrapped_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """State-dict pre-hook on a wrapped optimizer: its own state is empty or stale, so saving it loses Adam's."""
    raise _wrapped_use(optimizer, "state_dict()")


def _refuse_wrapped_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load pre-hook on a wrapped optimizer: state loaded into it would never reach the wrapper's updates."""
    raise _wrapped_use(optimizer, "load_state_dict()")


def _check_optimizer_cls(cls: Any, arg: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{arg} must be a torch.optim.Optimizer subclass, got {cls!r}")
    if issubclass(cls, HybridDeviceOptimizer):
        raise TypeError(f"{arg} cannot be HybridDeviceOptimizer itself; pass the class it should run")
    check_steps_without_closure(cls, arg)


def _profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function(name)`` while a profiler is on, else nothing.

    Its enter/exit is an op dispatched through Python; right after a bucket's host step
    has streamed hundreds of MB through the caches it runs cold, ~0.1 ms per range.
    """
    # Private `_profiler_enabled` (no public "is a profiler on?"), as in _bucket_stage.
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Keeps ``offload_fraction`` of the local-shard elements' optimizer work on the host.

    Args:
        params_or_optimizer: parameters / param groups (``(name, param)`` pairs give
            error messages the FQN), or an existing ``torch.optim.Optimizer`` to wrap:
            its class, groups, hyper-parameters and any state are taken over.
        offload_fraction: share (in [0, 1]) of trainable device-resident local elements whose
            update runs on the host, as a whole-parameter prefix in parameter order. Params
            already on the CPU always update on the host; without an accelerator all params
            are on the CPU and the fraction splits them between the host path and the plain
            ("device") optimizer, so both code paths run everywhere.
        cpu_optimizer_cls: class of the host update; default the wrapped optimizer's
            class, else ``torch.optim.AdamW``. A class with a registered host kernel
            (:mod:`offload_fsdp.host_kernels`: ``Adam``/``AdamW`` without amsgrad, ``SGD``)
            steps whole buckets with it; any other class runs as one instance per bucket.
        gpu_optimizer_cls: class of the device update; default ``cpu_optimizer_cls``. When it
            differs, hyper-parameters the user set (constructor keywords, keys of their group
            dicts, for a wrapped optimizer values other than its class's defaults) and values
            changed later in ``param_groups`` apply to both shares; one left at the cpu class's
            default gets the gpu class's own default on the device share
            (:mod:`offload_fsdp.defaults`, ``docs/offload.md``).
        param_update_in_fp32: deprecated (``DeprecationWarning``): the master weight's one
            setting is ``precision.main_params_dtype``. ``False`` = ``PrecisionPolicy(main_params_dtype=None)``.
        pin_cpu_grads / pin_cpu_params: page-lock the host buffers that cross the bus
            (ignored without an accelerator, and with ``pinned_transfer_slots``).
        pinned_transfer_slots: None (default): every host buffer that crosses the bus is
            page-locked. An int n >= 1: every host buffer stays pageable and grads / params
            cross the bus through n page-locked slots per direction, each the size of the
            largest bucket's grads / params (:mod:`offload_fsdp.transfer_ring`); pinned
            memory is then n buckets' worth, whatever the model size. Same results, bit for bit.
        overlap_cpu_optimizer_d2h_h2d: copies on side streams, D2H started from
            post-accumulate-grad hooks; False = blocking copies. With gradient
            accumulation every micro-batch's backward re-copies the (accumulated) grad,
            and step() re-copies any grad changed in place since (clipping, unscaling:
            detected by the tensor's version counter), so results are always those of
            the final grad. FSDP2 runs these hooks on the sharded grads after its
            reduce-scatter, so there too each D2H overlaps the rest of backward; the copy
            is ordered after the stream that is current when the hook runs.
        precision: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` of host Adam moments (bf16
            halves their memory and bytes moved), ``main_params_dtype`` of masters (default
            fp32: a low-precision param gets an fp32 master that is the truth, the param its
            cast, saved as ``master_param``; ``None``: params are updated in their own dtype;
            :mod:`offload_fsdp.master`), ``main_grads_dtype`` (when set) of host grad staging.
        bucket_numel: elements per host bucket (the pipelining unit).
        graph_safe_grads: every trainable param's gradient becomes a view of a persistent
            flat buffer (:mod:`offload_fsdp.graph_safe`; ``main_grads_dtype`` views go to
            ``decoupled_grad``), and :meth:`zero_grad` zeroes those buffers in place whatever
            ``set_to_none`` says, so a CUDA graph captured over forward + backward keeps
            writing into the gradients the step reads. Plain (local-shard) params only: FSDP2
            allocates DTensor gradients itself (``TypeError``). As with any persistent
            gradient, a param left out of a backward is stepped with a zero gradient.
        overlap_step_with_backward: run each host bucket's update during the final backward,
            on one host worker thread, as soon as all of its params' grads are final and
            staged (in gradient-arrival order; its H2D is queued right after); ``step()`` then
            waits for what is still running and does the rest (buckets not complete during
            backward, the device share). Results are bit-identical to the default mode. Costs
            one host thread, and a backward not inside :meth:`defer_grad_copies` commits to the
            step. Refused with an error naming the fix: ``step(closure)``; without
            ``speculative_clipping``: AMP's ``GradScaler.step``, ``optim.clip_grad_norm_`` / ``grad_norm``
            on these params, a grad changed in place after its update started (torch's clipping,
            unscaling); a second backward reaching a started bucket, hyper-parameters changed between
            backward and ``step()``. Needs ``overlap_cpu_optimizer_d2h_h2d=True`` (the hooks).
            ``docs/offload.md``, "Overlapped host step".
        speculative_clipping: with ``overlap_step_with_backward``: each host bucket is snapshotted before its
            update during backward, so ``optim.clip_grad_norm_`` between backward and ``step()`` is honoured: the
            update is committed when the clip's coefficient is 1, else the bucket is restored and ``step()``
            updates it with the clipped grads; bit-identical to the clip + the same optimizer without offload.
            Costs a snapshot of the master and state (AdamW, fp32 master and moments: 12 bytes per param),
            bounded by ``clip_snapshot_bytes`` (None: no bound; a bucket over it waits for ``step()``, counted
            in :attr:`speculation_counts`). :mod:`offload_fsdp.speculative`.
        bind_host_cores: bind the threads running the host updates to this local rank's own cores
            (``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, NUMA-local; :mod:`offload_fsdp.core_binding`); None: when
            the node has two local ranks or more, two allowed cores for each and no affinity set by the user.
            The cores are :attr:`host_cores` and in the INFO construction line.
        model: the model holding the params (after ``fully_shard``). When given, each module
            owning offloaded params (an FSDP2 unit, else the registering module) gets a forward
            pre-hook waiting only for its own buckets' H2D, instead of the main stream waiting
            for the whole step's H2D at the end of ``step()``. Reads of params outside those
            forwards (a checkpoint save right after ``step()``, EMA) must call
            :meth:`wait_for_params` first (:mod:`offload_fsdp.forward_waits`).
        options: all of the settings above but ``model`` and the deprecated ``param_update_in_fp32``, as one
            :class:`~offload_fsdp.options.OffloadOptions` (a docstring under each field; enums for the
            schedule and the host step, which ``$OFFLOAD_FSDP_HOST_STEP`` chooses when left unset). The
            keywords build the same object (``self.options``); giving both is a ``ValueError``.
        **defaults: hyper-parameters (lr, betas, weight_decay, ...) for the explicit form.

    Side effects of construction: host buffers are allocated once (exact size),
    masters are copied from the params, hooks are registered on offloaded params,
    and the partition is logged at INFO. :meth:`add_param_group` does the same for
    a group added later, partitioning that group on its own.
    """

    def __init__(
        self,
        params_or_optimizer: Iterable[Any] | torch.optim.Optimizer,
        offload_fraction: float = 1.0,
        *,
        cpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        gpu_optimizer_cls: type[torch.optim.Optimizer] | None = None,
        param_update_in_fp32: bool | None = None,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        pinned_transfer_slots: int | None = None,
        precision: PrecisionPolicy | None = None,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        graph_safe_grads: bool = False,
        overlap_step_with_backward: bool = False,
        speculative_clipping: bool = False,
        clip_snapshot_bytes: int | None = None,
        bind_host_cores: bool | None = None,
        model: torch.nn.Module | None = None,
        options: OffloadOptions | None = None,
        **defaults: Any,
    ) -> None:
        self._built = False
        keywords = OffloadOptions.from_keywords(
            offload_fraction=offload_fraction, cpu_optimizer_cls=cpu_optimizer_cls,
            gpu_optimizer_cls=gpu_optimizer_cls, precision=precision, pin_cpu_grads=pin_cpu_grads,
            pin_cpu_params=pin_cpu_params, overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d,
            pinned_transfer_slots=pinned_transfer_slots, bucket_numel=bucket_numel,
            graph_safe_grads=graph_safe_grads, overlap_step_with_backward=overlap_step_with_backward,
            speculative_clipping=speculative_clipping, clip_snapshot_bytes=clip_snapshot_bytes,
            bind_host_cores=bind_host_cores,
        )  # fmt: skip
        if options is not None and keywords.changed():
            raise ValueError(
                f"settings {keywords.changed()} were passed as keywords together with options=; set them in the "
                "OffloadOptions instead"
            )
        opts = self.options = options if options is not None else keywords
        groups, opt_defaults, cpu_cls, wrapped, explicit = self._resolve_groups(
            params_or_optimizer, opts.cpu_optimizer_cls, defaults
        )
        gpu_cls = opts.gpu_optimizer_cls if opts.gpu_optimizer_cls is not None else cpu_cls
        _check_optimizer_cls(gpu_cls, "gpu_optimizer_cls")
        _refuse_repeated_params(groups)
        super().__init__(groups, opt_defaults)
        if wrapped is not None:
            # One list of groups for both: a group added through either is seen by a scheduler
            # on the wrapped optimizer (as torch's would be), and step() refuses one added behind
            # this optimizer's back (through the wrapped one) instead of never updating it.
            try:
                wrapped.param_groups = self.param_groups
            except AttributeError as exc:  # a read-only property (an optimizer wrapping another)
                raise TypeError(
                    f"cannot take over the param groups of {type(wrapped).__name__} ({exc}); wrap the optimizer "
                    "it wraps, or pass the params and cpu_optimizer_cls= instead"
                ) from exc
        # Keys the user set, per group and at constructor level (those also fill groups added later).
        group_keys, self._explicit_defaults = explicit
        self._device_defaults: DeviceDefaults | None = None
        if gpu_cls is not cpu_cls:  # the device class keeps its own defaults for what the user left unset
            self._device_defaults = DeviceDefaults(gpu_cls)
            for index, (group, keys) in enumerate(zip(self.param_groups, group_keys)):
                self._device_defaults.add_group(index, group, keys)
        self.offload_fraction = opts.offload_fraction
        self.cpu_optimizer_cls, self.gpu_optimizer_cls = cpu_cls, gpu_cls
        self.precision = policy_with_fp32_update(opts.precision, param_update_in_fp32)
        self.overlap = opts.overlap_cpu_optimizer_d2h_h2d
        self._scratch = FusedScratch()
        # Built now: Adam's reads its step (compiled loop or torch's fused kernel) from the options or
        # $OFFLOAD_FSDP_HOST_STEP here.
        with choose_host_step(opts.host_step.value if opts.host_step is not None else None):
            self._host_kernel = host_kernel_for(cpu_cls)
        self._engines: dict[torch.device, CopyEngine] = {}
        # Optional timing probe, called as hook(stage, bucket, is_begin) around each bucket's "d2h"
        # (once per staged grad), "host_step" and "h2d"; set by scripts/bench_offload.py --timeline-json.
        self._stage_hook: Callable[[str, HostBucket, bool], None] | None = None

        self._transfer_slots = opts.pinned_transfer_slots
        # With transfer slots every host buffer stays pageable: only the slots are page-locked.
        self._pin = (opts.pin_cpu_grads, opts.pin_cpu_params) if self._transfer_slots is None else (False, False)
        self._bucket_numel = opts.bucket_numel
        self._records: list[ParamShard] = []
        self._buckets: list[HostBucket] = []
        self._device_delegate: DelegatedOptimizer | None = None
        self._hook_handles: list[Any] = []
        self._defer_grad_copies = False  # set by defer_grad_copies(): backward hooks leave grads for step()
        self._host_cores = HostCores(opts.bind_host_cores)
        self._overlapped = (
            OverlappedStep(
                self._before_overlapped_update,
                functools.partial(self._step_bucket, push=False),  # step() writes the params (see _step_records)
                lambda i: self.param_groups[i],
                self._host_cores.bind_this_thread,
                SpeculativeClip(opts.clip_snapshot_bytes, self._forget) if opts.speculative_clipping else None,
            )
            if opts.schedule is Schedule.OVERLAPPED
            else None
        )
        self._accelerated = False
        self._model = weakref.ref(model) if model is not None else None  # per-module H2D waits (model=)
        self.graph_safe_grads = opts.graph_safe_grads
        self._grad_buffers: list[GraphSafeGrads] = []  # one per group batch placed (graph_safe_grads only)
        records = build_records(self.param_groups)
        self._keep_grad_buffers(records)
        self._host_buffers = self._place(records, "construction")
        # Arenas of groups added by add_param_group, held like _host_buffers (their pinned
        # registration is undone when an arena's storage object dies).
        self._later_host_buffers: list[HostBuffers] = []
        self._built = True
        # A scheduler attached to the wrapped optimizer before wrapping checks that *it* was stepped.
        self._wrapped = weakref.ref(wrapped) if wrapped is not None else None
        if wrapped is not None:  # only once built: a failed wrap leaves it usable on its own
            # Its own step would update the params from its own (stale or empty) state.
            wrapped.register_step_pre_hook(_refuse_wrapped_step)
        self._groups_placed = len(self.param_groups)
        # Weights loaded between construction (or a state-dict load) and the first step
        # must not be reverted by masters copied earlier: step() refreshes them once.
        self._refresh_masters_before_step = True
        if wrapped is not None and wrapped.state:
            self.load_state_dict(wrapped.state_dict())
        if wrapped is not None:  # after its state was taken over: from now on the wrapper holds it
            wrapped.register_state_dict_pre_hook(_refuse_wrapped_state_dict)
            wrapped.register_load_state_dict_pre_hook(_refuse_wrapped_load)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _resolve_groups(
        params_or_optimizer: Any, cpu_cls: type | None, defaults: dict[str, Any]
    ) -> tuple[
        list[dict[str, Any]], dict[str, Any], type, torch.optim.Optimizer | None, tuple[list[set[str]], set[str]]
    ]:
        """Complete param groups + defaults, from the wrapped optimizer or a probe of ``cpu_cls``.

        Also returns the hyper-parameter keys the user set: (one set per group, the
        constructor-level ones) (see :mod:`offload_fsdp.defaults`).
        """
        if isinstance(params_or_optimizer, HybridDeviceOptimizer):
            raise TypeError("cannot wrap a HybridDeviceOptimizer in another; wrap the underlying optimizer")
        if isinstance(params_or_optimizer, torch.nn.Module):
            name = type(params_or_optimizer).__name__
            raise TypeError(
                f"HybridDeviceOptimizer got a module ({name}); pass its parameters, "
                "HybridDeviceOptimizer(model.parameters(), ...), or an optimizer to wrap, "
                "HybridDeviceOptimizer(torch.optim.AdamW(model.parameters()), ...)"
            )
        if isinstance(params_or_optimizer, torch.optim.Optimizer):
            wrapped = params_or_optimizer
            if defaults:
                raise ValueError(
                    f"hyper-parameters {sorted(defaults)} were passed together with an optimizer to wrap; "
                    "set them on the wrapped optimizer (its groups are taken over as they are)"
                )
            cls = cpu_cls if cpu_cls is not None else type(wrapped)
            _check_optimizer_cls(cls, "cpu_optimizer_cls")
            # Its groups are complete: what differs from its class's default is what the user set.
            own = class_defaults(type(wrapped))
            *group_keys, default_keys = [
                {k for k, v in hyperparameters(d).items() if k not in own or not same_value(v, own[k])}
                for d in (*wrapped.param_groups, wrapped.defaults)
            ]
            explicit = (group_keys, default_keys)
            # Its group dicts themselves, not copies: a scheduler attached to it before wrapping
            # (LambdaLR, OneCycleLR's betas) keeps writing the hyper-parameters this optimizer reads.
            return list(wrapped.param_groups), dict(wrapped.defaults), cls, wrapped, explicit
        cls = cpu_cls if cpu_cls is not None else torch.optim.AdamW
        _check_optimizer_cls(cls, "cpu_optimizer_cls")
        # Read the user's group dicts before the probe fills them; a lone tensor is left for torch to refuse.
        params = params_or_optimizer if isinstance(params_or_optimizer, torch.Tensor) else list(params_or_optimizer)
        user_groups = params if len(params) and isinstance(params[0], dict) else [{}]
        explicit = ([set(hyperparameters(g)) | set(defaults) for g in user_groups], set(defaults))
        # A throw-away instance validates the hyper-parameters and fills every group
        # with the class's defaults; it allocates no state (torch state is lazy).
        probe = cls(params, **defaults)
        return [dict(g) for g in probe.param_groups], dict(probe.defaults), cls, None, explicit

    @property
    def param_update_in_fp32(self) -> bool:
        """Deprecated view of ``precision.main_params_dtype is not None`` (read-only)."""
        return self.precision.main_params_dtype is not None

    def _master_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return master_dtype(dtype, self.precision.main_params_dtype)

    def _group_kernel(self, group: dict[str, Any]) -> HostKernel | None:
        """The host kernel for ``group``'s buckets, or None when its class has none or it cannot run the group."""
        kernel = self._host_kernel
        return kernel if kernel is not None and kernel.unsupported(group) is None else None

    def _bucket_kernel(self, bucket: HostBucket) -> tuple[HostKernel, dict[str, torch.dtype]] | None:
        """(kernel, its flat state buffers' dtypes) for ``bucket``, or None: a delegated optimizer steps it."""
        group = self.param_groups[bucket.group_index]
        kernel = self._group_kernel(group)
        if (
            kernel is None
            or bucket.param_dtype not in kernel.dtypes
            or bucket.grad_dtype not in kernel.dtypes
            or bucket.master_dtype not in kernel.master_dtypes
        ):
            return None
        return kernel, kernel.state_layout(group, bucket.master_dtype, self.precision)

    def _engine_for(self, device: torch.device) -> CopyEngine:
        key = engine_device(device, overlap=self.overlap)
        if key not in self._engines:
            self._engines[key] = copy_engine_for(key, transfer_slots=self._transfer_slots)
        return self._engines[key]

    @property
    def speculation_counts(self) -> SpeculationCounts | None:
        """What ``speculative_clipping`` did so far (committed / redone / deferred buckets), or None without it."""
        speculation = self._overlapped.speculation if self._overlapped is not None else None
        return speculation.counts if speculation is not None else None

    @property
    def host_cores(self) -> frozenset[int] | None:
        """The cores the host updates' threads are bound to (``bind_host_cores``), or None when unbound."""
        return self._host_cores.cores

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this optimizer holds: bucket buffers (default) or transfer slots."""
        arenas = [b.pinned for b in (self._host_buffers, *self._later_host_buffers)]
        slots = sum(e.pinned_bytes for e in self._engines.values())
        return sum(a.reserved_bytes for a in arenas if a.pinned) + slots

    def _place(self, records: list[ParamShard], what: str) -> HostBuffers:
        """Partition ``records`` (new, validated) and give each side what it needs; returns their arenas.

        Offloaded records get exactly-sized buckets of their own (existing buffers are
        never touched) with masters copied from the params and backward hooks; the
        others join the device delegate. Side effects: ``_records``, ``_buckets``,
        ``_hook_handles`` and ``_device_delegate`` grow; the partition is logged.
        """
        accelerated = self._accelerated or (
            torch.accelerator.is_available() and any(r.local.device.type != "cpu" for r in records)
        )
        partition(records, self.offload_fraction, host_resident_is_offloaded=accelerated)
        self._check_classes_fit_shards(records)
        for r in records:
            if r.offloaded:
                r.grad_dtype = self.precision.grad_staging_dtype(r.param.dtype)
        buckets, buffers = build_buckets(
            records,
            first_index=len(self._buckets),
            bucket_numel=self._bucket_numel,
            master_dtype_of=self._master_dtype,
            kernel_of=self._bucket_kernel,
            pin=(self._pin[0] and accelerated, self._pin[1] and accelerated),
            engine_for=self._engine_for,
        )
        model = self._model() if self._model is not None else None
        waits = owners_of_buckets(model, buckets) if model is not None else []  # raises for a param not in it
        self._init_host_copies(buckets)
        # The last step that can fail (building the device class); self is changed only from here on.
        self._join_device_delegate(records)
        self._fit_transfer_slots(buckets)
        if self.overlap:
            self._hook_handles.extend(self._register_hooks(records))
        if self._overlapped is not None:
            self._overlapped.register(records, self)
        self._hook_handles.extend(register_forward_waits(waits, self._wait_pushed))
        self._accelerated = accelerated
        self._records.extend(records)
        self._buckets.extend(buckets)
        self._warn_unused_precision(records)
        self._log_partition(records, buckets, buffers, what)
        return buffers

    @staticmethod
    def _fit_transfer_slots(buckets: list[HostBucket]) -> None:
        """Let each engine size what it holds (``pinned_transfer_slots``' slots) for these new buckets too."""
        for engine in {id(b.engine): b.engine for b in buckets}.values():
            engine.fit(b for b in buckets if b.engine is engine)

    def _check_classes_fit_shards(self, records: list[ParamShard]) -> None:
        """Refuse, naming class and param, a non-elementwise class on a sharded param (:mod:`offload_fsdp.per_element`)."""
        for r in records:
            if r.trainable and r.is_sharded:
                cls = self.cpu_optimizer_cls if r.offloaded else self.gpu_optimizer_cls
                check_per_element(cls, r.name, tuple(r.local.shape), r.global_shape)

    @torch.no_grad()
    def _init_host_copies(self, buckets: list[HostBucket]) -> None:
        """Fill host masters / param staging from the params; attach fallback delegates."""
        for bucket in buckets:
            for r in bucket.records:
                self._copy_master_from_param(r)
                r.working = r.master
            if bucket.kernel is None:
                bucket.delegate = DelegatedOptimizer(
                    self.cpu_optimizer_cls, bucket.records, self.param_groups, where="host"
                )

    @staticmethod
    def _copy_master_from_param(r: ParamShard) -> None:
        """The host master (and param staging) of offloaded ``r`` becomes exactly its param widened."""
        r.host_bucket.engine.fetch(r.push_source, r.local)
        if r.param_stage is not None:
            r.host_master.copy_(r.param_stage)
        r.mark_synced(master_is_upcast=True)

    @torch.no_grad()
    def _join_device_delegate(self, records: list[ParamShard]) -> None:
        """Give the trainable, not offloaded ``records`` a working tensor and add them to the device delegate."""
        records = [r for r in records if r.trainable and not r.offloaded]
        for r in records:
            master_dtype = self._master_dtype(r.param.dtype)
            # A device fp32 master for low-precision params; otherwise the local param itself.
            r.working = r.local.to(master_dtype, copy=True) if master_dtype != r.param.dtype else r.local
            r.mark_synced(master_is_upcast=True)
        if not records:
            return
        if self._device_delegate is None:
            view = self._device_defaults.for_device if self._device_defaults is not None else None
            self._device_delegate = DelegatedOptimizer(
                self.gpu_optimizer_cls, records, self.param_groups, where="device", view=view
            )
        else:
            self._device_delegate.add_records(records, self.param_groups)

    def _register_hooks(self, records: list[ParamShard]) -> list[Any]:
        """Post-accumulate-grad hooks that start an offloaded grad's D2H as soon as it is final."""
        handles = []
        self_ref = weakref.ref(self)
        for r in records:
            if not r.offloaded:
                continue

            def hook(param: torch.Tensor, record: ParamShard = r) -> None:
                opt = self_ref()
                if opt is not None and opt._overlapped is not None:
                    opt._overlapped.check_not_started(record)  # a grad its update would miss
                grad = get_grad(param)
                if opt is None or opt._defer_grad_copies or grad is None or grad.layout != torch.strided:
                    return  # deferred (step() copies it), or an error step() raises with the param's name
                local = local_tensor(grad)
                if local.dtype == record.grad_dtype and local.shape == record.local.shape:
                    opt._stage_grad(record, local)
                    if opt._overlapped is not None:
                        opt._overlapped.grad_final(record)

            handles.append(r.param.register_post_accumulate_grad_hook(hook))
        return handles

    def _warn_unused_precision(self, records: list[ParamShard]) -> None:
        low = {self.precision.exp_avg_dtype, self.precision.exp_avg_sq_dtype} != {torch.float32}
        ignored = any(
            not r.offloaded or r.host_bucket.kernel is None or not r.host_bucket.kernel.moment_dtypes_from_policy
            for r in records
            if r.trainable
        )
        if low and ignored:
            warnings.warn(
                "PrecisionPolicy exp_avg/exp_avg_sq dtypes apply to the host Adam(W) kernel only; "
                "parameters updated by a delegated optimizer or another host kernel (SGD's momentum_buffer "
                "is in the master's dtype) keep that class's own state dtype",
                stacklevel=3,
            )

    def _log_partition(
        self, records: list[ParamShard], buckets: list[HostBucket], buffers: HostBuffers, what: str
    ) -> None:
        def nbytes(rs: list[ParamShard]) -> int:
            return sum(r.numel * r.param.element_size() for r in rs)

        host = [r for r in records if r.offloaded]
        device = [r for r in records if r.trainable and not r.offloaded]
        pinned = buffers.pinned
        engines = {id(b.engine): b.engine for b in buckets}.values()
        logger.info(
            "HybridDeviceOptimizer partition (%s, offload_fraction=%.3f): host %d params / %d elements / %d bytes, "
            "device %d params / %d elements / %d bytes, %d buckets; pinned host bytes reserved %d, used %d "
            "(page-locked: %s); pageable host bytes %d; pinned_transfer_slots=%s, page-locked slot bytes %d "
            "(optimizer.pinned_bytes: the total); host step cores %s",
            what, self.offload_fraction, len(host), sum(r.numel for r in host), nbytes(host),
            len(device), sum(r.numel for r in device), nbytes(device), len(buckets),
            pinned.reserved_bytes, pinned.layout.used_bytes, pinned.pinned, buffers.pageable_reserved_bytes,
            self._transfer_slots, sum(e.pinned_bytes for e in engines), self._host_cores.description,
        )  # fmt: skip

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch; after construction the new group also gets its own host buffers and hooks.

        The group is partitioned on its own by the construction rule
        (:func:`~offload_fsdp.records.partition`): ``offload_fraction`` of the group's
        trainable device-resident local elements, as a whole-parameter prefix in the
        group's order (its CPU-resident params take the host path when an accelerator
        holds any of the optimizer's params; with none, the fraction counts all of the
        group's trainable elements). Offloaded params get exactly-sized host buckets
        and arenas of their own (existing buffers are never reallocated or moved);
        the others join the device optimizer. Masters are copied from the params now.

        Raises ``ValueError`` naming a parameter that is already in a group (or twice
        in this one), and anything the construction-time checks raise; on an error the
        optimizer is left as it was.
        """
        if not getattr(self, "_built", False):  # Optimizer.__init__ adding the user's groups
            super().add_param_group(param_group)
            return
        # Before torch fills the group (in place) with the defaults: these keys are the user's.
        user_keys = set(hyperparameters(param_group)) if isinstance(param_group, dict) else set()
        try:
            super().add_param_group(param_group)
        except ValueError:
            self._check_new_params(param_group, existing=len(self.param_groups))
            raise
        index = len(self.param_groups) - 1
        try:
            self._check_new_params(param_group, existing=index)
            if self._device_defaults is not None:
                explicit = user_keys | self._explicit_defaults
                self._device_defaults.add_group(index, self.param_groups[index], explicit)
            records = build_records([self.param_groups[index]], first_group_index=index)
            self._keep_grad_buffers(records)
            self._later_host_buffers.append(self._place(records, f"param group {index} added"))
            self._groups_placed = len(self.param_groups)
        except BaseException:
            self.param_groups.pop()
            raise

    def _check_new_params(self, group: dict[str, Any], *, existing: int) -> None:
        """Raise ``ValueError`` naming a param of a new group that is already optimised or listed twice.

        ``existing``: how many of ``param_groups`` are the groups already built.
        (torch's own check only says that "some parameters" repeat, and only warns
        about a repeat inside the group, which would give a param two records here.)
        """
        params = group["params"]
        if not isinstance(params, list):
            return  # torch failed before normalising the group; its error stands
        owner = {id(p): g for g, built in enumerate(self.param_groups[:existing]) for p in built["params"]}
        names = {id(r.param): r.name for r in self._records}
        for position, p in enumerate(params):
            if id(p) in owner:
                name = names.get(id(p)) or param_name(group, existing, position)
                raise ValueError(
                    f"parameter {name!r} of the new param group is already in param group {owner[id(p)]} (some "
                    "parameters appear in more than one parameter group); add each parameter to one group only"
                )
        _refuse_repeated_params([group], first_index=existing)

    # ------------------------------------------------------------------ step

    @contextlib.contextmanager
    def defer_grad_copies(self) -> Iterator[None]:
        """Backward inside this context starts no device-to-host grad copies (like DDP's ``no_sync``).

        With gradient accumulation every micro-batch's backward would copy its
        partial grad to the host again; run all but the last micro-batch's backward
        in this context and only the final grad crosses PCIe (from the last
        backward's hooks, or at :meth:`step`). Results are the same either way:
        ``step()`` copies every grad not yet staged. FSDP2 needs it only without
        ``set_requires_gradient_sync(False)``, which already skips the reduce-scatter
        that runs these hooks.
        """
        previous, self._defer_grad_copies = self._defer_grad_copies, True
        try:
            yield
        finally:
            self._defer_grad_copies = previous

    def _collect_active(self) -> list[tuple[ParamShard, torch.Tensor]]:
        """(record, local grad) of every record with a gradient; validates them, naming the param."""
        active = []
        for r in self._records:
            grad = get_grad(r.param)
            if grad is None:
                continue
            if grad.layout != torch.strided:
                raise ValueError(f"parameter {r.name!r} has a sparse gradient ({grad.layout}); HybridDeviceOptimizer "
                                 "supports dense gradients only (use a dense embedding, sparse=False)")  # fmt: skip
            if not r.trainable:
                raise ValueError(
                    f"parameter {r.name!r} has a gradient but requires_grad was False when the optimizer was "
                    "built, so no update space exists for it; build the optimizer after unfreezing it"
                )
            local = local_tensor(grad)
            if local.shape != r.local.shape:
                raise ValueError(
                    f"gradient of parameter {r.name!r} has local shape {tuple(local.shape)}, expected "
                    f"{tuple(r.local.shape)}; gradients must be sharded like their parameter"
                )
            if r.offloaded and local.dtype != r.grad_dtype:
                raise TypeError(
                    f"gradient of parameter {r.name!r} has dtype {local.dtype} but its host staging is "
                    f"{r.grad_dtype}; pass precision=PrecisionPolicy(main_grads_dtype={local.dtype}) so grads "
                    "are staged in their own dtype"
                )
            active.append((r, local))
        return active

    def _stage_grad(self, record: ParamShard, grad: torch.Tensor) -> None:
        """Copy ``grad`` to the record's host staging unless this very grad, unmodified, is already there.

        The key includes the tensor's version counter: accumulation into the grad
        (next micro-batch) or in-place edits after backward (clipping, unscaling)
        bump it, so the grad is copied again. Keys are cleared after each step and
        by zero_grad, so a reused allocation can never match a stale key.
        """
        key = grad_key(grad)
        if record.staged_grad_key == key:
            return
        with self._bucket_stage("d2h", record.host_bucket):
            record.host_bucket.engine.stage_grad(record.host_bucket, record.host_grad_stage, grad)
        record.staged_grad_key = key

    def _bucket_stage(self, stage: str, bucket: HostBucket) -> contextlib.AbstractContextManager[None]:
        """Profiler range ``HybridDeviceOptimizer.<stage>[bucket <i>]`` (+ the timing hook, if set).

        Nested inside the aggregate ``HybridDeviceOptimizer.<stage>`` ranges, so a
        trace shows the pipeline per bucket (``scripts/plot_offload_timeline.py``).
        """
        # Runs once per staged grad, in backward hooks too: free when nobody is profiling or timing.
        # Private `_profiler_enabled` (no public "is a profiler on?"); if torch drops it every step raises.
        if self._stage_hook is None and not torch.autograd._profiler_enabled():
            return contextlib.nullcontext()
        return self._profiled_stage(stage, bucket)

    @contextlib.contextmanager
    def _profiled_stage(self, stage: str, bucket: HostBucket) -> Iterator[None]:
        with record_function(f"HybridDeviceOptimizer.{stage}[bucket {bucket.index}]"):
            if self._stage_hook is None:
                yield
                return
            self._stage_hook(stage, bucket, True)
            yield
            self._stage_hook(stage, bucket, False)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a gradient (torch semantics for gradless params).

        Order: queue all D2H grad copies, queue the device share's update, then per
        bucket: wait for its grads, update on the host, queue its H2D. When this
        returns the host work is done and the main stream is ordered after the H2D.
        """
        self._check_groups_placed()
        loss, done = None, set[int]()
        if self._overlapped is not None:
            finished = self._finish_overlapped_backward(closure)
            if finished is None:  # GradScaler found inf/NaN grads: every speculative update was taken back
                return loss
            done = finished
        elif closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._overlapped is None and self._grad_scaler_skips_step():
            return loss
        try:
            self._step_records(done)
        except BaseException:
            self._abandon_overlapped_step()
            raise
        if self._overlapped is not None:
            self._overlapped.end_step()
        return loss

    def _finish_overlapped_backward(self, closure: Any) -> set[int] | None:
        """Refusals, then wait for the updates started during backward; ids of the records they updated
        (None: GradScaler skips this step)."""
        assert self._overlapped is not None
        self._overlapped.check_backward_finished("step()")  # nothing to abandon: refused until a load
        try:
            self._refuse_in_overlapped_step(closure)
            # With GradScaler (allowed with speculative_clipping) the updates ran on scaled grads: all redone.
            amp = getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None
            done = self._overlapped.finish_backward(keep=not amp)  # raises a worker's error, naming the bucket
            if amp and self._grad_scaler_skips_step():
                self._overlapped.discard()  # nothing applied, as torch skips the step
                return None
            return done
        except BaseException:
            self._abandon_overlapped_step()
            raise

    def _abandon_overlapped_step(self) -> None:
        """After an error: end the copy engines begun during backward, forget the step's bookkeeping."""
        if self._overlapped is None:
            return
        # The buckets updated before the error keep their update: write their params (after backward's reads).
        for engine in self._overlapped.begun_engines.values():
            engine.note_params_read()
        for bucket in self._overlapped.updated_buckets():
            self._push_bucket(bucket, bucket.records)
        for engine in self._overlapped.begun_engines.values():
            engine.end_step()  # the next forward waits for those H2D
        self._overlapped.end_step()

    @torch.no_grad()
    def _discard_overlapped_step(self) -> None:
        """End a step whose backward raised after updates started, writing no param; the masters those updates
        changed that were exact upcasts (a checkpoint does not hold them) are copied from the params again."""
        assert self._overlapped is not None
        for bucket in self._overlapped.discard():
            for r in bucket.records:
                if r.master_is_upcast:
                    self._copy_master_from_param(r)

    def _step_records(self, done: set[int]) -> None:
        """The step of every record with a grad, except ``done`` (updated during backward)."""
        begun = self._overlapped.begun_engines if self._overlapped is not None else {}
        active = self._collect_active()
        if not active:
            return
        if self._refresh_masters_before_step:
            self.reload_model_params()
        else:
            # Every record, gradless ones too: their state's master must show the user's write now
            # (a no-op for `done`, synced by their update; a loop over version counters otherwise).
            self._refresh_written(self._records)
        grads = {id(r): g for r, g in active}
        engines = list({id(e): e for e in [*self._engines.values(), *begun.values()]}.values())
        for engine in engines:
            if id(engine) in begun:
                engine.note_params_read()  # begun during backward: keep its H2D, move the read mark to now
            else:
                engine.begin_step()
        try:
            # Updated during backward, written only now: backward may read a param after its grad is final.
            for bucket in self._overlapped.updated_buckets() if self._overlapped is not None else []:
                self._push_bucket(bucket, bucket.records)
            with _profiled("HybridDeviceOptimizer.d2h"):
                for r, g in active:
                    if r.offloaded:
                        if not r.grad_edits_move_key and id(r) not in done:
                            r.staged_grad_key = None  # the hooks' copy may predate an unseen edit: copy again
                        self._stage_grad(r, g)
            self._step_device([(r, g) for r, g in active if not r.offloaded])
            for bucket in self._buckets:
                bucket_active = [r for r in bucket.records if id(r) in grads and id(r) not in done]
                if bucket_active:  # on this rank's cores (bind_host_cores); its H2D queued from here
                    self._host_cores.run(
                        functools.partial(self._step_bucket, bucket, bucket_active, push=False), bucket.device
                    )
                    self._push_bucket(bucket, bucket_active)
        finally:
            for engine in engines:
                engine.end_step(main_waits=self._model is None)  # else each module's forward waits
            for r in self._records:
                r.staged_grad_key = None
        for r, _ in active:
            self._publish(r)
        self._mark_wrapped_stepped()

    def _refuse_in_overlapped_step(self, closure: Any) -> None:
        """What ``overlap_step_with_backward=True`` cannot honour: ``ValueError`` naming the fix."""
        if closure is not None:
            raise ValueError(
                "step(closure) is not supported with overlap_step_with_backward=True: the host updates start "
                "during the backward before step(), not inside the closure; call loss.backward() and then step() "
                "without a closure, or build the optimizer without overlap_step_with_backward"
            )
        # GradScaler.step sets these on an optimizer with _step_supports_amp_scaling (see that property).
        amp = getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None
        if amp and self._overlapped is not None and self._overlapped.speculation is None:
            self.found_inf = self.grad_scale = None
            raise ValueError(
                "AMP's GradScaler.step is not supported with overlap_step_with_backward=True: the host updates "
                "ran during backward on still-scaled gradients, before GradScaler could unscale them or skip a "
                "step with inf/NaN gradients (the buckets updated so far used them: restore from a checkpoint); build "
                "the optimizer with speculative_clipping=True (each bucket is then restored and redone after "
                "backward), train in bf16 without a GradScaler, or build it without overlap_step_with_backward"
            )

    # torch.amp.GradScaler's protocol for optimizers that handle scaling: GradScaler.step then calls
    # step() with `grad_scale` / `found_inf` set instead of unscaling and maybe skipping on its own.
    # Needed because GradScaler unscales with torch._amp_foreach_non_finite_check_and_unscale_, which
    # bumps no version counter: the backward hooks' host copies of the still-scaled grads would look
    # current to step() (_stage_grad's key). The overlapped mode uses it to refuse GradScaler.
    _step_supports_amp_scaling = True

    def _grad_scaler_skips_step(self) -> bool:
        """GradScaler's part of :meth:`step` (default mode): True when it found inf/NaN grads (no update).

        Otherwise the grads are unscaled here in place exactly as ``GradScaler.unscale_``
        does (a multiply by the float32 reciprocal of the scale) unless the user already
        called ``unscale_``; either way every host copy is dropped so step() copies the
        unscaled grads again.
        """
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found_inf is None and grad_scale is None:
            return False
        for r in self._records:
            r.staged_grad_key = None  # scaled (or unscaled behind the version counters) since the hooks' copies
        if found_inf is not None and found_inf.item() != 0:
            return True
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float().item()  # GradScaler's own reciprocal
            for r in self._records:  # under step()'s no_grad
                if r.param.grad is not None:  # GradScaler unscales .grad only
                    r.param.grad.mul_(inv_scale)
        return False

    @staticmethod
    def _wait_pushed(bucket: HostBucket) -> None:
        bucket.engine.wait_pushed(bucket)

    def wait_for_params(self) -> None:
        """Order the current stream after every param H2D queued so far (the host does not block).

        Needed only with ``model=``, before reading params other than through the model's
        forward (which waits for its own params): e.g. saving a checkpoint right after ``step()``.
        """
        for bucket in self._buckets:
            bucket.engine.wait_pushed(bucket)

    def _before_overlapped_update(self, bucket: HostBucket) -> None:
        """Main-thread preparation of a bucket update started during backward: the masters' refresh
        that step() does first (the user's weights are the truth), for this bucket's records."""
        if self._refresh_masters_before_step:
            self.reload_model_params()
        else:
            self._refresh_written(bucket.records)

    def _check_groups_placed(self) -> None:
        """``ValueError`` for a param group that got no update space (added to the wrapped optimizer)."""
        if len(self.param_groups) > self._groups_placed:
            wrapped = self._wrapped() if self._wrapped is not None else None
            raise ValueError(
                f"param group {self._groups_placed} was added to the wrapped "
                f"{type(wrapped).__name__ if wrapped is not None else 'optimizer'} after it was wrapped, so "
                "HybridDeviceOptimizer made no update space for its params and would never update them; "
                "call add_param_group on the HybridDeviceOptimizer instead"
            )

    def _mark_wrapped_stepped(self) -> None:
        """Tell a scheduler attached to the wrapped optimizer that its optimizer stepped.

        torch's LRScheduler warns "lr_scheduler.step() before optimizer.step()" unless the
        optimizer it was built on set the private flag ``_opt_called`` (its patched ``step``
        does); no public API exists. If torch renames it, only that spurious warning returns.
        """
        wrapped = self._wrapped() if self._wrapped is not None else None
        if wrapped is not None:
            wrapped._opt_called = True  # type: ignore[attr-defined]  # set by torch's patched step; see above

    def _step_device(self, active: list[tuple[ParamShard, torch.Tensor]]) -> None:
        if not active:
            return
        assert self._device_delegate is not None
        previous = [(r, r.working_tensor.grad) for r, _ in active]
        for r, g in active:
            r.working_tensor.grad = g if g.dtype == r.working_tensor.dtype else g.to(r.working_tensor.dtype)
        try:
            self._device_delegate.step(self.param_groups)
        finally:
            # Restore, not clear: when the working tensor IS the param, its .grad is the user's grad.
            for r, before in previous:
                r.working_tensor.grad = before
        for r, _ in active:
            if r.working is not r.local:
                r.local.copy_(r.working_tensor)  # the param is the cast of its fp32 master
                r.mark_synced()

    def _step_bucket(self, bucket: HostBucket, active: list[ParamShard], *, push: bool = True) -> None:
        bucket.engine.wait_grads(bucket)
        bucket.engine.wait_params_free(bucket)
        group = self.param_groups[bucket.group_index]
        with _profiled("HybridDeviceOptimizer.host_step"), self._bucket_stage("host_step", bucket):
            if bucket.kernel is not None:
                self._kernel_step(bucket, bucket.kernel, active, group)
            else:
                for r in active:
                    staged, working = r.host_grad_stage, r.working_tensor
                    working.grad = staged if staged.dtype == working.dtype else staged.to(working.dtype)
                assert bucket.delegate is not None  # attached to every bucket without a host kernel
                try:
                    bucket.delegate.step(self.param_groups)
                finally:
                    for r in active:
                        r.working_tensor.grad = None
                for r in active:
                    if r.param_stage is not None:
                        r.param_stage.copy_(r.host_master)
        if push:
            self._push_bucket(bucket, active)

    def _push_bucket(self, bucket: HostBucket, active: list[ParamShard]) -> None:
        with _profiled("HybridDeviceOptimizer.h2d"), self._bucket_stage("h2d", bucket):
            bucket.engine.push_params(bucket, [(r.local, r.push_source) for r in active])
        for r in active:
            r.mark_synced()  # after the push: its copy_ bumped the version counter

    def _kernel_step(
        self, bucket: HostBucket, kernel: HostKernel, active: list[ParamShard], group: dict[str, Any]
    ) -> None:
        """``kernel`` over ``active``: refuse a group it cannot run now, create missing state, step."""
        setting = kernel.unsupported(group)
        if setting is not None:
            raise ValueError(
                f"param group {bucket.group_index}: {setting} was turned on after construction; the host "
                f"{kernel.name} kernel cannot run it and no buffers for it exist. Build the optimizer with "
                f"{setting} set instead (its buckets then run {self.cpu_optimizer_cls.__name__} itself)"
            )
        missing = set(kernel.state_layout(group, bucket.master_dtype, self.precision)) - set(bucket.state)
        if missing:
            raise ValueError(
                f"param group {bucket.group_index}: the host {kernel.name} kernel now needs state {sorted(missing)}, "
                "which was not allocated at construction (a setting changed since, e.g. momentum from 0); build "
                "the optimizer with that setting from the start"
            )
        for r in active:
            if r.state is None:
                self._materialize_kernel_state(r)
        kernel.step_bucket(bucket, active, group, self._scratch)

    # ------------------------------------------------------------------ state

    def _publish(self, record: ParamShard) -> None:
        if record.state is not None:
            self.state[record.param] = record.state

    def _materialize_kernel_state(self, r: ParamShard) -> None:
        """Fresh state of a record its bucket's kernel steps, created by the kernel as its class would
        (:meth:`HostKernel.init_state`: ``step`` 0 if it keeps one, its views of the flat state buffers), plus
        ``master_param``; none at all when that is empty (SGD without momentum on an fp32 param, as in torch).
        Marked ``placeholder_state`` (never updated) until a load or an update."""
        bucket = r.host_bucket
        kernel = bucket.kernel
        assert kernel is not None, f"{r.name}: materialised as kernel state without a kernel"
        sl = slice(r.offset, r.offset + r.numel)
        # "step" first: torch's key order
        views = {"step": torch.tensor(0.0, dtype=torch.float32)} if kernel.has_step else {}
        views.update({name: flat[sl].view(r.local.shape) for name, flat in bucket.state.items()})
        init_fresh_state(kernel, self.param_groups[bucket.group_index], views)
        state: dict[str, Any] = {name: r.wrap(view) for name, view in views.items()}
        if r.has_separate_master:
            state[MASTER_KEY] = r.wrap(r.host_master)
        r.state = state or None
        r.placeholder_state = True

    def _forget(self, r: ParamShard) -> None:
        if r.state is None:
            return
        delegate = self._delegate_of(r)
        if delegate is not None:
            delegate.forget(r)
        r.state = None
        self.state.pop(r.param, None)

    def _delegate_of(self, r: ParamShard) -> DelegatedOptimizer | None:
        if r.offloaded:
            return r.host_bucket.delegate
        return self._device_delegate

    @torch.no_grad()
    def materialize_state(self) -> None:
        """Create every trainable parameter's fresh state (``step`` 0) without changing any parameter.

        The state is what the wrapped class creates on its first step before updating
        (:mod:`offload_fsdp.fresh_state`; a host kernel's state buffers are zeros), plus
        ``master_param`` for low-precision params, so an in-place checkpoint
        load has tensors to fill. Uses no gradients of the user and no randomness;
        parameters and their gradients are left untouched. Idempotent.
        """
        for bucket in self._buckets:
            # nothing in flight may still use the masters or bucket state while state is created
            bucket.engine.wait_params_free(bucket)
        pending: dict[int, tuple[DelegatedOptimizer, list[ParamShard]]] = {}
        for r in self._records:
            if not r.trainable or r.state is not None:
                continue
            delegate = self._delegate_of(r)
            if delegate is None:
                self._materialize_kernel_state(r)
            else:
                pending.setdefault(id(delegate), (delegate, []))[1].append(r)
        for delegate, records in pending.values():
            delegate.materialize(records, self.param_groups)
        for r in self._records:
            self._publish(r)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh masters (host or device) from the current params, where the params changed.

        Call after writing new values into the model's parameters (e.g. loading
        weights): otherwise the next step would start from the stale master and
        silently revert them. A master whose cast equals its param is kept (it
        holds more precision than the param, e.g. one just loaded in place with the
        weights it was saved with); one whose param differs is replaced by the
        param's value, element by element: where the param's value differs from the
        master's cast the master takes it, elsewhere the master keeps its extra
        precision. The first step after construction or after ``load_state_dict``
        calls this by itself (one comparison pass); between later steps, each
        ``step()`` and ``state_dict()`` refresh exactly the params written in place
        since the optimizer last wrote them (:meth:`_refresh_written`), so an
        explicit call is never needed.
        """
        self._refresh_masters(self._records)
        self._refresh_masters_before_step = False

    @torch.no_grad()
    def _refresh_written(self, records: list[ParamShard]) -> None:
        """Refresh the masters of those ``records`` whose param was written in place since the
        optimizer last wrote it (version counter moved): the user's weights are the truth.

        A loop over version counters, no pass over the data, unless something was written.
        """
        written = [r for r in records if r.has_master and r.written_since_sync]
        if written:
            logger.debug("refreshing the masters of %d params written since the last step", len(written))
            self._refresh_masters(written)

    @torch.no_grad()
    def _refresh_masters(self, records: list[ParamShard]) -> None:
        """:meth:`reload_model_params` for ``records`` only."""
        chosen = {id(r) for r in records}
        for bucket in self._buckets:
            mine = [r for r in bucket.records if id(r) in chosen]
            if mine:
                bucket.engine.wait_params_free(bucket)
            for r in mine:
                if r.param_stage is None:
                    bucket.engine.fetch(r.host_master, r.local)
                    continue
                bucket.engine.fetch(r.param_stage, r.local)
                adopt_written(r.host_master, r.param_stage)
        for r in records:
            if not r.offloaded and r.has_master:
                adopt_written(r.working_tensor, r.local)
        for r in records:
            if r.has_master:
                # adopting a written param keeps a master that was exactly its param widened exactly so
                r.mark_synced(master_is_upcast=r.master_is_upcast)

    def state_dict(self) -> dict[str, Any]:
        """As torch; a ``master_param`` in it is first refreshed from a param written since the last step."""
        if self._overlapped is not None:
            self._overlapped.check_idle("state_dict()")  # it would hold a half-applied step
        self._refresh_written(self._records)
        return self._without_unread_state(super().state_dict())

    def _without_unread_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """``saved`` less the never-updated state a kernel's first update does not read (SGD's momentum
        buffers made by :meth:`materialize_state`): torch's class has none yet, and a resume must start them
        from the grad as the run that never saved does. Their masters stay."""
        unread = {
            id(r.param)
            for r in self._records
            if r.placeholder_state and r.offloaded and r.host_bucket.kernel is not None
            and first_update_replaces_state(r.host_bucket.kernel)
        }  # fmt: skip
        if not unread:
            return saved
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for index, per_param in saved["state"].items():
            if id(params[index]) in unread:
                per_param = {k: v for k, v in per_param.items() if k == MASTER_KEY}
            if per_param:
                state[index] = per_param
        return {**saved, "state": state}

    def checkpoint_state(self, *, for_save: bool) -> dict[str, Any]:
        """The torch-convention state dict a checkpoint saves (``for_save``) or loads into in place.

        ``for_save=True``: :meth:`state_dict`, less each ``master_param`` that is exactly its
        param widened (copied from the param and not updated or loaded since: the optimizer
        tracks it per param, so deciding costs no copy or comparison); the saved weight
        rebuilds it on load. A per-param dict that loses its master is a copy; every tensor is
        the optimizer's own.

        ``for_save=False``: every trainable param's state is created first
        (:meth:`materialize_state`); the tensors are the optimizer's own (views of its host
        buckets), for a loader to fill in place and pass to :meth:`load_state_dict`. Nothing
        is refreshed (the values are about to be overwritten).
        """
        if not for_save:
            self.materialize_state()
            return super().state_dict()
        saved = self.state_dict()
        upcast = {id(r.param) for r in self._records if r.master_is_upcast}
        params = [p for group in self.param_groups for p in group["params"]]
        saved["state"] = {
            index: {k: v for k, v in state.items() if k != MASTER_KEY} if id(params[index]) in upcast else state
            for index, state in saved["state"].items()
        }
        return saved

    def _class_of(self, r: ParamShard) -> type[torch.optim.Optimizer]:
        return self.cpu_optimizer_cls if r.offloaded else self.gpu_optimizer_cls

    def _materialize_for_load(self, pairs: list[tuple[ParamShard, dict[str, Any] | None]]) -> None:
        """Materialise state and check every (record, saved state) pair; on an error, drop what was created."""
        fresh = [r for r in self._records if r.trainable and r.state is None]
        self.materialize_state()
        try:
            for r, saved in pairs:
                if saved is not None and r.trainable:
                    check_record_state(r, saved, self._class_of(r).__name__)
        except BaseException:
            for r in fresh:
                self._forget(r)
            raise

    def _keep_grad_buffers(self, records: list[ParamShard]) -> None:
        """With ``graph_safe_grads``: the trainable ``records``' gradients become views of persistent buffers."""
        if self.graph_safe_grads:
            trainable = [r.param for r in records if r.trainable]
            self._grad_buffers.append(pin_grads(trainable, grad_dtype=self.precision.main_grads_dtype))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch; also clears ``decoupled_grad``. ``set_to_none=False`` keeps (zeroes) the buffers.

        With ``graph_safe_grads=True`` the trainable params' gradient buffers are always
        kept and zeroed in place (a slot set to something else is pointed back at its
        buffer): their addresses are what a captured CUDA graph writes.
        """
        if self._overlapped is not None:
            self._overlapped.check_idle("zero_grad()")  # the update of these grads already ran in part
            self._overlapped.forget_readiness()
        if self.graph_safe_grads:
            for handle in self._grad_buffers:
                handle.zero_()
            zero_grads((r.param for r in self._records if not r.trainable), set_to_none=set_to_none)
        else:
            zero_grads((r.param for r in self._records), set_to_none=set_to_none)
        for r in self._records:
            r.staged_grad_key = None
        for engine in self._engines.values():
            engine.release_grads()  # slots held since backward reference the grads just dropped

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a torch-convention optimizer state dict in place (positional param matching).

        Saved state is copied into this optimizer's own (host or device) tensors,
        keeping dtypes (bf16 moments stay bf16) and buckets. Params absent from the
        saved state get no state, as in torch. A saved master (``master_param``, or
        the legacy ``main_param``) is loaded and its param set to its cast (one
        host-to-device copy); the other masters are refreshed from the params once,
        by the next :meth:`step` (which compares every param with its master: weights
        loaded after this call, as ``set_state_dict`` does, are seen). Hyper-parameters
        come from the saved groups.
        """
        if self._overlapped is not None and self._overlapped.backward_raised:
            self._discard_overlapped_step()  # the load replaces what those updates changed
        elif self._overlapped is not None:
            self._overlapped.check_idle("load_state_dict()")  # the worker may still be updating this state
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        check_groups_match(self.param_groups, saved_groups)
        check_groups_fit_class(self.cpu_optimizer_cls, self.param_groups, saved_groups)
        saved_ids = list(chain.from_iterable(g["params"] for g in saved_groups))
        saved_state = state_dict["state"]
        pairs: list[tuple[ParamShard, dict[str, Any] | None]] = []
        for r, sid in zip(self._records, saved_ids):
            saved = saved_state.get(sid)
            if saved is not None:  # a legacy master key read as ours; a None value is torch's "no value"
                # (older torch saved SGD's momentum_buffer=None without momentum; torch loads and skips it)
                saved = {k: v for k, v in canonical_state(saved).items() if v is not None} or None
            pairs.append((r, saved))
        self._materialize_for_load(pairs)  # checks everything first: a failed load changes nothing
        for r, saved in pairs:
            if saved is None or not r.trainable:
                self._forget(r)
                continue
            load_record_state(r, saved, self._class_of(r).__name__)
        for ours, theirs in zip(self.param_groups, saved_groups):
            ours.update(hyperparameters(theirs))
        # The one master refresh of a resume: torch.distributed.checkpoint's set_state_dict
        # loads the optimizer BEFORE the model weights, so it waits for the next step.
        self._refresh_masters_before_step = True
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
