"""An emulated network wire for benchmarks: traffic that costs wall time, not CPU time.

On one machine gloo talks over loopback TCP, where sending is CPU work (copies through the kernel): nothing can
hide behind compute, it only steals a core. Inside a private network namespace whose loopback is rate-limited
with tc's token bucket filter (``tbf``), each byte also waits for the wire, while the CPU is free, as NCCL
traffic leaves the GPU's compute free. ``netem`` (added delay) is not in every kernel; the rate is the knob.
Both directions of a 2-rank exchange share the one loopback queue, so the rate is the total of both.

A bench adds ``--wire RATE|PRESET|off`` and calls ``enter`` first thing in ``main``:

    parser = argparse.ArgumentParser(); wire.add_argument(parser); args = parser.parse_args()
    link = wire.enter(args.wire)     # re-executes this script inside a shaped namespace (needs root, ip, tc)
    print(link.describe())           # the rate, and for a preset how it was derived
    link.set_rate(None)              # inside the namespace only: switch shaping off (or to another rate)
                                     # between contenders, to compare with and without the wire in one run

``enter`` returns at once when ``--wire off`` (plain loopback, as before) or when already inside; otherwise it
runs ``sys.executable sys.argv`` inside a new namespace and exits with its status, or exits with a message
saying why it cannot (not root, no ``ip`` / ``tc``, tc refused the qdisc). Processes inside must connect to
127.0.0.1 (the namespace has nothing else): ``RankPool`` does.

Presets keep the ratio of compute to communication of a real GPU: the rate is chosen so that this CPU's
measured matmul throughput / wire bandwidth = the GPU's dense BF16 throughput / its bandwidth.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

ENV_RATE = "L3PLUGIN_WIRE_RATE"  # bits/s inside the namespace ("0": unshaped); set by enter()
ENV_NOTE = "L3PLUGIN_WIRE_NOTE"  # how the rate was chosen, for describe()
BURST_BYTES = 256 * 1024  # tbf bucket: short control messages pass at once, bulk traffic at the rate
QUEUE_LATENCY = "50ms"  # tbf queue limit, in time at the rate (TCP backs off beyond it)

# name: (GPU dense BF16 FLOP/s, bytes/s per GPU, what the bandwidth is). H100 SXM: 989 TFLOP/s dense BF16;
# 400 Gb/s InfiniBand per GPU between nodes (DP, PP traffic in the paper); NVLink 450 GB/s each way inside a
# node (TP, CP traffic).
PRESETS = {
    "h100": (989e12, 50e9, "H100 SXM dense BF16 989 TFLOP/s over 400 Gb/s (50 GB/s) InfiniBand per GPU"),
    "h100-nvlink": (989e12, 450e9, "H100 SXM dense BF16 989 TFLOP/s over NVLink 450 GB/s per GPU"),
}
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}  # tc's units: "bps" are bytes per second


class WireError(RuntimeError):
    """The wire cannot be set up here; the message says why and what to do."""


def parse_rate(text: str) -> int | None:
    """Bits per second of a tc-style rate ("4gbit", "500mbit", "62.5mbps"); None for "off"."""
    spec = str(text).strip().lower()
    if spec == "off":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-z]+)", spec)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"--wire {text!r}: expected off, a preset ({', '.join(PRESETS)}) or a rate with a tc unit "
                         f"({', '.join(_UNITS)}), e.g. 4gbit")
    bits = float(match.group(1)) * _UNITS[match.group(2)]
    if not 1e3 <= bits <= 1e12:
        raise ValueError(f"--wire {text!r}: {bits:.3g} bit/s is outside 1kbit..1tbit")
    return int(bits)


def rate_text(bits: int | None) -> str:
    if bits is None:
        return "off"
    per_second = f"{bits / 8e6:,.1f} MB/s" if bits >= 8e6 else f"{bits / 8e3:,.1f} kB/s"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit} ({per_second})"
    return f"{bits}bit ({per_second})"


def matmul_flops(dtype_name: str = "bfloat16", n: int = 1024, repeats: int = 5) -> float:
    """Measured FLOP/s of one thread multiplying n x n matrices in ``dtype_name`` (median of ``repeats``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dtype = getattr(torch, dtype_name)
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def preset_rate(name: str, dtype_name: str) -> tuple[int, str]:
    """(bits/s, explanation) of a preset for this CPU: matmul FLOP/s / rate = the GPU's FLOP/s / bandwidth."""
    gpu_flops, gpu_bytes, what = PRESETS[name]
    cpu = matmul_flops(dtype_name)
    bits = int(8 * cpu * gpu_bytes / gpu_flops)
    return bits, (f"preset {name}: {what}, i.e. {gpu_flops / gpu_bytes:,.0f} FLOP per byte; this CPU's measured "
                  f"{dtype_name} matmul (1 thread, 1024^3) does {cpu / 1e9:.1f} GFLOP/s -> {rate_text(bits)}")


def add_argument(parser, default: str = "off") -> None:
    parser.add_argument("--wire", default=default, metavar="RATE|PRESET|off",
                        help="run on an emulated wire: a tc rate (e.g. 4gbit, 500mbit), a preset "
                             f"({', '.join(PRESETS)}: this CPU's compute/bandwidth ratio set to that GPU's), or off "
                             "(plain loopback, where communication is CPU work). Needs root, ip and tc. Default: "
                             f"{default}")


class Wire:
    """The wire this process runs on. ``rate``: bits/s, None when unshaped."""

    def __init__(self, rate: int | None, inside: bool, note: str = ""):
        self.rate, self.inside, self.note = rate, inside, note

    def describe(self) -> str:
        if not self.inside:
            return ("wire: off (plain loopback: gloo traffic is CPU work, so overlap can only take a core from "
                    "compute)")
        shaped = (f"{rate_text(self.rate)}, tbf on the loopback of a private network namespace, shared by both "
                  "directions" if self.rate else "unshaped loopback inside the namespace")
        return f"wire: {shaped}" + (f"\n  {self.note}" if self.note else "")

    def set_rate(self, rate: int | None) -> None:
        """Shape the namespace's loopback at ``rate`` bits/s (None: no shaping). Inside the namespace only."""
        if not self.inside:
            raise WireError("set_rate needs the namespace: start the bench with --wire RATE")
        if rate == self.rate:
            return
        if rate is None:
            _run(["tc", "qdisc", "del", "dev", "lo", "root"])
        else:
            _run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate}bit",
                  "burst", str(BURST_BYTES), "latency", QUEUE_LATENCY])
        self.rate = rate


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise WireError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")


