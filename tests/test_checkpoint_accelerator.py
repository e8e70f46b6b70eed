"""Loading into accelerator tensors (``pytest -m accelerator``; skipped without one).

The reader's fast paths read file bytes straight into the destination's memory, which only host tensors
have; an accelerator destination takes a host copy. A load into device tensors must give the saved values,
never an error blaming the files.
"""

import pytest
import torch

import checkpoint

pytestmark = pytest.mark.accelerator


def test_a_checkpoint_saved_on_the_host_loads_into_accelerator_tensors_exactly(tmp_path):
    device = torch.accelerator.current_accelerator()
    saved = {
        "w": torch.randn(64, 33),  # whole chunk, same dtype: the archive fast path on the host
        "b": torch.randn(7).to(torch.bfloat16),
        "step": 3,
    }
    checkpoint.save_state_dict({"model": saved}, tmp_path / "ck")
    target = {
        "w": torch.zeros(64, 33, device=device),
        "b": torch.zeros(7, dtype=torch.bfloat16, device=device),
        "step": 0,
    }
    state = {"model": target}
    checkpoint.load_state_dict(state, tmp_path / "ck", no_dist=True)
    assert state["model"]["w"].device.type == device.type
    torch.testing.assert_close(state["model"]["w"].cpu(), saved["w"], rtol=0, atol=0)
    torch.testing.assert_close(state["model"]["b"].cpu(), saved["b"], rtol=0, atol=0)
    assert state["model"]["step"] == 3
