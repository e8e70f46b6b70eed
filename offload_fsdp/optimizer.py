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
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from offload_fsdp.buckets import HostBucket
from offload_fsdp.core_binding import HostCores
from offload_fsdp.defaults import DeviceDefaults, class_defaults, same_value
from offload_fsdp.delegate import hyperparameters
from offload_fsdp.forward_waits import owners_of_buckets, register_forward_waits
from offload_fsdp.grad import get_grad, local_tensor
from offload_fsdp.grad_slots import GradSlots, grad_slots_for
from offload_fsdp.host_update import HostUpdate
from offload_fsdp.layout import OffloadLayout, describe
from offload_fsdp.master import MASTER_KEY, policy_with_fp32_update
from offload_fsdp.options import DEFAULT_BUCKET_NUMEL, OffloadOptions, Schedule
from offload_fsdp.per_element import check_steps_without_closure
from offload_fsdp.placement import Placement
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard, build_records, param_name
from offload_fsdp.schedule import AfterBackward, OverlappedSchedule, StepSchedule
from offload_fsdp.speculative import SpeculationCounts, SpeculativeClip
from offload_fsdp.state_only import StateOnlyPlacement
from offload_fsdp.trace import PhaseTrace
from offload_fsdp.transfer import Transfer
from offload_fsdp.wrapping import WrappedLink

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


