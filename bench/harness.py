"""The scaffolding every bench in bench/ shares, written once:

- ``interleaved_rounds``: warm-up rounds (not kept), then timed rounds in which every contender runs once, the
  order rotating by one contender per round (``round_order``), so no contender always runs first or after the
  same neighbour; the machine is shared, and its drift falls on every contender alike.
- ``ratio_stats`` / ``ratio_text``: the median of per-round ratios, with their range (a ratio taken within a
  round compares runs made under the same load).
- ``barrier_timed``: one step on a rank between two barriers: wall (barrier to barrier, what the slowest rank
  sets), own (this rank's step alone) and busy (this process's CPU seconds in it).
- ``timed_methods``: the seconds a step spends blocked in chosen methods (a pipeline receive, a collective's wait),
  and optionally when each call began.
- ``exposure_bound``: the least time a step must wait at its round ends for reductions that share one link,
  from when each gradient became final: what no bucket layout or wait policy can hide at a given memory.
- ``enter_wire`` / ``calibrate_wire``: ``--wire auto`` (bench/wire.py) enters at PROBE_RATE, then picks the rate
  at which one transfer takes a target time, from its time unshaped and at the probe rate (in either
  ``--wire-mode``: the rate is set on the shared loopback or on every rank's link).
- ``json_output``: ``--json``: the tables go to stderr and every printed figure, with the command line, a UTC
  timestamp and machine facts, goes to stdout as one JSON object (bench/docs_tables.py renders docs tables
  from it).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

PROBE_RATE = "2gbit"  # --wire auto: the rate first entered, from which the final one is derived


# ---- rounds ----------------------------------------------------------------------------------------------
def round_order(names, round_index: int) -> list:
    """The order of round ``round_index`` (warm-up rounds counted): the contenders starting from the
    (round_index mod n)-th, cyclically. Over n rounds each contender runs once in every position."""
    names = list(names)
    if not names:
        raise ValueError("round_order: no contenders (names is empty)")
    start = round_index % len(names)
    return names[start:] + names[:start]


def interleaved_rounds(names, run, rounds: int, warmup: int = 1) -> dict:
    """Run ``run(name)`` for every contender once per round: ``warmup`` rounds first (results dropped), then
    ``rounds`` kept, each round in ``round_order``. Returns {name: [result of each kept round, in order]}."""
    names = list(names)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"interleaved_rounds: rounds={rounds}, warmup={warmup}: needs rounds >= 1, warmup >= 0")
    kept = {name: [] for name in names}
    for index in range(warmup + rounds):
        for name in round_order(names, index):
            result = run(name)
            if index >= warmup:
                kept[name].append(result)
    return kept


def rounds_with_gradients_checked(names, run, rounds: int) -> tuple[dict, set]:
    """``interleaved_rounds`` of ``run(name)``, each result a list of per-rank dicts holding "grads" ({key:
    tensor}): every result's gradients against the first result's, rank by rank, bit for bit. Returns (the kept
    rounds, "grads" removed; the names whose gradients differed in some round)."""
    import torch

    reference, differ = [], set()

    def checked(name):
        result = run(name)
        reference[:] = reference or [r["grads"] for r in result]
        if not all(a.keys() == r["grads"].keys() and all(torch.equal(a[key], r["grads"][key]) for key in a)
                   for a, r in zip(reference, result)):
            differ.add(name)
        for r in result:
            del r["grads"]
        return result

    return interleaved_rounds(names, checked, rounds), differ


def span_medians(rounds, pp: int) -> dict:
    """{(virtual stage, op): median seconds} of the executor's spans (``waits["actions"]``: (op, micro-batch,
    chunk, start, end)) over every rank of every round; each rank's result holds "rank" and "actions"; virtual
    stage = chunk * pp + rank."""
    spans = {}
    for ranks in rounds:
        for r in ranks:
            for op, _mb, chunk, start, end in r["actions"]:
                spans.setdefault((chunk * pp + r["rank"], op), []).append(end - start)
    return {key: statistics.median(values) for key, values in spans.items()}


def ratio_stats(top, bottom) -> dict:
    """Per-round ratios top[i] / bottom[i]: {"median", "min", "max"}."""
    top, bottom = list(top), list(bottom)
    if len(top) != len(bottom) or not top:
        raise ValueError(f"ratio_stats: needs two equally long, non-empty lists (got {len(top)} and {len(bottom)})")
    ratios = [a / b for a, b in zip(top, bottom)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def ratio_text(stats: dict, digits: int = 3) -> str:
    """"median (min-max)" of ``ratio_stats``."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


