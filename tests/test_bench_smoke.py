"""Tiny runs of the benches on bench/harness.py, with --json: each runs to the end, prints only its JSON record
on stdout (its tables on stderr), that record holds the figures it printed, and bench/docs_tables.py renders
each docs table of the bench from it (the docs' header; the simulated pipeline table: the docs' rows). Sizes are
far too small for the timings to mean anything; no timing is asserted. (multimodal_pp simulated and cp_memory:
test_bench_harness.py, against the docs.) On the per-rank wire (root, ip, tc; skipped otherwise), cp_attention,
pp_schedule, a one-variant zero.py and a one-contender zero_megatron.py start their ranks on their own links,
and their wire tables say so.

A run costs mostly imports: torch in some bench processes, and in every RankPool's fork server torch and
Megatron-Core, DeepSpeed or transformers. So the runs go in two groups, each group's benches one after the other
in one interpreter (tests/bench_driver.py: each bench executed as `python bench/X.py ... --json` would, its
stdout and stderr its own), whose fork server, started once, imports the group's preloads once for all of its
pools. Both groups start when the module starts (tests/runs_ahead.py), side by side on the two cores; a test
takes its run's record once that run has ended."""

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))
import docs_tables  # noqa: E402
import wire  # noqa: E402
from runs_ahead import SESSION, time_allowed  # noqa: E402


def rendered_rows(table, record):
    """The table ``table`` rendered from ``record`` (bench/docs_tables.py): its header matches the docs table it
    regenerates (where the docs hold one, DOC_FIGURES names it); returns its data rows, cells split."""
    text = docs_tables.render(table, record)
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert lines[1].startswith("|---") and len(lines) > 2, text
    doc = ROOT / docs_tables.TABLES[table].doc
    in_docs = [line for d, line, names, _ in docs_tables.DOC_FIGURES if table in names and line.startswith("|")]
    if in_docs:
        assert lines[0] in docs_tables.doc_tables(doc.read_text()), f"{table}: header not in {doc}: {lines[0]}"
    width = lines[0].count("|")
    assert all(line.count("|") == width for line in lines), text
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[2:]]


# The runs of the tests below on loopback: the test that checks each -> the bench command (without --json).
LOOPBACK_RUNS = {
    "test_pp_schedule_real_run_and_simulated_tables":
        ("bench/pp_schedule.py", "--steps", "1", "--hidden", "32", "--seq", "16"),
    "test_zero_table":
        ("bench/zero.py", "--quick", "--gas", "2", "--rounds", "1", "--variants", "ours ZeRO-1"),
    "test_pp_zero_bubble_rows":
        ("bench/pp_schedule.py", "--zero-bubble", "--zb-vpp", "1", "--layers", "2", "--hidden", "32", "--seq", "8",
         "--mbs", "1", "--rounds", "1"),
    "test_pp_zero_bubble_gpt_rows":
        ("bench/pp_zero_bubble_gpt.py", "--vpps", "2", "--microbatches", "2", "--layers", "4", "--hidden", "32",
         "--heads", "4", "--seq", "8", "--mbs", "1", "--rounds", "1"),
    "test_multimodal_real_section":
        ("bench/multimodal_pp.py", "real", "--hidden", "32", "--heads", "4", "--text-seq", "16", "--image-tokens",
         "16", "--encoder-width", "16", "--rounds", "1", "--microbatches", "2"),
    "test_hf_cp_table":
        ("bench/hf_cp.py", "--seq", "256", "--rounds", "1"),
    "test_cp_attention_timed_rows":
        ("bench/cp_attention.py", "--seq", "256", "--rounds", "1", "--work-seq", "2048", "--draws", "1"),
    "test_idle_groups_rows":
        ("bench/idle_groups.py", "--groups", "0", "3", "--idle", "0.2", "--reduces", "10"),
    "test_autoload_startup_rows":
        ("bench/autoload_startup.py", "--rounds", "1", "--deepspeed-rounds", "0"),
}

