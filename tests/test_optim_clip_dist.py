"""clip_grad_norm_ on 1-4 gloo ranks equals the single-process reference, with one all_reduce.

Each launch checks, on shapes that force uneven and empty shards:
FSDP2 ``fully_shard`` DTensor grads, flat-shard params (ShardSpec) with fp32
decoupled grads of bf16 params, a whole (replicated) plain param, all of them
mixed in one call, and on 4 ranks HSDP (replicate x shard mesh), where the
replicas must not be counted twice. The reference is
``torch.nn.utils.clip_grad_norm_`` on unsharded copies in the same process.
After clipping, ``build_optimizer``'s torch backend steps the FSDP2 params and
must match fused AdamW on the unsharded reference.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks

NORM_TYPES = (2.0, 1.0, math.inf)
FLAT_SHAPES = [(5, 3), (2,), (3, 1, 2)]  # 15, 2 and 6 elements: some ranks get nothing


@contextmanager
def _count_all_reduce():
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _model() -> torch.nn.Module:
    # Rows per weight: 5, 2, 7 -> uneven on 2-4 ranks, empty shards for the 2-row layer on 3 and 4.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2), torch.nn.Linear(2, 7))


def _fsdp_and_reference(mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    reference = copy.deepcopy(model)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))  # same on every rank
    model(batch).square().sum().backward()  # FSDP averages identical grads: equal to the reference
    reference(batch).square().sum().backward()
    return model, reference


def _flat_shards(rank: int, world_size: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """bf16 flat-shard params with fp32 decoupled grads, and their whole fp32 reference params."""
    from offload_fsdp.shard_spec import ShardSpec, attach_shard_spec

    gen = torch.Generator().manual_seed(2)
    shards, whole = [], []
    for shape in FLAT_SHAPES:
        grad = torch.randn(shape, generator=gen)
        numel = grad.numel()
        per_rank = -(-numel // world_size)
        start, end = min(rank * per_rank, numel), min((rank + 1) * per_rank, numel)
        shard = torch.nn.Parameter(torch.zeros(end - start, dtype=torch.bfloat16))
        attach_shard_spec(shard, ShardSpec(shape, flat_start=start))
        shard.decoupled_grad = grad.reshape(-1)[start:end].clone()
        shards.append(shard)
        ref = torch.nn.Parameter(torch.zeros(shape))
        ref.grad = grad
        whole.append(ref)
    return shards, whole


def _replicated_plain() -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([3.0, -1.0, 0.5, 2.0])
    ref = torch.nn.Parameter(torch.zeros(4))
    ref.grad = param.grad.clone()
    return param, ref


def _norms(params, norm_type, **kwargs) -> tuple[float, int]:
    from optim import grad_norm

    with _count_all_reduce() as calls:
        norm = grad_norm(params, norm_type, **kwargs)
    return norm.item(), len(calls)


def _ref_norm(params, norm_type) -> float:
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    return torch.nn.utils.get_total_norm(grads, norm_type).item()


def _check_clipped(params, refs, max_norm, **kwargs) -> None:
    from optim import clip_grad_norm_, get_grad

    clip_grad_norm_(params, max_norm, **kwargs)
    torch.nn.utils.clip_grad_norm_(refs, max_norm)
    for param, ref in zip(params, refs):
        grad = get_grad(param)
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        else:
            spec = getattr(param, "fsdp_shard_spec", None)
            if spec is not None:
                full = ref.grad.reshape(-1)[spec.flat_start : spec.flat_start + grad.numel()]
                torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-7)
                continue
        torch.testing.assert_close(grad, ref.grad, rtol=1e-5, atol=1e-7)


def _check_step_after_clipping(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """build_optimizer's torch backend steps FSDP2 DTensor params like fused AdamW on the unsharded model."""
    from optim import build_optimizer

    opt = build_optimizer(model.parameters(), "adamw", lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    opt.step()
    ref_opt.step()
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref.detach(), rtol=1e-6, atol=1e-7)


