"""Run a function on N CPU ranks (gloo) and get each rank's result back, in rank order (``l3plugin demo``
starts its ranks with it; the tests and benches too).

Worker processes are started once per world size and reused for many calls, because importing
megatron.core and deepspeed costs seconds per process. They are forked from one server process that has
imported torch and the pool's ``preload`` modules once (multiprocessing's "forkserver"), so a pool rebuilt
after a failure, or a pool of another size, starts in a fraction of a second instead of paying the imports
again on every rank. Every call has a timeout. When a rank raises,
hangs or dies, the call fails with a message that names the rank, its exception and traceback (or, for
a hung rank, the Python stack where it hangs), and the pool is rebuilt so the next call starts clean.

    pool = RankPool(world_size=4)
    results = pool.run(my_module.check_something, arg, timeout=60)   # [rank0_result, rank1_result, ...]

``fn`` must be importable by the workers (a module-level function); its arguments and result must
pickle. Workers run with OMP_NUM_THREADS=1 and torch.set_num_threads(1): there are only 2 cores. Upstream
warnings that mean nothing on a CPU machine are filtered in the workers (``worker.CPU_MEANINGLESS_WARNINGS``).

No worker outlives its pool or its parent, whatever way they end: a failed or timed-out call kills the
workers (SIGKILL: a rank stuck in a collective ignores everything else) before rebuilding; ``close`` and
interpreter exit do the same for what is left; a worker dies with its parent (a thread watches it), so
a parent killed by SIGKILL, Ctrl-C or a CI timeout leaves nothing behind. ``run_command`` gives launched
process trees (torchrun, launchers) the same guarantee. ``live_workers()`` lists workers still running.
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from l3plugin.arguments.checks import check_int
from l3plugin.ranks.worker import GROUPS_LEFT_LIMIT, _alive, _stat, _worker_main

DEFAULT_TIMEOUT = 120.0
_POLL = 0.2  # how often the parent checks for dead workers while it waits


class RanksFailed(AssertionError):
    """A distributed call failed: some rank raised, hung past the timeout, or died."""


@dataclass
class RankFailure:
    rank: int
    kind: str  # "raised", "hung" or "died"
    detail: str

    def __str__(self):
        return f"--- rank {self.rank} {self.kind} ---\n{self.detail.rstrip()}"


def _free_port() -> int:
    """A port free now for the ranks' store, below the kernel's ephemeral range where one exists: the workers bind it
    only after they start (seconds; longer on a loaded machine), and an ephemeral port could meanwhile go to any
    process's outgoing connection (EADDRINUSE). Below the range only an explicit bind can take it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(max(1024, low - 10000), low), min(20, max(0, low - 1024))) if low > 1024 else []
    for port in [*candidates, 0]:  # 0: any free port, as before
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port for the ranks' store")


# pid -> start time (clock ticks since boot, /proc/<pid>/stat field 22; None without /proc) of every worker this
# process started; each leads a process group. The start time tells our worker from a later process that got the
# same pid: the kernel reuses a pid once its process is reaped and no process group holds it any more.
_STARTED_WORKERS: dict[int, int | None] = {}


def _start_time(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[19]) if fields else None  # fields start at proc(5)'s field 3: [19] is field 22


def _group_is_ours(pgid: int) -> bool:
    """Whether process group ``pgid`` may still be the group of the worker we started with that pid: the worker
    itself still exists (running or a zombie: the same start time), or no process holds its pid (its group, if
    anything is left in it, keeps the pid from being reused). A process of that pid with another start time
    means our worker and its whole group are gone and the number now names someone else's."""
    started = _STARTED_WORKERS.get(pgid)
    if started is None or not os.path.isdir("/proc/self"):
        return True  # nothing to tell them apart by
    now = _start_time(pgid)
    return now is None or now == started


def live_workers() -> list[int]:
    """Pids of the workers started by this process, and of anything they started, that still run."""
    live = {pid for pid in _STARTED_WORKERS if _alive(pid) and _group_is_ours(pid)}
    if os.path.isdir("/proc/self"):
        for entry in os.listdir("/proc"):
            fields = _stat(entry) if entry.isdigit() else None
            if (fields and fields[0] not in ("Z", "X") and int(fields[2]) in _STARTED_WORKERS  # [2]: pgrp
                    and _group_is_ours(int(fields[2]))):
                live.add(int(entry))
    return sorted(live)


def _kill_group(pgid: int) -> None:
    if not _group_is_ours(pgid):
        return  # the pid was reused: that group is not ours to kill
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_live_workers():
    """SIGKILL every worker this process started and whatever they started (their process groups)."""
    for pgid in _STARTED_WORKERS:
        _kill_group(pgid)
    for pid in live_workers():  # a worker killed before it made its group
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


