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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto_server) on 127.0.0.1 for the session: its endpoint URL."""
    pytest.importorskip("s3fs", reason="needs the test extra (s3fs, moto[server])")
    from tests.s3_server import MotoServer

    server = MotoServer()
    yield server.endpoint
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """``s3://<a new bucket>`` on the session's server, with AWS_ENDPOINT_URL and credentials set."""
    from tests.s3_server import environment, make_bucket

    for name, value in environment(s3_server).items():
        monkeypatch.setenv(name, value)
    return f"s3://{make_bucket(s3_server)}"
