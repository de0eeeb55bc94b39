"""The renderers of bench/docs_tables.py: each turns one bench's --json figures into a docs table, in the
docs' layout (columns, rounding), so the table can be regenerated from a run rather than copied by hand."""

from __future__ import annotations

import contextlib
import io

MIB = 2**20


def markdown(header: list[str], rows) -> str:
    """A markdown table: the header, its rule and one line per row (cells already formatted)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["|" + "|".join(f" {cell} " if cell != "" else " " for cell in row) + "|" for row in rows]
    return "\n".join(lines) + "\n"


def sci(x: float) -> str:
    """x in the docs' scientific notation: 2.5e-3 (Python writes 2.5e-03)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def ratio_range(stats, digits: int = 3, range_digits: int = 2) -> str:
    """"median (min-max)" of a harness.ratio_stats record, the range shorter, as the docs print it."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{range_digits}f}-{stats['max']:.{range_digits}f})"


def seq_text(seq: int) -> str:
    return f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)


# ---- multimodal_pp -----------------------------------------------------------------------------------------
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


# docs/pipeline.md's selected rows of the text-only splits, (image tokens, p, v), in the docs' order.
MULTIMODAL_SPLIT_ROWS = ((1200, 4, 1), (1200, 8, 1), (1200, 4, 2), (3000, 4, 1), (3000, 8, 1), (3000, 4, 2))


def multimodal_splits(figures: dict) -> str:
    """docs/pipeline.md's text-pipeline splits (from a run without P2P time, --bandwidth-gbps 0): the selected
    rows of MULTIMODAL_SPLIT_ROWS that the run has."""
    by_key = {(row["image_tokens"], row["pp"], row["vpp"]): row["splits"] for row in figures["rows"]}
    rows = []
    for key in [key for key in MULTIMODAL_SPLIT_ROWS if key in by_key]:
        splits = by_key[key]
        cells = [f"{splits[name]['load_max_over_min']:.2f} / {splits[name]['bubble']:.2f}" if splits[name] else "n/a"
                 for name in ("count", "grouped", "balanced")]
        rows.append([*key, *cells, f"{splits['balanced']['makespan'] / splits['count']['makespan']:.3f}",
                     " ".join(map(str, splits["balanced"]["counts"]))])
    return markdown(["I", "p", "v", "count: load / bubble", "grouped", "balanced", "balanced step / count",
                     "balanced layers per stage"], rows)


# ---- cp_memory ---------------------------------------------------------------------------------------------
def cp_memory(figures: dict) -> str:
    """docs/cp.md's table of what one CP attention layer saves for the backward (MiB)."""
    lines = ["| cp | S | keep MiB | regather MiB | freed MiB | planner keep / regather / freed | measured / planner |",
             "|---|---|---|---|---|---|---|"]
    for row in figures["rows"]:
        keep, regather = row["keep"], row["regather"]
        p_keep, p_regather, p_freed = row["planner_keep"], row["planner_regather"], row["planner_gathered_kv"]
        lines.append(f"| {row['cp']} | {seq_text(row['seq'])} | {keep / MIB:.2f} | {regather / MIB:.2f} "
                     f"| {(keep - regather) / MIB:.2f} | {p_keep / MIB:.2f} / {p_regather / MIB:.2f} / {p_freed / MIB:.2f} "
                     f"| {keep / p_keep:.3f} / {regather / p_regather:.3f} / {(keep - regather) / p_freed:.3f} |")
    return "\n".join(lines) + "\n"


# ---- pp_schedule -------------------------------------------------------------------------------------------
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


