"""The streaming safetensors writer behind `fsdp-ckpt export` (checkpoint/safetensors_io.py), in process."""

import pytest
import torch

from checkpoint.safetensors_io import write_shards

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_shards_read_back_with_the_safetensors_library_for_bool_empty_and_strided_tensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    values = {
        "model.mask": torch.tensor([[True, False, True], [False, False, True]]),
        "model.empty": torch.zeros(0, 3),
        "model.column": torch.randn(4, 3, generator=g).bfloat16()[:, 1],  # a strided view
        "model.w": torch.randn(3, 5, generator=g),
    }
    specs = [(k, v.dtype, tuple(v.shape)) for k, v in values.items()]
    shards = [specs[:2], specs[2:]]
    write_shards(tmp_path, shards, iter(values.items()), full_keys=True)
    back = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        back |= safetensors_torch.load_file(path)
    assert back.keys() == values.keys()
    for key, value in values.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