def why_not_here() -> str | None:
    """Why a namespace cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating a network namespace needs root (ip netns add); run the bench as root, or use --wire off"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"{' and '.join(missing)} not found on PATH (Debian/Ubuntu: apt-get install iproute2); "
                "or use --wire off")
    return None


def enter(spec: str, dtype_name: str = "bfloat16") -> Wire:
    """Return the wire this process runs on, re-executing the script inside a shaped namespace if needed.

    ``dtype_name``: the dtype the bench computes in, for a preset's matmul measurement."""
    if ENV_RATE in os.environ:  # already inside
        bits = int(os.environ[ENV_RATE])
        return Wire(bits or None, inside=True, note=os.environ.get(ENV_NOTE, ""))
    name = str(spec).strip().lower()
    if name in PRESETS:
        bits, note = preset_rate(name, dtype_name)
    else:
        try:
            bits, note = parse_rate(spec), ""
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if bits is None:
        return Wire(None, inside=False)
    reason = why_not_here()
    if reason:
        raise SystemExit(f"--wire {spec}: cannot emulate a wire here: {reason}")
    sys.exit(run_inside(bits, [sys.executable, *sys.argv], note))


NAMESPACE_PREFIX = "l3wire"


def remove_stale_namespaces() -> None:
    """Delete namespaces this module made for processes that are gone (a bench killed with SIGKILL)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in listing:
        pid = name[len(NAMESPACE_PREFIX):]
        if name.startswith(NAMESPACE_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_inside(bits: int, command: list[str], note: str = "") -> int:
    """Run ``command`` in a new network namespace whose loopback is shaped at ``bits``/s; its exit status.
    SIGTERM / SIGHUP end the command and still remove the namespace."""
    import signal

    remove_stale_namespaces()
    namespace = f"{NAMESPACE_PREFIX}{os.getpid()}"
    _run(["ip", "netns", "add", namespace])

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    child = None
    try:
        inside = ["ip", "netns", "exec", namespace]
        _run(inside + ["ip", "link", "set", "lo", "up"])
        _run(inside + ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{bits}bit",
                       "burst", str(BURST_BYTES), "latency", QUEUE_LATENCY])
        env = dict(os.environ, **{ENV_RATE: str(bits), ENV_NOTE: note,
                                  "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"})
        child = subprocess.Popen(inside + command, env=env)
        return child.wait()
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def rate_for_time(target: float, unshaped: float, probed: float, probe_rate: int) -> int:
    """The rate (bits/s) at which a transfer takes ``target`` seconds, from its time unshaped and at
    ``probe_rate``: over tbf a transfer costs its CPU time plus bytes / rate, so the two give both terms.
    Clamped to 10 Mbit/s..100 Gbit/s; measure again at the result (TCP adds its own overhead)."""
    rate = int(probe_rate * max(probed - unshaped, 1e-4) / max(target - unshaped, 1e-4))
    return min(max(rate, 10**7), 10**11)


# -- measured inside a RankPool worker ------------------------------------------------------------------
def time_collectives_alone(numel: int, repeats: int = 3, ops: dict | None = None) -> dict:
    """Wall and CPU seconds of an fp32 all-reduce and of a point-to-point exchange (each rank sends ``numel``
    fp32 elements to the next and receives as many), with no compute beside them; medians. Run on every rank
    of a RankPool: the bench prints these next to its results, so wire time can be told from CPU time.
    ``ops``: name -> function, timed instead of those two (a bench's own collectives, e.g. CP's K/V
    all-gather; each should send about ``numel`` fp32 elements per rank, as collectives_alone_text says)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    data, received = torch.ones(numel), torch.empty(numel)

    def exchange():
        works = [dist.isend(data, (rank + 1) % world), dist.irecv(received, (rank - 1) % world)]
        for work in works:
            work.wait()

    out = {}
    for name, fn in (ops or {"all-reduce": lambda: dist.all_reduce(data), "exchange": exchange}).items():
        walls, cpus = [], []
        for _ in range(repeats + 1):
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
        out[name] = (sorted(walls[1:])[repeats // 2], sorted(cpus[1:])[repeats // 2])
    return out


def collectives_alone_text(results: list[dict], numel: int) -> str:
    """One line per collective from ``time_collectives_alone``'s per-rank results (slower rank)."""
    mb = numel * 4 / 1e6
    lines = []
    for name in results[0]:
        wall = max(r[name][0] for r in results)
        cpu = max(r[name][1] for r in results)
        lines.append(f"  alone on this wire: {name} of {mb:.1f} MB fp32 per rank: {1000 * wall:.0f} ms wall, "
                     f"{1000 * cpu:.0f} ms CPU ({mb / wall:.0f} MB/s per rank)")
    return "\n".join(lines)
