"""An emulated network wire for benchmarks: traffic that costs wall time, not CPU time.

On one machine gloo talks over loopback TCP, where sending is CPU work (copies through the kernel): nothing can
hide behind compute, it only steals a core. Over links rate-limited with tc's token bucket filter (``tbf``),
each byte also waits for the wire while the CPU is free, as NCCL traffic leaves the GPU's compute free.
``netem`` (added delay) is not in every kernel; the rate is the knob. Two modes (``--wire-mode``):

- ``per-rank`` (the default): a NIC per GPU. Every RankPool worker rank r runs in a network namespace of its
  own, ``l3wire<pid>r<r>``, whose interface ``eth0`` (address 10.213.0.<r+1>, private to these namespaces) is
  one end of a veth pair; the other end is a port of a bridge in a switch namespace ``l3wire<pid>sw``. tbf
  shapes both ends: the rank's uplink (eth0's egress) and its downlink (the switch port's egress), so each rank
  sends at RATE and receives at RATE at once (full duplex, a non-blocking fabric). The bench process itself
  stays where it is; ``link.pool_options(n)`` makes the namespaces of n ranks and returns RankPool's
  ``worker_init`` (setns(2) into namespace r, GLOO_SOCKET_IFNAME=eth0) and ``master_addr`` (rank 0's address).
- ``shared``: the old bus. The bench re-executes itself inside one namespace ``l3wire<pid>`` whose loopback is
  shaped: every rank's traffic, both directions, queues in one bucket, so RATE is the total of all of them
  (a 2-rank exchange runs at half the per-rank mode's speed). Processes inside connect to 127.0.0.1.

A bench adds ``--wire RATE|PRESET|off`` and ``--wire-mode per-rank|shared`` and calls ``enter`` first thing:

    parser = argparse.ArgumentParser(); wire.add_argument(parser); args = parser.parse_args()
    link = wire.enter(args.wire, mode=args.wire_mode)   # needs root, ip, tc (shared: re-executes the script)
    with RankPool(2, **link.pool_options(2)) as pool:   # per-rank: every worker in its own namespace
        print(link.describe())       # the rate and mode, and for a preset how the rate was derived
        link.set_rate(None)          # switch shaping off (or to another rate) between contenders, to compare
                                     # with and without the wire in one run
        print(link.traffic_text())   # per-rank: the bytes each rank's uplink and downlink carried

``enter`` returns at once when ``--wire off`` (plain loopback, as before), or exits with a message saying why
it cannot (not root, no ``ip`` / ``tc``); an ``ip`` / ``tc`` command that fails raises WireError with its
command and error. Namespaces go on every exit: at the end of the bench (also after an exception), on
SIGTERM / SIGHUP / Ctrl-C; those of a bench killed with SIGKILL are removed by the next one
(``remove_stale_namespaces``).

Presets keep the ratio of compute to communication of a real GPU: the rate is chosen so that this CPU's
measured matmul throughput / wire bandwidth = the GPU's dense BF16 throughput / its bandwidth per GPU (in
per-rank mode each rank's link runs at that rate each way, as a GPU's NIC does).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

ENV_RATE = "L3PLUGIN_WIRE_RATE"  # bits/s inside the shared namespace ("0": unshaped); set by enter()
ENV_NOTE = "L3PLUGIN_WIRE_NOTE"  # how the rate was chosen, for describe()
BURST_BYTES = 256 * 1024  # tbf bucket: short control messages pass at once, bulk traffic at the rate
QUEUE_LATENCY = "50ms"  # tbf queue limit, in time at the rate (TCP backs off beyond it)
MODES = ("per-rank", "shared")
NAMESPACE_PREFIX = "l3wire"  # + the owner's pid (per-rank mode: + "sw" / "r<rank>"; "w<n>" first for a 2nd wire)
RANK_INTERFACE = "eth0"  # a rank's end of its link, inside its namespace
SUBNET = "10.213.0"  # rank r is SUBNET.<r+1>/24, only inside the namespaces (nothing routes out)
NETNS_DIR = "/var/run/netns"  # where `ip netns add` leaves the namespaces' handles
CLONE_NEWNET = 0x40000000
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
    parser.add_argument("--wire-mode", choices=MODES, default=MODES[0],
                        help="per-rank: every rank its own full-duplex link at RATE each way (a NIC per GPU); "
                             "shared: one loopback bus at RATE for all ranks and both directions (the old wire). "
                             f"Default: {MODES[0]}")


class Wire:
    """The wire this process runs on. ``rate``: bits/s, None when unshaped; ``mode``: "off" (plain loopback),
    "shared" (this process is inside the shaped namespace) or "per-rank" (RankPool workers get links through
    ``pool_options``)."""

    def __init__(self, rate: int | None, mode: str, note: str = ""):
        if mode not in ("off", *MODES):
            raise ValueError(f"Wire mode {mode!r}: expected off or one of {MODES}")
        self.rate, self.mode, self.note = rate, mode, note
        self.links = RankLinks(rate) if mode == "per-rank" else None

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        if self.mode == "off":
            return ("wire: off (plain loopback: gloo traffic is CPU work, so overlap can only take a core from "
                    "compute)")
        if self.mode == "shared":
            shaped = (f"{rate_text(self.rate)} shared by every rank and both directions (mode shared: tbf on the "
                      "loopback of one private network namespace)" if self.rate
                      else "unshaped loopback inside the namespace (mode shared)")
        else:
            shaped = (f"{rate_text(self.rate)} each way per rank (mode per-rank: every rank in its own network "
                      "namespace, a veth link to a bridge, tbf on its uplink and its downlink)" if self.rate
                      else "unshaped per-rank links (mode per-rank)")
        return f"wire: {shaped}" + (f"\n  {self.note}" if self.note else "")

    def set_rate(self, rate: int | None) -> None:
        """Shape the wire at ``rate`` bits/s (None: no shaping): the shared loopback, or every rank's link."""
        if self.mode == "off":
            raise WireError("set_rate needs a wire: start the bench with --wire RATE")
        if rate == self.rate:
            return
        if self.links is not None:
            self.links.set_rate(rate)
        else:
            _shape(None, "lo", rate, was_shaped=self.rate is not None)
        self.rate = rate

    def pool_options(self, world_size: int) -> dict:
        """RankPool's keyword arguments for ``world_size`` ranks on this wire: in per-rank mode the namespaces
        are made (if not yet) and each worker enters its own; otherwise none (loopback, shaped or not)."""
        if self.links is None:
            return {}
        self.links.add_ranks(world_size)
        return {"worker_init": functools.partial(enter_rank_namespace, tuple(self.links.namespaces)),
                "master_addr": rank_address(0)}

    def traffic(self) -> dict:
        """Per-rank mode: {rank: {"up": bytes, "down": bytes}} each rank's link carried so far; else {}."""
        return self.links.traffic() if self.links is not None else {}

    def traffic_text(self) -> str:
        """One line: what each rank's uplink / downlink carried (per-rank mode), or what the mode is."""
        if self.links is None:
            return f"wire traffic: not counted per rank (mode {self.mode})"
        counts = self.traffic()
        return "wire traffic, MB up / down per rank link: " + ", ".join(
            f"rank {r} {c['up'] / 1e6:.1f} / {c['down'] / 1e6:.1f}" for r, c in sorted(counts.items()))

    def close(self) -> None:
        """Per-rank mode: delete the namespaces (their links go with them)."""
        if self.links is not None:
            self.links.close()