# ---- on a rank -------------------------------------------------------------------------------------------
def barrier_timed(step, group=None):
    """On every rank of a process group: barrier, ``step()``, barrier. Returns ({"wall": barrier to barrier,
    "own": to this rank's step end, "busy": this process's CPU seconds in the step}, step's result)."""
    import torch.distributed as dist

    dist.barrier(group=group)
    start, cpu = time.perf_counter(), time.process_time()
    result = step()
    own, busy = time.perf_counter() - start, time.process_time() - cpu
    dist.barrier(group=group)
    return {"wall": time.perf_counter() - start, "own": own, "busy": busy}, result


@contextlib.contextmanager
def timed_methods(cls, methods, seconds: dict, began: list | None = None):
    """Within the block, add the seconds spent in each of ``cls``'s ``methods`` (every instance's calls) to
    ``seconds[method]``: where a step blocks (a receive, a collective's wait); ``began``: append (method,
    perf_counter at the call) for each call. Yields ``seconds``."""
    originals = {method: getattr(cls, method) for method in methods}

    def timed(method, original):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            if began is not None:
                began.append((method, start))
            try:
                return original(*args, **kwargs)
            finally:
                seconds[method] = seconds.get(method, 0.0) + time.perf_counter() - start
        return wrapper

    for method, original in originals.items():
        setattr(cls, method, timed(method, original))
    try:
        yield seconds
    finally:
        for method, original in originals.items():
            setattr(cls, method, original)


def exposure_bound(finals, round_ends, seconds_per_element: float, carry_seconds: float = 0.0) -> float:
    """The least time (s) a step must wait at its round ends for its gradient reductions, whatever the bucket
    layout: the reductions of a round share one link that moves ``seconds_per_element`` per gradient element,
    and an element cannot go before its parameter's gradient is final (its last gradient hook in the round).

    ``finals``: (time, parameter key, elements) per gradient hook of the step; ``round_ends``: the time of each
    round end, in order. The link finishes a round's reductions no earlier than max over j of (t_j + the
    elements final at or after t_j, times seconds_per_element); what is left at the round end is waited there,
    less ``carry_seconds`` (what the memory allowed for carried reductions lets run on under the next round),
    except at the step's last round end, which nothing follows. Ignores a carry's hold on the link (a lower
    bound)."""
    bound, start = 0.0, float("-inf")
    for index, end in enumerate(round_ends):
        last = {}  # parameter -> (time of its last hook in this round, elements)
        for t, key, elements in sorted(finals):
            if start < t <= end:
                last[key] = (t, elements)
        finish, tail = float("-inf"), 0
        for t, elements in sorted(last.values(), reverse=True):
            tail += elements
            finish = max(finish, t + tail * seconds_per_element)
        carry = carry_seconds if index < len(round_ends) - 1 else 0.0
        bound += max(0.0, finish - end - carry)
        start = end
    return bound


# ---- the wire --------------------------------------------------------------------------------------------
def enter_wire(spec: str, dtype_name: str = "bfloat16", mode: str = "per-rank"):
    """wire.enter, with ``auto`` entering at PROBE_RATE (calibrate_wire picks the final rate inside)."""
    import wire

    return wire.enter(PROBE_RATE if spec == "auto" else spec, dtype_name, mode)


CALIBRATION_CHECKS = 3  # calibrate_wire: timings at the picked rate, each correcting it while >10% off the target


