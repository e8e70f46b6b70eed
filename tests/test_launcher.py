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