atexit.register(kill_live_workers)  # a pool nobody closed (the last resort before PR_SET_PDEATHSIG)


def run_command(cmd, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=...)`` that leaves no process of the tree behind: the command runs in
    a session of its own, and the whole session is killed when it ends, times out or the caller is
    interrupted (subprocess.run's timeout kills only the direct child: torchrun's workers would live on)."""
    check = kwargs.pop("check", False)
    kwargs.setdefault("text", True)
    capture = kwargs.pop("capture_output", True)
    if capture:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    with subprocess.Popen(cmd, start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:  # a timeout or Ctrl-C: the whole tree goes
            _kill_group(proc.pid)
            proc.communicate()
            raise
        finally:
            _kill_group(proc.pid)  # what the command left running (its own children)
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, stdout, stderr)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _worker_context(preload: tuple[str, ...]):
    """The forkserver context, its server importing torch and ``preload`` once (a server started earlier by
    another pool keeps its own list; the worker then imports what is missing itself)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["l3plugin.ranks.server", "torch", *preload])
    return ctx


def start_fork_server(preload: tuple[str, ...] = ()) -> None:
    """Start the workers' fork server now, without waiting for it: it imports torch and ``preload`` in its own
    process (on another core) while this one goes on; pools started later fork from it."""
    from multiprocessing import forkserver

    _worker_context(tuple(preload))
    forkserver.ensure_running()


