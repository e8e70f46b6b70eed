"""Which :class:`~offload_fsdp.copy_engine.CopyEngine` moves one device's bytes: the one place engines are chosen.

* a CPU-resident param, or ``overlap_cpu_optimizer_d2h_h2d=False``: :class:`~offload_fsdp.copy_engine.SyncCopyEngine`
  (blocking copies, shared by all such buckets);
* an accelerator with ``pinned_transfer_slots=n``: :class:`~offload_fsdp.transfer_ring.RingCopyEngine`
  (n page-locked slots per direction, pageable buckets);
* an accelerator otherwise: :class:`~offload_fsdp.copy_engine.StreamCopyEngine` (side streams, pinned buckets).

Everything else talks to engines through the ``CopyEngine`` protocol only.
"""

from __future__ import annotations

import torch

from offload_fsdp.copy_engine import CopyEngine, StreamCopyEngine, SyncCopyEngine
from offload_fsdp.transfer_ring import RingCopyEngine

__all__ = ["copy_engine_for", "engine_device"]


def engine_device(device: torch.device, *, overlap: bool) -> torch.device:
    """The device whose engine serves a param on ``device``: the CPU's synchronous one unless it overlaps."""
    return device if (device.type != "cpu" and overlap) else torch.device("cpu")


def copy_engine_for(device: torch.device, *, transfer_slots: int | None) -> CopyEngine:
    """A new engine for ``device`` (as :func:`engine_device` names it); see the module docstring."""
    if device.type == "cpu":
        return SyncCopyEngine()
    if transfer_slots is not None:
        return RingCopyEngine(device, transfer_slots)
    return StreamCopyEngine(device)
