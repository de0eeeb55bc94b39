"""Our own waits are bounded: a peer that never joins gives a rank-named error within the timeout.

One test per kind of wait: the pipeline's P2P receive and send (schedule/p2p.py), CP attention's K/V
all-gather (forward) and dK/dV reduce-scatter (backward), and the CP route's document-boundary broadcast over
TP (megatron/batch_hooks.py). Rank 1 never joins; rank 0 must raise
``CommTimeout`` naming itself, the peer or group and the operation, long before the process group's own
timeout.

The cases run one after the other in one call, each on a process group of its own (the operation rank 0 gave up
on stays posted in its group, out of the next cases' way); rank 1 goes through them without waiting for rank 0's
timeouts, so the call takes about one bound per case. Then the pool replaces its workers.
"""

import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from l3plugin.collective.waits import DEFAULT_TIMEOUT, ENV_VAR, resolve_timeout

TIMEOUT = 0.5  # seconds rank 0 waits (any bound shows: its peer never comes)
PEER_TIMEOUT = 60.0  # rank 1's own waits, in the forwards it shares with rank 0 (which comes to them late)


def timed(fn):
    """Rank 0 reports how long it took to fail (the harness's own time includes rebuilding its pool)."""
    start = time.monotonic()
    try:
        return fn()
    except Exception as exc:
        raise RuntimeError(f"clear error after {time.monotonic() - start:.2f} s") from exc


def p2p_peer_never_joins(operation, timeout, group=None):
    """Rank 0 runs its pipeline plan (p=2, m=2) until it blocks; rank 1 never posts anything."""
    from l3plugin.schedule.p2p import PipelineChannels
    from l3plugin.schedule.plan import FORWARD, build_schedule

    if dist.get_rank() == 1:
        return "stayed away"
    schedule = build_schedule(2, 1, 2, 2)
    channels = PipelineChannels(schedule, 0, None, [0, 1], group, shape=(4, 2), dtype=torch.float32,
                                device=torch.device("cpu"), wait_timeout=timeout)

    def run():
        for action in schedule.ranks[0].actions:
            recv, send = schedule.action_messages(0, action)
            if action.op == FORWARD:
                channels.send(send, torch.ones(4, 2), 1)
                if operation == "send":
                    channels.wait_sent(send)
            else:
                channels.recv(recv, 1)
        return "finished without its peer"
    return timed(run)


def cp_peer_never_joins(operation, timeout, overlap=False, group=None):
    """all-gather: rank 1 never calls attention. reduce-scatter (cp_kv="keep") and all-gather again
    (cp_kv="regather" without prefetch, the backward's first collective): rank 1 skips the backward."""
    from l3plugin.cp.attention import all_gather_attention

    group = dist.group.WORLD if group is None else group
    q = torch.randn(8, 2, 4, requires_grad=True)
    if operation == "all-gather" and dist.get_rank() == 1:
        return "stayed away"
    cp_kv = "keep" if operation == "reduce-scatter" else "regather"
    bound = timeout if dist.get_rank() == 0 else PEER_TIMEOUT
    out = timed(lambda: all_gather_attention(q, q, q, [0, 16], group=group, wait_timeout=bound,
                                             overlap=overlap, cp_kv=cp_kv, prefetch=False))
    if dist.get_rank() == 1:
        return "skipped the backward"
    return timed(lambda: out.sum().backward())


def cp_overlapped_peer_never_joins(operation, timeout, group=None):
    """The same with the communication in parts (cp/overlap.py): the first part waited times out."""
    return cp_peer_never_joins(operation, timeout, overlap=True, group=group)


def boundaries_peer_never_joins(operation, timeout, group=None):
    """The CP route's document boundaries sent over TP (megatron/batch_hooks.py): rank 1 never receives."""
    from l3plugin.megatron.batch_hooks import broadcast_boundaries

    if dist.get_rank() == 1:
        return "stayed away"
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    group = dist.group.WORLD if group is None else group
    return timed(lambda: broadcast_boundaries(cu, 0, group, torch.device("cpu"), timeout))


def env_bound_peer_never_joins(operation, timeout, group=None):
    """A blocking helper of comm.py called without a timeout takes $L3PLUGIN_WAIT_TIMEOUT, not the default."""
    from l3plugin.collective import comm

    if dist.get_rank() == 1:
        return "stayed away"
    os.environ[ENV_VAR] = str(timeout)
    try:
        group = dist.group.WORLD if group is None else group
        return timed(lambda: comm.broadcast_from(torch.zeros(1), 0, group, what="bound from the env"))
    finally:
        del os.environ[ENV_VAR]


