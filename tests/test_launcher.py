import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailed, run_ranks


def _allreduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def test_run_ranks_returns_each_ranks_result_after_a_collective():
    assert run_ranks(_allreduce_rank, world_size=3) == [6.0, 6.0, 6.0]


def test_run_ranks_reraises_a_ranks_exception_with_its_traceback():
    with pytest.raises(RankFailed, match="boom on rank one"):
        run_ranks(_raise_on_rank_one, world_size=2, timeout_s=60)


def _exit_hard_on_rank_zero(rank: int, world_size: int) -> None:
    import os

    if rank == 0:
        os._exit(3)  # dies without reporting, like a crash during import
    import time

    time.sleep(100)  # the survivor waits on nothing the parent could hear about


def test_run_ranks_notices_a_rank_that_dies_without_reporting_well_before_the_timeout():
    import time

    start = time.monotonic()
    with pytest.raises(RankFailed, match="exited"):
        run_ranks(_exit_hard_on_rank_zero, world_size=2, timeout_s=120)
    assert time.monotonic() - start < 60


def _return_tensors(rank: int, world_size: int) -> dict:
    return {"rank": torch.full((1000,), float(rank)), "nested": [torch.arange(3) * rank]}


def test_run_ranks_returns_tensors_intact_after_the_rank_exits():
    results = run_ranks(_return_tensors, world_size=2)
    for rank, result in enumerate(results):
        assert torch.equal(result["rank"], torch.full((1000,), float(rank)))
        assert torch.equal(result["nested"][0], torch.arange(3) * rank)


def _mark_a_preloaded_module(rank: int, world_size: int) -> object:
    seen = getattr(torch, "_run_ranks_test_mark", None)
    torch._run_ranks_test_mark = rank  # torch is preloaded in the fork server: a rank's change must die with it
    return seen


def test_each_run_gets_fresh_rank_processes_that_see_no_earlier_runs_globals():
    first = run_ranks(_mark_a_preloaded_module, world_size=2)
    second = run_ranks(_mark_a_preloaded_module, world_size=2)
    assert first + second == [None] * 4


def _environment_and_directory(rank: int, world_size: int) -> tuple[str | None, str]:
    import os

    return os.environ.get("RUN_RANKS_TEST_VALUE"), os.getcwd()


def test_ranks_see_the_callers_current_environment_and_directory(tmp_path, monkeypatch):
    run_ranks(_allreduce_rank, world_size=2)  # the fork server is up before the change below
    monkeypatch.setenv("RUN_RANKS_TEST_VALUE", "set by the test")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_environment_and_directory, world_size=2) == [("set by the test", str(tmp_path))] * 2
