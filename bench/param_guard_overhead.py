"""What the parameter-gather guard (l3plugin/zero/param_gather.py) costs per torch function while gathers pend.

    .venv/bin/python bench/param_guard_overhead.py [--rounds 7] [--calls 20000] [--size 64]

One process, no distributed group: the guard is put on the torch-function mode stack with one pending parameter
that the timed calls never touch (the common case: most calls of a forward use other tensors or parameters
already completed), and F.linear on [size, size] tensors is timed with and without it, interleaved (A, B, A, B).
Prints microseconds per call, the median of the per-round differences and ratios. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from l3plugin.zero.param_gather import GUARD  # noqa: E402


class _Owner:
    """Stands in for the optimizer: never asked, since the timed calls do not touch the pending parameter."""

    def wait_param_gather(self, params):
        raise AssertionError("the timed calls touched the pending parameter")


def per_call_us(x, w, calls):
    start = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, w = torch.ones(args.size, args.size), torch.ones(args.size, args.size)
    pending, owner = torch.nn.Parameter(torch.ones(4)), _Owner()
    per_call_us(x, w, args.calls)  # warm-up
    plain, guarded = [], []
    for _ in range(args.rounds):
        plain.append(per_call_us(x, w, args.calls))
        if not GUARD.hold(owner, [pending]):
            sys.exit("another torch-function mode is on the stack: nothing to measure")
        guarded.append(per_call_us(x, w, args.calls))
        GUARD.release([pending])
    added = statistics.median(g - p for g, p in zip(guarded, plain))
    ratio = statistics.median(g / p for g, p in zip(guarded, plain))
    print(f"F.linear [{args.size}, {args.size}] x {args.calls} calls, {args.rounds} interleaved rounds, torch "
          f"{torch.__version__}, 1 thread: {statistics.median(plain):.1f} us per call plain, "
          f"{statistics.median(guarded):.1f} us with the guard pending; added {added:.1f} us per call "
          f"(median of per-round differences, range {min(g - p for g, p in zip(guarded, plain)):.1f}-"
          f"{max(g - p for g, p in zip(guarded, plain)):.1f}), ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
