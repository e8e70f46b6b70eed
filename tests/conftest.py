import functools

import pytest
import torch

from tests.cli import run_in_process

# marker -> (is it available here, why it is skipped)
_NEEDS = {
    "accelerator": (
        torch.accelerator.is_available,
        "needs an accelerator (torch.accelerator); run `pytest -m accelerator` on one",
    ),
    "cuda": (torch.cuda.is_available, "needs a CUDA device; run `pytest -m cuda` on a GPU machine"),
}


def pytest_collection_modifyitems(config, items):
    for marker, (available, reason) in _NEEDS.items():
        if available():
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def cli(capsys):
    """``cli(*args, check=0)``: run ``fsdp-ckpt`` in this process (tests/cli.py) -> CompletedProcess."""
    return functools.partial(run_in_process, capsys)