# The per-rank wire runs: bench -> (its options after --wire 200mbit, where its figures sit in the record, the
# docs tables that render them). zero.py runs one variant (stock ZeRO-1: its baseline only) and zero_megatron.py
# one contender, each with 20 ms of emulated accelerator compute per micro-batch; the variants' table columns are
# test_zero_table's, on loopback.
WIRE_RUNS = {
    "zero_megatron": (["--quick", "--gas", "2", "--layers", "1", "--contenders", "ZeRO-2 default",
                       "--emulated-compute", "20"], (),
                      ["zero-megatron"]),
    "pp_schedule": (["--vpp", "2", "--layers", "4", "--microbatches", "4", "--rounds", "1", "--hidden", "32",
                     "--seq", "16", "--mbs", "1", "--agreed-order"], ("wire",), ["pp-wire"]),
    "zero": (["--quick", "--gas", "2", "--rounds", "1", "--variants", "stock ZeRO-1", "--emulated-compute", "20"], (),
             ["zero-wire", "zero"]),
    "cp_attention": (["--seq", "256", "--rounds", "1", "--work-seq", "--masks", "causal"], (),
                     ["cp-wire", "cp-regather"]),
}
WIRE_HERE = wire.why_not_here()  # None where the wire can be made (root, ip, tc)


def wire_test(bench):
    return f"test_bench_runs_on_the_per_rank_wire[{bench}]"


def command(test):
    """The bench command (without --json) of a test's run."""
    if test in LOOPBACK_RUNS:
        return LOOPBACK_RUNS[test]
    bench = test[test.index("[") + 1:-1]
    return (f"bench/{bench}.py", "--wire", "200mbit", *WIRE_RUNS[bench][0])


# The two groups: the fork server's preload (every RankPool preload of the group's benches), then the tests whose
# runs it makes, in the order they run. Megatron-Core's: the pipeline simulation, which needs no fork server, runs
# first, while the server imports. The other: DeepSpeed's and transformers' benches and the torch-only ones (their
# workers start with those imported too: more than they need, nothing they lack). Each group is about half of the
# CPU seconds.
GROUPS = {
    "megatron": (["megatron.core"],
                 ["test_pp_schedule_real_run_and_simulated_tables", "test_pp_zero_bubble_rows",
                  "test_pp_zero_bubble_gpt_rows", "test_multimodal_real_section",
                  wire_test("pp_schedule"), wire_test("zero_megatron")]),
    "others": (["transformers.models.llama.modeling_llama", "deepspeed", "torch._inductor.compile_fx"],
               ["test_autoload_startup_rows", "test_cp_attention_timed_rows", wire_test("cp_attention"),
                "test_idle_groups_rows", "test_hf_cp_table", "test_zero_table", wire_test("zero")]),
}


def outcome(folder, i, driver_err=""):
    """(exit status, stdout, stderr) of run ``i`` of a group, from the driver's files; a run it has not finished
    (yet, or ever) has no exit status, and its stderr is the driver's."""
    if not (folder / f"{i}.rc").exists():  # written last
        return None, "", driver_err
    return tuple((folder / f"{i}.{part}").read_text() for part in ("rc", "out", "err"))


