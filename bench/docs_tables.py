"""Render a docs table from a bench's saved --json output, so a figure in the docs can be traced to a run.

    .venv/bin/python bench/multimodal_pp.py --json > mm.json
    .venv/bin/python bench/docs_tables.py multimodal-simulated mm.json                    # print the table
    .venv/bin/python bench/docs_tables.py multimodal-simulated mm.json --check docs/pipeline.md

    .venv/bin/python bench/cp_memory.py --json > mem.json
    .venv/bin/python bench/docs_tables.py cp-memory mem.json --check docs/cp.md

    .venv/bin/python bench/pp_schedule.py --no-real --json > pp.json
    .venv/bin/python bench/docs_tables.py pp-simulated pp.json --check docs/benchmarks.md

Tables (TABLES below): the bench that writes the JSON, the doc that holds the table, and the renderer.
--check DOC: exit 1, naming the lines, unless every line of the rendered table stands in DOC, in order (a
run with fewer rows, e.g. `cp_memory.py --cp 2 --seq 4096`, checks those rows).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 2**20


def multimodal_simulated(figures: dict) -> str:
    """docs/pipeline.md's simulated multimodal tables: the bench's own printout of the same figures."""
    from multimodal_pp import print_simulated

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_simulated(figures)
    return text.getvalue()


def multimodal_real(figures: dict) -> str:
    """docs/pipeline.md's measured multimodal table (a saved timing run: docs/runs/multimodal_real.json)."""
    from multimodal_pp import print_real

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_real(figures)
    return "".join(line + "\n" for line in text.getvalue().splitlines() if not line.startswith("wrote "))


def cp_memory(figures: dict) -> str:
    """docs/cp.md's table of what one CP attention layer saves for the backward (MiB)."""
    lines = ["| cp | S | keep MiB | regather MiB | freed MiB | planner keep / regather / freed | measured / planner |",
             "|---|---|---|---|---|---|---|"]
    for row in figures["rows"]:
        keep, regather = row["keep"], row["regather"]
        p_keep, p_regather, p_freed = row["planner_keep"], row["planner_regather"], row["planner_gathered_kv"]
        seq = f"{row['seq'] // 1024}K" if row["seq"] % 1024 == 0 else str(row["seq"])
        lines.append(f"| {row['cp']} | {seq} | {keep / MIB:.2f} | {regather / MIB:.2f} | {(keep - regather) / MIB:.2f} "
                     f"| {p_keep / MIB:.2f} / {p_regather / MIB:.2f} / {p_freed / MIB:.2f} "
                     f"| {keep / p_keep:.3f} / {regather / p_regather:.3f} / {(keep - regather) / p_freed:.3f} |")
    return "\n".join(lines) + "\n"


# docs/benchmarks.md's selected rows of the simulated schedules: (p, v, m, k) and the name the docs give the row.
PP_ROWS = (((16, 1, 48, 16), "1F1B"), ((16, 1, 48, 1), "all-forward-all-backward (GPipe)"),
           ((16, 4, 48, 16), "Megatron interleaved, k = p = 16"), ((16, 4, 48, 24), "flexible k = 1.5p = 24"),
           ((16, 4, 48, 32), "flexible k = 2p = 32"), ((16, 4, 32, 24), "flexible k = 1.5p = 24 (last group 8 < p)"),
           ((16, 4, 32, 8), "flexible k = p/2 = 8 (AFAB)"), ((4, 1, 9, 4), "1F1B"),
           ((4, 2, 9, 4), "interleaved k = p = 4 (last group 1)"), ((4, 2, 9, 6), "flexible k = 6 (last group 3)"),
           ((4, 3, 10, 6), "flexible k = 6"))


def pp_simulated(figures: dict) -> str:
    """docs/benchmarks.md's table of simulated pipeline schedules (the rows of PP_ROWS)."""
    rows = {}
    for row in figures["paper_settings"] + figures["small_settings"]:
        rows.setdefault((row["p"], row["v"], row["m"], row["k"]), row)  # v = 1 rows repeat per v: equal
    lines = ["| p | v | m | schedule | stock | bubble, lat 0 | bubble, lat 0.1 | in-flight |",
             "|---|---|---|---|---|---|---|---|"]
    for key, name in PP_ROWS:
        row = rows[key]
        lines.append(f"| {row['p']} | {row['v']} | {row['m']} | {name} | {'yes' if row['stock_accepts'] else 'no'} "
                     f"| {row['bubble']['0.0']:.3f} | {row['bubble']['0.1']:.3f} | {row['inflight']} |")
    return "\n".join(lines) + "\n"


# name: (the bench whose --json it reads, the doc holding the table, renderer)
TABLES = {
    "multimodal-simulated": ("multimodal_pp", "docs/pipeline.md", multimodal_simulated),
    "multimodal-real": ("multimodal_pp", "docs/pipeline.md", multimodal_real),
    "cp-memory": ("cp_memory", "docs/cp.md", cp_memory),
    "pp-simulated": ("pp_schedule", "docs/benchmarks.md", pp_simulated),
}


def render(name: str, record: dict) -> str:
    """The table ``name`` from a bench's --json record (checked to come from the right bench)."""
    if name not in TABLES:
        raise ValueError(f"table {name!r}: valid names are {sorted(TABLES)}")
    bench, _, renderer = TABLES[name]
    if record.get("bench") != bench:
        raise ValueError(f"table {name!r} renders bench/{bench}.py's --json output; this JSON is from "
                         f"{record.get('bench')!r} ({' '.join(record.get('command', []))})")
    return renderer(record["figures"])


def missing_lines(table: str, doc: str) -> list[str]:
    """The lines of ``table`` not found in ``doc``, in order (each searched after the previous one found)."""
    doc_lines, at, missing = doc.splitlines(), 0, []
    for line in table.splitlines():
        try:
            at = doc_lines.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("json", type=Path, help="a bench's --json output (its last line is read)")
    parser.add_argument("--check", type=Path, metavar="DOC", help="exit 1 unless DOC holds the rendered table")
    args = parser.parse_args(argv)
    lines = args.json.read_text().strip().splitlines()
    if not lines:
        parser.error(f"{args.json}: empty; expected a bench's --json output")
    try:
        table = render(args.table, json.loads(lines[-1]))
    except (ValueError, KeyError) as exc:
        parser.error(f"{args.json}: {exc}")
    if args.check is None:
        sys.stdout.write(table)
        return 0
    missing = missing_lines(table, args.check.read_text())
    if missing:
        print(f"{args.check} lacks {len(missing)} line(s) of the {args.table} table rendered from {args.json}:\n"
              + "\n".join(missing), file=sys.stderr)
        return 1
    print(f"{args.check} holds the {args.table} table rendered from {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
