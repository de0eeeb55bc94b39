"""Top-down slow-rank analysis over the 4D mesh (paper section 6.1), and ``l3plugin analyze-trace``.

In a collective every member waits for the last one to arrive, so the slowest rank is the one whose
collective looks *shortest*. In a multi-dimensional mesh that rank may itself only be late because it
waited for a peer in another dimension (the paper's figure 8: rank 2 looks slowest in its TP group, yet
it was waiting for its CP peer, rank 6). So we go top-down, outermost dimension first, DP -> PP -> CP ->
TP, each time keeping only the ranks at the coordinate that made the others wait, until one rank is left.

Definitions (per matched call = the same collective on every member, or one send with its receive):
  * wait of a member = from its start to the start of the last member to arrive, but no longer than its
    own call lasted (a send that returned at once did not wait, whatever the clock says);
  * lateness of a member = how long after the first member it arrived, but no more than the longest
    wait in that call -- the time it cost the others.
  * calls are matched across ranks by channel (process group, or sender/receiver pair) and their order
    on it; their group is classified by which mesh coordinates vary among the members under the order
    [TP, CP, PP, DP] (``MeshShape``): "tp", "pp", or several ("cp-dp" for a DP x CP gradient group).
  * at level D (DP, PP, CP, TP; sizes 1 are skipped) we take the calls among the remaining candidates
    whose outermost varying dimension is D, add up each candidate's lateness by its D coordinate, and
    keep the coordinate with the most. That is the paper's "find the member the others wait for, then
    look at its group in the next dimension", with the evidence of every group at the level summed by
    coordinate so that one noisy group cannot mislead (the late member's next group lies in the kept
    slab). A level without such calls cannot narrow; if more than one candidate is left at the end, the
    one that arrived latest overall is named and the answer is flagged as ambiguous.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass

from l3plugin.arguments.flags import positive_int
from l3plugin.debug.traces import TraceSet, load_traces
from l3plugin.mesh.shape import DIMS, MeshShape

LEVELS = ("dp", "pp", "cp", "tp")  # outermost first


@dataclass
class _Call:
    label: str                 # varying dimensions, inner first: "tp", "cp-dp", ...
    outer: str | None          # outermost varying dimension
    group: tuple               # the mesh group it belongs to (for the tables)
    waits: dict                # rank -> seconds
    lateness: dict             # rank -> seconds


@dataclass
class SlowRankReport:
    slowest_rank: int
    mesh: MeshShape
    path: list
    groups: list               # wait-time table per group, most waiting first
    wait_by_dim: dict          # label -> [seconds per rank]
    calls: int
    ambiguous: bool
    warnings: list
    source: str

    def to_dict(self, top: int | None = None) -> dict:
        return {"slowest_rank": self.slowest_rank, "coords": self.mesh.coords(self.slowest_rank),
                "mesh": dict(zip(DIMS, self.mesh.sizes)), "ambiguous": self.ambiguous, "path": self.path,
                "groups": self.groups[:top] if top else self.groups, "wait_by_dim": self.wait_by_dim,
                "matched_calls": self.calls, "source": self.source, "warnings": self.warnings}

    def format_text(self, top: int = 10) -> str:
        c = self.mesh.coords(self.slowest_rank)
        out = [f"Slowest rank: {self.slowest_rank} (tp={c['tp']} cp={c['cp']} pp={c['pp']} dp={c['dp']})"
               + ("  [ambiguous: see notes]" if self.ambiguous else ""),
               f"{self.calls} matched calls from {self.source} traces; mesh tp={self.mesh.tp} cp={self.mesh.cp} "
               f"pp={self.mesh.pp} dp={self.mesh.dp}", "",
               "Top-down path, outermost dimension first (the member arriving last makes the others wait):"]
        for step in self.path:
            if "note" in step:
                out.append(f"  {step['dim'].upper():<3} {step['note']}")
                continue
            by_coord = ", ".join(f"{step['dim']}={k} {v:.3f} s" for k, v in step["lateness_by_coordinate"].items())
            out.append(f"  {step['dim'].upper():<3} group {step['group']}: rank {step['late_rank']} arrives last; "
                       f"the others waited {step['wait_s']:.3f} s  (lateness: {by_coord})")
        out += ["", f"Wait time per group (top {min(top, len(self.groups))} of {len(self.groups)}):"]
        for g in self.groups[:top]:
            members = ", ".join(f"rank {m['rank']} {m['wait_s']:.3f}" for m in g["members"])
            out.append(f"  {g['dim'].upper():<6} {g['group']}  {g['calls']} calls, total wait "
                       f"{g['total_wait_s']:.3f} s: {members}")
        out += [f"note: {w}" for w in self.warnings]
        return "\n".join(out)


def _match_calls(trace: TraceSet):
    """Group events into calls: {(channel, seq): {rank: event}}, checking that members agree."""
    calls = defaultdict(dict)
    for rank, events in trace.events.items():
        for ev in events:
            calls[(ev.channel, ev.seq)][rank] = ev
    matched, incomplete = [], 0
    for (channel, seq), by_rank in calls.items():
        members = next(iter(by_rank.values())).participants
        if len(members) < 2:
            continue  # a group of one waits for nobody
        ops = {ev.op for ev in by_rank.values()}
        if channel[0] == "coll" and len(ops) > 1:
            detail = ", ".join(f"rank {r}: {ev.op}" for r, ev in sorted(by_rank.items()))
            raise ValueError(f"traces disagree on call #{seq} of group {list(channel[2])} ({detail}): they do "
                             f"not cover the same calls (different trace windows?) or the job was desynced")
        if set(by_rank) != set(members):
            incomplete += 1  # a member's trace window ends before (or starts after) this call
            continue
        matched.append(by_rank)
    return matched, incomplete


class _Classifier:
    def __init__(self, mesh: MeshShape):
        self.mesh = mesh
        self.coords = [tuple(mesh.coords(r)[d] for d in DIMS) for r in range(mesh.world_size)]
        self._group_of: dict = {}

    def varying(self, ranks) -> list[str]:
        return [d for i, d in enumerate(DIMS) if len({self.coords[r][i] for r in ranks}) > 1]

    def mesh_group(self, label: str, rank: int) -> tuple:
        if label not in self._group_of:
            self._group_of[label] = {r: tuple(g) for g in self.mesh.group_ranks(label) for r in g}
        return self._group_of[label][rank]


def _call_waits(by_rank: dict, clf: _Classifier) -> _Call:
    starts = {r: ev.start_us for r, ev in by_rank.items()}
    first, last = min(starts.values()), max(starts.values())
    waits = {}
    for r, ev in by_rank.items():
        wait = last - starts[r]
        if ev.duration_us is not None:
            wait = min(wait, ev.duration_us)
        waits[r] = max(wait, 0.0) / 1e6
    longest = max(waits.values())
    lateness = {r: min((s - first) / 1e6, longest) for r, s in starts.items()}
    ranks = sorted(by_rank)
    varying = clf.varying(ranks)
    label = "-".join(varying) or "self"
    group = tuple(ranks)
    if varying:
        enclosing = clf.mesh_group(label, ranks[0])
        group = enclosing if set(ranks) <= set(enclosing) else group
    return _Call(label, varying[-1] if varying else None, group, waits, lateness)


def _check_layout(trace: TraceSet, clf: _Classifier):
    """Refuse traces whose recorded TP/CP/PP/DP groups do not follow the [TP, CP, PP, DP] order."""
    for rank, groups in sorted(trace.recorded_groups.items()):
        for dim in DIMS:
            got = sorted(groups.get(dim) or [])
            want = list(clf.mesh_group(dim, rank))
            if got and got != want:
                raise ValueError(
                    f"rank {rank}'s {dim.upper()} group is {got} in its trace, but tp={clf.mesh.tp} cp={clf.mesh.cp} "
                    f"pp={clf.mesh.pp} dp={clf.mesh.dp} in the order [TP, CP, PP, DP] puts it in {want}: the job "
                    f"used another rank order (Megatron's default is tp-cp-ep-dp-pp) or other sizes")


def _check_groups_fit(matched, clf: _Classifier):
    """Refuse a mesh under which the traces' collective groups are not mesh groups.

    Under the right sizes every collective runs on a whole group of the mesh (TP, CP, CP x DP, ...). A
    group that is only part of the mesh group spanning its members means the sizes are wrong (e.g.
    --tp 2 --cp 4 for a tp=4 x cp=2 job makes each TP group of 4 look like half a TP x CP group of 8).
    Only groups within one pipeline (varying PP alone, e.g. Megatron's embedding group of the first and
    last stage) are legitimately partial.
    """
    for by_rank in matched:
        event = next(iter(by_rank.values()))
        if event.is_p2p:
            continue
        ranks = sorted(by_rank)
        varying = clf.varying(ranks)
        if not varying or varying == ["pp"]:
            continue
        label = "-".join(varying)
        enclosing = list(clf.mesh_group(label, ranks[0]))
        if ranks != enclosing:
            m = clf.mesh
            raise ValueError(
                f"the traces' {event.op} group {ranks} is not a group of the mesh tp={m.tp} cp={m.cp} pp={m.pp} "
                f"dp={m.dp} in the order [TP, CP, PP, DP] (its members differ in {label.upper()}, whose group "
                f"there is {enclosing}): the mesh sizes do not match the job; pass the --tp/--cp/--pp/--dp "
                f"the job used")


def analyze_traces(trace: TraceSet, mesh: MeshShape) -> SlowRankReport:
    if mesh.world_size != trace.world_size:
        raise ValueError(f"mesh tp*cp*pp*dp = {mesh.world_size} but the traces come from {trace.world_size} ranks")
    clf = _Classifier(mesh)
    _check_layout(trace, clf)
    matched, incomplete = _match_calls(trace)
    if not matched:
        raise ValueError("no call was seen by all of its members: nothing to analyse "
                         "(do the traces cover the same steps?)")
    _check_groups_fit(matched, clf)
    calls = [_call_waits(by_rank, clf) for by_rank in matched]
    warnings = list(trace.warnings)
    if incomplete:
        warnings.append(f"{incomplete} calls missing from some member's trace were left out")

    candidates, levels = set(range(mesh.world_size)), []
    for dim in LEVELS:
        size = getattr(mesh, dim)
        if size == 1:
            continue
        axis = DIMS.index(dim)
        level_calls = [c for c in calls if c.outer == dim and set(c.waits) <= candidates]
        score = [0.0] * size
        for c in level_calls:
            for r, late in c.lateness.items():
                score[clf.coords[r][axis]] += late
        if not level_calls or max(score) <= 0.0:
            levels.append({"dim": dim, "note": f"no {dim.upper()} call made anyone wait; not narrowed",
                           "candidates": sorted(candidates)})
            continue
        best = max(range(size), key=lambda i: (score[i], -i))
        candidates = {r for r in candidates if clf.coords[r][axis] == best}
        levels.append({"dim": dim, "coordinate": best, "calls": len(level_calls),
                       "lateness_by_coordinate": {str(i): round(s, 6) for i, s in enumerate(score)},
                       "candidates": sorted(candidates)})

    total_late = defaultdict(float)
    for c in calls:
        for r, late in c.lateness.items():
            total_late[r] += late
    slowest = max(sorted(candidates), key=lambda r: total_late[r])
    ambiguous = len(candidates) > 1
    if ambiguous:
        warnings.append(f"the levels left {len(candidates)} candidates {sorted(candidates)}; rank {slowest} "
                        f"arrived latest overall among them")

    tables = _group_tables(calls)
    path = [_path_step(step, slowest, tables) for step in levels]
    wait_by_dim = defaultdict(lambda: [0.0] * mesh.world_size)
    for c in calls:
        for r, w in c.waits.items():
            wait_by_dim[c.label][r] += w
    order = {d: i for i, d in enumerate(DIMS)}
    wait_by_dim = {k: [round(w, 6) for w in v] for k, v in
                   sorted(wait_by_dim.items(), key=lambda kv: (kv[0].count("-"), order.get(kv[0], 9), kv[0]))}
    return SlowRankReport(slowest, mesh, path, tables, wait_by_dim, len(calls), ambiguous, warnings, trace.source)


def _group_tables(calls) -> list:
    acc = {}
    for c in calls:
        entry = acc.setdefault((c.label, c.group), {"calls": 0, "wait": defaultdict(float),
                                                      "late": defaultdict(float)})
        entry["calls"] += 1
        for r in c.waits:
            entry["wait"][r] += c.waits[r]
            entry["late"][r] += c.lateness[r]
    tables = []
    for (label, group), e in acc.items():
        members = sorted(({"rank": r, "wait_s": round(e["wait"][r], 6), "lateness_s": round(e["late"][r], 6)}
                          for r in e["wait"]), key=lambda m: (-m["wait_s"], m["rank"]))
        tables.append({"dim": label, "group": list(group), "calls": e["calls"],
                       "total_wait_s": round(sum(e["wait"].values()), 6), "members": members})
    return sorted(tables, key=lambda t: (-t["total_wait_s"], t["group"]))


def _path_step(step: dict, slowest: int, tables: list) -> dict:
    """Name the level's group that holds the slowest rank, and who made its members wait."""
    if "note" in step:
        return step
    mine = [t for t in tables if slowest in t["group"] and t["dim"].split("-")[-1] == step["dim"]]
    if not mine:
        return {**step, "note": f"rank {slowest} took part in no {step['dim'].upper()} call"}
    table = max(mine, key=lambda t: (t["dim"] == step["dim"], t["total_wait_s"]))
    late = max(table["members"], key=lambda m: (m["lateness_s"], -m["rank"]))
    others = sum(m["wait_s"] for m in table["members"] if m["rank"] != late["rank"])
    return {**step, "group": table["group"], "group_dim": table["dim"], "late_rank": late["rank"],
            "wait_s": round(others, 6), "waits_by_rank": {str(m["rank"]): m["wait_s"] for m in table["members"]}}


