"""The suite's background queue of subprocess runs (tests/runs_ahead.py): low priority, stretched timeouts, and a
run its test needs before the queue reached it runs in the test itself."""

import os
import subprocess
import sys
import threading
import types

import pytest

from runs_ahead import STARVED_FACTOR, SessionRuns, time_allowed

NICE = [sys.executable, "-c", "import os; print(os.nice(0))"]  # a child's own nice value


def fake_module(runs, needed_by=None):
    module = types.ModuleType("fake_ahead_module")
    module.ahead_runs = lambda tmp_path_factory, selected: (runs, needed_by or {})
    return module


def items(module, *names):
    return [types.SimpleNamespace(module=module, name=name, originalname=name) for name in names]


def child_nice_and_timeout():
    return int(subprocess.run(NICE, capture_output=True, text=True, timeout=60).stdout), time_allowed(10)


def test_a_queued_run_starts_its_processes_at_nice_19_with_stretched_timeouts(tmp_path_factory):
    began = threading.Event()
    session = SessionRuns()
    module = fake_module({"test_a": lambda: (began.set(), child_nice_and_timeout())[1]})
    session.start(items(module, "test_a"), tmp_path_factory)
    try:
        assert began.wait(60)  # the queue's thread runs it (asked before, the run would move to this thread)
        assert session.of_module(module).result("test_a") == (19, 10 * STARVED_FACTOR)
    finally:
        session.close()


def test_a_run_not_queued_runs_in_the_caller_and_errors_reach_the_test(tmp_path_factory):
    session = SessionRuns()

    def fails():
        raise RuntimeError("the run's own error")

    # "test_b" is not selected: its run is declared but not queued; "test_c" is queued and raises.
    module = fake_module({"test_b": child_nice_and_timeout, "test_c": fails})
    session.start(items(module, "test_c"), tmp_path_factory)
    try:
        runs = session.of_module(module)
        assert runs.result("test_b") == (os.getpriority(os.PRIO_PROCESS, 0), 10)
        with pytest.raises(RuntimeError, match="the run's own error"):
            runs.result("test_c")
        with pytest.raises(KeyError, match="declares no run named 'test_d'"):
            runs.result("test_d")
    finally:
        session.close()
