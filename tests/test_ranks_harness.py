"""The CPU multi-process harness: results in rank order, and clear failures for raise, hang and death."""

import os
import time

import pytest

from l3plugin.testing.ranks import DistributedTestError, RankPool


def rank_and_sum(offset):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), os.environ["OMP_NUM_THREADS"], torch.get_num_threads()


def raise_on_rank(bad_rank):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.all_reduce(torch.ones(1))  # the healthy ranks block here, waiting for the failed one
    return "unreachable"


def sleep_on_rank(slow_rank, seconds):
    import torch.distributed as dist

    if dist.get_rank() == slow_rank:
        time.sleep(seconds)
    return dist.get_rank()


def exit_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        os._exit(3)
    return dist.get_rank()


@pytest.fixture(scope="module")
def pool():
    with RankPool(3, grace=2.0) as p:  # its own pool: these tests restart it on purpose
        yield p


def test_results_in_rank_order_and_single_threaded(pool):
    results = pool.run(rank_and_sum, 10)
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[1] == 0 + 1 + 2 + 3 * 10 for r in results)
    assert all(r[2] == "1" and r[3] == 1 for r in results)


def test_rank_that_raises_is_named_with_its_traceback(pool):
    with pytest.raises(DistributedTestError) as err:
        pool.run(raise_on_rank, 1, timeout=60)
    text = str(err.value)
    assert "rank 1 raised" in text
    assert "ValueError: deliberate failure on rank 1" in text
    assert "in raise_on_rank" in text  # the traceback
    # The healthy ranks were stuck in all_reduce: reported as hung, with where they hang.
    assert "rank 0 hung" in text and "rank 2 hung" in text
    assert "probably blocked in a collective" in text and "all_reduce" in text
    assert pool.run(rank_and_sum, 0)[2][0] == 2  # the pool was rebuilt and works


def test_rank_that_hangs_past_the_timeout_is_named(pool):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        pool.run(sleep_on_rank, 2, 600, timeout=3)
    assert time.monotonic() - start < 60
    text = str(err.value)
    assert "rank 2 hung" in text and "timeout of 3 s" in text
    assert "rank 0 " not in text and "rank 1 " not in text
    assert "sleep_on_rank" in text  # the hung rank's stack shows where it is
    assert pool.run(sleep_on_rank, 0, 0) == [0, 1, 2]


def test_rank_that_dies_is_named_with_exit_code(pool):
    with pytest.raises(DistributedTestError) as err:
        pool.run(exit_on_rank, 0, timeout=60)
    assert "rank 0 died" in str(err.value) and "code 3" in str(err.value)
    assert pool.run(sleep_on_rank, 1, 0) == [0, 1, 2]


def test_unpicklable_function_gives_a_clear_error(pool):
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 1)
