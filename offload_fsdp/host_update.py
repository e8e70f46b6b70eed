"""The host kernel concern: how one host bucket is updated, and its fresh state.

A bucket is updated by the optimizer class's host kernel over flat buffers
(:mod:`offload_fsdp.host_kernels`) when the kernel can run the bucket's group
and dtypes, else by that bucket's ``DelegatedOptimizer`` (one ordinary
``cpu_optimizer_cls`` instance over the masters' views). Either way the update
reads the grads' host staging, updates masters and state in place, and leaves
the param-dtype cast in param staging for the H2D.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from offload_fsdp import fused_step
from offload_fsdp.buckets import HostBucket
from offload_fsdp.compiled_step import choose_host_step
from offload_fsdp.delegate import DelegatedOptimizer
from offload_fsdp.host_kernels import HostKernel, first_update_replaces_state, host_kernel_for, init_fresh_state
from offload_fsdp.master import MASTER_KEY
from offload_fsdp.precision import PrecisionPolicy
from offload_fsdp.records import ParamShard
from offload_fsdp.trace import PhaseTrace, profiled

__all__ = ["HostUpdate"]


class HostUpdate:
    """Updates host buckets: the class's host kernel where it can run, else the bucket's delegated instance.

    ``host_step``: Adam's step choice (``OffloadOptions.host_step``; None: ``$OFFLOAD_FSDP_HOST_STEP``),
    read once, now. ``groups``: the optimizer's ``param_groups`` (hyper-parameters are read there).
    """

    def __init__(
        self,
        cpu_cls: type[torch.optim.Optimizer],
        precision: PrecisionPolicy,
        *,
        host_step: str | None,
        groups: Callable[[], list[dict[str, Any]]],
        trace: PhaseTrace,
    ) -> None:
        self.cpu_cls, self.precision, self._groups, self._trace = cpu_cls, precision, groups, trace
        with choose_host_step(host_step):
            self.kernel = host_kernel_for(cpu_cls)
        self.scratch = fused_step.PieceScratch(fused_step.PIECE_NUMEL)  # read now: tests make pieces small
        """reusable fp32 buffers of the kernels' cache-sized pieces"""

    def _group_kernel(self, group: dict[str, Any]) -> HostKernel | None:
        """The host kernel for ``group``'s buckets, or None when its class has none or it cannot run the group."""
        kernel = self.kernel
        return kernel if kernel is not None and kernel.unsupported(group) is None else None

    def bucket_kernel(self, bucket: HostBucket) -> tuple[HostKernel, dict[str, torch.dtype]] | None:
        """(kernel, its flat state buffers' dtypes) for ``bucket``, or None: a delegated optimizer steps it."""
        group = self._groups()[bucket.group_index]
        kernel = self._group_kernel(group)
        if (
            kernel is None
            or bucket.param_dtype not in kernel.dtypes
            or bucket.grad_dtype not in kernel.dtypes
            or bucket.master_dtype not in kernel.master_dtypes
        ):
            return None
        return kernel, kernel.state_layout(group, bucket.master_dtype, self.precision)

    def attach_delegates(self, buckets: list[HostBucket]) -> None:
        """Give every bucket without a kernel its ``cpu_optimizer_cls`` instance over the masters' views."""
        for bucket in buckets:
            if bucket.kernel is None:
                bucket.delegate = DelegatedOptimizer(self.cpu_cls, bucket.records, self._groups(), where="host")

    def update(self, bucket: HostBucket, active: list[ParamShard]) -> None:
        """Wait for the bucket's grads and for its params' last H2D, then update ``active`` in place."""
        bucket.engine.wait_grads(bucket)
        bucket.engine.wait_params_free(bucket)
        group = self._groups()[bucket.group_index]
        with profiled("HybridDeviceOptimizer.host_step"), self._trace.bucket_phase("host_step", bucket):
            if bucket.kernel is not None:
                self._kernel_update(bucket, bucket.kernel, active, group)
            else:
                self._delegated_update(bucket, active)

    def _delegated_update(self, bucket: HostBucket, active: list[ParamShard]) -> None:
        for r in active:
            staged, working = r.host_grad_stage, r.working_tensor
            working.grad = staged if staged.dtype == working.dtype else staged.to(working.dtype)
        assert bucket.delegate is not None  # attached to every bucket without a host kernel
        try:
            bucket.delegate.step(self._groups())
        finally:
            for r in active:
                r.working_tensor.grad = None
        for r in active:
            if r.param_stage is not None:
                r.param_stage.copy_(r.host_master)

    def _kernel_update(
        self, bucket: HostBucket, kernel: HostKernel, active: list[ParamShard], group: dict[str, Any]
    ) -> None:
        """``kernel`` over ``active``: refuse a group it cannot run now, create missing state, step."""
        setting = kernel.unsupported(group)
        if setting is not None:
            raise ValueError(
                f"param group {bucket.group_index}: {setting} was turned on after construction; the host "
                f"{kernel.name} kernel cannot run it and no buffers for it exist. Build the optimizer with "
                f"{setting} set instead (its buckets then run {self.cpu_cls.__name__} itself)"
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
                self.create_state(r)
        kernel.step_bucket(bucket, active, group, self.scratch)

    def create_state(self, r: ParamShard) -> None:
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
        init_fresh_state(kernel, self._groups()[bucket.group_index], views)
        state: dict[str, Any] = {name: r.wrap(view) for name, view in views.items()}
        if r.has_separate_master:
            state[MASTER_KEY] = r.wrap(r.host_master)
        r.state = state or None
        r.placeholder_state = True

    @staticmethod
    def unread_state(records: list[ParamShard]) -> set[int]:
        """ids of the params whose state is never-updated state their kernel's first update does not read
        (SGD's momentum buffers made by ``materialize_state``): a checkpoint leaves it out."""
        return {
            id(r.param)
            for r in records
            if r.placeholder_state and r.offloaded and r.host_bucket.kernel is not None
            and first_update_replaces_state(r.host_bucket.kernel)
        }  # fmt: skip