def pp_posting_simulated(figures: dict) -> str:
    """docs/pipeline.md's simulated receive posting: step on the wire / step without it, per vpp and message share."""
    columns = [("k=p agreed order", "agreed-order k=p"), ("k=p early", "flexible k=p"),
               ("k=1.5p agreed order", "agreed-order k=1.5p"), ("k=1.5p early", "flexible k=1.5p"),
               ("k=2p early", "flexible k=2p")]
    lines = ["| vpp | message / forward | " + " | ".join(head for head, _ in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for vpp, by_share in figures["posting_simulated"].items():
        for share, rows in by_share.items():
            def cell(prefix):
                (name,) = [n for n in rows if n.startswith(prefix + "=")]
                return f"{rows[name]['wire_over_no_wire']:.3f}"
            lines.append(f"| {vpp.split()[1]} | {float(share):.0%} | " + " | ".join(cell(p) for _, p in columns) + " |")
    return "\n".join(lines) + "\n"


def pp_real(figures: dict) -> str:
    """docs/benchmarks.md's real CPU run of flexible against stock interleaved (pp 4, vpp 2, m 8, k 4)."""
    real = figures["real"]  # ranks, pp, vpp, m, k: fixed in pp_schedule.real_run (no option changes them)
    return markdown(["ranks", "pp", "vpp", "m", "k", "hidden", "seq", "steps", "flexible ms", "stock ms",
                     "flexible / stock", "gradients identical"],
                    [[4, 4, 2, 8, 4, real["hidden"], real["seq"], real["steps"], f"{1000 * real['flexible_step_s']:.1f}",
                      f"{1000 * real['stock_step_s']:.1f}", f"{real['flexible_over_stock']:.3f}",
                      "yes" if real["identical_gradients"] else "NO"]])


def pp_wire(figures: dict) -> str:
    """docs/benchmarks.md's pipeline schedules on a wire (pp 2; every vpp the run timed)."""
    wire = figures["wire"]
    rows = []
    for key in sorted((key for key in wire if key.startswith("vpp ")), key=lambda key: int(key.split()[1])):
        for row in wire[key]["rows"]:
            stock = row["schedule"].startswith("stock")
            rows.append([key.split()[1], row["schedule"], f"{row['no_wire_ms']:.0f}", f"{row['wire_ms']:.0f}",
                         ratio_range(row["wire_over_no_wire"]),
                         "1" if stock else f"{row['wire_over_stock_wire']['median']:.3f}",
                         f"{row['saved_mb']:.1f}", row["inflight"]])
    identical = all(wire[key]["identical_gradients"] for key in wire if key.startswith("vpp "))
    send = wire["activation_send_alone_s"]
    shares = ", ".join(f"vpp {v} {send / t:.0%}" for v, t in wire["chunk_forward_s"].items())
    return (markdown(["vpp", "schedule", "no wire ms", "wire ms", "wire / no wire", "wire / stock's wire",
                      "saved MB", "in-flight"], rows)
            + f"\nGradients identical in every run: {'yes' if identical else 'NO'}. One activation "
              f"({wire['activation_bytes'] / 1e6:.2f} MB) sent alone: {1000 * send:.0f} ms wall; of one chunk's "
              f"forward: {shares}.\n")


# ---- cp_attention ------------------------------------------------------------------------------------------
def _loopback_entries(figures: dict, name: str) -> list:
    if figures.get("wire_mode", "off") != "off":
        raise ValueError(f"table {name!r} renders a run on loopback; this run used a wire: render cp-wire")
    return figures["timed"]


def cp_timed(figures: dict) -> str:
    """docs/benchmarks.md's timed CP attention table (loopback): medians of per-round ratios of wall times."""
    rows = []
    for at, entry in enumerate(_loopback_entries(figures, "cp-timed")):
        r = {pair: value["wall"] for pair, value in entry["ratios"].items()}
        work, pairs = entry["work_max_over_min"], entry["pairs_of_causal"]
        rows.append([entry["seq"], f"{r['cp1 causal / cp1 non-causal']:.3f}",
                     f"{r['cp1 docs / cp1 causal'] / pairs:.2f} (pairs {pairs:.3f})",
                     f"{r['ring causal / cp2 causal']:.2f}", f"{r['ring docs / cp2 docs 2cp']:.2f}",
                     f"{r['cp1 causal / cp2 causal']:.2f}",
                     f"{r['cp1 docs / cp2 docs 2cp']:.2f} ({'work max/min ' if at == 0 else ''}{work['docs 2cp']:.2f})",
                     f"{r['cp1 docs / cp2 docs balanced']:.2f} ({work['docs balanced']:.3f})",
                     f"{r['cp2 docs balanced / cp2 docs 2cp']:.2f}"])
    return markdown(["S", "causal / non-causal (cp=1)", "docs / (pair ratio x causal)", "ring / all-gather, causal",
                     "ring / all-gather, docs", "cp=2 speedup causal", "cp=2 speedup docs, 2cp layout",
                     "cp=2 speedup docs, balanced layout", "balanced / 2cp time, docs"], rows)


def cp_work(figures: dict) -> str:
    """docs/benchmarks.md's load-balance table (analytic work counts, cp 2 / 4 / 8 in one row per S)."""
    by_seq = {}
    for row in figures["work"]:
        by_seq.setdefault(row["seq"], []).append(row)
    rows = []
    for seq, per_cp in by_seq.items():
        def cells(layout, key, fmt):
            return " / ".join(format(row[layout][key], fmt) for row in per_cp)

        def spread(layout, fmt):
            return " / ".join(f"{format(row[layout]['max_over_min_mean'], fmt)}, "
                              f"{format(row[layout]['max_over_min_worst'], fmt)}" for row in per_cp)

        rows.append([seq_text(seq), " / ".join(str(row["cp"]) for row in per_cp), spread("2cp", "#.3g"),
                     cells("2cp", "speedup_mean", ".2f"), spread("balanced", ".3f"),
                     cells("balanced", "speedup_mean", ".2f")])
    return markdown(["S", "cp", "2cp layout max/min (mean, worst)", "2cp speedup", "balanced max/min (mean, worst)",
                     "balanced speedup"], rows)


def torch_cp_work(figures: dict) -> str:
    """docs/cp.md's load balance of l3plugin's layouts and torch's balancers on the same documents (analytic)."""
    by_seq = {}
    for row in figures["torch_work"]:
        by_seq.setdefault(row["seq"], []).append(row)
    names = ["l3plugin balanced", "torch head-tail", "torch ptrr", "torch per-document head-tail",
             "torch per-document head-tail, as its docstring draws it"]
    rows = []
    for seq, per_cp in by_seq.items():
        rows.append([seq_text(seq), " / ".join(str(row["cp"]) for row in per_cp),
                     *(" / ".join(f"{row[n]['max_over_min_mean']:.2f}, {row[n]['max_over_min_worst']:.2f}"
                                  for row in per_cp) for n in names)])
    return markdown(["S", "cp", "l3plugin balanced", "torch head-tail (= l3plugin 2cp)", "torch PTRR",
                     "torch per-document head-tail, as sharded", "the same, as its docstring draws it"], rows)


def torch_cp_flex(figures: dict) -> str:
    """docs/cp.md's forward beside torch's FlexAttention CP (cp_attention.py --torch-flex)."""
    rows = []
    for entry in figures["torch_flex"]:
        for name, c in entry["contenders"].items():
            rows.append([f"{seq_text(entry['seq'])} ({entry['documents']} documents)", name, f"{c['wall_s']:.3f}",
                         f"{c['over_l3plugin_balanced']:.2f}", f"{c['work_max_over_min']:.3f}",
                         sci(c["max_abs_error"])])
    return markdown(["S", "contender", "forward s", "/ l3plugin balanced", "work max/min", "max abs error vs fp64"],
                    rows)


def _wire_entries(figures: dict, name: str) -> list:
    if figures.get("wire_mode", "off") == "off":
        raise ValueError(f"table {name!r} renders a run on a wire (--wire); this run was on loopback")
    return figures["timed"]


def cp_wire(figures: dict) -> str:
    """docs/benchmarks.md's CP attention on a wire: ring / all-gather, plain -> overlapped, and overlapped / plain."""
    rows = []
    for entry in _wire_entries(figures, "cp-wire"):
        ratios = entry["wall_ratios"]

        def median(a, b):
            stats = ratios.get(f"{a} / {b}")
            return None if stats is None else stats["median"]

        def ring_cell(mask, ag, with_range):
            plain, over = median(f"ring {mask}", f"{ag} plain"), median(f"ring {mask}", f"{ag} overlapped")
            if plain is None:
                return "-"
            spread = ratios[f"ring {mask} / {ag} overlapped"]
            return f"{plain:.3f} -> {ratio_range(spread) if with_range else f'{over:.3f}'}"

        over = [median(f"{ag} overlapped", f"{ag} plain")
                for ag in ("all-gather causal", "all-gather docs 2cp", "all-gather docs balanced")]
        first = [median(f"ring {mask}", f"{ag} overlapped local-first")
                 for mask, ag in (("causal", "all-gather causal"), ("docs", "all-gather docs 2cp"))]
        rows.append([seq_text(entry["seq"]), ring_cell("causal", "all-gather causal", True),
                     ring_cell("docs", "all-gather docs 2cp", False), ring_cell("docs", "all-gather docs balanced", False),
                     ", ".join("-" if x is None else f"{x:.3f}" for x in over),
                     ", ".join("-" if x is None else f"{x:.3f}" for x in first)])
    return _kv_alone_line(figures) + markdown(["S", "ring / AG causal, plain -> overlapped", "ring / AG docs 2cp, plain -> overlapped",
                     "ring / AG docs balanced, plain -> overlapped",
                     "overlapped / plain: causal, docs 2cp, docs balanced",
                     "ring / AG overlapped local-first: causal, docs 2cp"], rows)


def _kv_alone_line(figures: dict) -> str:
    """The K/V all-gather alone at each S, and its share of the overlapped all-gather's step (causal, else docs)."""
    cells = []
    for entry in figures["timed"]:
        step = next((entry["contenders"][name]["wall_s"] for name in ("all-gather causal overlapped",
                                                                      "all-gather docs 2cp overlapped")
                     if name in entry["contenders"]), None)
        alone = entry["all_gather_alone_s"]
        cells.append(f"{seq_text(entry['seq'])} {1000 * alone:.0f} ms" + (f" ({alone / step:.1%})" if step else ""))
    return ("K/V all-gather alone on this wire (share of the overlapped all-gather step): "
            + ", ".join(cells) + "\n\n")


def cp_regather(figures: dict) -> str:
    """What regathering K/V in the backward costs against keeping them (cp_kv), without and with prefetch
    (regather ahead), stacks of ``layers`` calls, 2cp layout, on a wire."""
    rows, layers = [], figures["layers"]
    for entry in _wire_entries(figures, "cp-regather"):
        cells = []
        for ag in ("all-gather causal overlapped", "all-gather docs 2cp overlapped"):
            for kind in ("regather", "regather ahead"):
                stats = entry["wall_ratios"].get(f"{ag} {kind} x{layers} / {ag} keep x{layers}")
                cells.append("-" if stats is None else ratio_range(stats, 2))
        rows.append([seq_text(entry["seq"]), *cells])
    return markdown(["S", f"regather / keep, causal (2cp), {layers} calls", "regather ahead / keep, causal",
                     "regather / keep, docs 2cp", "regather ahead / keep, docs 2cp"], rows)


# ---- zero --------------------------------------------------------------------------------------------------
def _sent(collective_bytes: dict) -> str:
    """MB per op and dtype, largest first; the norms' and overflow flags' scalars (under 1%) left out."""
    total = sum(collective_bytes.values())
    return " + ".join(f"{nbytes / 1e6:.1f} {key}" for key, nbytes in sorted(collective_bytes.items(),
                                                                             key=lambda item: -item[1])
                      if nbytes >= 0.01 * total)


def zero(figures: dict) -> str:
    """docs/benchmarks.md's ZeRO variants under DeepSpeed, one table per gas."""
    parts = []
    for gas, table in figures["gas"].items():
        rows = [[row["variant"], f"{row['step_ms']:.0f}", ratio_range(row["ratio"], 2) if row["ratio"] else "",
                 f"{row['exposed_ms']:.0f}",
                 f"{row['exposed_over_collectives']['median']:.2f}" if row["exposed_over_collectives"] else "",
                 f"{row['cpu_busy']:.2f}", f"{row['grad_bytes_per_param']:.2f}",
                 f"{row['reductions_in_backward']}/{row['reductions']}", _sent(row["collective_bytes"]),
                 sci(row["grad_error"])] for row in table["rows"]]
        parts.append(f"gas {gas}:\n\n" + markdown(["variant", "step ms", "ratio", "exposed ms", "exp/coll", "CPU busy",
                                                   "grad B/param", "in bwd", "sent MB", "err"], rows))
    return "\n".join(parts)


def emulated_note(ms) -> str:
    """The compute line's note for a run with --emulated-compute (runs since 2026-11-28; "" without)."""
    return f" ({ms:.0f} ms of it emulated accelerator compute: the ranks sleep, the CPU free)" if ms else ""


def zero_wire(figures: dict) -> str:
    """docs/benchmarks.md's ZeRO variants on a wire: every gas in one table."""
    if figures.get("wire_mode", "off") == "off":
        raise ValueError("table 'zero-wire' renders a run on a wire (--wire); this run was on loopback: render zero")
    rows = [[gas, row["variant"], f"{row['step_ms']:.0f}", ratio_range(row["ratio"], 2) if row["ratio"] else "",
             f"{row['exposed_ms']:.0f}",
             ratio_range(row["exposed_over_collectives"], 2) if row["exposed_over_collectives"] else "",
             f"{row['cpu_busy']:.2f}", f"{row['grad_bytes_per_param']:.2f}"]
            + ([f"{row['after_step_bytes_per_param']:.2f}"] if "after_step_bytes_per_param" in row else [])
            for gas, table in figures["gas"].items() for row in table["rows"]]
    alone = "; ".join(f"{name} {1000 * t['wall']:.0f} ms wall ({1000 * t['cpu']:.0f} ms CPU)"
                      for name, t in figures["collectives_alone_s"].items())
    after_step = ["B/param after step"] if len(rows[0]) > 8 else []  # runs since the deferred parameter all-gather
    return (f"Forward+backward of one micro-batch: {figures['forward_backward_ms']:.0f} ms"
            + emulated_note(figures.get("emulated_compute_ms")) + ". Alone on this wire, no "
            f"compute: {alone}.\n\n" + markdown(["gas", "variant", "step ms", "ratio to stock", "exposed ms",
                                                   "exp/coll", "CPU busy", "grad B/param"] + after_step, rows))


# ---- hf_cp, autoload_startup -------------------------------------------------------------------------------
def hf_cp(figures: dict) -> str:
    """docs/huggingface.md's cp = 2 against cp = 1 table (step time, saved activations)."""
    rows = []
    for row in figures["rows"]:
        ratio, peak, held = row["cp2_over_cp1"], row["peak_bytes"], row["held_bytes"]
        rows.append([row["seq"], row["documents"], f"{row['step_s']['1']:.2f} s", f"{row['step_s']['2']:.2f} s",
                     f"{ratio['median']:.3f} ({ratio['min']:.2f}..{ratio['max']:.2f})",
                     f"{row['busy_cp2_over_cp1']:.3f}",
                     f"{peak['1'] / MIB:.1f} / {peak['2'] / MIB:.1f} ({peak['2'] / peak['1']:.3f})",
                     f"{held['1'] / MIB:.1f} / {held['2'] / MIB:.1f} ({held['2'] / held['1']:.3f})"])
    return markdown(["S", "documents", "cp=1 step", "cp=2 step", "cp2/cp1 wall (range)", "cp2/cp1 CPU time",
                     "saved peak cp1 / cp2 MiB (ratio)", "held after forward cp1 / cp2 MiB (ratio)"], rows)


def autoload_startup(figures: dict) -> str:
    """The autoload hook's start-up cost (docs/zero.md's figures): per contender, medians of interleaved rounds."""
    rows = [(f"`python -c pass`, {row['label']}", row, figures["rounds"]) for row in figures["startup"]]
    if "import_deepspeed" in figures:
        rows.append(("`import deepspeed`, hook on / off", figures["import_deepspeed"], figures["deepspeed_rounds"]))
    return markdown(["start", "rounds", "without ms", "with ms", "with / without", "added ms"],
                    [[label, rounds, f"{1000 * row['without_s']:.1f}", f"{1000 * row['with_s']:.1f}",
                      ratio_range(row["ratio"]), f"{1000 * row['added_s']:.2f}"] for label, row, rounds in rows])


# ---- zero_megatron -------------------------------------------------------------------------------------------
def zero_megatron(figures: dict) -> str:
    """ZeRO on the Megatron-Core path (bench/zero_megatron.py): every gas in one table."""
    rows = [[gas, row["contender"], f"{row['step_ms']:.0f}", f"{row['exposed_ms']:.0f}",
             ratio_range(row["exposed_over_collectives"], 2) if row["exposed_over_collectives"] else "",
             f"{row['grad_bytes_per_param']:.2f}", f"{row['reductions_in_backward']}/{row['reductions']}",
             {True: "yes", False: "NO", None: "n/a (other buckets)"}[row["identical_to_blocking"]]]
            for gas, table in figures["gas"].items() for row in table["rows"]]
    return (f"Forward+backward of one micro-batch: {figures['forward_backward_ms']:.0f} ms"
            + emulated_note(figures["model"].get("emulated_compute_ms")) + "; one round's fp32 "
            f"reduce-scatters alone on this wire: {1000 * figures['round_reduce_scatter_alone_s']:.0f} ms.\n\n"
            + markdown(["gas", "contender", "step ms", "exposed ms", "exp/coll", "grad B/param", "in bwd",
                        "bit-identical to blocking"], rows))
