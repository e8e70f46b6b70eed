"""kill -9 at every protocol step of a save to s3:// (issue 20): a save that replaces a checkpoint, on the real moto
server, is killed by SIGKILL right before its Nth request to the server. The saver counts its own requests on
botocore's ``before-send`` event of s3fs's client (every HTTP request on the wire, whichever call sent it) and
kills itself there: deterministic, no sleep, no race.

The small save is killed before every one of its requests. The multipart save sends the same requests, in the same
order, except that its data file is a multipart upload instead of one PUT (asserted): it is killed before each
request of that upload, before the first request after it and before the first after its commit; killing it at
every step the two saves share would be the small sweep's kill points a second time (at ~3 s each)."""

from __future__ import annotations

import itertools
import os
import signal
from collections import Counter
from collections.abc import Iterable

import pytest
import torch

import checkpoint
from checkpoint.object_commit import HEAD_NAME
from tests.distributed import PROCESSES, run_process
from tests.s3_server import apply, environment

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

_MIB = 1 << 20
_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    # a few small tensors: one PUT per object
    "small": {"w": (16,), "b": (5,), "m": (3, 4)},
    # a data file of two 5 MiB parts (S3's smallest part, which moto enforces): a multipart upload
    "multipart": {"w": ((5 * _MIB) // 4 + 64,), "b": (5,)},
}
_PART_BYTES: dict[str, int | None] = {"small": None, "multipart": 5 * _MIB}
_MULTIPART_OPERATIONS = {"CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"}


def _state(shapes: dict, value: float) -> dict:
    return {name: torch.full(shape, value) for name, shape in shapes.items()}


def _objects(url: str) -> list[str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, use_listings_cache=False)
    return sorted(p[len(root) + 1 :] for p in fs.find(root))


def _save_killed_at(kill_at: int | None, url: str, env: dict, case: str, value: float, told) -> None:
    """Save ``value`` to ``url`` and SIGKILL this process right before its ``kill_at``-th request to the server
    (never: ``None``); puts the operations of the requests the save sent (``PutObject``, ...) on ``told`` when it
    ends."""
    import checkpoint.fsspec_storage as fsspec_storage
    from checkpoint.storage_backend import locate

    apply(env)
    part_bytes = _PART_BYTES[case]
    if part_bytes is not None:
        fsspec_storage.PART_BYTES = part_bytes
    sent = itertools.count(1)
    operations: list[str] = []

    def count(event_name: str, **kwargs) -> None:
        if next(sent) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        operations.append(event_name.rsplit(".", 1)[-1])  # before-send.s3.<operation>

    client = locate(url).storage.fs.s3  # connects: no request yet
    client.meta.events.register("before-send.s3", count, unique_id="kill-sweep")
    checkpoint.save_state_dict(_state(_SHAPES[case], value), url)
    told.put(operations)


def _run_saver(
    kill_at: int | None, url: str, env: dict, case: str, value: float
) -> tuple[int | None, list[str] | None]:
    """(exit code, the operations of the requests it sent when it finished)."""
    told = PROCESSES.Queue()
    code = run_process(_save_killed_at, (kill_at, url, env, case, value, told), f"the save killed at request {kill_at}")
    return code, (told.get(timeout=10) if code == 0 else None)


def _loaded(url: str, shapes: dict) -> float:
    """The one value the checkpoint at ``url`` holds in every tensor (a mix fails the test)."""
    target = _state(shapes, 0.0)
    checkpoint.load_state_dict(target, url)
    values = {float(t.flatten()[0]) for t in target.values()}
    assert len(values) == 1 and all(torch.equal(t, torch.full_like(t, *values)) for t in target.values()), target
    return values.pop()


def _kill_points(case: str, operations: list[str], small_operations: list[str]) -> Iterable[int]:
    """The requests (numbered from 1) a save of ``case`` that sends ``operations`` is killed before (see the module
    docstring); ``small_operations``: what the small save sends."""
    if case == "small":
        return range(1, len(operations) + 1)
    upload = [n for n, operation in enumerate(operations, 1) if operation in _MULTIPART_OPERATIONS]
    assert upload == list(range(upload[0], upload[-1] + 1)) and len(upload) >= 4, operations  # create, 2 parts, end
    # the other requests are the small save's, the multipart upload in place of the data file's one PUT
    assert small_operations[upload[0] - 1] == "PutObject", small_operations
    assert (
        operations[: upload[0] - 1] + operations[upload[-1] :]
        == small_operations[: upload[0] - 1] + small_operations[upload[0] :]
    ), (operations, small_operations)
    head = max(n for n, operation in enumerate(operations, 1) if operation == "PutObject")  # the commit: the last PUT
    return [*upload, upload[-1] + 1, head + 1]  # and once after the commit, so that its sweep sees old and new


def _multipart_uploads(url: str) -> list[str]:
    """Multipart uploads begun under ``url`` and never completed nor aborted (invisible in listings, stored)."""
    import fsspec

    fs, key = fsspec.core.url_to_fs(url)
    bucket, prefix, _ = fs.split_path(key)
    answer = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
    return [upload["Key"] for upload in answer.get("Uploads", [])]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["small", "multipart"])
