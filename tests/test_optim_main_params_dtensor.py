"""One master weight: ``build_optimizer(backend="torch")`` on bf16 FSDP2 params trains as the offloaded path does.

Both optimizers keep an fp32 master of each bf16 local shard (``offload_fsdp.master`` and
``ParamShard`` records): the torch backend's torch ``AdamW`` (``optim.enable_main_params``)
and ``HybridDeviceOptimizer(offload_fraction=0)``, whose device share runs the same fused
``AdamW`` kernel. Given the same grads they must agree bit for bit, params and masters, also
after the user writes a local shard through ``to_local()`` between steps, and after a resume
from ``state_dict()`` / ``load_state_dict``.
"""

from __future__ import annotations

import copy

import torch

from tests.distributed import run_ranks

HYPER = {"lr": 0.02, "betas": (0.8, 0.95), "weight_decay": 0.1}
BF16 = torch.bfloat16


def _sharded_model(mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # 5 and 3 rows over 2 ranks: uneven shards; the (1, 5) weight leaves one rank an empty shard.
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    model = model.to(BF16)
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _optimizers(models: list[torch.nn.Module]) -> list[torch.optim.Optimizer]:
    from offload_fsdp import HybridDeviceOptimizer
    from optim import build_optimizer

    torch_backend = build_optimizer(list(models[0].parameters()), "adamw", backend="torch", **HYPER)
    assert type(torch_backend) is torch.optim.AdamW and torch_backend.defaults["fused"]
    hybrid = HybridDeviceOptimizer(torch.optim.AdamW(models[1].parameters(), fused=True, **HYPER), offload_fraction=0)
    return [torch_backend, hybrid]


@torch.no_grad()
def _write_through_to_local(model: torch.nn.Module) -> None:
    """The user's write into the local shards (moves the local tensors' version counters, not the DTensors')."""
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        local = p.to_local()
        local[: local.shape[0] // 2 + 1].copy_(torch.randn(local[: local.shape[0] // 2 + 1].shape, generator=gen))


def _train(models, opts, rank: int, steps: range) -> None:
    for step in steps:
        if step == 2:
            for model in models:
                _write_through_to_local(model)
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 6, generator=gen).to(BF16)
        for model, opt in zip(models, opts):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()


def _bits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every param's local shard and every state tensor's local shard, in order."""
    out = []
    for p in model.parameters():
        out.append(p.to_local().clone())
        for name in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            value = opt.state[p][name]
            out.append((value.to_local() if hasattr(value, "to_local") else value).clone())
    return out


def _body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    models = [_sharded_model(mesh), _sharded_model(mesh)]
    opts = _optimizers(models)
    _train(models, opts, rank, range(4))
    trained = [_bits(m, o) for m, o in zip(models, opts)]
    master_dtypes = sorted({str(opts[0].state[p]["master_param"].dtype) for p in models[0].parameters()})

    # Resume each from its own state_dict into fresh models and optimizers, then continue both pairs.
    saved = [copy.deepcopy(o.state_dict()) for o in opts]  # as a checkpoint holds it: no shared tensors
    resumed = [_sharded_model(mesh), _sharded_model(mesh)]
    for new, old in zip(resumed, models):
        new.load_state_dict(old.state_dict())
    resumed_opts = _optimizers(resumed)
    for opt, state in zip(resumed_opts, saved):
        opt.load_state_dict(state)
    _train(models, opts, rank, range(4, 6))
    _train(resumed, resumed_opts, rank, range(4, 6))
    continued = [_bits(m, o) for m, o in zip(models, opts)]
    after_resume = [_bits(m, o) for m, o in zip(resumed, resumed_opts)]

    def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))

    return {
        "master_dtypes": master_dtypes,
        "trained_equal": equal(*trained),
        "continued_equal": equal(*continued),
        "resumed_torch_equal": equal(after_resume[0], continued[0]),
        "resumed_hybrid_equal": equal(after_resume[1], continued[1]),
        "moved": not equal(trained[0], continued[0]),
    }


def test_torch_backend_on_bf16_fsdp2_params_trains_and_resumes_bit_exact_like_the_hybrid_optimizer():
    for result in run_ranks(_body, world_size=2):
        assert result["master_dtypes"] == ["torch.float32"], result
        assert result["trained_equal"], result  # incl. a write through to_local() before the 3rd step
        assert result["continued_equal"], result
        assert result["resumed_torch_equal"] and result["resumed_hybrid_equal"], result
        assert result["moved"], result
