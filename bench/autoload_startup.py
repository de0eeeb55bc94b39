"""What l3plugin-autoload.pth adds to every interpreter start (`python -c pass`) of this venv.

    .venv/bin/python bench/autoload_startup.py            # 40 + 15 rounds, two to three minutes
    .venv/bin/python bench/autoload_startup.py --rounds 100 --deepspeed-rounds 0

Contenders, interleaved (bench/harness.py: each round runs both, the order alternating; warm-up rounds first)
and summarised by the median over rounds of per-round ratios and differences: "no hook" puts a directory
holding an empty l3plugin_autoload.py first on PYTHONPATH, so the installed l3plugin-autoload.pth imports
that instead (everything else about start-up, sys.path and the .pth files read, is the same); "hook" is
- installed: the installed l3plugin_autoload, found as this venv finds it (an editable install through
  setuptools' finder, after every sys.path entry missed), bytecode as this environment leaves it;
- copy, compiled / copy, cached: a copy of it first on PYTHONPATH, with PYTHONDONTWRITEBYTECODE=1 and no
  cache (every start compiles it) / with its bytecode cached (as a regular install precompiles it).
Then what the hook adds to `import deepspeed` (it imports l3plugin.deepspeed and patches the engines):
`python -c "import deepspeed"` with and without L3PLUGIN_NO_AUTOLOAD=1, interleaved the same way: wall time,
the child's CPU time and its peak RSS (its own rusage, from wait4). Both with this bench's tree first on
PYTHONPATH, so the hook imports the l3plugin of the checkout the bench sits in (run a copy of it in a worktree
of an older commit, with the same venv, to measure that commit).
Prints tables; asserts nothing about the timings (only that its own set-up is right). --json: every figure as
JSON on stdout, the tables on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TREE = Path(__file__).resolve().parents[1]  # the checkout this bench sits in: its l3plugin is measured
sys.path.insert(0, str(TREE))

import harness  # noqa: E402
import wire  # noqa: E402


def start_once(env, code="pass") -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def start_measured(env, code) -> tuple:
    """(wall seconds, CPU seconds, peak RSS in MiB) of one `python -c code`, from the child's own rusage: CPU
    time (user + system) is what a loaded machine's wall time blurs; ru_maxrss is in KiB on Linux."""
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise subprocess.CalledProcessError(child.returncode, child.args)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def interleaved(rounds, a_env, b_env, code="pass", warmup=1, once=start_once):
    """Per-contender results of ``once`` (a, b): harness.interleaved_rounds of the two environments."""
    envs = {"a": a_env, "b": b_env}
    times = harness.interleaved_rounds(envs, lambda name: once(envs[name], code), rounds, warmup)
    return times["a"], times["b"]


def row(label, a, b, unit=1e3, suffix="_s", digits=(1, 2)):
    """Print a row; return its figures (seconds, or MiB with unit=1 and suffix="_mib")."""
    figures = {"label": label, f"without{suffix}": statistics.median(b), f"with{suffix}": statistics.median(a),
               "ratio": harness.ratio_stats(a, b), f"added{suffix}": statistics.median(x - y for x, y in zip(a, b))}
    print(f"{label:<22} {figures[f'without{suffix}'] * unit:>10.{digits[0]}f} "
          f"{figures[f'with{suffix}'] * unit:>8.{digits[0]}f} {harness.ratio_text(figures['ratio']):>21} "
          f"{figures[f'added{suffix}'] * unit:>9.{digits[1]}f}")
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--deepspeed-rounds", type=int, default=15, help="0 skips the import deepspeed table")
    wire.add_argument(parser)
    harness.add_json_argument(parser)
    args = parser.parse_args(argv)
    link = wire.enter(args.wire, mode=args.wire_mode)
    with harness.json_output(args.json, "autoload_startup", argv) as figures:
        tables(args, link, figures)
    return 0


def tables(args, link, figures):
    """Both tables; figures: what they print."""
    print(f"{link.describe()}\n  (this bench starts interpreters and sends nothing: the wire changes nothing here; "
          "collectives alone: none)")
    import l3plugin_autoload

    with tempfile.TemporaryDirectory() as tmp:
        hook_dir, empty_dir, nothing_dir = Path(tmp, "hook"), Path(tmp, "empty"), Path(tmp, "nothing")
        nothing_dir.mkdir()
        for d, text in ((hook_dir, Path(l3plugin_autoload.__file__).read_text()), (empty_dir, "")):
            d.mkdir()
            (d / "l3plugin_autoload.py").write_text(text)
        base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "L3PLUGIN_NO_AUTOLOAD")}
        cached = os.path.exists(importlib.util.cache_from_source(l3plugin_autoload.__file__))
        figures.update(installed_hook=l3plugin_autoload.__file__, bytecode_cached=cached, rounds=args.rounds,
                       startup=[], deepspeed_rounds=args.deepspeed_rounds)
        print(f"python {sys.version.split()[0]}, installed hook {l3plugin_autoload.__file__} (bytecode cached: "
              f"{cached}, PYTHONDONTWRITEBYTECODE={base.get('PYTHONDONTWRITEBYTECODE', '')!r}), {args.rounds} rounds")
        print(f"{'hook':<22} {'no hook ms':>10} {'hook ms':>8} {'hook/no hook (range)':>21} {'added ms':>9}")
        no_cache = {**base, "PYTHONDONTWRITEBYTECODE": "1"}
        with_cache = {k: v for k, v in base.items() if k != "PYTHONDONTWRITEBYTECODE"}
        for label, env, hook_path in (("installed", base, nothing_dir), ("copy, compiled", no_cache, hook_dir),
                                      ("copy, cached", with_cache, hook_dir)):
            hook_env, plain_env = {**env, "PYTHONPATH": str(hook_path)}, {**env, "PYTHONPATH": str(empty_dir)}
            # Three warm-up rounds (for "cached" they write __pycache__ in the two temp dirs).
            times = interleaved(args.rounds, hook_env, plain_env, warmup=3)
            if hook_path == hook_dir:
                assert bool(list(hook_dir.glob("__pycache__/*.pyc"))) == (env is with_cache), label
            figures["startup"].append(row(label, *times))
        if args.deepspeed_rounds:
            tree = {**base, "PYTHONPATH": str(TREE)}
            on, off = interleaved(args.deepspeed_rounds, tree, {**tree, "L3PLUGIN_NO_AUTOLOAD": "1"},
                                  "import deepspeed", once=start_measured)
            figures["tree"] = str(TREE)
            print(f"\nimport deepspeed, {args.deepspeed_rounds} rounds, l3plugin from {TREE}, load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after the runs")
            print(f"{'':<22} {'off':>10} {'on':>8} {'on/off (range)':>21} {'added':>9}")
            figures["import_deepspeed"] = row("wall ms", [r[0] for r in on], [r[0] for r in off])
            figures["import_deepspeed_cpu"] = row("CPU ms", [r[1] for r in on], [r[1] for r in off])
            figures["import_deepspeed_peak_rss"] = row("peak RSS MiB", [r[2] for r in on], [r[2] for r in off],
                                                       unit=1, suffix="_mib", digits=(0, 1))
            figures["load_average"] = os.getloadavg()


if __name__ == "__main__":
    sys.exit(main())
