"""The worker side of RankPool (l3plugin/ranks/pool.py): what runs inside each rank's process. It dies with the pool's
owner, takes the owner's environment, joins the gloo group, then runs calls until told to stop, resetting the
frameworks' model-parallel state after each and reporting how many process groups the call left behind."""

from __future__ import annotations

import gc
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback

from l3plugin.upstream.patchset import PrivateState


def _stat(pid) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    if os.path.isdir("/proc/self"):
        fields = _stat(pid)
        return fields is not None and fields[0] not in ("Z", "X")
    try:  # no /proc: ask the kernel
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this worker when ``parent_pid`` (the pool's owner) exits, however that ends. The worker's own
    parent is the fork server, which lives while any worker does (each holds the server's end-of-owner pipe),
    so a thread watches the owner (Linux: a pidfd; elsewhere every second); PR_SET_PDEATHSIG covers the
    server being killed."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        owner = os.pidfd_open(parent_pid)
    except ProcessLookupError:  # the owner died before we got here
        os._exit(1)
    except (AttributeError, OSError):
        owner = None

    def watch():
        if owner is not None:
            select.select([owner], [], [])  # readable once the owner has exited
        else:
            while _alive(parent_pid):
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="l3plugin-owner-watch", daemon=True).start()


# A reused worker accumulates the process groups its calls leave (frameworks cache some, tests make others):
# each idle gloo group keeps threads that poll (bench/idle_groups.py: 0.004 / 0.11 / 0.18 CPU-s per second per idle
# worker with 0 / 100 / 200 groups, 3 threads a group). Destroying them would
# leave framework caches (DeepSpeed's groups) pointing at dead groups, so past this many the pool is restarted
# instead: forked from the server, that takes a fraction of a second.
GROUPS_LEFT_LIMIT = 16
PROCESS_GROUPS = PrivateState(
    "torch.distributed.distributed_c10d", "_world",
    why="RankPool counts the process groups a call left (its .pg_map) and restarts past GROUPS_LEFT_LIMIT: "
        "without it leaked gloo groups accumulate in reused workers, each polling",
    version_of="torch")


def _groups_left() -> int:
    """Process groups of this worker besides the world's."""
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map) - 1


def _reset_framework_state():
    """Leave no model-parallel state (nor its process groups and their threads) for the next call."""
    if "megatron.core.parallel_state" in sys.modules:
        from l3plugin.mesh.groups import destroy_mesh

        destroy_mesh()
    param_gather = sys.modules.get("l3plugin.zero.param_gather")
    if param_gather is not None and param_gather.GUARD.pending:
        # The call's optimizers are garbage now but held by their reference cycles: collect them, so that the
        # guard forgets their pending gathers and leaves the torch-function stack (it costs every later torch
        # call some Python while it stays). What a kept optimizer (keep_state) left pending stays guarded.
        import gc

        gc.collect()
        param_gather.GUARD.drop_dead()
        param_gather.GUARD.leave_if_done()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:  # a PipelineEngine leaves its grid as DeepSpeed's global mpu; later engines take it
        groups.mpu = None


def _worker_main(rank, world_size, port, task_q, result_q, preload, stack_file, collective_timeout,
                 keep_state, parent_pid, owner_env, worker_init=None, master_addr="127.0.0.1"):
    os.setpgid(0, 0)  # a group of its own: killing it ends what the worker started too (helpers, pools)
    _die_with_parent(parent_pid)
    _worker_environment(rank, world_size, master_addr, port, owner_env)
    silence_cpu_meaningless_warnings()  # inherited from our server, unless the process's server is another's
    import faulthandler

    # On SIGUSR1 the parent gets this rank's Python stack: that is how a hang says where it is.
    stack_fh = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)
    try:
        if worker_init is not None:
            worker_init(rank, world_size)
        _join_group(rank, world_size, master_addr, port, preload, collective_timeout)
        result_q.put(("ready", rank, True, None, 0))
    except BaseException:
        result_q.put(("ready", rank, False, traceback.format_exc(), 0))
        return

    while True:
        msg = task_q.get()
        if msg is None:
            break
        result_q.put(_run_task(rank, msg, keep_state))
    import torch.distributed as dist

    dist.destroy_process_group()


