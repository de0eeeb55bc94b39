"""The suite's independent subprocess runs, started ahead in the background at the lowest CPU priority.

Most of such a run (an example under torchrun, a bench, a fresh interpreter importing DeepSpeed) is one or two cores
importing torch / DeepSpeed / Megatron-Core, and the suite runs its tests one after the other: while a test waits for
a slow rank, sleeps on purpose or runs single-threaded Python, a core idles. So every module's runs are queued when
the session starts (conftest.py), in the order of the tests, and run one at a time in a thread whose processes have
nice 19: they take the cores the tests leave idle and yield them as soon as a test wants them. A test then takes its
run's result (or its exception) and asserts on it; a run not started yet when its test comes runs there and then, at
normal priority.

A module declares its runs with a function of the session's ``tmp_path_factory`` and the names of its selected
tests, returning ``{name: callable}`` (a name being the test, function or parametrized id, that checks the run) and
optionally ``{name: tests that need it}``; its tests get the results through conftest.py's ``ahead`` fixture:

    def ahead_runs(tmp_path_factory, selected):
        return {"test_a": lambda: run_a(tmp_path_factory.mktemp("a"), timeout=time_allowed(300))}

    def test_a(ahead):
        out = ahead.result("test_a")

Timeouts: a run at nice 19 may get almost no CPU for minutes while the tests keep both cores busy, so a run's own
timeouts go through ``time_allowed``, which stretches them in the queue's thread only.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

STARVED_FACTOR = 8  # a queued run's timeouts are this many times its normal ones (at most STARVED_LIMIT s)
STARVED_LIMIT = 1500.0
_QUEUE_THREAD = "run-ahead"


def time_allowed(seconds: float) -> float:
    """``seconds``, stretched when the caller runs in the background queue (see the module doc)."""
    if threading.current_thread().name.startswith(_QUEUE_THREAD):
        return max(seconds, min(seconds * STARVED_FACTOR, STARVED_LIMIT))
    return seconds


def _lowest_priority():
    # On Linux the nice value is a thread's own, and the processes this thread starts inherit it.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class SessionRuns:
    """Every module's runs, queued at the session's start: see the module doc."""

    def __init__(self):
        self._pool = None
        self._runs = {}  # (module name, run name) -> callable
        self._futures = {}

    def start(self, items, tmp_path_factory):
        """Queue the runs of the modules of ``items`` (the session's selected tests, in order) that declare
        ``ahead_runs``, those their selected tests check or need."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=_QUEUE_THREAD, initializer=_lowest_priority)
        by_module = {}
        for item in items:
            module = getattr(item, "module", None)
            if module is not None and hasattr(module, "ahead_runs"):
                by_module.setdefault(module, set()).update({item.name, item.originalname})
        for module, selected in by_module.items():
            declared = module.ahead_runs(tmp_path_factory, selected)
            runs, needed_by = declared if isinstance(declared, tuple) else (declared, {})
            for name, run in runs.items():
                key = (module.__name__, name)
                self._runs[key] = run
                if selected & {name, *needed_by.get(name, ())}:
                    self._futures[key] = self._pool.submit(run)

    def of_module(self, module) -> "ModuleRuns":
        return ModuleRuns(self, module.__name__)

    def result(self, key):
        """The run's result, or the exception it raised; a run not started yet runs now, in the caller."""
        if key not in self._runs:
            raise KeyError(f"{key[0]}.ahead_runs declares no run named {key[1]!r} (or the session did not start it: "
                           "the runs_ahead fixture of tests/conftest.py)")
        future = self._futures.get(key)
        if future is None or future.cancel():
            self._futures[key] = future = _done_now(self._runs[key])
        return future.result()

    def close(self):
        # Runs not started yet (their tests failed or were deselected by an interrupt) are dropped; a running one
        # ends within its own timeout.
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class ModuleRuns:
    def __init__(self, session: SessionRuns, module_name: str):
        self._session, self._module = session, module_name

    def result(self, name: str):
        return self._session.result((self._module, name))


def _done_now(run):
    future = Future()
    try:
        future.set_result(run())
    except Exception as exc:  # noqa: BLE001 - raised again by result(), in the test that asked
        future.set_exception(exc)
    return future


SESSION = SessionRuns()
