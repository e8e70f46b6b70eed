"""The streaming pieces of fsdp-ckpt in process: the read-ahead thread and the chunk reader."""

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint.tool.stream import CheckpointReader, prefetch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _Tracked:
    """Counts the bytes of items that exist (created, not yet released by the consumer)."""

    def __init__(self):
        self.alive = self.peak = 0
        self.lock = threading.Lock()

    def make(self, size):
        with self.lock:
            self.alive += size
            self.peak = max(self.peak, self.alive)
        return size

    def release(self, size):
        with self.lock:
            self.alive -= size


def test_prefetch_keeps_order_and_never_holds_more_than_its_limit():
    sizes = [50, 10, 10, 80, 10, 30, 200, 5]
    tracked = _Tracked()
    got = []
    for item in prefetch((tracked.make(s) for s in sizes), sizes, limit_bytes=100):
        got.append(item)
        tracked.release(item)
    assert got == sizes
    assert tracked.peak <= 200  # the one item above the limit is read alone
    tracked = _Tracked()
    for item in prefetch((tracked.make(s) for s in sizes[:6]), sizes[:6], limit_bytes=100):
        tracked.release(item)
    assert tracked.peak <= 100


def test_prefetch_reraises_the_producers_error_in_the_consumer():
    def items():
        yield 1
        raise ValueError("chunk 2 is corrupt")

    out = []
    with pytest.raises(ValueError, match="chunk 2 is corrupt"):
        for item in prefetch(items(), [1, 1, 1], limit_bytes=10):
            out.append(item)
    assert out == [1]


def test_reader_assembles_chunked_tensors_and_objects_from_a_plain_dcp_save(tmp_path):
    sd = {"model.w": torch.arange(12.0).view(4, 3), "model.s": torch.tensor(2.5), "extra.step": 9}
    dcp.save(sd, checkpoint_id=str(tmp_path), no_dist=True)
    reader = CheckpointReader(tmp_path)
    assert reader.note and not reader.committed and reader.world_size == 1
    assert reader.entries["model.w"].shape == (4, 3) and reader.entries["extra.step"].kind == "object"
    values = dict(reader.iter_values(list(reader.entries), batch_bytes=8))
    torch.testing.assert_close(values["model.w"], sd["model.w"], rtol=0, atol=0)
    assert values["model.s"].item() == 2.5 and values["extra.step"] == 9
    # sorted keys: extra.step (0 bytes) and model.s (4) fit one 8-byte batch; model.w (48) goes alone
    assert [len(b) for b in reader.batches(list(reader.entries), batch_bytes=8)] == [2, 1]


def test_prefetch_thread_ends_when_the_consumer_stops_early():
    items = prefetch(iter(range(100)), [1] * 100, limit_bytes=1000)
    assert next(items) == 0
    items.close()  # what a failing writer's `for` loop does to it
    for thread in threading.enumerate():
        if thread.name == "fsdp-ckpt-prefetch":
            thread.join(timeout=5)
            assert not thread.is_alive()
