"""``fsdp-ckpt inspect``: a summary a person can read, whatever the number of parameters."""

import json

import pytest
import torch

import checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _saved(path, layers: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    checkpoint.save(path, model=model, optimizer=opt)


def test_inspect_shows_each_per_parameter_optimizer_option_once_and_json_keeps_every_key(cli, tmp_path):
    _saved(tmp_path / "small", layers=2)
    _saved(tmp_path / "large", layers=12)
    small = cli("inspect", tmp_path / "small").stdout.splitlines()
    large = cli("inspect", tmp_path / "large").stdout.splitlines()
    options = [line for line in large if line.startswith("optimizer.param_groups.<")]
    assert options and all(line.startswith("optimizer.param_groups.<24 params>.") for line in options)
    assert any(line.startswith("optimizer.param_groups.<24 params>.lr ") for line in options)
    assert len(options) == len({line.split()[1] for line in options})  # one line per option
    # ten times the layers: more state and weight lines, never more option lines
    groups = [len([line for line in out if line.startswith("optimizer.param_groups.")]) for out in (small, large)]
    assert groups[0] == groups[1]
    keys = json.loads(cli("inspect", tmp_path / "large", "--json").stdout)["keys"]
    assert sum(k["key"].endswith(".weight.lr") for k in keys) == 12
