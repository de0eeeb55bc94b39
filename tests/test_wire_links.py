"""The emulated wire made for real (bench/wire.py): per-rank links are full duplex and carry each rank's own
traffic, the shared bus is half duplex, rates can be changed and calibrated, and namespaces go on every exit.
Needs root, ``ip`` and ``tc`` (skipped otherwise). Timing bounds are coarse, at a low rate where the wire's
time (0.2 s) dwarfs gloo's CPU time (milliseconds) and the two modes differ by 2x."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # bench/wire.py, imported as the benches do
import harness  # noqa: E402
import wire  # noqa: E402

from l3plugin.ranks.pool import RankPool  # noqa: E402

pytestmark = [pytest.mark.wire,
              pytest.mark.skipif(wire.why_not_here() is not None,
                                 reason=f"the wire needs network namespaces: {wire.why_not_here()}")]

RATE = 80 * 10**6  # bits/s: 10 MB/s each way
# fp32 elements: 2 MB, 0.2 s at RATE in one direction (0.175 s past tbf's 256 KiB burst): full duplex within
# 0.5x..1.5x of it, half duplex (twice the bytes through one bucket) within 1.5x..3x.
NUMEL = 500_000
ONE_WAY = NUMEL * 4 * 8 / RATE


def exchange_seconds(results) -> float:
    """The slower rank's time of time_collectives_alone's exchange (each rank sends NUMEL and receives NUMEL)."""
    return max(r["exchange"][0] for r in results)


@pytest.fixture(scope="module")
def per_rank():
    link = wire.Wire(RATE, "per-rank")
    try:
        with RankPool(2, **link.pool_options(2)) as pool:
            yield link, pool
    finally:
        link.close()
    assert not set(link.links.namespaces + [link.links.switch]) & set(wire.namespaces())


# ---- on a rank ---------------------------------------------------------------------------------------------
def network_namespace_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def send_one_way(numel, source):
    import torch
    import torch.distributed as dist

    data = torch.ones(numel)
    dist.barrier()
    (dist.isend if dist.get_rank() == source else dist.irecv)(data, 1 - dist.get_rank()).wait()
    dist.barrier()


# ---- per-rank ----------------------------------------------------------------------------------------------
def test_each_rank_runs_in_its_own_namespace(per_rank):
    link, pool = per_rank
    made = [os.stat(os.path.join(wire.NETNS_DIR, name)).st_ino for name in link.links.namespaces]
    assert pool.run(network_namespace_inode) == made
    assert len(set(made)) == 2 and network_namespace_inode() not in made  # the bench process stays where it is


def test_per_rank_exchange_is_full_duplex(per_rank):
    """Both ranks send 4 MB to each other at once: each direction at RATE, so one direction's time, not two."""
    link, pool = per_rank
    link.set_rate(RATE)
    took = min(exchange_seconds(pool.run(wire.time_collectives_alone, NUMEL, 1)) for _ in range(2))
    assert 0.5 * ONE_WAY < took < 1.5 * ONE_WAY, (took, ONE_WAY)


def test_each_rank_sends_through_its_own_link(per_rank):
    """Rank s's bytes leave through s's uplink and reach the other rank through its downlink; the reverse
    ends carry only acknowledgements."""
    link, pool = per_rank
    link.set_rate(RATE)
    numel = NUMEL // 2  # 1 MB
    for source in (0, 1):
        before = link.traffic()
        pool.run(send_one_way, numel, source)
        after = link.traffic()
        moved = {(rank, end): after[rank][end] - before[rank][end] for rank in (0, 1) for end in ("up", "down")}
        target = 1 - source
        assert moved[source, "up"] >= 4 * numel and moved[target, "down"] >= 4 * numel, moved
        assert moved[source, "down"] < 0.2 * 4 * numel and moved[target, "up"] < 0.2 * 4 * numel, moved


def shaped_rate(namespace, device):
    """The tbf rate (bits/s) on ``device`` in ``namespace``, None without one."""
    shown = subprocess.run(["tc", "-n", namespace, "-j", "qdisc", "show", "dev", device], capture_output=True,
                           text=True, check=True)
    rates = [q["options"]["rate"] * 8 for q in json.loads(shown.stdout) if q["kind"] == "tbf"]
    return rates[0] if rates else None


def test_set_rate_and_calibration_shape_both_ends_of_every_link(per_rank):
    link, pool = per_rank
    ends = [(name, wire.RANK_INTERFACE) for name in link.links.namespaces] + [
        (link.links.switch, f"r{rank}") for rank in range(2)]
    link.set_rate(None)
    assert [shaped_rate(*end) for end in ends] == [None] * 4
    link.set_rate(RATE)
    assert [shaped_rate(*end) for end in ends] == [RATE] * 4
    # --wire auto's calibration: the exchange timed unshaped and at RATE (>= 0.2 s on the wire), then every end
    # set to the rate at which it takes 0.1 s: faster than RATE (how much faster depends on the CPU's load)
    picked = harness.calibrate_wire(link, lambda: exchange_seconds(pool.run(wire.time_collectives_alone,
                                                                            NUMEL, 1)), ONE_WAY / 2)
    assert picked["probed"] > ONE_WAY * 0.5 and picked["probe_rate"] == RATE, picked
    first_rate = wire.rate_for_time(ONE_WAY / 2, picked["unshaped"], picked["probed"], RATE)
    assert picked["checks"][0][0] == first_rate and link.rate == picked["rate"], picked  # then timed, corrected
    assert picked["rate"] > RATE, picked
    assert [shaped_rate(*end) for end in ends] == [pytest.approx(picked["rate"], rel=0.01)] * 4
    link.set_rate(RATE)