def rank_address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def enter_rank_namespace(namespaces, rank: int, world_size: int) -> None:
    """RankPool's worker_init in per-rank mode: move this worker into rank ``rank``'s namespace (setns(2);
    threads started later, gloo's among them, are born there) and have gloo use the rank's link."""
    import ctypes

    if rank >= len(namespaces):
        raise WireError(f"rank {rank} of {world_size} has no link: the wire made {len(namespaces)}; call "
                        f"link.pool_options({world_size}) for the pool")
    libc = ctypes.CDLL(None, use_errno=True)
    with open(os.path.join(NETNS_DIR, namespaces[rank])) as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            raise WireError(f"setns into {namespaces[rank]} failed: {os.strerror(ctypes.get_errno())}")
    os.environ["GLOO_SOCKET_IFNAME"] = RANK_INTERFACE


_LINKS_MADE = itertools.count()


class RankLinks:
    """The per-rank namespaces of this process: a switch with a bridge, and per rank a namespace linked to it
    by a veth pair, tbf on both ends. Made on demand (``add_ranks``), deleted by ``close``."""

    def __init__(self, rate: int | None):
        self.rate = rate
        serial = next(_LINKS_MADE)  # a second wire in one process (tests) gets names of its own
        self.owner = f"{NAMESPACE_PREFIX}{os.getpid()}" + (f"w{serial}" if serial else "")
        self.switch = f"{self.owner}sw"
        self.namespaces: list[str] = []

    def add_ranks(self, world_size: int) -> None:
        """Make the namespaces of ranks 0..world_size-1 that do not exist yet."""
        if not 1 <= world_size <= 250:
            raise WireError(f"per-rank wire: world_size={world_size}: needs 1..250 (one /24 of addresses)")
        if not self.namespaces:
            remove_stale_namespaces()
            _run(["ip", "netns", "add", self.switch])
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for rank in range(len(self.namespaces), world_size):
            name, port = f"{self.owner}r{rank}", f"r{rank}"
            _run(["ip", "netns", "add", name])
            self.namespaces.append(name)
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
            _run(["ip", "-n", name, "link", "add", RANK_INTERFACE, "type", "veth", "peer", "name", port,
                  "netns", self.switch])
            _run(["ip", "-n", name, "addr", "add", f"{rank_address(rank)}/24", "dev", RANK_INTERFACE])
            _run(["ip", "-n", name, "link", "set", RANK_INTERFACE, "up"])
            _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            _shape(name, RANK_INTERFACE, self.rate, was_shaped=False)  # the rank's uplink
            _shape(self.switch, port, self.rate, was_shaped=False)  # its downlink

    def set_rate(self, rate: int | None) -> None:
        for rank, name in enumerate(self.namespaces):
            _shape(name, RANK_INTERFACE, rate, was_shaped=self.rate is not None)
            _shape(self.switch, f"r{rank}", rate, was_shaped=self.rate is not None)
        self.rate = rate

    def traffic(self) -> dict:
        """{rank: {"up": bytes, "down": bytes}}: what left the rank's end of its link and the switch's end
        (interface counters: cumulative, shaped or not; each end's tbf sits on that egress)."""
        return {rank: {"up": _sent_bytes(name, RANK_INTERFACE), "down": _sent_bytes(self.switch, f"r{rank}")}
                for rank, name in enumerate(self.namespaces)}

    def close(self) -> None:
        for name in [*self.namespaces, self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.namespaces = []


def _shape(namespace: str | None, device: str, rate: int | None, was_shaped: bool) -> None:
    """tbf at ``rate`` on ``device``'s egress in ``namespace`` (None: this process's); ``rate`` None removes the
    tbf, if ``was_shaped``."""
    where = ["-n", namespace] if namespace else []
    if rate is not None:
        _run(["tc", *where, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate}bit",
              "burst", str(BURST_BYTES), "latency", QUEUE_LATENCY])
    elif was_shaped:
        _run(["tc", *where, "qdisc", "del", "dev", device, "root"])


