"""Render a docs table from a bench's saved --json output, so a figure in the docs can be traced to a run.

    .venv/bin/python bench/multimodal_pp.py --json > mm.json
    .venv/bin/python bench/docs_tables.py multimodal-simulated mm.json                    # print the table
    .venv/bin/python bench/docs_tables.py multimodal-simulated mm.json --check docs/pipeline.md

    .venv/bin/python bench/cp_memory.py --json > mem.json
    .venv/bin/python bench/docs_tables.py cp-memory mem.json --check docs/cp.md

    .venv/bin/python bench/pp_schedule.py --no-real --json > pp.json
    .venv/bin/python bench/docs_tables.py pp-simulated pp.json --check docs/benchmarks.md

    .venv/bin/python bench/docs_tables.py --docs-check      # every docs table -> its renderer and command

Tables (TABLES below): the bench that writes the JSON, the doc that holds the table, the renderer
(bench/docs_renderers.py) and the bench command whose --json output regenerates it. A table rendered from a
run on a wire opens with a line stating the wire's mode and rate and the run's command.
--check DOC: exit 1, naming the lines, unless every line of the rendered table stands in DOC, in order (a
run with fewer rows, e.g. `cp_memory.py --cp 2 --seq 4096`, checks those rows).
--docs-check: DOC_FIGURES names, for every table in docs/ and README.md and every bench figure given in
prose, the tables that render it, or why no bench makes it; exit 1 if a table is not listed or an entry is stale.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the renderers and the benches they print with

import docs_renderers as r  # noqa: E402


class Table(NamedTuple):
    bench: str  # the bench whose --json record it renders
    doc: str  # the doc holding the table (or, where the doc gives the figures in prose, those figures)
    renderer: Callable[[dict], str]
    run: str  # the bench command whose --json output regenerates it (the docs' figures came from such a run)


TABLES = {
    "multimodal-simulated": Table("multimodal_pp", "docs/pipeline.md", r.multimodal_simulated,
                                  "bench/multimodal_pp.py --json"),
    "multimodal-splits": Table("multimodal_pp", "docs/pipeline.md", r.multimodal_splits,
                               "bench/multimodal_pp.py simulated --bandwidth-gbps 0 --json"),
    "multimodal-real": Table("multimodal_pp", "docs/pipeline.md", r.multimodal_real,
                             "bench/multimodal_pp.py real --rounds 15 --png docs --json"),
    "cp-memory": Table("cp_memory", "docs/cp.md", r.cp_memory, "bench/cp_memory.py --json"),
    "pp-simulated": Table("pp_schedule", "docs/benchmarks.md", r.pp_simulated, "bench/pp_schedule.py --no-real --json"),
    "pp-posting-simulated": Table("pp_schedule", "docs/pipeline.md", r.pp_posting_simulated,
                                  "bench/pp_schedule.py --no-real --json"),
    "pp-real": Table("pp_schedule", "docs/benchmarks.md", r.pp_real, "bench/pp_schedule.py --json"),
    "pp-wire": Table("pp_schedule", "docs/benchmarks.md", r.pp_wire, "bench/pp_schedule.py --wire auto --rounds 5 --json"),
    "cp-timed": Table("cp_attention", "docs/benchmarks.md", r.cp_timed, "bench/cp_attention.py --json"),
    "cp-work": Table("cp_attention", "docs/benchmarks.md", r.cp_work, "bench/cp_attention.py --json"),
    "cp-wire": Table("cp_attention", "docs/benchmarks.md", r.cp_wire, "bench/cp_attention.py --wire auto --json"),
    "torch-cp-work": Table("cp_attention", "docs/cp.md", r.torch_cp_work, "bench/cp_attention.py --json"),
    "torch-cp-flex": Table("cp_attention", "docs/cp.md", r.torch_cp_flex,
                           "bench/cp_attention.py --torch-flex only --seq 2048 4096 8192 --rounds 3 --work-seq --json"),
    "cp-regather": Table("cp_attention", "docs/benchmarks.md", r.cp_regather, "bench/cp_attention.py --wire auto --kv-share 0.25 "
                         "--seq 8192 16384 --rounds 3 --masks causal --work-seq --json"),
    "zero": Table("zero", "docs/benchmarks.md", r.zero, "bench/zero.py --json"),
    "zero-wire": Table("zero", "docs/benchmarks.md", r.zero_wire,
                       "bench/zero.py --wire 4gbit --gas 4 8 --rounds 3 --micro-batch 2 --json"),
    "hf-cp": Table("hf_cp", "docs/huggingface.md", r.hf_cp, "bench/hf_cp.py --json"),
    "autoload-startup": Table("autoload_startup", "docs/zero.md", r.autoload_startup,
                              "bench/autoload_startup.py --rounds 100 --json"),
    "zero-megatron": Table("zero_megatron", "docs/benchmarks.md", r.zero_megatron,
                           "bench/zero_megatron.py --wire auto --gas 4 8 --rounds 5 --json"),
}


def wire_statement(record: dict) -> str:
    """For a run on a wire: the line stating its mode, rate and command, which every wire table carries."""
    figures = record["figures"]
    shaped = figures.get("wire", figures)  # pp_schedule keeps its wire run under "wire"
    mode, rate = shaped.get("wire_mode", "off"), shaped.get("rate_bits")
    if mode == "off":
        return ""
    from wire import rate_text

    where = {"per-rank": "per-rank links (each rank its own full-duplex link)",
             "shared": "the shared loopback bus (every rank, both directions)"}.get(mode, f"mode {mode}")
    each = " each way per rank" if mode == "per-rank" else " in total"
    return f"Wire: {where}, {rate_text(rate)}{each}; run: `{shlex.join(record['command'])}`\n\n"


# Every table of docs/*.md and README.md (its header line), and the prose that gives a bench's figures (its
# opening words): the doc, that line, and the TABLES that render its figures, or () and why no bench does.
DOC_FIGURES = (
    ("README.md", "| command | wall time | what it did |", (),
     "make demo / make test wall times, by hand (in full: docs/quickstart.md)"),
    ("README.md", "| framework | the one change | verified with | details |", (),
     "how to switch it on per framework; versions from docs/verified.md (tests/test_front_door.py)"),
    ("README.md", "| feature | Megatron-Core 0.19 | DeepSpeed 0.19 | torch 2.13 | l3plugin | evidence |", (),
     "a feature matrix against the anchors' code, no figures (in full: docs/comparison.md)"),
    ("README.md", "| page | what |", (), "an index"),
    ("README.md", "| what | l3plugin | anchor, same run | measured | evidence |",
     ("pp-simulated", "pp-wire", "cp-timed", "cp-work", "torch-cp-work", "cp-wire", "zero"),
     "the CP kernel row: bench/gpu_check.py on a GPU, by hand (docs/runs/gpu_check_h200.json)"),
    ("docs/quickstart.md", "| command | wall time | what it did |", (), "make demo / make test wall times, by hand"),
    ("docs/comparison.md", "| | Megatron-Core 0.19.0 | DeepSpeed 0.19.8 | Megatron-DeepSpeed", (),
     "a feature comparison against the anchors' code, no figures"),
    ("docs/benchmarks.md", "| figure | section | bench | command (after `.venv/bin/python`) |", (),
     "an index: figure -> section, bench, command, JSON"),
    ("docs/benchmarks.md", "| what | l3plugin | the anchor, same run | page | command |",
     ("pp-simulated", "pp-wire", "multimodal-real", "cp-timed", "cp-work", "torch-cp-work", "torch-cp-flex", "cp-wire",
      "cp-regather", "cp-memory", "zero", "zero-wire"), ""),
    ("docs/megatron.md", "| flag combination | why |", (), "what l3plugin refuses, no figures"),
    ("docs/megatron.md", "| Megatron-Core | how | result |", (), "test counts of the compat runs (docs/verified.md)"),
    ("docs/deepspeed.md", "| config | why |", (), "what l3plugin refuses, no figures"),
    ("docs/deepspeed.md", "| DeepSpeed | transformers / accelerate | result |", (),
     "test counts of the compat runs (docs/verified.md)"),
    ("docs/huggingface.md", "| entry point | what to add | verified with | the check |", (),
     "how to switch it on, no figures"),
    ("docs/post-training.md", "| question | answer |", (), "how to switch it on, no figures"),
    ("docs/benchmarks.md", "| table | command (per-rank links) | time |", (), "the commands, no figures"),
    ("docs/benchmarks.md", "Measured here (2 ranks exchanging 4 MB fp32 each way,", (),
     "the wire's own exchange, timed by hand (wire.time_collectives_alone); no bench records it"),
    ("docs/benchmarks.md", "| p | v | m | schedule | stock | bubble, lat 0 | bubble, lat 0.1 | in-flight |",
     ("pp-simulated",), ""),
    ("docs/benchmarks.md", "Real CPU run, same script: 4 gloo ranks,", ("pp-real",), ""),
    ("docs/pipeline.md", "| vpp | message / forward | k=p agreed order | k=p early |", ("pp-posting-simulated",), ""),
    ("docs/benchmarks.md", "| vpp | schedule | no wire ms | wire ms | wire / no wire | wire / stock's wire | saved MB "
     "| in-flight |", ("pp-wire",), ""),
    ("docs/benchmarks.md", "| S | causal / non-causal (cp=1) |", ("cp-timed",), ""),
    ("docs/benchmarks.md", "Before (issue 14, kernels attending", (),
     "the kernels before today's, measured then; today's benches cannot run them"),
    ("docs/benchmarks.md", "| S | cp | 2cp layout max/min (mean, worst) |", ("cp-work",), ""),
    ("docs/benchmarks.md", "| S | ring / AG causal, plain -> overlapped |", ("cp-wire",), ""),
    ("docs/benchmarks.md", "`cp_kv=\"keep\"`, as measured; `--wire` adds a 2cp", ("cp-regather",), ""),
    ("docs/benchmarks.md", "| S | regather / keep, causal (2cp), 4 calls |", ("cp-regather",), ""),
    ("docs/benchmarks.md", "| variant | step ms | ratio | exposed ms | exp/coll |", ("zero",), ""),
    ("docs/benchmarks.md", "- On gloo our reduce-scatter is a point-to-point exchange", (),
     "gloo's collectives timed alone by hand; no bench records these"),
    ("docs/benchmarks.md", "| gas | variant | step ms | ratio to stock |", ("zero-wire",), ""),
    ("docs/checkpoints.md", "| from -> to |", (), "what interoperates (tests), no figures"),
    ("docs/checkpoints.md", "| fault | outcome on the rank that reads it |", (), "fault injections (tests)"),
    ("docs/checkpoints.md", "| kill / fault during the save of step5 |", (), "fault injections (tests)"),
    ("docs/cp.md", "| cp | S | keep MiB | regather MiB |", ("cp-memory",), ""),
    ("docs/cp.md", "| S | cp | l3plugin balanced | torch head-tail", ("torch-cp-work",), ""),
    ("docs/cp.md", "| S | contender | forward s |", ("torch-cp-flex",), ""),
    ("docs/cp.md", "overlapped regather / overlapped keep =", ("cp-regather",), ""),
    ("docs/huggingface.md", "| S | documents | cp=1 step | cp=2 step |", ("hf-cp",), ""),
    ("docs/pipeline.md", "| I | p | v | count: load / bubble |", ("multimodal-splits",), ""),
    ("docs/pipeline.md", "| placement | where the encoder runs |", (), "what each placement does, no figures"),
    ("docs/pipeline.md", "| costs | v | m | k | flexible | flexible-zb |", (),
     "printed by bench/pp_zero_bubble.py (simulated, deterministic), no renderer yet"),
    ("docs/pipeline.md", "Simulated: llama3-8b shapes,", ("multimodal-simulated",), ""),
    ("docs/pipeline.md", "Measured: 2 gloo ranks (pp 2, one core each)", ("multimodal-real",), ""),
    ("docs/reliability.md", "| fault | outcome | time to a clear error |", (), "fault injections (tests)"),
    ("docs/reliability.md", "| code | shape | with the key: exit 0 | stock: exit 0 |", (),
     "exit-code counts printed by bench/clean_exits.py, by hand"),
    ("docs/upstream.md", "| set (declared in) | applied by | what |", (), "the patch registry, no figures"),
    ("docs/upstream.md", "| name | declared beside |", (), "upstream private state, no figures"),
    ("docs/verified.md", "| Megatron-Core (tag) |", (), "test counts of the compat runs"),
    ("docs/verified.md", "| run | 1 | 2 | 3 | 4 | 5 |", (), "Megatron-LM losses (tests/examples)"),
    ("docs/verified.md", "| run (core_v0.19.0) | 1 | 2 | 3 |", (), "Megatron-LM losses (tests/examples)"),
    ("docs/verified.md", "| deepspeed | transformers | accelerate |", (), "test counts of the compat runs"),
    ("docs/verified.md", "| iteration | stock ZeRO-1 | ours ZeRO-1 |", (),
     "Megatron-DeepSpeed's losses printed by examples/megatron_deepspeed/check.py, by hand"),
    ("docs/verified.md", "| tokens | documents | unmasked / dense causal pairs |", (),
     "bench/gpu_check.py on a GPU, by hand from its JSON (docs/runs/gpu_check_h200.json); no renderer yet"),
    ("docs/verified.md", "| torch setting | fused vs fused | split (B then W) vs fused |", (),
     "bench/gpu_check.py on a GPU, by hand from its JSON (docs/runs/gpu_check_h200_split.json); no renderer yet"),
    ("docs/zero.md", "| | reduce-scatter | gradient memory between micro-batches |", (), "what each stage does"),
    ("docs/zero.md", "| option | what it does | cost |", (), "the options (the measured cost: zero-wire)"),
    ("docs/zero.md", "| Megatron-Core does | l3plugin's ZeRO |", (), "a feature comparison, no figures"),
    ("docs/zero.md", "(`bench/autoload_startup.py`, this loaded 2-core machine,", ("autoload-startup",), ""),
    ("docs/zero.md", "`bench/zero_megatron.py --quick --bucket default 1/16`'s census, W = 2, 2 layers", (),
     "census figures quoted from bench/zero_megatron.py's printed rows, by hand"),
    ("docs/benchmarks.md", "| variant | B/param, DeepSpeed's default bucket size (5e8) |", (),
     "bench/zero.py --bucket default 1/16's census rows, by hand (no renderer for the two-bucket run yet)"),
    ("docs/benchmarks.md", "| configuration | buckets | ours, defaults: exp/coll (range)", (),
     "bench/zero.py --bucket default 1/16's wire rows, by hand (no renderer for the two-bucket run yet)"),
    ("docs/benchmarks.md", "| micro-batch | forward+backward / reduce-scatter per micro-batch |", (),
     "bench/zero.py --bucket default 1/16's printed rows at micro-batch 4, 8, 16, by hand (one run each)"),
    ("docs/benchmarks.md", "| wire | compute / communication per micro-batch | default: exp/coll gas 4 / gas 8 |", (),
     "bench/zero_megatron.py runs' printed rows, by hand (JSON: docs/runs/zero_megatron_defaults_*.json)"),
    ("docs/benchmarks.md", "| emulated compute per micro-batch | forward+backward / reduce-scatter", (),
     "bench/zero.py --emulated-compute's printed rows, by hand (JSON: docs/runs/zero_emulated_compute_*ms.json)"),
    ("docs/pipeline.md", "| v | m | step flexible / zb (ms) | zb / flexible (range) |", (),
     "bench/pp_schedule.py --zero-bubble's printed rows, by hand (its JSON: docs/runs/pp_zero_bubble_h1024_quiet.json)"),
    ("docs/pipeline.md", "| v | m | zb / flexible (5 rounds; 9 rounds, range) |", (),
     "bench/pp_zero_bubble_gpt.py's printed rows of two runs, by hand (docs/runs/pp_zero_bubble_gpt_5rounds.json, "
     "_9rounds.json)"),
    ("docs/benchmarks.md", "| gas | contender | step ms | exposed ms | exp/coll | grad B/param | in bwd |",
     ("zero-megatron",), ""),
    ("docs/benchmarks.md", "| pp_variable_lengths run | contender |", (),
     "bench/pp_variable_lengths.py's printed rows, by hand (the runs' JSON: docs/runs/pp_variable_lengths_*.json)"),
    ("docs/cp.md", "| documents | docs / sequence | THD padding per sequence", (),
     "printed by bench/cp_thd_padding.py (a count over generated document lengths, no timing)"),
    ("docs/post-training.md", "| step | micro-batches | lengths |", (),
     "the output of examples/megatron/rl_post_training.py (tests/test_examples.py compares the two layouts)"),
    ("docs/post-training.md", "| variable | values | what it does |", (), "a reference of two variables, no figures"),
    ("docs/post-training.md", "| p | m | k = 1: step / bubble / peak |", (),
     "`l3plugin simulate --pp P --vpp 2 --microbatches M --group-size K --json` (ideal costs, printed by hand)"),
    ("docs/verified.md", "| case | m | vpp | max abs diff | bit-identical | notes |", (),
     "printed by compat/verl_engine.py (make compat-verl), copied by hand"),
    ("docs/te-on-gpu.md", "| call | carries | MiB sent | command", (),
     "the call plan printed by bench/te_carry.py prepare / plan (sizes of one download), copied by hand"),
    ("docs/te-on-gpu.md", "| what | figure | measured or estimate |", (),
     "timings of bench/te_carry.py prepare, a local store/join round trip and single g++ compiles, by hand; "
     "estimates marked"),
)


def doc_tables(text: str) -> list[str]:
    """The header lines of the markdown tables in ``text``."""
    lines = text.splitlines()
    return [head for head, rule in zip(lines, lines[1:]) if head.startswith("|") and rule.startswith("|---")]


def docs_check(root: Path) -> list[str]:
    """What is wrong with DOC_FIGURES against the docs under ``root``: a table no entry names, an entry whose
    line is gone, an entry naming no table and giving no reason, or an unknown table."""
    problems, texts = [], {}
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        texts[str(path.relative_to(root))] = path.read_text()
    for doc, line, names, why in DOC_FIGURES:
        if doc not in texts or not any(text_line.startswith(line) for text_line in texts[doc].splitlines()):
            problems.append(f"{doc}: no line starts with {line!r} (DOC_FIGURES is stale)")
        problems += [f"{doc}: {line!r} names no table {name!r}" for name in names if name not in TABLES]
        if not names and not why:
            problems.append(f"{doc}: {line!r}: no table renders it and no reason is given")
    for doc, text in texts.items():
        listed = [line for d, line, _, _ in DOC_FIGURES if d == doc]
        problems += [f"{doc}: table {head!r} is not in DOC_FIGURES (name its renderer or why none)"
                     for head in doc_tables(text) if not any(head.startswith(line) for line in listed)]
    return problems


def listing() -> str:
    """Every DOC_FIGURES entry: the doc, its line, and the commands that regenerate it (or why none)."""
    out = []
    for doc, line, names, why in DOC_FIGURES:
        out.append(f"{doc}: {line[:80]}")
        for name in names:
            out.append(f"    {name}: {TABLES[name].run} > RUN.json; bench/docs_tables.py {name} RUN.json")
        if not names:
            out.append(f"    not from a bench: {why}")
    return "\n".join(out) + "\n"


def render(name: str, record: dict) -> str:
    """The table ``name`` from a bench's --json record (checked to come from the right bench)."""
    if name not in TABLES:
        raise ValueError(f"table {name!r}: valid names are {sorted(TABLES)}")
    table = TABLES[name]
    if record.get("bench") != table.bench:
        raise ValueError(f"table {name!r} renders bench/{table.bench}.py's --json output; this JSON is from "
                         f"{record.get('bench')!r} ({' '.join(record.get('command', []))})")
    return wire_statement(record) + table.renderer(record["figures"])


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
    parser.add_argument("table", nargs="?", choices=sorted(TABLES))
    parser.add_argument("json", nargs="?", type=Path, help="a bench's --json output (its last line is read)")
    parser.add_argument("--check", type=Path, metavar="DOC", help="exit 1 unless DOC holds the rendered table")
    parser.add_argument("--docs-check", action="store_true", help="list every docs table and bench figure with "
                        "the table that renders it and its command (or why no bench makes it); exit 1 if a docs "
                        "table is not listed or the list is stale")
    args = parser.parse_args(argv)
    if args.docs_check:
        sys.stdout.write(listing())
        problems = docs_check(Path(__file__).resolve().parent.parent)
        print("\n".join(problems) if problems else "every docs table is listed", file=sys.stderr)
        return 1 if problems else 0
    if args.table is None or args.json is None:
        parser.error("give TABLE and JSON (or --docs-check)")
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
