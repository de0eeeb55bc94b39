"""Trace readers and the analysis on synthetic traces (no processes): the paper's figure-8 trap, the
Kineto GPU trace shape, the CLI, and malformed or truncated files that must fail loudly."""

import argparse
import gzip
import json
import sys

import pytest

from l3plugin.debug.slow_rank import add_analyze_parser, analyze_trace_dir
from l3plugin.debug.traces import load_traces, parse_group_ranks
from l3plugin.mesh.shape import MeshShape

T0 = 1_700_000_000.0  # seconds on the wall clock
EPS = 0.001           # how long a collective takes once everyone is there


def simulate(world, slow, steps, rounds=3, slow_compute=0.1, compute=0.01):
    """Per-rank call lists of a toy step: each collective ends when its last member arrives (+EPS);
    a send returns at once, its receive ends when the send was made."""
    ready = {r: T0 for r in range(world)}
    calls = {r: [] for r in range(world)}
    for _ in range(rounds):
        for r in ready:
            ready[r] += slow_compute if r == slow else compute
        for kind, op, groups in steps:
            for g in groups:
                if kind == "coll":
                    end = max(ready[r] for r in g) + EPS
                    for r in g:
                        calls[r].append({"op": op, "group": list(g), "start": ready[r], "end": end})
                        ready[r] = end
                else:
                    src, dst = g
                    end = max(ready[src], ready[dst]) + EPS
                    pair = {"group": sorted(g), "src": src, "dst": dst}
                    calls[src].append({"op": "send", **pair, "start": ready[src], "end": ready[src] + EPS})
                    calls[dst].append({"op": "recv", **pair, "start": ready[dst], "end": end})
                    ready[src], ready[dst] = ready[src] + EPS, end
    return calls


def _pg_name(group):
    return "pg" + "_".join(map(str, sorted(group)))


def write_recorder_traces(directory, calls, mesh=None, groups=None):
    world = len(calls)
    for rank, rank_calls in calls.items():
        seq, lines = {}, [{"kind": "meta", "format": "l3plugin-collectives", "version": 1, "rank": rank,
                           "world_size": world, "mesh": mesh, "groups": groups and groups[rank]}]
        for c in rank_calls:
            key = (c["op"] in ("send", "recv"), c.get("src"), c.get("dst"), tuple(c["group"]))
            rec = {"kind": "op", "op": c["op"], "group": c["group"], "pg": _pg_name(c["group"]),
                   "seq": seq.get(key, 0), "bytes": 256, "start": int(c["start"] * 1e9),
                   "end": int(c["end"] * 1e9), "async": False}
            if "src" in c:
                rec.update(src=c["src"], dst=c["dst"], tag=0)
            seq[key] = rec["seq"] + 1
            lines.append(rec)
        lines.append({"kind": "end", "records": len(rank_calls)})
        (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


KINETO_NAMES = {"all_reduce": "allreduce", "all_gather": "_allgather_base", "send": "send", "recv": "recv"}


def write_kineto_traces(directory, calls, gz_ranks=()):
    """Chrome traces in the shape PyTorch's profiler writes for NCCL: relative ts + baseTimeNanoseconds."""
    for rank, rank_calls in calls.items():
        base_ns = int(T0 * 1e9) - 3_600_000_000_000 + rank * 500_000_000  # ranks started 0.5 s apart
        events = [{"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "pid": 0, "tid": 7,
                   "ts": 5.0, "dur": 3.0, "args": {"External id": 1}},
                  # a batch_isend_irecv coalesced by NCCL: no peer ranks, so it cannot be matched
                  {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "pid": 0, "tid": 20, "ts": 9.0,
                   "dur": 2.0, "args": {"Collective name": "coalesced", "Process Group Ranks": "[0, 4]",
                                        "Group size": 2, "Seq": 0}}]
        seq = {}
        for i, c in enumerate(rank_calls):
            args = {"External id": 100 + i, "Collective name": KINETO_NAMES[c["op"]], "dtype": "BFloat16",
                    "In msg nelems": 1024, "Out msg nelems": 1024, "Group size": len(c["group"]),
                    "Process Group Name": _pg_name(c["group"]), "Process Group Description": "undefined",
                    "Process Group Ranks": "[" + ", ".join(map(str, c["group"])) + "]", "Rank": 0}
            if c["op"] == "send":
                args["Dst Rank"] = c["dst"]
            elif c["op"] == "recv":
                args["Src Rank"] = c["src"]
            else:
                key = tuple(c["group"])
                args["Seq"], seq[key] = seq.get(key, 0), seq.get(key, 0) + 1
            ts = (c["start"] * 1e9 - base_ns) / 1000.0
            events.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{c['op']}", "pid": 0, "tid": 20,
                           "ts": ts, "dur": (c["end"] - c["start"]) * 1e6, "args": args})
            # The CPU op that launched it: ignored when kernels exist (CPU issue time, not GPU arrival).
            events.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 1,
                           "ts": ts - 50_000.0, "dur": 10.0, "args": dict(args)})
        trace = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": len(calls)},
                 "baseTimeNanoseconds": base_ns, "traceEvents": events, "traceName": f"rank{rank}"}
        name = f"host_{rank}.pt.trace.json"
        if rank in gz_ranks:
            with gzip.open(directory / (name + ".gz"), "wt") as fh:
                json.dump(trace, fh)
        else:
            (directory / name).write_text(json.dumps(trace, indent=1))


