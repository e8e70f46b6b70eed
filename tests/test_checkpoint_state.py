"""Every piece of state a user saves comes back: extra through rewrites, strict optimizer resume, Stateful values."""

import pytest
import torch

import checkpoint
from checkpoint.tool.cli import main as fsdp_ckpt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _trained(seed: int = 0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _extra(sched) -> dict:
    return {"step": 7, "sched": sched.state_dict(), "rng": torch.arange(5, dtype=torch.uint8), "note": "run-a"}


def _assert_same_extra(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    assert got["step"] == want["step"] and got["note"] == want["note"]
    assert got["sched"] == want["sched"]
    assert torch.equal(got["rng"], want["rng"])


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_keeps_the_nested_extra_that_load_returns(tmp_path, world_size):
    model, opt, sched = _trained()
    extra = _extra(sched)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt, extra=extra)
    assert fsdp_ckpt(["reshard", str(tmp_path / "c"), str(tmp_path / "r"), "--world-size", str(world_size), "-q"]) == 0
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    got = checkpoint.load(tmp_path / "r", model=model2, optimizer=opt2)
    _assert_same_extra(got, extra)
    assert torch.equal(model2[0].weight, model[0].weight)


def test_export_to_a_torch_file_then_import_keeps_extra(tmp_path):
    model, opt, sched = _trained()
    extra = _extra(sched)
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt, extra=extra)
    assert fsdp_ckpt(["export", str(tmp_path / "c"), str(tmp_path / "full.pt"), "--format", "torch", "-q"]) == 0
    assert fsdp_ckpt(["import", str(tmp_path / "full.pt"), str(tmp_path / "i"), "-q"]) == 0
    model2 = _model(1)
    got = checkpoint.load(tmp_path / "i", model=model2, optimizer=torch.optim.AdamW(model2.parameters()))
    _assert_same_extra(got, extra)


def test_a_checkpoint_resharded_by_the_old_writer_still_returns_its_extra(tmp_path):
    from checkpoint.commit import write_metadata
    from checkpoint.manifest import METADATA_NAME

    checkpoint.save(tmp_path / "c", model=_model(), extra={"step": 4})
    opened = checkpoint.open_checkpoint(tmp_path / "c")
    opened.metadata.planner_data = {k: (k,) for k in opened.metadata.state_dict_metadata}  # the old reshard's record
    (tmp_path / "c" / METADATA_NAME).unlink()
    write_metadata(tmp_path / "c", opened.metadata)
    assert checkpoint.load(tmp_path / "c", model=_model(), verify="none") == {"step": 4}


def test_strict_load_of_a_model_only_checkpoint_into_an_optimizer_names_the_first_param_without_state(tmp_path):
    model, _, _ = _trained()
    checkpoint.save(tmp_path / "c", model=model)
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    with pytest.raises(ValueError, match=r"missing: optimizer\.state\.0\.weight\."):
        checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)
    result = checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2, strict=False)
    assert "optimizer.state.0.weight.exp_avg" in result.missing_keys
    assert "optimizer.state.2.bias.exp_avg_sq" in result.missing_keys
    assert not opt2.state  # nothing loaded: no made-up moments left behind
    assert torch.equal(model2[0].weight, model[0].weight)


def test_a_frozen_param_without_saved_state_is_not_an_error(tmp_path):
    model, _, _ = _trained()
    checkpoint.save(tmp_path / "c", model=model)
    model2 = _model(1)
    opt2 = torch.optim.AdamW(model2.parameters())
    for p in model2.parameters():
        p.requires_grad_(False)
    checkpoint.load(tmp_path / "c", model=model2, optimizer=opt2)


class _Loader:
    """A dataloader-like Stateful: its position is state, and so is a tensor (an RNG state)."""

    def __init__(self, position: int = 0) -> None:
        self.position = position
        self.rng = torch.full((3,), position, dtype=torch.uint8)

    def state_dict(self) -> dict:
        return {"position": self.position, "rng": self.rng.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]
        self.rng = state["rng"].clone()