def group_run(folder, preload, tests, timeout=900):
    """The tests' bench runs, one after the other in one interpreter (tests/bench_driver.py): {test: (exit status,
    stdout, stderr) of its run}, and the wire namespaces the group left behind (named after the driver's pid; each
    bench's wire goes when the driver exits, as when a bench exits)."""
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"preload": preload, "runs": [[str(i), [*command(test), "--json"]]
                                                             for i, test in enumerate(tests)]}))
    driver = subprocess.Popen([sys.executable, str(ROOT / "tests/bench_driver.py"), str(folder), str(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    try:
        out, err = driver.communicate(timeout=time_allowed(timeout))
    finally:
        driver.kill()
        driver.wait()
    driver_err = (folder / "driver.err").read_text() if (folder / "driver.err").exists() else ""
    assert driver.returncode == 0, f"bench driver: exit {driver.returncode}\n{err[-3000:]}\n{driver_err[-3000:]}"
    left = {name for name, pid in wire.namespaces().items() if pid == driver.pid}
    return {test: outcome(folder, i, driver_err) for i, test in enumerate(tests)}, left


def json_record(test, rc, stdout, stderr):
    """The record of a test's run (its stdout must be exactly one JSON line) and its stderr."""
    argv = command(test)
    assert rc == "0", f"{argv}: exit {rc}\n{stderr[-3000:]}"
    lines = stdout.splitlines()
    assert len(lines) == 1, f"{argv}: stdout holds more than the JSON record: {stdout[:2000]}"
    record = json.loads(lines[0])
    assert record["command"] == [str(argv[0]), *map(str, argv[1:]), "--json"]
    assert record["machine"]["cpu_count"] == os.cpu_count()
    return record, stderr


assert set(sum((tests for _, tests in GROUPS.values()), [])) == set(LOOPBACK_RUNS) | {wire_test(b) for b in WIRE_RUNS}


class Runs:
    """The groups of the selected tests, started ahead (tests/runs_ahead.py); ``record(test)`` as soon as the
    test's own run has ended (not its whole group), ``wire_left(test)`` once its group has."""

    def __init__(self, tmp_path_factory, selected):
        selected = set(selected)
        if WIRE_HERE is not None:
            selected -= {wire_test(bench) for bench in WIRE_RUNS}
        runs, needed_by, self.where, self.ended = {}, {}, {}, set()
        for group, (preload, tests) in GROUPS.items():
            tests = [test for test in tests if test in selected]
            if tests:
                folder = tmp_path_factory.mktemp(group)
                runs[group] = functools.partial(self._group_run, group, folder, preload, tests)
                needed_by[group] = tuple(tests)
                self.where.update({test: (group, folder, i) for i, test in enumerate(tests)})
        self.runs, self.needed_by = runs, needed_by
        self.ahead = None  # this module's runs in the session's queue, once its tests start (the fixture below)

    def _group_run(self, group, *args):
        try:
            return group_run(*args)
        finally:
            self.ended.add(group)

    def record(self, test):
        group, folder, i = self.where[test]
        while not (folder / f"{i}.rc").exists() and group not in self.ended:
            time.sleep(0.2)
        if (folder / f"{i}.rc").exists():
            return json_record(test, *outcome(folder, i))
        return json_record(test, *self.ahead.result(group)[0][test])  # the group's error, or the driver's stderr

    def wire_left(self, test):
        return self.ahead.result(self.where[test][0])[1]


RUNS: list = []  # this session's Runs (ahead_runs makes it)


def ahead_runs(tmp_path_factory, selected):
    """The groups of the selected tests, queued in the background when the session starts (tests/runs_ahead.py)."""
    RUNS[:] = [Runs(tmp_path_factory, selected)]
    return RUNS[0].runs, RUNS[0].needed_by


@pytest.fixture(scope="module")
def ahead(request):
    (runs,) = RUNS
    runs.ahead = SESSION.of_module(request.module)
    return runs


def test_cp_attention_timed_rows(ahead):
    record, _ = ahead.record("test_cp_attention_timed_rows")
    figures = record["figures"]
    assert [row["seq"] for row in figures["work"]] == [2048] * 3
    (timed,) = figures["timed"]
    assert set(timed["contenders"]) == {"cp1 non-causal", "cp1 causal", "cp1 docs", "cp2 causal", "cp2 docs 2cp",
                                        "cp2 docs balanced", "ring causal", "ring docs"}
    assert timed["ring_vs_all_gather_max_abs_difference"] < 1e-4  # the ring baseline computes the same attention
    assert all(c["wall_s"] > 0 and len(c["busy_s"]) == 2 for c in timed["contenders"].values())
    (row,) = rendered_rows("cp-timed", record)
    assert row[0] == "256" and row[2].endswith("(pairs 1.000)") and "work max/min" in row[6]
    (row,) = rendered_rows("cp-work", record)
    assert row[:2] == ["2K", "2 / 4 / 8"] and row[3].count(" / ") == 2
    (row,) = rendered_rows("torch-cp-work", record)  # torch's load balancers on the same documents (bench/torch_cp.py)
    assert row[:2] == ["2K", "2 / 4 / 8"] and row[-1] == " / ".join(["1.00, 1.00"] * 3)
    with pytest.raises(ValueError, match="this run was on loopback"):
        docs_tables.render("cp-wire", record)


def test_autoload_startup_rows(ahead):
    record, _ = ahead.record("test_autoload_startup_rows")
    rows = record["figures"]["startup"]
    assert [r["label"] for r in rows] == ["installed", "copy, compiled", "copy, cached"]
    assert all(r["with_s"] > 0 and r["without_s"] > 0 for r in rows)
    assert "import_deepspeed" not in record["figures"]
    rows = rendered_rows("autoload-startup", record)
    assert [row[0] for row in rows] == ["`python -c pass`, installed", "`python -c pass`, copy, compiled",
                                        "`python -c pass`, copy, cached"]
    assert all(row[1] == "1" and float(row[2]) > 0 for row in rows)


def test_zero_table(ahead):
    record, _ = ahead.record("test_zero_table")
    assert docs_tables.render("zero", record).startswith("gas 2:\n")  # on loopback: no wire line
    rows = {row[0]: row for row in rendered_rows("zero", record)}
    assert list(rows) == ["stock ZeRO-1", "ours ZeRO-1", "ours ZeRO-1 no overlap"]
    assert rows["stock ZeRO-1"][2] == "" and rows["ours ZeRO-1"][2].count("(") == 1  # ratio against stock
    assert rows["ours ZeRO-1"][4] != "" and rows["ours ZeRO-1"][8].startswith("0.3 P2P fp32 + ")
    with pytest.raises(ValueError, match="this run was on loopback"):
        docs_tables.render("zero-wire", record)


def test_hf_cp_table(ahead):
    record, _ = ahead.record("test_hf_cp_table")
    (row,) = rendered_rows("hf-cp", record)
    assert row[:2] == ["256", str(record["figures"]["rows"][0]["documents"])] and row[2].endswith(" s")


def test_pp_schedule_real_run_and_simulated_tables(ahead):
    """One run of both parts: the simulated tables (schedules, receive posting) are the docs' ones; the real
    run's row renders."""
    record, _ = ahead.record("test_pp_schedule_real_run_and_simulated_tables")
    assert docs_tables.missing_lines(docs_tables.render("pp-simulated", record),
                                     (ROOT / "docs/benchmarks.md").read_text()) == []
    assert docs_tables.missing_lines(docs_tables.render("pp-posting-simulated", record),
                                     (ROOT / "docs/pipeline.md").read_text()) == []
    (row,) = rendered_rows("pp-real", record)
    assert row[:8] == ["4", "4", "2", "8", "4", "32", "16", "1"] and row[-1] == "yes"


def test_pp_zero_bubble_rows(ahead):
    """flexible vs flexible-zb at v 1, m p..4p: identical gradients, and both plans simulated with the step costs
    the run measured (a forward, B and W per stage for zb; stage 0's B is empty: its input needs no gradient)."""
    record, _ = ahead.record("test_pp_zero_bubble_rows")
    rows = record["figures"]["zero_bubble"]["rows"]
    assert [(row["v"], row["m"]) for row in rows] == [(1, 2), (1, 4), (1, 8)]
    for row in rows:
        assert row["identical_gradients"]
        costs = row["measured_stage_costs_ms"]
        assert [len(c) for c in costs["flexible"]] == [2, 2] and [len(c) for c in costs["flexible-zb"]] == [3, 3]
        assert costs["flexible-zb"][0][1] < costs["flexible-zb"][0][2] and costs["flexible-zb"][1][1] > 0
        assert row["simulated_step_ratio_measured_costs"] > 0 and len(row["split_over_fused_backward"]) == 2


def test_pp_zero_bubble_gpt_rows(ahead):
    """A GPTModel under flexible, flexible-zb and flexible-zb with Megatron's linear kept: identical gradients,
    and every contender's spans per virtual stage (zb's: F, B and W; stage 0's B empty, its input needs none)."""
    record, _ = ahead.record("test_pp_zero_bubble_gpt_rows")
    (row,) = record["figures"]["rows"]
    assert (row["v"], row["m"], row["stage"]) == (2, 2, 3) and row["identical_gradients"]
    costs = row["stage_costs_ms"]
    assert set(costs["flexible"]) == {f"{s}{op}" for s in range(4) for op in "FB"}
    for contender in ("flexible-zb", "flexible-zb, Megatron's linear"):
        assert set(costs[contender]) == {f"{s}{op}" for s in range(4) for op in "FBW"}
        assert len(row["b_w_over_flexible_backward"][contender]) == 2
    assert set(row["peak_held_mb"]) == set(costs) and all(mb > 0 for mb in row["peak_held_mb"].values())


def test_multimodal_real_section(ahead):
    record, _ = ahead.record("test_multimodal_real_section")
    rows = {row["contender"]: row for row in record["figures"]["rows"]}
    assert set(rows) == {f"{p} depth {d}" for p in ("pipeline", "broadcast", "replicated") for d in (2, 8)} | {
        "count split", "measured split"}
    assert sum(rows["measured split"]["counts"]) == 12 and set(record["figures"]["layer_times"]) == {"S", "X"}
    assert rows["replicated depth 2"]["step_vs_baseline"] == 1.0  # its own baseline: one round, ratio exactly 1
    assert all(len(row["busy_s"]) == 2 for row in rows.values())


def test_idle_groups_rows(ahead):
    record, _ = ahead.record("test_idle_groups_rows")
    rows = record["figures"]["rows"]
    assert [row["groups"] for row in rows] == [0, 3]
    assert all(b > a for a, b in zip(rows[0]["threads"], rows[1]["threads"]))  # every kept group has its threads
    assert all(len(row["idle_cpu_per_s"]) == 2 and row["loop_wall_s"] > 0 for row in rows)


# ---- on the per-rank wire (root, ip, tc): each bench starts its ranks on their own links --------------------


@pytest.mark.wire
@pytest.mark.skipif(WIRE_HERE is not None, reason=f"the wire needs namespaces: {WIRE_HERE}")
@pytest.mark.parametrize("bench", list(WIRE_RUNS))
def test_bench_runs_on_the_per_rank_wire(ahead, bench):
    """The bench's ranks ran on their own links (each rank's uplink and downlink carried its traffic: rank 0's
    up is rank 1's down, give or take the control messages), none of its namespaces outlived the interpreter it
    ran in (tests/bench_driver.py, whose exit ends every wire of the group, as a bench's exit ends its own), and
    its docs tables render from the record, stating the wire."""
    _, where, tables = WIRE_RUNS[bench]
    (record, _), left = ahead.record(wire_test(bench)), ahead.wire_left(wire_test(bench))
    figures = record["figures"]
    for key in where:
        figures = figures[key]
    assert figures["wire_mode"] == "per-rank" and figures["rate_bits"] == 200 * 10**6
    if bench == "pp_schedule":  # the executor's own count of receive buffers posted at once is its plan's
        posted = figures["vpp 2"]["posted_receives"]
        assert sorted(posted) == sorted(figures["vpp 2"]["waits_ms"]) and len(posted) == 5, posted
        assert all(row["executor"] == row["plan"] for row in posted.values()), posted
    if bench == "zero_megatron":  # the default starts every reduction in backward; blocking none; same weights
        rows = {row["contender"]: row for row in figures["gas"]["2"]["rows"]}
        default, blocking = rows["ZeRO-2 default"], rows["ZeRO-2 blocking"]
        assert default["reductions_in_backward"] == default["reductions"] > 0, default
        assert blocking["reductions_in_backward"] == 0 and default["identical_to_blocking"], rows
        # the emulated compute is in the measured micro-batch; the exposure bound at both link speeds, ZeRO-2's
        # overlapped contenders only
        assert figures["model"]["emulated_compute_ms"] == 20 and figures["forward_backward_ms"] >= 20, figures
        assert sorted(default["exposed_bound"]) == ["alone", "wire"] and blocking["exposed_bound"] is None, rows
        assert all(b["bound_ms"] >= 0 for b in default["exposed_bound"].values()), default
    if bench == "zero":  # the emulated accelerator compute (the ranks sleep) is in the measured forward+backward
        assert figures["emulated_compute_ms"] == 20 and figures["forward_backward_ms"] >= 20, figures
    for table in tables:  # each states the wire's mode, rate and the run's command above the table
        assert docs_tables.render(table, record).startswith(
            "Wire: per-rank links (each rank its own full-duplex link), 200mbit (25.0 MB/s) each way per rank; "
            f"run: `bench/{bench}.py --wire 200mbit "), table
        assert rendered_rows(table, record), table
    traffic = figures["wire_traffic_bytes"]
    assert sorted(traffic) == ["0", "1"]
    for rank, peer in (("0", "1"), ("1", "0")):
        assert traffic[rank]["up"] > 100_000, traffic
        assert abs(traffic[rank]["up"] - traffic[peer]["down"]) < 0.1 * traffic[rank]["up"], traffic
    assert not left, f"{bench} left namespaces behind: {left}"