def test_links_made_unshaped_take_a_rate_later():
    link = wire.Wire(None, "per-rank")
    try:
        link.pool_options(2)
        ends = [(name, wire.RANK_INTERFACE) for name in link.links.namespaces] + [
            (link.links.switch, f"r{rank}") for rank in range(2)]
        assert [shaped_rate(*end) for end in ends] == [None] * 4
        link.set_rate(RATE)
        assert [shaped_rate(*end) for end in ends] == [RATE] * 4
    finally:
        link.close()
    assert not {name for name, _ in ends} & set(wire.namespaces())


# ---- the shared bus, for comparison ------------------------------------------------------------------------
SHARED_BENCH = f"""
import json, subprocess, sys
sys.path.append({str(ROOT / "bench")!r})
import wire
from l3plugin.ranks.pool import RankPool


def loopback_qdiscs():
    shown = subprocess.run(["tc", "-j", "qdisc", "show", "dev", "lo"], capture_output=True, text=True, check=True)
    return [q["kind"] for q in json.loads(shown.stdout)]


if __name__ == "__main__":
    link = wire.enter("{RATE}bit", mode="shared")  # re-executes this script inside the shaped namespace
    assert link.mode == "shared" and link.pool_options(2) == {{}}, link.describe()
    with RankPool(2) as pool:
        shaped, qdiscs = pool.run(wire.time_collectives_alone, {NUMEL}, 1), loopback_qdiscs()
        link.set_rate(None)
    print(json.dumps([shaped, qdiscs, loopback_qdiscs(), link.describe()]))
"""


def start_shared_bench(folder):
    script = folder / "shared_bench.py"
    script.write_text(SHARED_BENCH)
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.fixture(scope="module", autouse=True)
def shared_bench(request, tmp_path_factory):
    """SHARED_BENCH started before the module's first test, when its test is selected: its interpreters' start-up
    (the fork server importing torch, seconds of one core) overlaps the per-rank tests, which mostly wait on the
    wire. None when not started here (the test then starts it)."""
    selected = any(item.module is request.module and item.name == "test_shared_bus_exchange_is_half_duplex"
                   for item in request.session.items)
    bench = start_shared_bench(tmp_path_factory.mktemp("shared")) if selected else None
    try:
        yield bench
    finally:
        if bench is not None and bench.poll() is None:
            bench.kill()  # the test did not get to it; the namespace's owner ends with it
            bench.communicate()


def test_shared_bus_exchange_is_half_duplex(shared_bench, tmp_path):
    """The same exchange on the shared loopback bus: both directions in one bucket, twice the time; set_rate
    inside switches the loopback's tbf off."""
    bench = shared_bench or start_shared_bench(tmp_path)
    try:
        stdout, stderr = bench.communicate(timeout=300)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    assert bench.returncode == 0, stderr[-3000:]
    shaped, qdiscs, qdiscs_unshaped, described = json.loads(stdout.splitlines()[-1])
    assert 1.5 * ONE_WAY < exchange_seconds(shaped) < 3 * ONE_WAY, (shaped, ONE_WAY)
    assert qdiscs == ["tbf"] and "tbf" not in qdiscs_unshaped, (qdiscs, qdiscs_unshaped)
    assert "shared by every rank and both directions" not in described and "unshaped loopback" in described


# ---- namespaces go on every exit ---------------------------------------------------------------------------
OWNER = f"""
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's KeyboardInterrupt, even if started ignored
sys.path.append({str(ROOT / "bench")!r})
import wire
how = sys.argv[1]
if how == "shared":
    sys.exit(wire.run_inside(10**8, [sys.executable, "-c", "print('inside', flush=True); import time; time.sleep(60)"]))
link = wire.enter("100mbit", mode="per-rank")
link.pool_options(2)
print(json.dumps(link.links.namespaces + [link.links.switch]), flush=True)
sys.stdin.readline()  # the test has seen the namespaces
if how == "raise":
    raise RuntimeError("the bench failed")
if how != "return":  # short sleeps, as a bench's steps: a signal landing just before one long sleep's syscall
    for _ in range(600):  # would wait out the whole sleep (CPython acts on a signal between bytecodes)
        time.sleep(0.1)
"""


@pytest.mark.parametrize("how, signum, code", [("return", None, 0), ("raise", None, 1),
                                               ("sleep", signal.SIGTERM, 128 + signal.SIGTERM),
                                               ("sleep", signal.SIGHUP, 128 + signal.SIGHUP),
                                               ("sleep", signal.SIGINT, -signal.SIGINT),
                                               ("shared", signal.SIGTERM, 128 + signal.SIGTERM)])
def test_namespaces_are_removed_on_exit(how, signum, code):
    before = set(wire.namespaces())
    owner = subprocess.Popen([sys.executable, "-c", OWNER, how], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        first = owner.stdout.readline()
        made = set(wire.namespaces()) - before
        if how == "shared":
            assert first.strip() == "inside" and made == {f"{wire.NAMESPACE_PREFIX}{owner.pid}"}
        else:
            assert made == set(json.loads(first)) and len(made) == 3, (first, made)
        owner.stdin.close()  # on to the end, or the sleep
        if signum is not None:
            owner.send_signal(signum)
        assert owner.wait(timeout=60) == code, owner.stderr.read()[-3000:]
    finally:
        owner.kill()
        owner.wait()
    left = made & set(wire.namespaces())
    assert not left, f"left behind after {how} / {signum}: {left}"


def test_stale_namespaces_of_a_killed_bench_are_removed():
    before = set(wire.namespaces())
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "sleep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        made = set(json.loads(owner.stdout.readline()))
    finally:
        owner.kill()  # SIGKILL: no clean-up runs
        owner.wait()
    assert made <= set(wire.namespaces()) - before
    wire.remove_stale_namespaces()
    assert not made & set(wire.namespaces())