WITHIN = f"did not finish within {TIMEOUT:g} s"
CASES = [
    (env_bound_peer_never_joins, "broadcast", "rank 0: broadcast (bound from the env) of 1 float32 elements (0.0 "
                                              "MiB) in group ranks [0, 1] " + WITHIN),
    (boundaries_peer_never_joins, "broadcast", "rank 0: broadcast (document boundaries' count over TP) of 1 int64 "
                                               "elements"),
    (p2p_peer_never_joins, "recv", "rank 0: pipeline rank 0: receive of the grad of microbatch 0 (stage 1 -> 0) "
                                   "from pipeline rank 1 (global rank 1) " + WITHIN),
    (p2p_peer_never_joins, "send", "rank 0: pipeline rank 0: send of the activation of microbatch 0 (stage 0 -> 1) "
                                   "to pipeline rank 1 (global rank 1) " + WITHIN),
    (cp_peer_never_joins, "all-gather", "rank 0: all-gather (CP K/V (2, 8, 2, 4)) of 128 float32 elements "
                                        "(0.0 MiB) in group ranks [0, 1] " + WITHIN),
    (cp_peer_never_joins, "reduce-scatter", "rank 0: reduce-scatter (point-to-point exchange on gloo) (CP dK/dV "
                                            "(2, 8, 2, 4)) of 256 float32 elements (0.0 MiB) in group ranks [0, 1] "
                                            + WITHIN),
    (cp_peer_never_joins, "all-gather again", "rank 0: all-gather (CP K/V (2, 8, 2, 4) (again)) of 128 float32 "
                                              "elements (0.0 MiB) in group ranks [0, 1] " + WITHIN),
    (cp_overlapped_peer_never_joins, "all-gather again", "rank 0: all-gather (CP K/V (2, 8, 2, 4) (again)) of 128 "
                                                         "float32 elements (0.0 MiB) in group ranks [0, 1] " + WITHIN),
    (cp_overlapped_peer_never_joins, "all-gather", "rank 0: all-gather (CP K/V part 0 (2, 4, 2, 4)) of 64 float32 "
                                                   "elements (0.0 MiB) in group ranks [0, 1] " + WITHIN),
    (cp_overlapped_peer_never_joins, "reduce-scatter", "rank 0: reduce-scatter (point-to-point exchange on gloo) (CP "
                                                       "dK/dV part 0 (2, 4, 2, 4)) of 128 float32 elements (0.0 MiB) "
                                                       "in group ranks [0, 1] " + WITHIN),
]


def run_cases(cases, timeout):
    """On each rank: every (fn, operation) of ``cases`` in turn, each on a new process group of both ranks.
    Per case (True, what it returned) or (False, its error: type, message and traceback)."""
    groups = [dist.new_group([0, 1]) for _ in cases]
    outcomes = []
    for (fn, operation), group in zip(cases, groups):
        try:
            outcomes.append((True, fn(operation, timeout, group=group)))
        except Exception as exc:  # noqa: BLE001 - the test reads each rank's error
            outcomes.append((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    return outcomes


@pytest.fixture(scope="module")
def outcomes(ranks, uncaught):
    """{(fn, operation): (rank 0's outcome, rank 1's)} of every case, from one call (while the ranks wait out their
    bounds, ``uncaught``'s fresh interpreter imports torch)."""
    try:
        per_rank = ranks.run(2, run_cases, [(fn, operation) for fn, operation, _ in CASES], TIMEOUT, timeout=120)
    finally:  # rank 0's given-up operations stay posted in its groups: the next tests get fresh workers
        ranks.pool(2).restart()
    return {(fn, operation): (per_rank[0][i], per_rank[1][i]) for i, (fn, operation, _) in enumerate(CASES)}


@pytest.mark.parametrize("fn,operation,expected", CASES)
def test_a_peer_that_never_joins_gives_a_rank_named_error(outcomes, fn, operation, expected):
    (returned, text), (peer_returned, peer) = outcomes[(fn, operation)]
    assert not returned and "CommTimeout" in text, text  # rank 0 raised
    assert expected in text, text
    assert peer_returned, peer  # the peer that stayed away is not blamed for raising
    elapsed = float(re.search(r"clear error after ([0-9.]+) s", text).group(1))
    assert TIMEOUT <= elapsed < TIMEOUT + 1.5, elapsed  # the bound, not the process group's 30 minutes
    print(f"{fn.__name__}[{operation}]: clear error after {elapsed:.2f} s (wait bound {TIMEOUT:g} s)")


def test_timeout_setting_comes_from_argument_environment_or_default(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_timeout() == DEFAULT_TIMEOUT and DEFAULT_TIMEOUT < 30 * 60
    monkeypatch.setenv(ENV_VAR, "42.5")
    assert resolve_timeout() == 42.5 and resolve_timeout(3) == 3.0
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{ENV_VAR}=.*{bad}.* is invalid: must be a finite number of "
                                             f"seconds > 0"):
            resolve_timeout()
    for bad in (0, -2.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match=r"wait_timeout=.* is invalid: must be a finite number of seconds > 0"):
            resolve_timeout(bad)


UNCAUGHT = """
import threading, time, torch.distributed as dist
from l3plugin.collective.waits import wait_work
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
# A non-daemon thread that never ends stands for the backend thread still stuck in the collective:
# interpreter shutdown would wait for it.
threading.Thread(target=time.sleep, args=(600,)).start()

class StuckWork:
    def wait(self, timeout):
        raise RuntimeError("Timed out waiting 100ms for recv operation to complete")

wait_work(StuckWork(), timeout=0.1, what="receive from rank 1")
"""


def run_uncaught(folder):
    """Run UNCAUGHT in a fresh interpreter: (its CompletedProcess, seconds it took)."""
    import sys

    from l3plugin.ranks.pool import _free_port, run_command

    script = folder / "uncaught.py"
    script.write_text(UNCAUGHT.format(port=_free_port()))
    start = time.monotonic()
    done = run_command([sys.executable, str(script)], timeout=120)
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def uncaught(tmp_path_factory):
    """``run_uncaught`` started in a thread (a Future): its interpreter's start-up, mostly importing torch, overlaps
    the cases above, whose ranks mostly wait."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as side:
        yield side.submit(run_uncaught, tmp_path_factory.mktemp("uncaught"))


def test_an_uncaught_timeout_ends_the_process(uncaught):
    """Under torchrun the failing rank must exit so that the agent stops the job (measured: without this,
    the rank that raised stayed alive until the process group's own timeout)."""
    done, seconds = uncaught.result()
    assert done.returncode == 1, done.stderr
    assert "CommTimeout: rank 0: receive from rank 1 did not finish within 0.1 s" in done.stderr
    assert seconds < 60  # not the 600 s the stuck thread would hold the process
