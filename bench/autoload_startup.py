"""What l3plugin-autoload.pth adds to every interpreter start (`python -c pass`) of this venv.

    .venv/bin/python bench/autoload_startup.py            # 40 + 5 rounds, about a minute
    .venv/bin/python bench/autoload_startup.py --rounds 100 --deepspeed-rounds 0

Contenders, interleaved (each round runs both, the order alternating) and summarised by the median over
rounds of per-round ratios and differences:
- hook: the installed l3plugin-autoload.pth imports a copy of l3plugin_autoload.py put first on PYTHONPATH
  (it puts a finder on sys.meta_path);
- no hook: the same, with an empty l3plugin_autoload.py instead, so everything else about start-up
  (sys.path, the .pth files read) is the same.
Twice: with no bytecode cache for either module (PYTHONDONTWRITEBYTECODE=1: every start compiles it, as
an editable install does on this machine), then with it cached (a regular install precompiles).
Then what the hook adds to `import deepspeed` (it imports l3plugin.deepspeed and patches the engines):
`python -c "import deepspeed"` with and without L3PLUGIN_NO_AUTOLOAD=1, interleaved the same way.
Prints tables; asserts nothing about the timings (only that its own set-up is right).
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


def start_once(env, code="pass") -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def interleaved(rounds, a_env, b_env, code="pass"):
    """Per-contender times; each round runs both, the order alternating between rounds."""
    a, b = [], []
    for r in range(rounds):
        pair = [(a, a_env), (b, b_env)]
        for times, env in pair if r % 2 else pair[::-1]:
            times.append(start_once(env, code))
    return a, b


def row(label, a, b, unit=1e3):
    ratio = statistics.median(x / y for x, y in zip(a, b))
    added = statistics.median(x - y for x, y in zip(a, b))
    print(f"{label:<22} {statistics.median(b) * unit:>10.1f} {statistics.median(a) * unit:>8.1f} {ratio:>13.3f} "
          f"{added * unit:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--deepspeed-rounds", type=int, default=5, help="0 skips the import deepspeed table")
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
            row(label, *interleaved(args.rounds, hook_env, plain_env))
        if args.deepspeed_rounds:
            print(f"\nimport deepspeed, {args.deepspeed_rounds} rounds")
            print(f"{'':<22} {'off ms':>10} {'on ms':>8} {'on/off':>13} {'added ms':>9}")
            code = "import deepspeed"
            start_once(base, code)  # warm-up
            row("hook on / off", *interleaved(args.deepspeed_rounds, base, {**base, "L3PLUGIN_NO_AUTOLOAD": "1"},
                                              code))


if __name__ == "__main__":
    main()