def test_stateful_values_save_their_state_and_load_through_load_state_dict(tmp_path):
    module = torch.nn.Linear(3, 2)
    checkpoint.save_state_dict({"extra": {"loader": _Loader(9), "head": module}}, tmp_path / "c")
    keys = set(checkpoint.open_checkpoint(tmp_path / "c").metadata.state_dict_metadata)
    assert keys == {"extra.loader.position", "extra.loader.rng", "extra.head.weight", "extra.head.bias"}

    loader, head = _Loader(), torch.nn.Linear(3, 2)
    checkpoint.load_state_dict({"extra": {"loader": loader, "head": head}}, tmp_path / "c")
    assert loader.position == 9 and torch.equal(loader.rng, torch.full((3,), 9, dtype=torch.uint8))
    assert torch.equal(head.weight, module.weight) and torch.equal(head.bias, module.bias)


def test_checkpoint_load_hands_stateful_extra_values_their_saved_state(tmp_path):
    model = _model()
    checkpoint.save(tmp_path / "c", model=model, extra={"step": 3, "loader": _Loader(4)})
    loader = _Loader()
    got = checkpoint.load(tmp_path / "c", model=_model(1), extra={"loader": loader})
    assert got["loader"] is loader and loader.position == 4 and got["step"] == 3
    with pytest.raises(ValueError, match="extra.other"):
        checkpoint.load(tmp_path / "c", model=_model(1), extra={"other": _Loader()})


def test_conjugate_and_negative_views_save_their_values(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 1j])
    n = torch.tensor([1.0, 2.0])._neg_view()  # what z.conj().imag and friends hand out
    checkpoint.save_state_dict({"z": z.conj(), "n": n}, tmp_path / "c")
    out = {"z": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2)}
    checkpoint.load_state_dict(out, tmp_path / "c")
    assert torch.equal(out["z"], z.conj().resolve_conj()) and torch.equal(out["n"], torch.tensor([-1.0, -2.0]))


def _sharded_tensor_body(rank: int, world_size: int, root: str) -> None:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    full = torch.arange(16.0).reshape(4, 4)
    place = f"rank:{rank}/cpu"
    one = init_from_local_shards(
        [Shard(full[2 * rank : 2 * rank + 2].clone(), ShardMetadata([2 * rank, 0], [2, 4], place))], [4, 4]
    )
    checkpoint.save_state_dict({"w": one}, f"{root}/one")
    blocks = [Shard(full[r : r + 1].clone(), ShardMetadata([r, 0], [1, 4], place)) for r in (2 * rank, 2 * rank + 1)]
    two = init_from_local_shards(blocks, [4, 4])
    with pytest.raises(TypeError, match="2 local shards on this rank is not supported.*checkpoint.shard"):
        checkpoint.save_state_dict({"w": two}, f"{root}/two")


def test_a_one_block_sharded_tensor_saves_and_a_multi_block_one_is_refused_with_what_to_pass(tmp_path):
    from tests.distributed import run_ranks

    run_ranks(_sharded_tensor_body, 2, (str(tmp_path),))
    out = {"w": torch.zeros(4, 4)}
    checkpoint.load_state_dict(out, tmp_path / "one")
    assert torch.equal(out["w"], torch.arange(16.0).reshape(4, 4))


def _hybrid_bf16_checkpoint(path):
    from offload_fsdp import HybridDeviceOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).bfloat16()
    opt = HybridDeviceOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), 1.0)
    for _ in range(2):
        model(torch.randn(4, 6).bfloat16()).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model=model, optimizer=opt)
    masters = {n: opt.state[p]["master_param"].clone() for n, p in model.named_parameters()}
    return model, opt, masters


