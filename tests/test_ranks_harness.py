"""The CPU multi-process harness: results in rank order, and clear failures for raise, hang and death. What the
ranks run is in tests/ranks_harness_calls.py (no pytest import in every fresh worker)."""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from l3plugin.ranks.pool import RanksFailed, RankPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from idle_groups import keep_groups  # noqa: E402  (workers get this sys.path with every call)
from ranks_harness_calls import (exit_on_rank, init_trace, leave_state_behind, mark_rank, raise_on_rank,  # noqa: E402
                                 rank_and_sum, sleep_on_rank, state_seen, stuck_in_collective)


@pytest.fixture(scope="module")
def pool():
    with RankPool(3, grace=1.0) as p:  # its own pool: these tests restart it on purpose
        yield p


def test_results_in_rank_order_and_single_threaded(pool):
    results = pool.run(rank_and_sum, 10)
    assert [r[0] for r in results] == [0, 1, 2]
    assert all(r[1] == 0 + 1 + 2 + 3 * 10 for r in results)
    assert all(r[2] == "1" and r[3] == 1 for r in results)


def test_a_call_leaves_no_environment_or_torch_function_mode_to_the_next(pool):
    assert pool.run(leave_state_behind) == [1, 1, 1]
    assert pool.run(state_seen) == [(None, "1", 0)] * 3


def test_workers_that_keep_many_process_groups_are_replaced_after_the_call(pool):
    """Each idle gloo group keeps polling threads: the pool restarts (cheaply) once a call left more than
    GROUPS_LEFT_LIMIT groups, and only then; the call itself still returns its results."""
    from l3plugin.ranks.pool import GROUPS_LEFT_LIMIT

    assert all(n == 0 for n, _ in pool.run(keep_groups, 0))  # workers that kept no group yet (no restart needed)
    before = pool.pids
    pool.run(keep_groups, GROUPS_LEFT_LIMIT)  # exactly at the limit: kept
    assert pool.pids == before
    kept = pool.run(keep_groups, 1)
    assert pool.pids != before and all(n == GROUPS_LEFT_LIMIT + 1 and t > 2 * GROUPS_LEFT_LIMIT for n, t in kept)
    assert all(n == 0 for n, _ in pool.run(keep_groups, 0))  # fresh workers: the groups and their threads are gone
    assert pool.run(rank_and_sum, 0)[0][1] == 3


def test_rank_that_raises_is_named_with_its_traceback_and_the_old_workers_are_killed(pool):
    old = pool.pids
    with pytest.raises(RanksFailed) as err:
        pool.run(raise_on_rank, 1, timeout=60)
    assert wait_gone(old, 0.5) == []  # ranks 0 and 2 were blocked in all_reduce: killed with the failed call
    assert set(pool.pids).isdisjoint(old)
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
    with pytest.raises(RanksFailed) as err:
        pool.run(sleep_on_rank, 2, 600, timeout=2)  # ranks 0 and 1 answer at once
    assert time.monotonic() - start < 60
    text = str(err.value)
    assert "rank 2 hung" in text and "timeout of 2 s" in text
    assert "rank 0 " not in text and "rank 1 " not in text
    assert "sleep_on_rank" in text  # the hung rank's stack shows where it is
    assert pool.run(sleep_on_rank, 0, 0) == [0, 1, 2]


def test_rank_that_dies_is_named_with_exit_code(pool):
    with pytest.raises(RanksFailed) as err:
        pool.run(exit_on_rank, 0, timeout=60)
    assert "rank 0 died" in str(err.value) and "code 3" in str(err.value)
    assert pool.run(sleep_on_rank, 1, 0) == [0, 1, 2]


def test_unpicklable_function_gives_a_clear_error(pool):
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda: 1)


# -- no worker outlives its pool or its parent ------------------------------------------------------------
def wait_gone(pids, seconds=15.0):
    """The pids among ``pids`` still running after waiting up to ``seconds``."""
    from l3plugin.ranks.pool import _alive

    deadline = time.monotonic() + seconds
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def call_under_way(markers, world_size=2, seconds=120.0):
    """Wait until every rank of stuck_in_collective has left its file, then a little more: rank 0 in all_reduce,
    rank 1 asleep. False if they did not within ``seconds``."""
    deadline = time.monotonic() + seconds
    while len(list(Path(markers).glob("rank*"))) < world_size:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    time.sleep(0.5)  # from the file to the blocking call: a few lines of Python
    return True