def resolve_mesh(trace: TraceSet, tp=None, cp=None, pp=None, dp=None) -> MeshShape:
    """Mesh sizes from the flags, else from the trace metadata; the two must agree when both exist."""
    flags = {d: v for d, v in zip(DIMS, (tp, cp, pp, dp)) if v is not None}
    meta = trace.mesh_sizes
    if meta:
        conflicts = [f"{d}={v} (trace says {meta[d]})" for d, v in flags.items() if meta[d] != v]
        if conflicts:
            raise ValueError(f"mesh flags disagree with the trace metadata: {', '.join(conflicts)}")
        sizes = dict(meta)
    else:
        sizes = {d: flags.get(d) for d in DIMS}
    return MeshShape.for_world(trace.world_size, tp=sizes["tp"] or 1, cp=sizes["cp"] or 1,
                               pp=sizes["pp"] or 1, dp=sizes["dp"])


def analyze_trace_dir(trace_dir: str, tp=None, cp=None, pp=None, dp=None, kind: str = "auto") -> SlowRankReport:
    trace = load_traces(trace_dir, kind=kind)
    return analyze_traces(trace, resolve_mesh(trace, tp, cp, pp, dp))


def write_heatmap(report: SlowRankReport, path: str) -> None:
    """Per-rank wait time (rows: group kinds, columns: ranks) as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("--png needs matplotlib, which is not installed; install the plot extra: "
                          "pip install 'l3plugin[plot]'") from exc
    labels = list(report.wait_by_dim)
    data = [report.wait_by_dim[k] for k in labels]
    world = report.mesh.world_size
    fig = Figure(figsize=(max(4.0, 0.45 * world + 2), 0.6 * len(labels) + 1.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="viridis")
    ax.set_xticks(range(world))
    ax.set_xticklabels([str(r) for r in range(world)])
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([k.upper() for k in labels])
    ax.get_xticklabels()[report.slowest_rank].set_color("red")
    ax.set_xlabel("rank (red: slowest)")
    if world <= 64:
        top = max((max(row) for row in data), default=0.0)
        for i, row in enumerate(data):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 * top else "white")
    ax.set_title(f"wait time per rank (s); slowest rank {report.slowest_rank}")
    fig.colorbar(im, ax=ax, label="seconds waiting")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _cmd_analyze(args) -> int:
    try:
        report = analyze_trace_dir(args.trace_dir, args.tp, args.cp, args.pp, args.dp, kind=args.format)
        if args.png:
            write_heatmap(report, args.png)
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(args.top)) if args.json else report.format_text(args.top))
    return 0


def add_analyze_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "analyze-trace", help="find the rank that holds the others back, top-down over DP, PP, CP, TP",
        description="Reads per-rank traces (record_collectives jsonl or PyTorch profiler chrome traces), "
                    "matches each collective across its members and narrows down, outermost dimension "
                    "first, to the rank the others wait for.")
    parser.add_argument("trace_dir", help="directory with rank<R>.jsonl or profiler *.json(.gz) files")
    for dim in DIMS:
        parser.add_argument(f"--{dim}", type=positive_int, default=None,
                            help=f"{dim.upper()} size (default: from the trace metadata, else 1"
                                 + ("; DP: what is left" if dim == "dp" else "") + ")")
    parser.add_argument("--format", choices=("auto", "recorder", "kineto"), default="auto",
                        help="trace kind (default: recorder if rank*.jsonl files exist, else kineto)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--png", metavar="FILE", help="write a per-rank wait-time heatmap (needs matplotlib)")
    parser.add_argument("--top", type=positive_int, default=10, help="groups in the wait-time table")
    parser.set_defaults(func=_cmd_analyze)
    return parser
