"""What the ranks of tests/test_ranks_harness.py run (and its pools' worker_init), in a module that imports no
pytest: every worker imports the module of the function it is sent, and that file's pools restart on purpose,
each fresh worker paying the import again (pytest: a third of a second of CPU)."""

import os
import time
from pathlib import Path


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


def stuck_in_collective(markers):
    """Rank 0 blocks in an all-reduce with no bound of ours; rank 1 never joins it. Each rank first leaves a file in
    ``markers``: the call is under way (test_ranks_harness.call_under_way)."""
    import torch
    import torch.distributed as dist

    Path(markers, f"rank{dist.get_rank()}").touch()
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    time.sleep(600)


def bounded_wait_case(fn_name, operation):
    """A case of test_bounded_waits.py by name (rank 0 gives up on a peer that never joins), so that the parent
    running it need not import that module, nor torch with it."""
    import test_bounded_waits as bw

    return getattr(bw, fn_name)(operation, bw.TIMEOUT)


def mark_rank(rank, world_size, fail_on=None):
    """A worker_init: leaves a trace the call can read, or fails on one rank."""
    if rank == fail_on:
        raise OSError(f"deliberate worker_init failure on rank {rank}")
    os.environ["L3PLUGIN_TEST_INIT"] = f"{rank}/{world_size}"


def init_trace():
    import torch.distributed as dist

    return os.environ.get("L3PLUGIN_TEST_INIT"), dist.get_rank()


def leave_state_behind():
    """A call that changes the environment and leaves a torch-function mode on the stack (as a test that forgot
    to restore them would): the worker's next call must see neither."""
    import torch
    from torch.overrides import TorchFunctionMode

    os.environ["L3PLUGIN_LEFT_BEHIND"] = "1"
    del os.environ["OMP_NUM_THREADS"]
    TorchFunctionMode().__enter__()
    return torch._C._len_torch_function_stack()


def state_seen():
    import torch

    return os.environ.get("L3PLUGIN_LEFT_BEHIND"), os.environ.get("OMP_NUM_THREADS"), \
        torch._C._len_torch_function_stack()
