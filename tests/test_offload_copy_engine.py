"""StreamCopyEngine pieces that hold on any backend, checked without an accelerator."""

from __future__ import annotations

import types

import torch

from offload_fsdp.copy_engine import StreamCopyEngine


def test_without_record_stream_a_grad_in_flight_is_held_until_its_copy_is_waited_for(monkeypatch):
    def missing(self, stream):
        raise NotImplementedError("record_stream is not implemented for this backend")

    monkeypatch.setattr(torch.Tensor, "record_stream", missing)
    engine = StreamCopyEngine.__new__(StreamCopyEngine)  # no device streams needed for this part
    engine.d2h_stream, engine._record_stream_supported = object(), True
    done = types.SimpleNamespace(synchronized=False)
    done.synchronize = lambda: setattr(done, "synchronized", True)
    bucket = types.SimpleNamespace(d2h_sources=[], d2h_done=done)
    grads = [torch.ones(3), torch.ones(2)]
    for g in grads:
        engine._keep_until_copied(bucket, g)
    assert bucket.d2h_sources == grads and not engine._record_stream_supported
    engine.wait_grads(bucket)
    assert done.synchronized and bucket.d2h_sources == [] and bucket.d2h_done is None
