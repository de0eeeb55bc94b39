"""What l3plugin-autoload.pth adds to every interpreter start (`python -c pass`) of this venv.

    .venv/bin/python bench/autoload_startup.py            # 40 rounds, a few seconds
    .venv/bin/python bench/autoload_startup.py --rounds 100

Contenders, interleaved (each round runs both, the order alternating) and summarised by the median over
rounds of per-round ratios and differences:
- hook: the installed l3plugin-autoload.pth imports a copy of l3plugin_autoload.py put first on PYTHONPATH
  (it puts a finder on sys.meta_path);
- no hook: the same, with an empty l3plugin_autoload.py instead, so everything else about start-up
  (sys.path, the .pth files read) is the same.
Twice: with no bytecode cache for either module (PYTHONDONTWRITEBYTECODE=1: every start compiles it, as
an editable install does on this machine), then with it cached (a regular install precompiles).
Prints a table; asserts nothing about the timings (only that its own set-up is right).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start_once(env) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    import l3plugin_autoload

    with tempfile.TemporaryDirectory() as tmp:
        hook_dir, empty_dir = Path(tmp, "hook"), Path(tmp, "empty")
        for d, text in ((hook_dir, Path(l3plugin_autoload.__file__).read_text()), (empty_dir, "")):
            d.mkdir()
            (d / "l3plugin_autoload.py").write_text(text)
        base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "L3PLUGIN_NO_AUTOLOAD")}
        print(f"python {sys.version.split()[0]}, hook module {l3plugin_autoload.__file__}, {args.rounds} rounds")
        print(f"{'bytecode':<22} {'no hook ms':>10} {'hook ms':>8} {'hook/no hook':>13} {'added ms':>9}")
        for cached in (False, True):
            env = dict(base)
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            if not cached:
                env["PYTHONDONTWRITEBYTECODE"] = "1"
            hook_env, plain_env = {**env, "PYTHONPATH": str(hook_dir)}, {**env, "PYTHONPATH": str(empty_dir)}
            for _ in range(3):  # warm-up (and, when cached, writes __pycache__ in the two temp dirs)
                start_once(hook_env), start_once(plain_env)
            label = "cached" if cached else "not cached (compiled)"
            assert list(hook_dir.glob("__pycache__/*.pyc")) if cached else not list(hook_dir.glob("__pycache__"))
            hook, plain = [], []
            for r in range(args.rounds):
                pair = [(hook, hook_env), (plain, plain_env)]
                for times, e in pair if r % 2 else pair[::-1]:
                    times.append(start_once(e))
            ratio = statistics.median(h / p for h, p in zip(hook, plain))
            added = statistics.median(h - p for h, p in zip(hook, plain))
            print(f"{label:<22} {statistics.median(plain) * 1e3:>10.1f} {statistics.median(hook) * 1e3:>8.1f} "
                  f"{ratio:>13.3f} {added * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