# Upstream warnings that mean nothing on CPU ranks, silenced in every worker (the one place they are named), and
# who says them: megatron.core's imports without TE/apex, its advice to set CUDA_DEVICE_MAX_CONNECTIONS=1 (which
# orders CUDA kernels; CPU ranks have no CUDA streams), and torch's CPU matmul on mixed dtypes.
CPU_MEANINGLESS_WARNINGS = {
    "Transformer Engine and Apex are not installed": "megatron.core",
    "Apex is not installed": "megatron.core",
    "full scope is deprecated": "megatron.core",
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS":
        "megatron.core",
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS":
        "megatron.core",
    "Mismatch dtype between input and weight": "torch (C++)",
}


def silence_cpu_meaningless_warnings() -> None:
    """Filter ``CPU_MEANINGLESS_WARNINGS`` (run in the fork server before its imports, and in every worker)."""
    import re
    import warnings

    for message in CPU_MEANINGLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)


def _worker_environment(rank, world_size, master_addr, port, owner_env):
    """The owner's environment when the pool started (the fork server's is older), single-threaded, with the
    variables torchrun would set."""
    os.environ.clear()
    os.environ.update(owner_env)
    os.environ.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
    })


def _join_group(rank, world_size, master_addr, port, preload, collective_timeout):
    """One torch thread, the gloo process group of every rank, then the modules to import once."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=collective_timeout))
    for module in preload:
        __import__(module)
    # What is alive now (torch, megatron.core, ...: ~400k objects) lives as long as the worker: out of the
    # collector's sight, a full collection walks only what the calls make (2 s -> milliseconds each).
    gc.freeze()


def _run_task(rank, msg, keep_state):
    """One call on this worker: (task id, rank, True, pickled result, groups left) or (..., False, the error
    and where, groups left)."""
    task_id, sys_path, payload = msg
    # The parent's sys.path lets us import test modules that pytest put on it after we started.
    for entry in sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    environment, modes = dict(os.environ), _torch_function_modes()
    try:
        fn, args, kwargs = pickle.loads(payload)
        result = fn(*args, **kwargs)
        out = (task_id, rank, True, pickle.dumps(result))
    except BaseException as exc:  # report everything, including SystemExit from user code
        out = (task_id, rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    if not keep_state:
        try:
            _reset_framework_state()
        except Exception as exc:  # a stale mesh would poison the next call: fail this one instead
            out = (task_id, rank, False, f"cleanup after the call failed: {type(exc).__name__}: {exc}\n"
                                         f"{traceback.format_exc()}")
        restore(environment, modes)
    return (*out, _groups_left())


def _torch_function_modes() -> int:
    import torch

    return torch._C._len_torch_function_stack()


def restore(environment: dict, modes: int, keep=()) -> tuple[list[str], int]:
    """The environment and the torch-function mode stack as they were before a call or a test: what one sets
    (transformers' TrainingArguments exports ACCELERATE_*, a test its wait bound) or leaves on the stack (a mode
    not exited, a parameter-gather guard of a kept optimizer) would change every later one in this process, and
    their order would matter. ``keep``: variables left as they are now. Returns (the variables put back, the modes
    popped); tests/conftest.py fails a test that needed either."""
    import torch

    changed = sorted(name for name in set(environment) | set(os.environ)
                     if environment.get(name) != os.environ.get(name) and name not in keep)
    for name in changed:
        if name in environment:
            os.environ[name] = environment[name]
        else:
            del os.environ[name]
    popped = 0
    while torch._C._len_torch_function_stack() > modes:
        torch._C._pop_torch_function_stack()
        popped += 1
    return changed, popped