def figure8_calls(slow=6):
    """Paper figure 8: cp=2 x tp=4; CP collective first, then TP."""
    shape = MeshShape(tp=4, cp=2)
    return simulate(8, slow, [("coll", "all_gather", shape.group_ranks("cp")),
                              ("coll", "all_reduce", shape.group_ranks("tp"))])


def pp_calls(slow):
    """tp=2 x cp=2 x pp=2: TP, CP, forward sends stage 0 -> 1, backward 1 -> 0."""
    shape = MeshShape(tp=2, cp=2, pp=2)
    fwd = [(g[0], g[1]) for g in shape.group_ranks("pp")]
    return simulate(8, slow, [("coll", "all_reduce", shape.group_ranks("tp")),
                              ("coll", "all_gather", shape.group_ranks("cp")),
                              ("p2p", None, fwd), ("p2p", None, [(b, a) for a, b in fwd])])


def test_figure8_trap_names_the_cp_peer_not_the_rank_that_looks_slow(tmp_path):
    write_recorder_traces(tmp_path, figure8_calls(slow=6))
    report = analyze_trace_dir(str(tmp_path), tp=4, cp=2)
    assert report.slowest_rank == 6 and not report.ambiguous
    assert [(s["dim"], s["group"]) for s in report.path] == [("cp", [2, 6]), ("tp", [4, 5, 6, 7])]
    # In TP group 0..3 rank 2 looks slowest (its collectives are shortest: it waited least) ...
    table = next(t for t in report.groups if t["group"] == [0, 1, 2, 3])
    assert min(table["members"], key=lambda m: m["wait_s"])["rank"] == 2
    # ... but only because it waited for rank 6 in CP first.
    assert "Slowest rank: 6" in report.format_text()


@pytest.mark.parametrize("slow", [0, 3, 5])
def test_kineto_gpu_traces(tmp_path, slow):
    write_kineto_traces(tmp_path, pp_calls(slow), gz_ranks=(3,))
    trace = load_traces(str(tmp_path))
    assert trace.source == "kineto" and len(trace.events[0]) == len(pp_calls(slow)[0])
    assert len(trace.warnings) == 8 and "1 coalesced P2P batches without peer ranks left out" in trace.warnings[0]
    assert trace.events[0][0].nbytes == 2048
    report = analyze_trace_dir(str(tmp_path), tp=2, cp=2, pp=2)
    assert report.slowest_rank == slow, report.format_text()
    assert [s["dim"] for s in report.path] == ["pp", "cp", "tp"]


