import pytest
import torch

from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec, shard_spec_of


def test_shard_spec_needs_exactly_one_of_box_or_flat_range():
    with pytest.raises(ValueError, match="exactly one"):
        ShardSpec(global_shape=(4, 4))
    with pytest.raises(ValueError, match="exactly one"):
        ShardSpec(global_shape=(4, 4), offsets=(0, 0), flat_start=0)


def test_attach_rejects_a_flat_range_running_past_the_global_tensor_naming_it():
    local = torch.zeros(5)
    with pytest.raises(ValueError, match="layers.0.w"):
        attach_shard_spec(local, ShardSpec(global_shape=(2, 3), flat_start=2), name="layers.0.w")


def test_attach_rejects_a_box_leaving_the_global_shape():
    with pytest.raises(ValueError, match="dim 1"):
        attach_shard_spec(torch.zeros(2, 3), ShardSpec(global_shape=(4, 4), offsets=(0, 2)))


def test_shard_spec_of_reads_our_attribute_then_megatron_convention():
    p = attach_shard_spec(torch.zeros(3), ShardSpec(global_shape=(2, 3), flat_start=1))
    assert shard_spec_of(p) == ShardSpec(global_shape=(2, 3), flat_start=1)
    m = torch.nn.Parameter(torch.zeros(4))
    m.megatron_fsdp_slice = slice(8, 12)
    m.orig_param = torch.empty(4, 4, device="meta")
    assert shard_spec_of(m) == ShardSpec(global_shape=(4, 4), flat_start=8)
    assert shard_spec_of(torch.zeros(3)) is None


def test_a_megatron_slice_whose_length_is_not_the_local_numel_is_rejected():
    m = torch.zeros(3)
    m.megatron_fsdp_slice = slice(2, 6)
    with pytest.raises(ValueError, match="covers 4 elements but the local shard has 3"):
        shard_spec_of(m)