def _sent_bytes(namespace: str, device: str) -> int:
    shown = subprocess.run(["ip", "-n", namespace, "-j", "-s", "link", "show", "dev", device],
                           capture_output=True, text=True)
    return sum(link["stats64"]["tx"]["bytes"] for link in json.loads(shown.stdout or "[]"))


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


def enter(spec: str, dtype_name: str = "bfloat16", mode: str = MODES[0]) -> Wire:
    """Return the wire this process runs on. Shared mode re-executes the script inside a shaped namespace (and
    exits with its status); per-rank mode stays here and deletes its namespaces when this process ends.

    ``dtype_name``: the dtype the bench computes in, for a preset's matmul measurement."""
    if ENV_RATE in os.environ:  # already inside the shared namespace
        bits = int(os.environ[ENV_RATE])
        return Wire(bits or None, "shared", note=os.environ.get(ENV_NOTE, ""))
    if mode not in MODES:
        raise SystemExit(f"--wire-mode {mode!r}: expected one of {', '.join(MODES)}")
    name = str(spec).strip().lower()
    if name in PRESETS:
        bits, note = preset_rate(name, dtype_name)
    else:
        try:
            bits, note = parse_rate(spec), ""
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if bits is None:
        return Wire(None, "off")
    reason = why_not_here()
    if reason:
        raise SystemExit(f"--wire {spec}: cannot emulate a wire here: {reason}")
    if mode == "shared":
        sys.exit(run_inside(bits, [sys.executable, *sys.argv], note))
    link = Wire(bits, "per-rank", note)
    atexit.register(link.close)  # after an exception too; signals become SystemExit below, so they reach it
    _exit_on_signals()
    return link


def _exit_on_signals() -> None:
    """SIGTERM / SIGHUP raise SystemExit, so finally blocks and atexit (which delete namespaces) still run."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def namespaces() -> dict:
    """{name: owner pid} of the wire namespaces that exist now (this module's, made by any process)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    owners = {name: re.fullmatch(NAMESPACE_PREFIX + r"(\d+)(w\d+)?(sw|r\d+)?", name) for name in listing}
    return {name: int(owner.group(1)) for name, owner in owners.items() if owner}


def remove_stale_namespaces() -> None:
    """Delete namespaces this module made for processes that are gone (a bench killed with SIGKILL)."""
    for name, owner in namespaces().items():
        if not os.path.exists(f"/proc/{owner}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def run_inside(bits: int, command: list[str], note: str = "") -> int:
    """Shared mode: run ``command`` in a new network namespace whose loopback is shaped at ``bits``/s; its exit
    status. SIGTERM / SIGHUP end the command and still remove the namespace."""
    remove_stale_namespaces()
    namespace = f"{NAMESPACE_PREFIX}{os.getpid()}"
    _run(["ip", "netns", "add", namespace])
    _exit_on_signals()
    child = None
    try:
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        _shape(namespace, "lo", bits, was_shaped=False)
        env = dict(os.environ, **{ENV_RATE: str(bits), ENV_NOTE: note,
                                  "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"})
        child = subprocess.Popen(["ip", "netns", "exec", namespace, *command], env=env)
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

    def exchange():  # receive posted first: gloo moves a send's bytes only once its receive is posted
        works = [dist.irecv(received, (rank - 1) % world), dist.isend(data, (rank + 1) % world)]
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
