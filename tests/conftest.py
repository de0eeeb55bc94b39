import os

import pytest
import torch

from l3plugin.ranks.pool import RankPools
from runs_ahead import SESSION  # tests/runs_ahead.py

# The suite's own process single-threaded, as the rank workers are: its ops are tiny, and on 2 cores shared with
# the workers a second intra-op thread costs more in barriers than it computes (tests/cp/test_kernels.py: 5x).
torch.set_num_threads(1)


SUITE_PRELOAD = ("megatron.core", "deepspeed")  # what the suite's fork server imports once for every worker


def pytest_configure(config):
    """The fork server starts importing SUITE_PRELOAD now, on the other core, while pytest collects (~13 s of one
    core: the test modules import torch, Megatron-Core and transformers), instead of after collection while the
    first test on ranks waits for it."""
    if config.option.collectonly:
        return
    from l3plugin.ranks.pool import start_fork_server

    # Started with pytest's capture on (it is suspended during configure): the server, and the workers it forks,
    # write into the captured output as they did when a test started the server, not to the terminal.
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.resume_global_capture()
    try:
        start_fork_server(SUITE_PRELOAD)
    finally:
        if capture is not None:
            capture.suspend_global_capture()


@pytest.fixture(scope="session", autouse=True)
def runs_ahead(request, tmp_path_factory):
    """The selected modules' subprocess runs, queued in the background at the lowest CPU priority (runs_ahead.py)."""
    SESSION.start(request.session.items, tmp_path_factory)
    yield SESSION
    SESSION.close()


@pytest.fixture(scope="module")
def ahead(request):
    """This module's runs from the queue: ``ahead.result(name)`` (a module may override it, test_bench_smoke.py)."""
    return SESSION.of_module(request.module)


@pytest.fixture(scope="session")
def ranks():
    """Run a function on N gloo CPU ranks: ``ranks.run(world_size, fn, *args, timeout=...)``.

    Workers are spawned once per world size for the whole session. They are forked from one server that imported
    megatron.core and DeepSpeed once (~6 and ~1.2 CPU-s a process), so a pool restarted after a failed call does
    not import them again.
    """
    pools = RankPools(preload=SUITE_PRELOAD)
    yield pools
    pools.close()


@pytest.hookimpl(trylast=True)  # after the session's fixtures (the pools) are torn down
def pytest_sessionfinish(session, exitstatus):
    """The suite ends with no worker process of ours alive; one left is killed and fails the run."""
    from l3plugin.ranks.pool import kill_live_workers, live_workers

    left = live_workers()
    if left:
        kill_live_workers()
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nworker processes {left} were still running at the end of the session (killed now): "
              "a pool was not closed", flush=True)


# Set by pytest for each phase of a test, or by a framework when it is first imported, for the process's life (the
# test that happens to import it first is not to blame).
SET_OUTSIDE_TESTS = {"PYTEST_CURRENT_TEST": "pytest",
                     "PYTORCH_NVML_BASED_CUDA_CHECK": "deepspeed/__init__.py (os.environ.setdefault at import)",
                     "TORCHINDUCTOR_CACHE_DIR": "torch/_inductor/runtime/cache_dir_utils.py (at the first compile)"}


@pytest.fixture(autouse=True)
def leaves_no_state():
    """A test leaves the suite's process as it found it: its environment (a pool started later copies it into its
    workers; a wait bound left set slowed every later failure) and torch's function-mode stack (a mode left there
    runs in every later torch call). One that does not fails, naming what it left; it is restored for the next.
    (The workers restore both after every call, with the same function: l3plugin/ranks/worker.py.)"""
    from l3plugin.ranks.worker import restore

    environment, modes = dict(os.environ), torch._C._len_torch_function_stack()
    yield
    changed, left = restore(environment, modes, keep=SET_OUTSIDE_TESTS)
    if changed or left:
        pytest.fail(f"the test changed {changed} in the environment and left {left} torch-function mode(s) on the "
                    "stack (restored now)")