def test_saved_masters_load_strictly_into_a_plain_optimizer_fp32_weights_take_the_master(tmp_path):
    model, opt, masters = _hybrid_bf16_checkpoint(tmp_path / "c")
    assert any(
        k.endswith(".master_param") for k in checkpoint.open_checkpoint(tmp_path / "c").metadata.state_dict_metadata
    )

    fp32 = _model(1).float()
    fp32[1] = torch.nn.Tanh()
    plain = torch.optim.AdamW(fp32.parameters())
    checkpoint.load(tmp_path / "c", model=fp32, optimizer=plain)
    for name, p in fp32.named_parameters():
        assert torch.equal(p, masters[name]), name  # the master, not the bf16 weight widened
        assert "master_param" not in plain.state[p]
        assert torch.equal(plain.state[p]["exp_avg"], opt.state[dict(model.named_parameters())[name]]["exp_avg"])

    bf16 = _model(1).bfloat16()
    plain = torch.optim.AdamW(bf16.parameters())
    checkpoint.load(tmp_path / "c", model=bf16, optimizer=plain)  # strict: the masters are skipped
    for (name, p), q in zip(bf16.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_reshard_with_a_rename_renames_the_per_group_parameter_lists_plain_dcp_reads(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt, _ = _trained()
    checkpoint.save(tmp_path / "c", model=model, optimizer=opt)
    args = [
        "reshard",
        str(tmp_path / "c"),
        str(tmp_path / "r"),
        "--world-size",
        "1",
        "-q",
        "--rename",
        r"^(\d)",
        r"net.\1",
    ]
    assert fsdp_ckpt(args) == 0
    renamed = torch.nn.Module()
    renamed.net = _model(1)
    opt2 = torch.optim.AdamW(renamed.parameters())
    renamed.net(torch.randn(1, 6)).sum().backward()
    opt2.step()
    msd, osd = get_state_dict(renamed, opt2)  # torch's default layout: asks for param_groups.0.params
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "r", no_dist=True)
    assert osd["param_groups"][0]["params"] == [f"net.{n}" for n, _ in model.named_parameters()]
    set_state_dict(renamed, opt2, model_state_dict=msd, optim_state_dict=osd)
    assert torch.equal(opt2.state[renamed.net[2].bias]["exp_avg"], opt.state[model[2].bias]["exp_avg"])


def test_stateful_values_in_lists_and_nested_dicts_save_their_state_and_load_in_place(tmp_path):
    checkpoint.save(
        tmp_path / "c", model=_model(), extra={"loaders": [_Loader(3), _Loader(4)], "data": {"loader": _Loader(5)}}
    )
    first, second, inner = _Loader(), _Loader(), _Loader()
    got = checkpoint.load(
        tmp_path / "c", model=_model(1), extra={"loaders": [first, second], "data": {"loader": inner}}
    )
    assert (first.position, second.position, inner.position) == (3, 4, 5)
    assert got["loaders"][1] is second and got["data"]["loader"] is inner
    a, b, c = _Loader(), _Loader(), _Loader()
    checkpoint.load_state_dict({"extra": {"loaders": [a, b], "data": {"loader": c}}}, tmp_path / "c")
    assert (a.position, b.position, c.position) == (3, 4, 5)
    with pytest.raises(TypeError, match=r"extra\.t: a tuple holding a Stateful _Loader; pass a list"):
        checkpoint.save(tmp_path / "t", model=_model(), extra={"t": (_Loader(1),)})


def test_export_to_a_torch_file_writes_the_tensors_inside_an_extra_value(tmp_path):
    rng = (torch.arange(4, dtype=torch.uint8), 42)  # a tuple is one value: saved whole
    checkpoint.save(tmp_path / "c", model=_model(), extra={"rng": rng})
    assert fsdp_ckpt(["export", str(tmp_path / "c"), str(tmp_path / "full.pt"), "--format", "torch", "-q"]) == 0
    state, seed = torch.load(tmp_path / "full.pt", weights_only=True)["extra.rng"]
    assert torch.equal(state, rng[0]) and seed == 42


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_reshard_with_a_rename_renames_the_tied_weight_record_so_export_still_writes_it_once(tmp_path):
    from safetensors import safe_open

    checkpoint.save(tmp_path / "c", model=_Tied())
    assert (
        fsdp_ckpt(
            ["reshard", str(tmp_path / "c"), str(tmp_path / "r"), "--world-size", "1", "-q", "--rename", "^", "net."]
        )
        == 0
    )
    assert (
        fsdp_ckpt(
            ["export", str(tmp_path / "r"), str(tmp_path / "st"), "--format", "safetensors", "--model-only", "-q"]
        )
        == 0
    )
    [shard] = (tmp_path / "st").glob("*.safetensors")
    with safe_open(shard, "pt") as st:
        assert set(st.keys()) == {"net.emb.weight"}