def _check_optimizer_cls(cls: Any, arg: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{arg} must be a torch.optim.Optimizer subclass, got {cls!r}")
    if issubclass(cls, HybridDeviceOptimizer):
        raise TypeError(f"{arg} cannot be HybridDeviceOptimizer itself; pass the class it should run")
    check_steps_without_closure(cls, arg)


def _resolve_groups(
    params_or_optimizer: Any, cpu_cls: type | None, defaults: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any], type, torch.optim.Optimizer | None, tuple[list[set[str]], set[str]]]:
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
            page-locked; n >= 1: they stay pageable and copies go through n page-locked slots
            per direction, with the same results (:attr:`OffloadOptions.pinned_transfer_slots`).
        overlap_cpu_optimizer_d2h_h2d: copies on side streams, D2H started from
            post-accumulate-grad hooks; False = blocking copies
            (:attr:`OffloadOptions.overlap_cpu_optimizer_d2h_h2d`).
        precision: ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` of host Adam moments (bf16
            halves their memory and bytes moved), ``main_params_dtype`` of masters (default
            fp32: a low-precision param gets an fp32 master that is the truth, the param its
            cast, saved as ``master_param``; ``None``: params are updated in their own dtype;
            :mod:`offload_fsdp.master`), ``main_grads_dtype`` (when set) of host grad staging.
        bucket_numel: elements per host bucket (the pipelining unit).
        graph_safe_grads: every trainable param's gradient becomes a view of a persistent
            flat buffer that :meth:`zero_grad` zeroes in place, so a captured CUDA graph keeps
            writing into the gradients the step reads (:attr:`OffloadOptions.graph_safe_grads`).
        overlap_step_with_backward: run each host bucket's update during the final backward,
            on one host worker thread, as soon as its grads are final; bit-identical results,
            and what this mode cannot honour (``step(closure)``, ``GradScaler``, clipping, ...)
            is refused naming the fix (:attr:`OffloadOptions.schedule`, ``docs/offload.md``,
            "Overlapped host step"). :attr:`step_in_progress` says when a backward started updates.
        speculative_clipping / clip_snapshot_bytes: clipping (and GradScaler) in that mode: buckets
            snapshotted before their update, committed or redone in ``step()``, bit-identical
            (:attr:`OffloadOptions.speculative_clipping`; :attr:`speculation_counts`).
        bind_host_cores: host-update threads bound to this local rank's own cores
            (:attr:`OffloadOptions.bind_host_cores`; :attr:`host_cores`, the INFO construction line).
        offload_state_only / state_device_bytes: the device share is updated on the device but its masters and
            state are parked in host memory between steps, within a device-memory budget
            (:attr:`OffloadOptions.offload_state_only`, :mod:`offload_fsdp.state_only`).
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
        offload_state_only: bool = False,
        state_device_bytes: int | None = None,
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
            bind_host_cores=bind_host_cores, offload_state_only=offload_state_only,
            state_device_bytes=state_device_bytes,
        )  # fmt: skip
        opts = self.options = OffloadOptions.choose(options, keywords)
        groups, opt_defaults, cpu_cls, wrapped, explicit = _resolve_groups(
            params_or_optimizer, opts.cpu_optimizer_cls, defaults
        )
        gpu_cls = opts.gpu_optimizer_cls if opts.gpu_optimizer_cls is not None else cpu_cls
        _check_optimizer_cls(gpu_cls, "gpu_optimizer_cls")
        _refuse_repeated_params(groups)
        super().__init__(groups, opt_defaults)
        self._wrapped = WrappedLink(wrapped)
        self._wrapped.share_groups(self.param_groups)
        # Keys the user set, per group and at constructor level (those also fill groups added later).
        group_keys, self._explicit_defaults = explicit
        self.offload_fraction = opts.offload_fraction
        self.cpu_optimizer_cls, self.gpu_optimizer_cls = cpu_cls, gpu_cls
        self.precision = policy_with_fp32_update(opts.precision, param_update_in_fp32)
        self.overlap = opts.overlap_cpu_optimizer_d2h_h2d
        self.graph_safe_grads = opts.graph_safe_grads
        self._host_cores = HostCores(opts.bind_host_cores)
        self._trace, self._transfer, self._host, self._placement, self._grads, self._schedule = _compose(
            self, opts, model
        )
        self._model = weakref.ref(model) if model is not None else None  # per-module H2D waits (model=)
        for index, (group, keys) in enumerate(zip(self.param_groups, group_keys)):
            self._placement.note_group(index, group, keys)
        self._defer_grad_copies = False  # set by defer_grad_copies(): backward hooks leave grads for step()
        self._hook_handles: list[Any] = []
        self._place(build_records(self.param_groups), "construction")
        self._built = True
        self._groups_placed = len(self.param_groups)
        self._wrapped.take_over(self.load_state_dict)

    @property
    def param_update_in_fp32(self) -> bool:
        """Deprecated view of ``precision.main_params_dtype is not None`` (read-only)."""
        return self.precision.main_params_dtype is not None

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes this optimizer holds: bucket buffers (default) or transfer slots."""
        return self._placement.pinned_bytes + self._transfer.pinned_bytes

    @property
    def speculation_counts(self) -> SpeculationCounts | None:
        """What ``speculative_clipping`` did so far (committed / redone / deferred buckets); None without it."""
        return self._schedule.speculation_counts

    @property
    def host_cores(self) -> frozenset[int] | None:
        """The cores the host updates' threads are bound to (``bind_host_cores``), or None when unbound."""
        return self._host_cores.cores

    @property
    def step_in_progress(self) -> bool:
        """True from the first host update started during backward (``overlap_step_with_backward=True``)
        until ``step()`` ends that step; always False in the default schedule. While True, ``zero_grad()``,
        ``state_dict()`` and ``load_state_dict()`` refuse: the backward committed to the step."""
        return self._schedule.in_progress

    def layout(self) -> OffloadLayout:
        """A read-only snapshot of the placement: per param (host or device, its bucket), per host bucket
        (params, dtypes, host kernel, copy engine) and per host arena (bytes); :mod:`offload_fsdp.layout`."""
        return describe(self._placement.records, self._placement.buckets, self._placement.buffers)

    def _place(self, records: list[ParamShard], what: str) -> None:
        """Place new, validated ``records``: buckets, masters, device share, hooks; logs the partition.

        Existing buffers are never touched; on an error nothing was recorded.
        """
        self._grads.keep(records)
        buckets, buffers = self._placement.allocate(records)
        model = self._model() if self._model is not None else None
        waits = owners_of_buckets(model, buckets) if model is not None else []  # raises for a param not in it
        self._placement.add(records, buckets, buffers)
        self._transfer.fit(buckets)
        if self.overlap:
            self._hook_handles.extend(_grad_hooks(self, records))
        self._schedule.watch(records, self)
        self._hook_handles.extend(register_forward_waits(waits, _wait_pushed))
        _log_partition(self._placement, records, buckets, what, self._transfer.transfer_slots,
                       self._host_cores.description)  # fmt: skip

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
            _check_new_params(self.param_groups, self._placement.records, param_group, existing=len(self.param_groups))
            raise
        index = len(self.param_groups) - 1
        try:
            _check_new_params(self.param_groups, self._placement.records, param_group, existing=index)
            self._placement.note_group(index, self.param_groups[index], user_keys | self._explicit_defaults)
            self._place(
                build_records([self.param_groups[index]], first_group_index=index), f"param group {index} added"
            )
            self._groups_placed = len(self.param_groups)
        except BaseException:
            self.param_groups.pop()
            raise

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

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every parameter with a gradient (torch semantics for gradless params).

        Order: queue all D2H grad copies, queue the device share's update, then per
        bucket: wait for its grads, update on the host, queue its H2D. When this
        returns the host work is done and the main stream is ordered after the H2D.
        """
        self._wrapped.check_groups_placed(len(self.param_groups), self._groups_placed)
        # The schedule runs the closure (or refuses it), applies GradScaler's verdict and
        # finishes what backward started; `done`: the records it already updated.
        loss, done, skip = self._schedule.start_step(self, closure, self._placement.records)
        if skip:
            return loss
        try:
            self._step_records(done)
        except BaseException:
            self._schedule.abandon()
            raise
        self._schedule.end_step()
        return loss

    def _step_records(self, done: set[int]) -> None:
        """The step of every record with a grad, except ``done`` (updated during backward)."""
        placement, transfer = self._placement, self._transfer
        active = _collect_active(placement.records)
        if not active:
            return
        # Every record, gradless ones too: their state's master must show the user's write now
        # (a no-op for `done`, synced by their update; a loop over version counters otherwise).
        placement.refresh_before_update(placement.records)
        grads = {id(r): g for r, g in active}
        engines = transfer.begin_step(self._schedule.begun_engines)
        try:
            # Updated during backward, written only now: backward may read a param after its grad is final.
            for bucket in self._schedule.updated_buckets():
                transfer.push(bucket, bucket.records)
            transfer.stage_grads([(r, g) for r, g in active if r.offloaded], done)
            placement.step_device([(r, g) for r, g in active if not r.offloaded])
            for bucket in placement.buckets:
                bucket_active = [r for r in bucket.records if id(r) in grads and id(r) not in done]
                if bucket_active:  # on this rank's cores (bind_host_cores); its H2D queued from here
                    self._host_cores.run(functools.partial(self._host.update, bucket, bucket_active), bucket.device)
                    transfer.push(bucket, bucket_active)
        finally:
            transfer.end_step(engines)
            for r in placement.records:
                r.staged_grad_key = None
        self._publish(r for r, _ in active)
        # A scheduler attached to the wrapped optimizer before wrapping checks that *it* was stepped.
        self._wrapped.mark_stepped()

    # torch.amp.GradScaler's protocol for optimizers that handle scaling (:mod:`offload_fsdp.amp`):
    # GradScaler.step then calls step() with `grad_scale` / `found_inf` set instead of unscaling itself.
    _step_supports_amp_scaling = True

    def wait_for_params(self) -> None:
        """Order the current stream after every param H2D queued so far (the host does not block).

        Needed only with ``model=``, before reading params other than through the model's
        forward (which waits for its own params): e.g. saving a checkpoint right after ``step()``.
        """
        for bucket in self._placement.buckets:
            bucket.engine.wait_pushed(bucket)
        self._placement.settle()  # offload_state_only: write-backs of masters and state landed

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch; also clears ``decoupled_grad``. ``set_to_none=False`` keeps (zeroes) the buffers.

        With ``graph_safe_grads=True`` the trainable params' gradient buffers are always
        kept and zeroed in place (a slot set to something else is pointed back at its
        buffer): their addresses are what a captured CUDA graph writes.
        """
        self._schedule.grads_zeroed()
        self._grads.zero(self._placement.records, set_to_none=set_to_none)
        for r in self._placement.records:
            r.staged_grad_key = None
        self._transfer.release_grads()

    # ------------------------------------------------------------------ state

    def _publish(self, records: Iterable[ParamShard] | None = None) -> None:
        """``self.state`` shows the state of ``records`` (default: all): each record's dict, or none."""
        for r in self._placement.records if records is None else records:
            if r.state is not None:
                self.state[r.param] = r.state
            else:
                self.state.pop(r.param, None)

    @torch.no_grad()
    def materialize_state(self) -> None:
        """Create every trainable parameter's fresh state (``step`` 0) without changing any parameter.

        The state is what the wrapped class creates on its first step before updating
        (:mod:`offload_fsdp.fresh_state`; a host kernel's state as its ``init_state`` makes it),
        plus ``master_param`` for low-precision params, so an in-place checkpoint
        load has tensors to fill. Uses no gradients of the user and no randomness;
        parameters and their gradients are left untouched. Idempotent.
        """
        self._placement.materialize()
        self._publish()

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
        since the optimizer last wrote them, so an explicit call is never needed.
        """
        self._placement.reload_all()

    def state_dict(self) -> dict[str, Any]:
        """As torch; a ``master_param`` in it is first refreshed from a param written since the last step."""
        self._schedule.check_idle("state_dict()")  # it would hold a half-applied step
        self._placement.settle()  # offload_state_only: parked state is read once its write-back landed
        self._placement.refresh_written(self._placement.records)
        # Never-updated state a kernel's first update does not read (SGD's momentum buffers made by
        # materialize_state) is left out: torch's class has none yet, and a resume must start it from
        # the grad as the run that never saved does. Its master stays.
        unread = HostUpdate.unread_state(self._placement.records)
        return _state_without(super().state_dict(), self.param_groups, unread, keep=MASTER_KEY)

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
        upcast = {id(r.param) for r in self._placement.records if r.master_is_upcast}
        return _state_without(self.state_dict(), self.param_groups, upcast, drop=MASTER_KEY)

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
        come from the saved groups. Hooks registered with torch's
        ``register_load_state_dict_pre_hook`` / ``post_hook`` run as torch runs them.
        """
        self._schedule.before_load()
        # torch's own load runs the user's hooks. Ours is the last pre-hook (it sees the dict they
        # return, loads it into the records and hands torch no state to cast) and the first
        # post-hook (it puts back this optimizer's own state, groups and defaults, which torch's
        # __setstate__ replaced, before the user's post-hooks look at them).
        kept = (self.state, self.param_groups, dict(self.defaults))
        load = self.register_load_state_dict_pre_hook(_load_into_records)
        restore = self.register_load_state_dict_post_hook(functools.partial(_restore, kept=kept), prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            load.remove()
            restore.remove()


def _load_into_records(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Load pre-hook (the last): the load itself; torch is left groups to check and no state to copy."""
    assert isinstance(optimizer, HybridDeviceOptimizer)
    try:
        optimizer._placement.load(state_dict, optimizer.param_groups)
    finally:
        optimizer._publish()  # what the load created, kept or dropped
    return {"state": {}, "param_groups": state_dict["param_groups"]}


def _restore(optimizer: torch.optim.Optimizer, *, kept: tuple[Any, list[dict[str, Any]], dict[str, Any]]) -> None:
    """Load post-hook (the first): this optimizer's own state, group dicts and defaults, as before the load."""
    optimizer.state, optimizer.param_groups = kept[0], kept[1]
    optimizer.defaults.clear()
    optimizer.defaults.update(kept[2])


def _state_without(
    saved: dict[str, Any], groups: list[dict[str, Any]], params: set[int], *, keep: str = "", drop: str = ""
) -> dict[str, Any]:
    """``saved`` with, for the params whose ids are in ``params``, only ``keep`` (a per-param dict left empty
    is left out) or all but ``drop`` (it stays, empty); changed dicts are copies."""
    if not params:
        return saved
    ids = [id(p) for group in groups for p in group["params"]]
    state = {}
    for index, per_param in saved["state"].items():
        if ids[index] in params:
            per_param = {k: v for k, v in per_param.items() if (k == keep if keep else k != drop)}
        if per_param or drop:
            state[index] = per_param
    return {**saved, "state": state}


def _log_partition(
    placement: Placement,
    records: list[ParamShard],
    buckets: list[HostBucket],
    what: str,
    slots: int | None,
    cores: str,
) -> None:
    """The INFO line of each placement (construction, a group added); ``cores``: the host step's binding."""

    def nbytes(rs: list[ParamShard]) -> int:
        return sum(r.numel * r.param.element_size() for r in rs)

    host = [r for r in records if r.offloaded]
    device = [r for r in records if r.trainable and not r.offloaded]
    buffers = placement.buffers[-1]
    pinned = buffers.pinned
    engines = {id(b.engine): b.engine for b in buckets}.values()
    logger.info(
        "HybridDeviceOptimizer partition (%s, offload_fraction=%.3f): host %d params / %d elements / %d bytes, "
        "device %d params / %d elements / %d bytes, %d buckets; pinned host bytes reserved %d, used %d "
        "(page-locked: %s); pageable host bytes %d; pinned_transfer_slots=%s, page-locked slot bytes %d "
        "(optimizer.pinned_bytes: the total); host step cores %s%s",
        what, placement.offload_fraction, len(host), sum(r.numel for r in host), nbytes(host),
        len(device), sum(r.numel for r in device), nbytes(device), len(buckets),
        pinned.reserved_bytes, pinned.layout.used_bytes, pinned.pinned, buffers.pageable_reserved_bytes,
        slots, sum(e.pinned_bytes for e in engines), cores, placement.device_share_note,
    )  # fmt: skip


def _wait_pushed(bucket: HostBucket) -> None:
    bucket.engine.wait_pushed(bucket)


def _collect_active(records: list[ParamShard]) -> list[tuple[ParamShard, torch.Tensor]]:
    """(record, local grad) of every record with a gradient; validates them, naming the param."""
    active = []
    for r in records:
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


def _compose(
    opt: HybridDeviceOptimizer, opts: OffloadOptions, model: torch.nn.Module | None
) -> tuple[PhaseTrace, Transfer, HostUpdate, Placement, GradSlots, StepSchedule]:
    """The objects ``opt``'s step is made of, one concern each (``docs/architecture.md``, "One optimizer step")."""
    groups = functools.partial(getattr, opt, "param_groups")
    trace = PhaseTrace()
    transfer = Transfer(
        overlap=opt.overlap, transfer_slots=opts.pinned_transfer_slots, main_waits=model is None, trace=trace
    )
    host_step = opts.host_step.value if opts.host_step is not None else None
    host = HostUpdate(opt.cpu_optimizer_cls, opt.precision, host_step=host_step, groups=groups,
                            trace=trace)  # fmt: skip
    pin = (opts.pin_cpu_grads, opts.pin_cpu_params) if opts.pinned_transfer_slots is None else (False, False)
    gpu_cls = opt.gpu_optimizer_cls
    # offload_state_only: a placement whose device share parks its masters and state on the host between steps
    make_placement: Callable[..., Placement] = (
        functools.partial(StateOnlyPlacement, state_device_bytes=opts.state_device_bytes)
        if opts.offload_state_only
        else Placement
    )
    placement = make_placement(
        offload_fraction=opt.offload_fraction,
        precision=opt.precision,
        classes=(opt.cpu_optimizer_cls, gpu_cls),
        device_defaults=DeviceDefaults(gpu_cls) if gpu_cls is not opt.cpu_optimizer_cls else None,
        groups=groups,
        host=host,
        engine_for=transfer.engine_for,
        bucket_numel=opts.bucket_numel,
        pin=pin,  # with transfer slots every host buffer stays pageable: only the slots are page-locked
    )
    grads = grad_slots_for(opts.graph_safe_grads, opt.precision.main_grads_dtype)
    schedule: StepSchedule = AfterBackward()
    if opts.schedule is Schedule.OVERLAPPED:
        schedule = OverlappedSchedule(
            lambda bucket: placement.refresh_before_update(bucket.records),
            host.update,  # step() pushes the params (see _step_records)
            lambda i: groups()[i],
            push=transfer.push,
            restore_master=placement.copy_master_from_param,
            on_worker_start=opt._host_cores.bind_this_thread,
            speculation=SpeculativeClip(opts.clip_snapshot_bytes, placement.forget)
            if opts.speculative_clipping
            else None,
        )
    return trace, transfer, host, placement, grads, schedule


def _grad_hooks(optimizer: HybridDeviceOptimizer, records: list[ParamShard]) -> list[Any]:
    """Post-accumulate-grad hooks that start an offloaded grad's D2H as soon as it is final."""
    handles = []
    self_ref = weakref.ref(optimizer)  # a hook must not keep the optimizer alive
    for r in records:
        if not r.offloaded:
            continue

        def hook(param: torch.Tensor, record: ParamShard = r) -> None:
            opt = self_ref()
            if opt is None:
                return
            opt._schedule.grad_arriving(record)
            grad = get_grad(param)
            if opt._defer_grad_copies or grad is None or grad.layout != torch.strided:
                return  # deferred (step() copies it), or an error step() raises with the param's name
            local = local_tensor(grad)
            if local.dtype == record.grad_dtype and local.shape == record.local.shape:
                opt._transfer.stage_grad(record, local)
                opt._schedule.grad_staged(record)

        handles.append(r.param.register_post_accumulate_grad_hook(hook))
    return handles


def _check_new_params(
    built: list[dict[str, Any]], records: list[ParamShard], group: dict[str, Any], *, existing: int
) -> None:
    """Raise ``ValueError`` naming a param of a new group that is already optimised or listed twice.

    ``existing``: how many of ``built`` (``param_groups``) are the groups already built.
    (torch's own check only says that "some parameters" repeat, and only warns
    about a repeat inside the group, which would give a param two records here.)
    """
    params = group["params"]
    if not isinstance(params, list):
        return  # torch failed before normalising the group; its error stands
    owner = {id(p): g for g, built in enumerate(built[:existing]) for p in built["params"]}
    names = {id(r.param): r.name for r in records}
    for position, p in enumerate(params):
        if id(p) in owner:
            name = names.get(id(p)) or param_name(group, existing, position)
            raise ValueError(
                f"parameter {name!r} of the new param group is already in param group {owner[id(p)]} (some "
                "parameters appear in more than one parameter group); add each parameter to one group only"
            )
    _refuse_repeated_params([group], first_index=existing)