PARENT = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from l3plugin.ranks.pool import RankPool, RankPools, live_workers


def bounded():  # the bounded-wait cases, each of which leaves a rank blocked, then a normal end
    import ranks_harness_calls
    pools = RankPools(preload=("ranks_harness_calls", "test_bounded_waits"))  # imported once, in the fork server
    for case in (("cp_peer_never_joins", "reduce-scatter"), ("p2p_peer_never_joins", "recv")):
        try:
            pools.run(2, ranks_harness_calls.bounded_wait_case, *case, timeout=60)
        except AssertionError:
            pass
        print("pids", *pools.pool(2).pids, flush=True)
    pools.close()
    print("live after close", live_workers(), flush=True)


def stuck():  # a parent killed while its workers are stuck in a collective
    import ranks_harness_calls
    pool = RankPool(2, preload=("ranks_harness_calls",))
    markers = os.path.join(os.path.dirname(os.path.abspath(__file__)), "markers")
    os.mkdir(markers)
    print("stuck", markers, *pool.pids, flush=True)
    pool.run(ranks_harness_calls.stuck_in_collective, markers, timeout=600)


if __name__ == "__main__":  # spawned workers import this file too
    for mode in sys.argv[1:]:
        {{"bounded": bounded, "stuck": stuck}}[mode]()
