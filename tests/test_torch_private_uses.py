"""Every private torch name the library still uses, so a torch upgrade that moves one fails here first.

Each entry names the module, the private name and the place that uses it (where the comment says why
it stays). When one fails: find the public replacement, or update the use and this list together.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.distributed import run_ranks

# (module, attribute path, where it is used)
PRIVATE_USES = [
    ("torch", "_foreach_add_", "offload_fsdp/host_kernels.py AdamKernel.step_bucket (step counters)"),
    ("torch", "_foreach_zero_", "offload_fsdp/grad.py _clear_slots"),
    ("torch", "_foreach_norm", "optim/clip.py _group_norms"),
    ("torch.utils._foreach_utils", "_group_tensors_by_device_and_dtype", "optim/clip.py _tensor_norms"),
    ("torch.utils._foreach_utils", "_has_foreach_support", "optim/clip.py _group_norms"),
    ("torch", "_foreach_mul_", "optim/clip.py clip_grad_norm_"),
    (
        "torch.autograd",
        "Variable._execution_engine.queue_callback",
        "offload_fsdp/overlap.py OverlappedStep._watch_backward",
    ),
    ("torch.autograd", "_profiler_enabled", "offload_fsdp/optimizer.py _profiled, _bucket_stage"),
    ("torch", "Tensor._make_wrapper_subclass", "checkpoint/shard.py CheckpointShard.__new__"),
    ("torch._utils", "_rebuild_tensor_v2", "checkpoint/chunk_archive.py (data.pkl's rebuild call)"),
    ("torch.serialization", "_get_layout", "checkpoint/safe_unpickle.py allow-list"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "checkpoint/safe_unpickle.py allow-list"),
    (
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        "checkpoint/data_file.py (imported once, as StorageInfo), safe_unpickle.py",
    ),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix", "checkpoint/storage.py"),
    ("torch.distributed.checkpoint._traverse", "set_element", "checkpoint/api.py, state_dict_io.py, safe_unpickle.py"),
    ("torch.distributed._shard.sharded_tensor", "ShardedTensor", "checkpoint/convert.py _is_sharded_tensor"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode", "checkpoint/torchfile_io.py"),
    ("torch.utils._foreach_utils", "_get_fused_kernels_supported_devices", "optim/build.py _fused_fits"),
]


@pytest.mark.parametrize(("module", "name", "where"), PRIVATE_USES, ids=[f"{m}.{n}" for m, n, _ in PRIVATE_USES])
def test_every_private_torch_name_the_library_uses_still_exists(module: str, name: str, where: str) -> None:
    try:
        obj: object = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"torch {torch.__version__} no longer has {module}.{name}, used by {where}: {exc}")
    assert obj is not None


def _dtensor_local_tensor_and_chunk_list(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    weight = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)], run_check=False)
    param = torch.nn.Parameter(weight)
    # offload_fsdp/grad.py local_tensor: the very object, stable across calls (to_local() is not, for a Parameter)
    assert param._local_tensor is param._local_tensor
    assert param._local_tensor.data_ptr() == weight.to_local().data_ptr()
    # checkpoint/convert.py: the public chunk list gives this rank's box
    (chunk,) = weight.__create_chunk_list__()
    assert tuple(chunk.sizes) == (3, 2)
    assert tuple(chunk.offsets) == (3 * rank, 0)
    replica = DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False)
    (chunk,) = replica.__create_chunk_list__()
    assert (tuple(chunk.sizes), tuple(chunk.offsets)) == ((4,), (0,))


def test_dtensor_local_tensor_is_the_same_object_on_every_read_and_chunk_list_gives_the_local_box() -> None:
    run_ranks(_dtensor_local_tensor_and_chunk_list, world_size=2)
