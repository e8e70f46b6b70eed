"""A job using the library's threads exits cleanly: status 0, no C++ ``terminate`` at interpreter exit.

The job is this file run under torchrun (2 gloo ranks): a reshard-on-load (a checkpoint saved by one
process loads into FSDP2 at 2 ranks) into ``HybridDeviceOptimizer`` with its host worker thread, the
streamed CRC-32 check's helper thread, an async save's writer thread, and a backward whose overlapped
host updates are still queued on the worker when the script ends, without ``destroy_process_group``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    # dim 0 of 5, 3 and 1 rows: uneven and empty shards at 2 ranks
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))


def _job(root: Path) -> None:
    import datetime
    import faulthandler

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import checkpoint
    from offload_fsdp import HybridDeviceOptimizer

    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where, in the test's output
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model = _net()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = HybridDeviceOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.1), offload_fraction=1, overlap_step_with_backward=True
    )
    checkpoint.load(root / "one_process", model=model, optimizer=opt)  # saved by 1 process: resharded
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    checkpoint.async_save(root / "two_ranks", model=model, optimizer=opt).result(timeout=120)
    checkpoint.load(root / "two_ranks", model=model, optimizer=opt)
    model(torch.randn(4, 6)).sum().backward()  # the host updates it starts are left to the exit
    print(f"rank {dist.get_rank()} reached the end", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_two_rank_reshard_on_load_job_with_the_host_optimizer_exits_with_status_0(tmp_path):
    import checkpoint

    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    checkpoint.save(tmp_path / "one_process", model=model, optimizer=opt)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={_free_port()}"]
    out = subprocess.run(
        [*command, __file__, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert "terminate called" not in out.stderr, out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("reached the end") == 2, out.stdout


if __name__ == "__main__":
    _job(Path(sys.argv[1]))