"""


def start_parent(tmp_path, *modes):
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(tests=os.path.dirname(__file__)))
    return subprocess.Popen([sys.executable, str(script), *modes], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


SIGNALS = ("SIGKILL", "SIGINT", "SIGTERM")
ENDING = ("SIGKILL", "SIGTERM")  # the signals that end a parent of its own; SIGINT interrupts this process's call
BOUNDED_IN = "SIGTERM"  # the parent that runs the bounded-wait cases first (test_bounded_wait_cases_leave_no_process)


@pytest.fixture(scope="module", autouse=True)
def parents(tmp_path_factory):
    """One parent per ending signal of the test below, both started at once and before the module's first test:
    each pays its own imports and pool, which leave a core idle; started together, and while the tests above wait
    out their grace periods and timeouts, they overlap (a third parent for the bounded-wait cases would pay them
    again: the SIGTERM one runs them before its stuck call). ``parents(signal)``: (parent, its stuck call's worker
    pids, the folder its ranks mark when the call is under way, the lines it printed before), read on first use."""
    started = {how: start_parent(tmp_path_factory.mktemp(how), *(["bounded"] if how == BOUNDED_IN else []), "stuck")
               for how in ENDING}
    read = {}

    def get(how):
        if how not in read:
            parent, before = started[how], []
            line = parent.stdout.readline()
            while line and not line.startswith("stuck "):
                before.append(line.strip())
                line = parent.stdout.readline()
            pids = ([int(x) for x in line.split()[2:]] if line else
                    f"no stuck call: exit code {parent.poll()}, printed {before}")
            read[how] = (parent, pids, line.split()[1] if line else None, before)
        return read[how]
    try:
        yield get
    finally:  # never wait for the pipes here: leaked workers would hold them open
        for how, parent in started.items():
            parent.kill()
            parent.wait()
            parent.stdout.close()
            parent.stderr.close()
            pids = read.get(how, (None, []))[1]
            for pid in wait_gone(pids if isinstance(pids, list) else [], 0):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", SIGNALS)
def test_workers_die_with_a_parent_killed_or_interrupted_mid_call(parents, how, tmp_path):
    """SIGKILL and SIGTERM end a parent of its own (started before the module's first test). Ctrl-C (SIGINT)
    interrupts a call of this process: KeyboardInterrupt leaves pool.run, with the call's workers killed."""
    if how == "SIGINT":
        pids = interrupted_mid_call(tmp_path / "markers")
    else:
        parent, pids, markers, _ = parents(how)
        assert isinstance(pids, list), pids  # else what the parent printed instead of its workers' pids
        assert call_under_way(markers), "the parent's stuck call never reached its ranks"
        parent.send_signal(getattr(signal, how))
        parent.wait(timeout=60)
    assert wait_gone(pids) == [], f"workers {pids} of a parent ended by {how} are still running"


def interrupted_mid_call(markers):
    """Ctrl-C while this process waits for a stuck call of a pool of its own (from this process's fork server):
    the call's worker pids, once KeyboardInterrupt has left pool.run."""
    markers.mkdir()
    main = threading.get_ident()
    # Ctrl-C raises KeyboardInterrupt, as in a terminal (a shell's background job inherits SIGINT ignored)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with RankPool(2) as pool:
            pids = pool.pids

            def interrupt():
                if call_under_way(markers):  # else the call below times out and fails the test
                    signal.pthread_kill(main, signal.SIGINT)  # KeyboardInterrupt in the main thread

            threading.Thread(target=interrupt, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                pool.run(stuck_in_collective, str(markers), timeout=150)
    finally:
        signal.signal(signal.SIGINT, handler)
    return pids


def test_bounded_wait_cases_leave_no_process(parents):
    _, stuck_pids, _, printed = parents(BOUNDED_IN)
    assert isinstance(stuck_pids, list), stuck_pids  # bounded() returned: the parent went on to its stuck call
    pids = [int(x) for line in printed if line.startswith("pids ") for x in line.split()[1:]]
    assert len(pids) == 4 and "live after close []" in printed, printed
    assert wait_gone(pids, 5) == []


def test_run_command_leaves_no_process_of_the_tree():
    import subprocess

    from l3plugin.ranks.pool import run_command

    # A command that ends but leaves a background child: the child is ended with it.
    done = run_command(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], timeout=30)
    assert wait_gone([int(done.stdout)], 5) == []
    # A command that times out: its whole tree goes, not only the direct child.
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_command(["sh", "-c", "sleep 600 & echo $!; wait"], timeout=1)
    assert wait_gone([int(err.value.stdout or err.value.output)], 5) == []
    with pytest.raises(subprocess.CalledProcessError):
        run_command(["sh", "-c", "exit 3"], timeout=30, check=True)


def test_worker_init_runs_in_every_worker_before_the_group_and_its_failure_is_named():
    import functools

    with RankPool(2, worker_init=mark_rank, master_addr="127.0.0.1") as pool:
        assert pool.run(init_trace) == [("0/2", 0), ("1/2", 1)]
    # grace: how long rank 0, left waiting for rank 1 in init_process_group, is given before it is reported
    with pytest.raises(RanksFailed, match=r"(?s)could not start 2 gloo ranks.*rank 1.*deliberate worker_init"):
        RankPool(2, worker_init=functools.partial(mark_rank, fail_on=1), start_timeout=60, grace=1.0)


def test_a_reused_worker_pid_is_neither_listed_nor_killed():
    """A worker's pid (and so its process group id) is free again once the worker and its group are gone; the
    next process given that number is not ours. Here a ``sleep`` in a group of its own stands for it, registered
    as a worker that had the same pid but started one clock tick earlier."""
    import subprocess

    from l3plugin.ranks import pool as pool_module

    other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own group, led by its pid
    try:
        started = pool_module._start_time(other.pid)
        if started is None:
            pytest.skip("no /proc here: a reused pid cannot be told apart")
        pool_module._STARTED_WORKERS[other.pid] = started - 1  # our "worker" of that pid: gone
        assert other.pid not in pool_module.live_workers()
        pool_module._kill_group(other.pid)
        assert other.poll() is None  # still running: not ours to kill
        pool_module._STARTED_WORKERS[other.pid] = started  # the worker it really is: listed and killed
        assert other.pid in pool_module.live_workers()
        pool_module._kill_group(other.pid)
        assert other.wait(timeout=10) == -signal.SIGKILL
    finally:
        pool_module._STARTED_WORKERS.pop(other.pid, None)
        other.kill()
        other.wait()


@pytest.mark.skipif(not os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"), reason="reads Linux's port range")
def test_the_store_port_is_free_and_below_the_ephemeral_range():
    """Outgoing connections take ephemeral ports: one picked there could be gone before the workers bind it."""
    import socket

    from l3plugin.ranks.pool import _free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(5):
        port = _free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