def calibrate_wire(link, transfer_seconds, target_seconds) -> dict:
    """``--wire auto``: the rate at which one transfer takes ``target_seconds`` (a number, or a function called
    with the wire unshaped). ``transfer_seconds()`` times the transfer at the link's current rate. Over tbf a
    transfer costs its CPU time plus bytes / rate, so its time unshaped and at the probe rate give the rate,
    which is set. That two-point model misses where the transfer's CPU work overlaps its wire time (at a fast probe
    rate it is CPU-bound: a 2026-11-28 calibration asked 251 ms and got 511), so the transfer is timed again at
    the rate picked and, while it is more than 10% off the target, the rate is corrected from that point (at most
    CALIBRATION_CHECKS times). Returns {"target", "unshaped", "probed", "probe_rate", "checks": [[rate, seconds]
    timed at each rate picked], "rate"} (seconds, bits/s)."""
    import wire

    probe = link.rate
    link.set_rate(None)
    target = target_seconds() if callable(target_seconds) else target_seconds
    unshaped = transfer_seconds()
    link.set_rate(probe)
    probed = transfer_seconds()
    rate = wire.rate_for_time(target, unshaped, probed, probe)
    link.set_rate(rate)
    checks = []
    for _ in range(CALIBRATION_CHECKS):
        seconds = transfer_seconds()
        checks.append([rate, seconds])
        if abs(seconds - target) <= 0.1 * target:
            break
        rate = wire.rate_for_time(target, unshaped, seconds, rate)
        link.set_rate(rate)
    return {"target": target, "unshaped": unshaped, "probed": probed, "probe_rate": probe, "checks": checks,
            "rate": rate}


def report_wire_traffic(link, figures: dict) -> None:
    """On a per-rank wire: print what each rank's link carried and keep it as figures["wire_traffic_bytes"]
    (rank -> {"up", "down"}): the traffic went through the ranks' own links, and how much of it."""
    if link.mode == "per-rank":
        print(link.traffic_text(), flush=True)
        figures["wire_traffic_bytes"] = {str(rank): counts for rank, counts in link.traffic().items()}


# ---- --json ----------------------------------------------------------------------------------------------
def add_json_argument(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object on stdout "
                        "(the tables go to stderr); bench/docs_tables.py renders docs tables from it")


def machine_facts() -> dict:
    """What a figure depends on besides the code: the machine and its load when the run ended. torch_threads:
    this process's, None where it never loaded torch (a simulated bench; one whose ranks did all the torch work,
    one thread each): importing torch only to ask would cost such a run seconds."""
    torch = sys.modules.get("torch")
    return {"cpu_count": os.cpu_count(), **cpu_model(), "load_average": list(os.getloadavg()),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__ if torch else importlib.metadata.version("torch"),
            "torch_threads": torch.get_num_threads() if torch else None}


# CPU features that change bf16 / fp32 compute speed by large factors (runs on machines with and without them
# differ 20x for the bf16 Megatron model; 2026-11-28)
CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model() -> dict:
    """{"cpu_model": the CPU's name, "cpu_flags": those of CPU_FLAGS_OF_NOTE it has} from /proc/cpuinfo; {} where
    it cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            text = info.read()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name"), "cpu_flags": [f for f in CPU_FLAGS_OF_NOTE if f in flags]}


def run_record(bench: str, figures: dict, argv=None) -> dict:
    """The JSON object a bench prints with --json."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return {"bench": bench, "command": [f"bench/{bench}.py", *argv],
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_facts(), "figures": figures}


@contextlib.contextmanager
def json_output(enabled: bool, bench: str, argv=None):
    """Yields the dict a bench fills with every figure it prints. With ``enabled`` (--json), what the block
    prints goes to stderr (file descriptor 1 too, so worker processes started in it print there) and, when it
    ends without an error, run_record(...) goes to stdout as one line."""
    figures: dict = {}
    if not enabled:
        yield figures
        return
    stdout = sys.stdout
    stdout.flush()
    saved_fd = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield figures
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
    stdout.write(json.dumps(run_record(bench, figures, argv)) + "\n")
    stdout.flush()
