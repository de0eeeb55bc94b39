"""Run several bench scripts one after the other in this one interpreter, each as `python bench/X.py ARGS`
would run it: its file executed as ``__main__`` (runpy), with its ``sys.argv``, ``sys.path[0]`` its folder, its
exit status taken from its SystemExit (an exception: 1, its traceback on stderr), its stdout into a file of its own.

    python tests/bench_driver.py OUTDIR SPEC.json
    # SPEC: {"preload": [module, ...], "runs": [[key, [script, *args]], ...]}

Writes OUTDIR/<key>.out (the run's stdout), <key>.err (its stderr: everything written to this process's
stderr from the run's start to its end, RankPool workers' output included) and, last, <key>.rc (its exit
status). At the end it SIGKILLs its fork server (no pool is left) and freezes its own heap: both exits would
spend seconds of CPU collecting the preloaded modules' objects.

Why: a smoke run of a bench costs mostly imports. A bench process may import torch (cp_attention, multimodal_pp,
pp_schedule on a wire), and its RankPool's fork server imports torch and Megatron-Core, DeepSpeed or
transformers (``preload``). multiprocessing starts that server once per process and forks every later pool's
workers from it, so benches run here pay both once. The server is started first, importing torch and SPEC's
preload (the union of the runs' RankPool preloads: a pool's own list only counts for the server it starts), while
the first run begins. The per-rank wires (bench/wire.py) of the runs are deleted when this process exits, as a
bench deletes its own when it exits.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path


def run_one(argv: list[str]) -> int:
    """``python argv[0] argv[1:]`` in this interpreter; its exit status."""
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # as the interpreter maps it: None 0, an int itself, anything else printed, 1
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def main(outdir: str, spec_file: str) -> int:
    outdir = Path(outdir)
    spec = json.loads(Path(spec_file).read_text())
    path = list(sys.path[1:])  # sys.path[0] is this script's folder (tests/), a bench's is its own
    combined = outdir / "driver.err"  # every run's stderr, in order; each run's part is copied out below
    stdout_fd = os.dup(1)
    with open(combined, "wb") as err:
        os.dup2(err.fileno(), 2)
        os.dup2(err.fileno(), 1)  # the fork server's stdout, as in a bench with --json (workers print to stderr)
        # RankPool's own list first (l3plugin/ranks/pool.py), then the runs' preloads.
        mp.get_context("forkserver").set_forkserver_preload(["l3plugin.ranks.server", "torch", *spec["preload"]])
        multiprocessing.forkserver.ensure_running()
        for key, argv in spec["runs"]:
            start = os.lseek(2, 0, os.SEEK_CUR)
            with open(outdir / f"{key}.out", "wb") as out:
                os.dup2(out.fileno(), 1)
                sys.path[:] = [str(Path(argv[0]).resolve().parent), *path]
                rc = run_one(argv)
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(err.fileno(), 1)
            end = os.lseek(2, 0, os.SEEK_CUR)
            with open(combined, "rb") as whole:
                whole.seek(start)
                (outdir / f"{key}.err").write_bytes(whole.read(end - start))
            (outdir / f"{key}.rc").write_text(str(rc))
    os.dup2(stdout_fd, 1)
    # Nothing is left to the fork server (every pool closed): end it, and this interpreter, without the
    # collection of every preloaded module's objects their exits would spend seconds of CPU on (atexit, which
    # deletes the runs' wires, still runs here).
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    if server is not None:
        os.kill(server, signal.SIGKILL)
        os.waitpid(server, 0)
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