def test_truncated_group_ranks_are_rebuilt_only_when_unambiguous():
    ranks = list(range(0, 128, 2))
    text = "[" + ", ".join(map(str, ranks[:29])) + ", ..., " + str(ranks[-1]) + "]"
    assert parse_group_ranks(text, group_size=64) == tuple(ranks)
    assert parse_group_ranks(text, group_size=64, start=0, stride=2) == tuple(ranks)
    assert parse_group_ranks([3, 1, 2]) == (1, 2, 3)
    with pytest.raises(ValueError, match="not an evenly strided group"):
        parse_group_ranks("[0, 1, 5, ..., 99]", group_size=40)
    with pytest.raises(ValueError, match="lists 2 ranks but 'Group size' is 3"):
        parse_group_ranks("[0, 1]", group_size=3)


def _cli(argv):
    parser = argparse.ArgumentParser(prog="l3plugin")
    add_analyze_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["analyze-trace", *argv])
    return args.func(args)


def test_cli_json_text_and_heatmap(tmp_path, capsys):
    traces = tmp_path / "t"
    traces.mkdir()
    write_recorder_traces(traces, figure8_calls(), mesh={"tp": 4, "cp": 2, "pp": 1, "dp": 1})
    png = tmp_path / "wait.png"
    assert _cli([str(traces), "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slowest_rank"] == 6 and [s["dim"] for s in out["path"]] == ["cp", "tp"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _cli([str(traces), "--tp", "4", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "Slowest rank: 6" in text and "top 3 of" in text
    assert _cli([str(traces), "--tp", "2"]) == 2
    assert "disagree with the trace metadata: tp=2 (trace says 4)" in capsys.readouterr().err


def test_cli_png_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    write_recorder_traces(tmp_path, figure8_calls(), mesh={"tp": 4, "cp": 2, "pp": 1, "dp": 1})
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    assert _cli([str(tmp_path), "--png", str(tmp_path / "x.png")]) == 2
    assert "l3plugin[plot]" in capsys.readouterr().err


def test_layout_other_than_tp_cp_pp_dp_is_refused(tmp_path):
    megatron_default = MeshShape(tp=2, cp=1, pp=2, dp=2)  # we build tp-cp-pp-dp groups...
    # ...but record the job's groups as Megatron's default order tp-cp-ep-dp-pp would make them.
    groups = {r: {"tp": [r - r % 2, r - r % 2 + 1], "pp": sorted({r % 4, r % 4 + 4}),
                  "dp": sorted({r - r % 4 + r % 2, r - r % 4 + r % 2 + 2})} for r in range(8)}
    calls = simulate(8, 1, [("coll", "all_reduce", megatron_default.group_ranks("tp"))])
    write_recorder_traces(tmp_path, calls, mesh={"tp": 2, "cp": 1, "pp": 2, "dp": 2}, groups=groups)
    with pytest.raises(ValueError, match="another rank order"):
        analyze_trace_dir(str(tmp_path))


def _cut_mid_line(d):
    p = d / "rank3.jsonl"
    p.write_bytes(p.read_bytes()[:-45])  # into the last call record


def _drop_end(d):
    p = d / "rank3.jsonl"
    p.write_text("".join(p.read_text().splitlines(keepends=True)[:-1]))


def _edit_line(lineno, fn):
    def edit(d):
        p = d / "rank3.jsonl"
        lines = p.read_text().splitlines(keepends=True)
        index = lineno - 1 if lineno > 0 else lineno
        lines[index] = fn(lines[index])
        p.write_text("".join(lines))
    return edit


def _set_field(key, value):
    return lambda line: json.dumps({**json.loads(line), key: value}) + "\n"


MALFORMED = {
    "cut mid-line": (_cut_mid_line, r"rank3\.jsonl:\d+: .*truncated"),
    "no end record": (_drop_end, r"rank3\.jsonl: no end record after line \d+: the trace is truncated"),
    "garbage line": (_edit_line(4, lambda _: "{not json\n"), r"rank3\.jsonl:4: not valid JSON"),
    "start is text": (_edit_line(2, _set_field("start", "12:00")), r"rank3\.jsonl:2: field 'start'"),
    "rank mismatch": (_edit_line(1, _set_field("rank", 4)),
                      r"rank3\.jsonl:1: metadata says rank 4 but the file name says rank 3"),
    "not our format": (_edit_line(1, lambda _: '{"hello": 1}\n'), r"rank3\.jsonl:1: first line must be"),
    "missing rank": (lambda d: (d / "rank5.jsonl").unlink(), r"missing for ranks \[5\]"),
    "ops disagree": (_edit_line(2, _set_field("op", "broadcast")), r"traces disagree on call #0 of group"),
    "end count": (_edit_line(-1, _set_field("records", 99)), r"end record counts 99 calls"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_recorder_traces_raise_clear_errors(tmp_path, case):
    write_recorder_traces(tmp_path, figure8_calls())
    damage, message = MALFORMED[case]
    damage(tmp_path)
    with pytest.raises(ValueError, match=message):
        analyze_trace_dir(str(tmp_path), tp=4, cp=2)


def test_malformed_kineto_traces_raise_clear_errors(tmp_path):
    write_kineto_traces(tmp_path, figure8_calls())
    path = tmp_path / "host_2.pt.trace.json"
    good = path.read_text()
    path.write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"host_2\.pt\.trace\.json:\d+: not valid JSON"):
        load_traces(str(tmp_path))
    path.write_text(good.replace('"[2, 6]"', '"[2, six]"', 1))
    with pytest.raises(ValueError, match=r"host_2\.pt\.trace\.json: event #\d+ .*holds non-integers"):
        load_traces(str(tmp_path))
    (tmp_path / "copy_of_host_2.json").write_text(good)
    path.write_text(good)
    with pytest.raises(ValueError, match="rank 2 also has a trace"):
        load_traces(str(tmp_path))


def test_empty_directory_and_wrong_sizes(tmp_path):
    with pytest.raises(ValueError, match="no trace files"):
        load_traces(str(tmp_path))
    write_recorder_traces(tmp_path, figure8_calls())
    with pytest.raises(ValueError, match="world size 8 != tp"):
        analyze_trace_dir(str(tmp_path), tp=4, cp=2, dp=2)


def test_binary_file_directory_and_contradicting_mesh_flags_give_clear_errors(tmp_path):
    write_recorder_traces(tmp_path, figure8_calls())
    good = (tmp_path / "rank3.jsonl").read_bytes()
    (tmp_path / "rank3.jsonl").write_bytes(good[:200] + b"\n\xff\xfe\x00garbage\x9c" + good[200:])
    with pytest.raises(ValueError, match=r"rank3\.jsonl:\d+: byte 201 is not UTF-8 text: a binary or corrupted file"):
        analyze_trace_dir(str(tmp_path), tp=4, cp=2)
    (tmp_path / "rank3.jsonl").write_bytes(good)

    (tmp_path / "rank5.jsonl").unlink()
    (tmp_path / "rank5.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"rank5\.jsonl: is a directory, not a trace file; move it out of"):
        analyze_trace_dir(str(tmp_path), tp=4, cp=2)
    (tmp_path / "rank5.jsonl").rmdir()

    write_recorder_traces(tmp_path, figure8_calls())  # tp=4 x cp=2, no mesh metadata in the traces
    assert analyze_trace_dir(str(tmp_path), tp=4, cp=2).slowest_rank == 6
    # (--tp 4 --dp 2 builds the very same groups, only named DP: traces without metadata cannot tell.)
    for flags in (dict(tp=2, cp=4), dict(tp=2, dp=4), dict(tp=8), dict(cp=2, dp=4)):
        with pytest.raises(ValueError, match=r"the traces' all_\w+ group \[[0-9, ]+\] is not a group of the mesh "
                                             r"tp=\d cp=\d pp=1 dp=\d .*the mesh sizes do not match the job"):
            analyze_trace_dir(str(tmp_path), **flags)


def test_cli_names_the_file_of_a_binary_trace(tmp_path, capsys):
    write_recorder_traces(tmp_path, figure8_calls())
    (tmp_path / "rank0.jsonl").write_bytes(bytes(range(256)))
    assert _cli([str(tmp_path), "--tp", "4", "--cp", "2"]) == 2
    # line 2: byte 10 of the file is a newline
    assert "rank0.jsonl:2: byte 128 is not UTF-8 text" in capsys.readouterr().err