class RankPool:
    """``world_size`` worker processes joined in one gloo process group."""

    def __init__(self, world_size: int, *, preload: tuple[str, ...] = (), start_timeout: float = 180.0,
                 grace: float = 5.0, keep_state: bool = False, worker_init=None, master_addr: str = "127.0.0.1"):
        check_int("world_size", world_size)
        self.world_size = world_size
        self.preload = tuple(preload)
        self.start_timeout = start_timeout
        self.grace = grace  # after one rank fails, how long the others get to report before we give up
        # False: Megatron's parallel_state is reset after every call (tests); True: calls build on
        # each other (a training loop driven one step per call).
        self.keep_state = keep_state
        # worker_init(rank, world_size), if given, runs in every worker before it joins the group (e.g. to enter
        # a network namespace); it must pickle. master_addr: where the workers reach rank 0 then.
        self.worker_init, self.master_addr = worker_init, master_addr
        self._ids = itertools.count()
        self._procs: list = []
        self._groups_left = 0  # the most process groups a rank kept after the last call
        self._start()

    # -- lifecycle -------------------------------------------------------------------------------
    def _start(self):
        """Spawn the workers and wait until every rank has joined the gloo group; else kill them and raise."""
        self._spawn()
        outcomes = self._collect("ready", self.start_timeout)
        failures = self._failures(outcomes, "start-up", self.start_timeout)
        if failures:
            self._kill()
            raise RanksFailed(f"could not start {self.world_size} gloo ranks:\n"
                                       + "\n".join(map(str, failures)))

    def _spawn(self):
        ctx = _worker_context(self.preload)
        self._tmpdir = tempfile.mkdtemp(prefix="l3plugin-ranks-")
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.world_size)]
        port = _free_port()
        self._procs = []
        for rank in range(self.world_size):
            p = ctx.Process(
                target=_worker_main, name=f"l3plugin-rank{rank}", daemon=True,
                args=(rank, self.world_size, port, self._task_qs[rank], self._result_q, self.preload,
                      self._stack_file(rank), max(300.0, self.start_timeout), self.keep_state, os.getpid(),
                      dict(os.environ), self.worker_init, self.master_addr),
            )
            p.start()
            _STARTED_WORKERS[p.pid] = _start_time(p.pid)
            self._procs.append(p)

    def _stack_file(self, rank):
        return os.path.join(self._tmpdir, f"stack-rank{rank}.txt")

    def _kill(self):
        """SIGKILL the workers and what they started, then free the queues and the stack files."""
        self._kill_workers()
        for q in [self._result_q, *self._task_qs]:
            q.cancel_join_thread()
            q.close()
        self._procs = []
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _kill_workers(self):
        for p in self._procs:
            _kill_group(p.pid)  # the worker and anything it started, even after the worker itself ended
            if p.is_alive():
                p.kill()  # a worker killed before it made its group
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():  # SIGKILL not delivered in 10 s: only a process stuck in the kernel does that
                raise RanksFailed(f"worker {p.name} (pid {p.pid}) survived SIGKILL for 10 s")

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, in rank order."""
        return [p.pid for p in self._procs]

    def restart(self):
        self._kill()
        self._start()

    def close(self):
        """Stop the workers politely, then for sure."""
        if not self._procs:
            return
        for q in self._task_qs:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- calls -----------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order. Interrupted
        (Ctrl-C) while the ranks work, it kills them before passing the interrupt on."""
        try:
            return self._run(fn, *args, timeout=timeout, **kwargs)
        except KeyboardInterrupt:
            self._kill()
            raise

    def _run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        if not self._procs:
            self._start()
        task_id = self._send_task(fn, args, kwargs)
        outcomes = self._collect(task_id, timeout)
        failures = self._failures(outcomes, getattr(fn, "__qualname__", str(fn)), timeout)
        if failures:
            failures.sort(key=lambda f: (f.kind != "raised", f.rank))
            self.restart()  # collectives may be half done: never reuse that process group
            summary = ", ".join(f"rank {f.rank} {f.kind}" for f in failures)
            raise RanksFailed(
                f"{getattr(fn, '__qualname__', fn)} failed on {self.world_size} ranks ({summary}):\n"
                + "\n".join(map(str, failures)))
        if not self.keep_state and self._groups_left > GROUPS_LEFT_LIMIT:
            self.restart()
        return [pickle.loads(outcomes[r]) for r in range(self.world_size)]

    def _send_task(self, fn, args, kwargs) -> int:
        """Hand ``fn(*args, **kwargs)`` to every worker; returns the call's id."""
        task_id = next(self._ids)
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"cannot send {getattr(fn, '__qualname__', fn)!r} to the ranks: {exc}. "
                            "Use a module-level function and picklable arguments.") from exc
        for q in self._task_qs:
            q.put((task_id, list(sys.path), payload))
        return task_id

    def _collect(self, task_id, timeout):
        """Results by rank: pickled bytes on success, RankFailure on error or death."""
        outcomes: dict = {}
        self._groups_left = 0
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                tid, rank, ok, data, groups_left = self._result_q.get(timeout=min(_POLL, deadline - now))
            except queue.Empty:
                self._note_deaths(outcomes)
                if any(isinstance(o, RankFailure) for o in outcomes.values()):
                    deadline = min(deadline, time.monotonic() + self.grace)
                continue
            if tid != task_id:
                continue  # a late answer to an earlier call that we already gave up on
            outcomes[rank] = data if ok else RankFailure(rank, "raised", data)
            self._groups_left = max(self._groups_left, groups_left)
            if not ok:
                # The others are probably blocked in a collective with this rank; give them a moment.
                deadline = min(deadline, time.monotonic() + self.grace)
        return outcomes

    def _note_deaths(self, outcomes):
        """A RankFailure in ``outcomes`` for every worker that ended without answering."""
        for rank, p in enumerate(self._procs):
            if rank not in outcomes and not p.is_alive():
                outcomes[rank] = RankFailure(rank, "died", f"process exited with code {p.exitcode}")

    def _failures(self, outcomes, what, timeout) -> list[RankFailure]:
        """The ranks that raised or died, then the ranks with no answer (hung, with where they are)."""
        failures = [f for f in outcomes.values() if isinstance(f, RankFailure)]
        missing = [r for r in range(self.world_size) if r not in outcomes]
        return failures + self._hang_failures(missing, what, self._why_missing(failures, timeout))

    def _why_missing(self, failures, timeout):
        if failures:
            return (f"no answer {self.grace:g} s after rank {failures[0].rank} {failures[0].kind}; "
                    f"probably blocked in a collective with it")
        return f"no answer within the timeout of {timeout:g} s"

    def _hang_failures(self, ranks, what, why):
        return [RankFailure(rank, "hung", f"did not finish {what}: {why}. Where it is:\n"
                                          f"{_task_stack(self._stack_of(rank)) or '(no stack)'}")
                for rank in ranks]

    def _stack_of(self, rank) -> str:
        """A live worker's Python stacks (faulthandler's dump on SIGUSR1); empty if it cannot tell."""
        p = self._procs[rank] if rank < len(self._procs) else None
        if p is None or not p.is_alive():
            return ""
        try:
            os.kill(p.pid, signal.SIGUSR1)
            time.sleep(0.3)
            with open(self._stack_file(rank)) as fh:
                return fh.read()
        except OSError:
            return ""


def _task_stack(stack: str) -> str:
    """From a faulthandler dump of all threads, the stack of the thread running the task."""
    blocks = stack.strip().split("\n\n")
    task = [b for b in blocks if "_worker_main" in b]
    return (task[0] if task else stack).strip()


class RankPools:
    """One RankPool per world size, created on first use and kept for the whole test session."""

    def __init__(self, preload: tuple[str, ...] = ()):
        self.preload = preload
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, preload=self.preload)
        return self._pools[world_size]

    def run(self, world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs) -> list:
        return self.pool(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self):
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
