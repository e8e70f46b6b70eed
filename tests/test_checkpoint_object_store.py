"""Checkpoints at s3:// URLs, against a real S3-compatible server (moto_server on 127.0.0.1, reached through s3fs)."""

from __future__ import annotations

import os

import pytest
import torch

import checkpoint
from checkpoint.object_commit import HEAD_NAME

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _objects(url: str) -> list[str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def test_a_state_dict_saved_to_s3_loads_back_bit_exact_and_nothing_is_written_locally(s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.randn(5, 7), "b": torch.arange(6, dtype=torch.bfloat16), "extra": {"step": 3, "name": "x"}}
    url = f"{s3_bucket}/run/step3"
    checkpoint.save_state_dict(state, url)
    target = {"w": torch.zeros(5, 7), "b": torch.zeros(6, dtype=torch.bfloat16), "extra": {"step": None, "name": None}}
    checkpoint.load_state_dict(target, url)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["extra"] == {"step": 3, "name": "x"}
    assert os.listdir(tmp_path) == []  # no local directory named "s3:"
    names = _objects(url)
    assert HEAD_NAME in names and any(n.endswith("/manifest.json") for n in names)


def test_an_unsupported_scheme_and_a_mangled_url_are_clear_errors_and_write_nothing(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unsupported URL scheme 'nosuch://'"):
        checkpoint.save_state_dict({"w": torch.ones(2)}, "nosuch://bucket/x")
    with pytest.raises(ValueError, match="pass the URL as a string"):
        checkpoint.save_state_dict({"w": torch.ones(2)}, Path("s3://bucket/x"))
    with pytest.raises(ValueError, match="pass the URL as a string"):
        checkpoint.load_state_dict({"w": torch.ones(2)}, Path("s3://bucket/x"))
    assert os.listdir(tmp_path) == []