def test_a_save_killed_at_every_protocol_step_leaves_the_old_or_the_new_checkpoint_whole(
    s3_bucket, s3_server, cli, case
):
    env, shapes = environment(s3_server), _SHAPES[case]
    old, new, after = 1.0, 2.0, 3.0

    def replaced_checkpoint(name: str) -> str:
        url = f"{s3_bucket}/{case}/{name}/ck"
        checkpoint.save_state_dict(_state(shapes, old), url)
        for mine in (f"{url}/notes.txt", f"{s3_bucket}/{case}/{name}/notes.txt"):
            _write(mine, b"the user's")
        return url

    # the save's requests, recorded by an unkilled saver of the same save (and of the small save)
    code, operations = _run_saver(None, replaced_checkpoint("whole"), env, case, new)
    assert code == 0 and operations is not None and len(operations) > 4
    small_operations = operations
    if case != "small":
        small_url = f"{s3_bucket}/{case}/small/ck"
        checkpoint.save_state_dict(_state(_SHAPES["small"], old), small_url)
        code, small_operations = _run_saver(None, small_url, env, "small", new)
        assert code == 0 and small_operations is not None

    outcomes: Counter = Counter()
    for kill_at in _kill_points(case, operations, small_operations):
        url = replaced_checkpoint(f"n{kill_at:03d}")
        root = url.rsplit("/", 1)[0]
        code, _ = _run_saver(kill_at, url, env, case, new)
        assert code == -signal.SIGKILL, (kill_at, code)
        loaded = _loaded(url, shapes)
        assert loaded in (old, new), (kill_at, loaded)
        assert str(checkpoint.latest(root)) == url and _loaded(str(checkpoint.latest(root)), shapes) == loaded
        saves = [n for n in _objects(url) if n.startswith("fsdp-save-")]
        outcomes[
            ("old" if loaded == old else "new", "leftovers" if len({n.split("/")[0] for n in saves}) > 1 else "clean")
        ] += 1
        if kill_at % 2:  # every other point: gc cleans up first, else the next save alone
            cli("gc", url)
            assert _leftovers(url) == [], (kill_at, _objects(url))
            assert _loaded(url, shapes) == loaded
        checkpoint.save_state_dict(_state(shapes, after), url)
        assert _loaded(url, shapes) == after
        assert _leftovers(url) == [], (kill_at, _objects(url))
        assert _multipart_uploads(url) == [], kill_at
        for mine in (f"{url}/notes.txt", f"{root}/notes.txt"):
            assert _read(mine) == b"the user's", (kill_at, mine)
    print(f"{case}: {len(operations)} requests per save, outcomes at each kill point: {dict(outcomes)}")
    assert set(outcomes) <= {("old", "clean"), ("old", "leftovers"), ("new", "clean"), ("new", "leftovers")}
    assert sum(n for (which, _), n in outcomes.items() if which == "old") >= 1
    assert sum(n for (which, _), n in outcomes.items() if which == "new") >= 1


def _leftovers(url: str) -> list[str]:
    """Our objects at ``url`` beyond one committed save and its head."""
    names = _objects(url)
    saves = sorted({n.split("/")[0] for n in names if n.startswith("fsdp-save-")})
    ours = [n for n in names if n.startswith(("fsdp-save-", "fsdp-ckpt-"))]
    return [n for n in ours if n != HEAD_NAME and not n.startswith(saves[-1] + "/")] if len(saves) == 1 else ours


def _read(url: str) -> bytes:
    import fsspec

    with fsspec.open(url, "rb") as f:
        return f.read()


def _write(url: str, data: bytes) -> None:
    import fsspec

    with fsspec.open(url, "wb") as f:
        f.write(data)
