"""What process groups left behind in a reused worker cost (why RankPool replaces a pool whose calls left more
than l3plugin.ranks.worker.GROUPS_LEFT_LIMIT groups): 2 gloo ranks keep 0, 100, 200 extra groups (as a framework cache or a test
would); for each count, the workers' CPU seconds over an idle pause (their threads poll) and the CPU and wall
seconds of a fixed all-reduce loop on the world group.

    .venv/bin/python bench/idle_groups.py [--groups 0 100 200] [--idle 5] [--reduces 2000] [--json]

One pool, counts in increasing order (groups cannot be taken back without restarting): a trend, not a ratio
of interleaved contenders. CPU seconds come from /proc/<pid>/stat (utime + stime) for the idle pause and from
time.process_time() in the ranks for the loop.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness  # noqa: E402

from l3plugin.ranks.pool import RankPool  # noqa: E402


def keep_groups(count):
    """Make ``count`` process groups of every rank and keep them; this worker's thread count."""
    import torch.distributed as dist

    kept = globals().setdefault("_KEPT", [])
    kept.extend(dist.new_group(list(range(dist.get_world_size()))) for _ in range(count))
    return len(kept), len(os.listdir("/proc/self/task"))


def reduce_loop(reduces):
    """CPU and wall seconds of ``reduces`` all-reduces of 1000 floats on the world group."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1000)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(reduces):
        dist.all_reduce(tensor)
    return time.process_time() - cpu, time.perf_counter() - wall


def cpu_seconds(pid) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[0, 100, 200], help="extra groups kept (increasing)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of idle pause per count")
    parser.add_argument("--reduces", type=int, default=2000, help="all-reduces in the timed loop")
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    if sorted(args.groups) != args.groups or args.groups[0] < 0:
        parser.error(f"--groups {args.groups}: must be >= 0 and increasing (groups are only added)")
    with harness.json_output(args.json, "idle_groups", argv) as figures, RankPool(2, keep_state=True) as pool:
        rows, kept = [], 0
        print("extra groups | threads per worker | idle CPU s/s per worker | all-reduce loop CPU s | wall s")
        for count in args.groups:
            threads = [t for _, t in pool.run(keep_groups, count - kept)]
            kept = count
            before = [cpu_seconds(pid) for pid in pool.pids]
            time.sleep(args.idle)
            idle = [(cpu_seconds(pid) - b) / args.idle for pid, b in zip(pool.pids, before)]
            loop = pool.run(reduce_loop, args.reduces)
            row = {"groups": count, "threads": threads, "idle_cpu_per_s": idle,
                   "loop_cpu_s": [c for c, _ in loop], "loop_wall_s": max(w for _, w in loop)}
            rows.append(row)
            print(f"{count:12d} | {max(threads):18d} | {max(idle):23.3f} | {max(row['loop_cpu_s']):21.2f} "
                  f"| {row['loop_wall_s']:.2f}", flush=True)
        figures["rows"] = rows
        figures["reduces"] = args.reduces
    return 0


if __name__ == "__main__":
    sys.exit(main())
