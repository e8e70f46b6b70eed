"""The placement concern: which records live on the host or the device, and what each side holds.

:class:`Placement` owns the optimizer's records (one :class:`~offload_fsdp.records.ParamShard`
per param), their host buckets and the arenas behind them, and the device share's
``DelegatedOptimizer``; it places new records (the one rule, :func:`~offload_fsdp.records.partition`),
keeps each master equal to what the user last wrote into its param, and creates or drops
a record's state. It moves no bytes between devices on its own: a bucket's copy engine does.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

from offload_fsdp.buckets import HostBucket, HostBuffers, build_buckets
from offload_fsdp.copy_engine import CopyEngine
from offload_fsdp.defaults import DeviceDefaults
from offload_fsdp.delegate import DelegatedOptimizer, hyperparameters
from offload_fsdp.host_update import HostUpdate
from offload_fsdp.master import adopt_written, canonical_state, master_dtype
from offload_fsdp.per_element import check_per_element
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard, partition
from offload_fsdp.state_io import check_groups_fit_class, check_groups_match, check_record_state, load_record_state

__all__ = ["Placement"]

logger = logging.getLogger(__name__)


class Placement:
    """Records, host buckets, arenas and the device delegate of one optimizer (see the module doc).

    ``groups``: the optimizer's ``param_groups``. ``host``: the host update (its kernel decides a
    bucket's state buffers). ``engine_for``: the copy engine of a device. ``pin``: page-lock
    (grads, params) buffers crossing the bus when an accelerator holds params.
    """

    def __init__(
        self,
        *,
        offload_fraction: float,
        precision: PrecisionPolicy,
        classes: tuple[type[torch.optim.Optimizer], type[torch.optim.Optimizer]],
        device_defaults: DeviceDefaults | None,
        groups: Callable[[], list[dict[str, Any]]],
        host: HostUpdate,
        engine_for: Callable[[torch.device], CopyEngine],
        bucket_numel: int,
        pin: tuple[bool, bool],
    ) -> None:
        self.offload_fraction, self.precision = offload_fraction, precision
        self.cpu_cls, self.gpu_cls = classes
        self.device_defaults = device_defaults
        self._groups, self._host, self._engine_for = groups, host, engine_for
        self._bucket_numel, self._pin = bucket_numel, pin
        self.records: list[ParamShard] = []
        self.buckets: list[HostBucket] = []
        self.buffers: list[HostBuffers] = []
        """the arenas of each placed batch (construction's, then one per added group), held for their memory"""
        self.device_delegate: DelegatedOptimizer | None = None
        self._accelerated = self._accelerated_next = False
        self.reload_pending = True
        """the next update first compares every param with its master (after construction or a load:
        weights written in between must not be reverted by masters copied earlier)"""

    # ------------------------------------------------------------------ placing records

    def allocate(self, records: list[ParamShard]) -> tuple[list[HostBucket], HostBuffers]:
        """Partition new ``records`` and allocate their buckets; nothing placed so far changes."""
        accelerated = self._accelerated or (
            torch.accelerator.is_available() and any(r.local.device.type != "cpu" for r in records)
        )
        partition(records, self.offload_fraction, host_resident_is_offloaded=accelerated)
        self._check_classes_fit_shards(records)
        for r in records:
            if r.offloaded:
                r.grad_dtype = self.precision.grad_staging_dtype(r.param.dtype)
        self._accelerated_next = accelerated
        buckets, buffers = build_buckets(
            records,
            first_index=len(self.buckets),
            bucket_numel=self._bucket_numel,
            master_dtype_of=self.master_dtype,
            kernel_of=self._host.bucket_kernel,
            pin=(self._pin[0] and accelerated, self._pin[1] and accelerated),
            engine_for=self._engine_for,
        )
        return buckets, buffers

    def add(self, records: list[ParamShard], buckets: list[HostBucket], buffers: HostBuffers) -> None:
        """Fill the new buckets' masters from the params and join the device share.

        Building the device class is the last step that can fail; nothing is recorded before it.
        """
        self._init_host_copies(buckets)
        self._host.attach_delegates(buckets)
        self._join_device_delegate(records)
        self._accelerated = self._accelerated_next
        self.records.extend(records)
        self.buckets.extend(buckets)
        self.buffers.append(buffers)
        self._warn_unused_precision(records)

    def master_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return master_dtype(dtype, self.precision.main_params_dtype)

    def _check_classes_fit_shards(self, records: list[ParamShard]) -> None:
        """Refuse, naming class and param, a non-elementwise class on a sharded param (:mod:`offload_fsdp.per_element`)."""
        for r in records:
            if r.trainable and r.is_sharded:
                check_per_element(self.class_of(r), r.name, tuple(r.local.shape), r.global_shape)

    @torch.no_grad()
    def _init_host_copies(self, buckets: list[HostBucket]) -> None:
        """Fill host masters / param staging from the params."""
        for bucket in buckets:
            for r in bucket.records:
                self.copy_master_from_param(r)
                r.working = r.master

    @staticmethod
    def copy_master_from_param(r: ParamShard) -> None:
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
            dtype = self.master_dtype(r.param.dtype)
            # A device fp32 master for low-precision params; otherwise the local param itself.
            r.working = r.local.to(dtype, copy=True) if dtype != r.param.dtype else r.local
            r.mark_synced(master_is_upcast=True)
        if records:
            self._join(records)

    def _join(self, records: list[ParamShard]) -> None:
        """The device share's optimizer takes over the new trainable device ``records`` (working tensors set)."""
        if self.device_delegate is None:
            self.device_delegate = self.new_device_delegate(records)
        else:
            self.device_delegate.add_records(records, self._groups())

    def new_device_delegate(self, records: list[ParamShard]) -> DelegatedOptimizer:
        """A ``gpu_optimizer_cls`` instance over ``records`` of the device share, with the device class's defaults."""
        view = self.device_defaults.for_device if self.device_defaults is not None else None
        return DelegatedOptimizer(self.gpu_cls, records, self._groups(), where="device", view=view)

    def note_group(self, index: int, group: dict[str, Any], explicit: set[str]) -> None:
        """A group was added: the device class keeps its own defaults for what the user left unset in it."""
        if self.device_defaults is not None:
            self.device_defaults.add_group(index, group, explicit)

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
                stacklevel=4,
            )

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes of the bucket arenas."""
        return sum(b.pinned.reserved_bytes for b in self.buffers if b.pinned.pinned)

    def step_device(self, active: list[tuple[ParamShard, torch.Tensor]]) -> None:
        """The device share's update of ``active`` (record, local grad) by the device delegate."""
        if active:
            assert self.device_delegate is not None
            self.step_delegate(self.device_delegate, active)

    def step_delegate(self, delegate: DelegatedOptimizer, active: list[tuple[ParamShard, torch.Tensor]]) -> None:
        """``delegate``'s update of its records in ``active`` (record, local grad); params take their master's cast."""
        previous = [(r, r.working_tensor.grad) for r, _ in active]
        for r, g in active:
            r.working_tensor.grad = g if g.dtype == r.working_tensor.dtype else g.to(r.working_tensor.dtype)
        try:
            delegate.step(self._groups())
        finally:
            # Restore, not clear: when the working tensor IS the param, its .grad is the user's grad.
            for r, before in previous:
                r.working_tensor.grad = before
        for r, _ in active:
            if r.working is not r.local:
                r.local.copy_(r.working_tensor)  # the param is the cast of its fp32 master
                r.mark_synced()

    @property
    def device_share_note(self) -> str:
        """What the INFO construction line adds about the device share (nothing: its state stays on the device)."""
        return ""

    def settle(self) -> None:
        """Make every optimizer tensor readable from the host now (nothing to do: nothing is parked)."""

    # ------------------------------------------------------------------ masters

    def refresh_before_update(self, records: list[ParamShard]) -> None:
        """The masters' refresh an update does first (the user's weights are the truth): every master after
        construction or a load, else those of ``records`` whose param was written since."""
        if self.reload_pending:
            self.reload_all()
        else:
            self.refresh_written(records)

    def reload_all(self) -> None:
        self.refresh_masters(self.records)
        self.reload_pending = False

    @torch.no_grad()
    def refresh_written(self, records: list[ParamShard]) -> None:
        """Refresh the masters of those ``records`` whose param was written in place since the
        optimizer last wrote it (version counter moved): the user's weights are the truth.

        A loop over version counters, no pass over the data, unless something was written.
        """
        written = [r for r in records if r.has_master and r.written_since_sync]
        if written:
            logger.debug("refreshing the masters of %d params written since the last step", len(written))
            self.refresh_masters(written)

    @torch.no_grad()
    def refresh_masters(self, records: list[ParamShard]) -> None:
        """``reload_model_params`` for ``records`` only."""
        chosen = {id(r) for r in records}
        for bucket in self.buckets:
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
                # (a master parked on the host by state-only offload compares on the host)
                adopt_written(r.working_tensor, r.local.to(r.working_tensor.device))
        for r in records:
            if r.has_master:
                # adopting a written param keeps a master that was exactly its param widened exactly so
                r.mark_synced(master_is_upcast=r.master_is_upcast)

    # ------------------------------------------------------------------ state

    def class_of(self, r: ParamShard) -> type[torch.optim.Optimizer]:
        return self.cpu_cls if r.offloaded else self.gpu_cls

    def delegate_of(self, r: ParamShard) -> DelegatedOptimizer | None:
        if r.offloaded:
            return r.host_bucket.delegate
        return self.device_delegate

    @torch.no_grad()
    def materialize(self) -> None:
        """Create every trainable record's missing fresh state (see ``materialize_state``)."""
        for bucket in self.buckets:
            # nothing in flight may still use the masters or bucket state while state is created
            bucket.engine.wait_params_free(bucket)
        pending: dict[int, tuple[DelegatedOptimizer, list[ParamShard]]] = {}
        for r in self.records:
            if not r.trainable or r.state is not None:
                continue
            delegate = self.delegate_of(r)
            if delegate is None:
                self._host.create_state(r)
            else:
                pending.setdefault(id(delegate), (delegate, []))[1].append(r)
        for delegate, records in pending.values():
            delegate.materialize(records, self._groups())

    def forget(self, r: ParamShard) -> None:
        """Drop ``r``'s state (its delegate's too)."""
        if r.state is None:
            return
        delegate = self.delegate_of(r)
        if delegate is not None:
            delegate.forget(r)
        r.state = None

    @torch.no_grad()
    def load(self, state_dict: dict[str, Any], groups: list[dict[str, Any]]) -> None:
        """Load a torch-convention optimizer state dict into the records' own tensors (positional matching).

        Everything is checked first (groups, each record's saved state against its class): a failed load
        changes nothing. A param without saved state gets none, as in torch; hyper-parameters come from the
        saved groups; every master is refreshed from its param before the next update.
        """
        saved_groups = state_dict["param_groups"]
        check_groups_match(groups, saved_groups)
        check_groups_fit_class(self.cpu_cls, groups, saved_groups)
        saved_ids = list(chain.from_iterable(g["params"] for g in saved_groups))
        saved_state = state_dict["state"]
        pairs: list[tuple[ParamShard, dict[str, Any] | None]] = []
        for r, sid in zip(self.records, saved_ids):
            saved = saved_state.get(sid)
            if saved is not None:  # a legacy master key read as ours; a None value is torch's "no value"
                # (older torch saved SGD's momentum_buffer=None without momentum; torch loads and skips it)
                saved = {k: v for k, v in canonical_state(saved).items() if v is not None} or None
            pairs.append((r, saved))
        self._materialize_for_load(pairs)
        for r, saved in pairs:
            if saved is None or not r.trainable:
                self.forget(r)
                continue
            load_record_state(r, saved, self.class_of(r).__name__)
        for ours, theirs in zip(groups, saved_groups):
            ours.update(hyperparameters(theirs))
        # The one master refresh of a resume: torch.distributed.checkpoint's set_state_dict
        # loads the optimizer BEFORE the model weights, so it waits for the next step.
        self.reload_pending = True

    def _materialize_for_load(self, pairs: list[tuple[ParamShard, dict[str, Any] | None]]) -> None:
        """Materialise state and check every (record, saved state) pair; on an error, drop what was created."""
        fresh = [r for r in self.records if r.trainable and r.state is None]
        self.materialize()
        try:
            for r, saved in pairs:
                if saved is not None and r.trainable:
                    check_record_state(r, saved, self.class_of(r).__name__)
        except BaseException:
            for r in fresh:
                self.forget(r)
            raise