def _clip_checks(rank: int, world_size: int) -> dict[str, list]:
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, list] = {}
    mesh = init_device_mesh("cpu", (world_size,))
    model, reference = _fsdp_and_reference(mesh)
    shards, whole = _flat_shards(rank, world_size)
    plain, plain_ref = _replicated_plain()
    everything = [*model.parameters(), *shards, plain]
    everything_ref = [*reference.parameters(), *whole, plain_ref]
    for norm_type in NORM_TYPES:
        results[f"fsdp2 p={norm_type}"] = [
            *_norms(model.parameters(), norm_type),
            _ref_norm(reference.parameters(), norm_type),
        ]
        results[f"flat p={norm_type}"] = [*_norms(shards, norm_type), _ref_norm(whole, norm_type)]
        results[f"mixed p={norm_type}"] = [*_norms(everything, norm_type), _ref_norm(everything_ref, norm_type)]
    # A plain decoupled grad of a DTensor param is that param's local shard.
    fsdp_grads = [(p, p.grad) for p in model.parameters()]
    for p, grad in fsdp_grads:
        p.grad, p.decoupled_grad = None, grad._local_tensor.clone()
    results["fsdp2, decoupled local grads"] = [*_norms(model.parameters(), 2.0), _ref_norm(reference.parameters(), 2.0)]
    for p, grad in fsdp_grads:
        p.grad, p.decoupled_grad = grad, None
    results["flat, explicit group"] = [*_norms(shards, 2.0, mesh_or_group=dist.group.WORLD), _ref_norm(whole, 2.0)]
    results["flat, 1-D mesh"] = [*_norms(shards, 2.0, mesh_or_group=mesh), _ref_norm(whole, 2.0)]
    _check_clipped(everything, everything_ref, max_norm=0.05)
    _check_step_after_clipping(model, reference)
    if world_size == 4:
        hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp, hsdp_ref = _fsdp_and_reference(hsdp_mesh)
        assert "Replicate" in str(next(hsdp.parameters()).grad.placements)
        for norm_type in NORM_TYPES:
            results[f"hsdp p={norm_type}"] = [
                *_norms(hsdp.parameters(), norm_type),
                _ref_norm(hsdp_ref.parameters(), norm_type),
            ]
        _check_clipped(list(hsdp.parameters()), list(hsdp_ref.parameters()), max_norm=0.05)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_clip_norm_on_local_shards_equals_single_process_reference_with_one_all_reduce(world_size):
    per_rank = run_ranks(_clip_checks, world_size)
    assert per_rank[0].keys() >= {"fsdp2 p=2.0", "flat p=inf", "mixed p=1.0", "fsdp2, decoupled local grads"}
    if world_size == 4:
        assert "hsdp p=2.0" in per_rank[0]
    for rank, results in enumerate(per_rank):
        for name, (norm, all_reduces, ref) in results.items():
            assert norm == pytest.approx(ref, rel=1e-5), f"rank {rank}, {name}: {norm} != reference {ref}"
            assert all_reduces == 1, f"rank {rank}, {name}: {all_reduces} all_reduce calls, expected one"


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).view(torch.uint8).tolist())


def _torch_clip_checks(rank: int, world_size: int, dtype_name: str, mesh_shape: tuple[int, ...]) -> dict:
    """optim.clip_grad_norm_ against torch's own clip on the same FSDP2 DTensor params, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from optim import clip_grad_norm_

    dtype = getattr(torch, dtype_name)
    names = ("replicate", "shard")[-len(mesh_shape) :]  # HSDP: (replicate, shard)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5)).to(dtype)
        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    ours, theirs = models
    batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)  # differs per rank
    mismatches = []
    # inf: only where no rank holds an empty shard (torch's inf-norm of an empty local shard raises)
    norm_types = (2.0, 1.0, 3.0, math.inf) if world_size == 2 else (2.0, 1.0)
    for norm_type in norm_types:
        for max_norm in (1e-2, 1e6):  # fires, does not
            for model in models:
                model.zero_grad()
                model(batch).float().square().mean().backward()
            norm = clip_grad_norm_(ours.parameters(), max_norm, norm_type)
            ref = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type).full_tensor()
            if _bits(norm) != _bits(ref) or norm.dtype != ref.dtype:
                mismatches.append(f"p={norm_type} max_norm={max_norm}: norm {norm.item()} vs torch {ref.item()}")
            for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                if _bits(p.grad.to_local()) != _bits(q.grad.to_local()):
                    mismatches.append(f"p={norm_type} max_norm={max_norm}: grad of {name}")
    return {"mismatches": mismatches}


@pytest.mark.parametrize(
    ("dtype", "mesh_shape"),
    [("float32", (2,)), ("bfloat16", (2,)), ("float32", (3,)), ("bfloat16", (2, 2))],
    ids=["fp32-2", "bf16-2", "fp32-3-uneven", "bf16-hsdp-2x2"],
)
def test_fsdp2_dtensor_grads_are_clipped_bit_for_bit_as_torchs_own_clip(dtype, mesh_shape):
    world_size = math.prod(mesh_shape)
    for rank, result in enumerate(run_ranks(_torch_clip_checks, world_size, args=(dtype, mesh_shape), timeout_s=120)):
        assert result["mismatches"] == [], f"rank {rank}: {result['mismatches']}"
