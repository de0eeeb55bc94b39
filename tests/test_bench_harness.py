"""bench/harness.py, the scaffolding every bench shares (rounds, ratios, barrier-timed steps, the wire's
calibration, --json), and bench/docs_tables.py: a docs table rendered from a fresh run's JSON is the docs' text."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # harness.py and wire.py, imported as the benches do

import docs_tables  # noqa: E402
import harness  # noqa: E402
from runs_ahead import time_allowed  # noqa: E402


# ---- rounds and ratios -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_round_order_puts_every_contender_in_every_position_once_per_n_rounds(n):
    names = [f"c{i}" for i in range(n)]
    orders = [harness.round_order(names, r) for r in range(n)]
    for order in orders:
        assert sorted(order) == names
    for position in range(n):
        assert sorted(order[position] for order in orders) == names
    assert harness.round_order(names, n) == harness.round_order(names, 0) == names
    assert harness.round_order(names, 1) == names[1:] + names[:1]


def test_round_order_refuses_no_contenders():
    with pytest.raises(ValueError, match="no contenders"):
        harness.round_order([], 0)


def test_interleaved_rounds_drops_the_warm_up_and_keeps_each_round_in_order():
    calls = []

    def run(name):
        calls.append(name)
        return (name, len(calls))

    kept = harness.interleaved_rounds(["a", "b", "c"], run, rounds=3)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]  # warm-up, then 3 rotated
    assert list(kept) == ["a", "b", "c"]
    # Each contender's kept results: its calls after the warm-up round, in the order they ran.
    assert kept["a"] == [("a", 6), ("a", 8), ("a", 10)]
    assert kept["c"] == [("c", 5), ("c", 7), ("c", 12)]
    calls.clear()
    assert harness.interleaved_rounds(["x", "y"], run, rounds=2, warmup=0) == {"x": [("x", 1), ("x", 4)],
                                                                              "y": [("y", 2), ("y", 3)]}
    with pytest.raises(ValueError, match="rounds=0"):
        harness.interleaved_rounds(["x"], run, rounds=0)


def test_ratio_stats_is_the_median_of_per_round_ratios_with_their_range():
    # Round 2 is slow for both contenders: per-round ratios see through it, a ratio of medians does not.
    top, bottom = [1.0, 10.0, 3.0], [2.0, 10.0, 2.0]
    stats = harness.ratio_stats(top, bottom)
    assert stats == {"median": 1.0, "min": 0.5, "max": 1.5}
    assert harness.ratio_text(stats) == "1.000 (0.500-1.500)"
    assert harness.ratio_text(stats, digits=2) == "1.00 (0.50-1.50)"
    with pytest.raises(ValueError, match="equally long"):
        harness.ratio_stats([1.0], [1.0, 2.0])


# ---- on a rank ---------------------------------------------------------------------------------------------
def test_barrier_timed_times_the_step_between_two_barriers(monkeypatch):
    import torch.distributed as dist

    events = []
    monkeypatch.setattr(dist, "barrier", lambda group=None: events.append(("barrier", group)))
    timing, result = harness.barrier_timed(lambda: events.append("step") or 42, group="pp")
    assert events == [("barrier", "pp"), "step", ("barrier", "pp")]
    assert result == 42
    assert set(timing) == {"wall", "own", "busy"}
    assert 0 <= timing["own"] <= timing["wall"] and timing["busy"] >= 0


def test_timed_methods_adds_up_the_calls_and_restores_the_class():
    class Channel:
        def recv(self, x):
            return x + 1

    original = Channel.recv
    seconds = {}
    with harness.timed_methods(Channel, ["recv"], seconds):
        assert Channel().recv(1) == 2 and Channel().recv(2) == 3
        assert Channel.recv is not original
    assert Channel.recv is original and list(seconds) == ["recv"] and seconds["recv"] >= 0
    with pytest.raises(RuntimeError), harness.timed_methods(Channel, ["recv"], {}):
        raise RuntimeError("restored even so")
    assert Channel.recv is original


def test_timed_methods_records_when_each_call_began_in_call_order():
    class Zero:
        def launch(self):
            pass

        def end_of_round(self):
            pass

    began = []
    with harness.timed_methods(Zero, ["launch", "end_of_round"], {}, began):
        Zero().launch()
        Zero().end_of_round()
        Zero().launch()
    assert [m for m, _ in began] == ["launch", "end_of_round", "launch"]
    assert began[0][1] <= began[1][1] <= began[2][1]


# ---- the exposure bound ------------------------------------------------------------------------------------
def test_exposure_bound_waits_what_the_link_cannot_finish_by_the_round_end():
    # 100 elements final at 0 s and 100 at 1 s, 0.01 s each on the link: done at 2 s; the round ends at 1.5 s.
    finals = [(0.0, "a", 100), (1.0, "b", 100)]
    assert harness.exposure_bound(finals, [1.5], 0.01) == pytest.approx(0.5)
    assert harness.exposure_bound(finals, [2.5], 0.01) == 0.0  # finished before the round end
    # The link is the bottleneck from the first gradient on: 300 elements from 0 s, whatever comes later.
    assert harness.exposure_bound([(0.0, "a", 200), (1.5, "b", 100)], [1.5], 0.01) == pytest.approx(1.5)


def test_exposure_bound_counts_a_parameter_once_per_round_at_its_last_hook():
    # Two backwards in one round (k > 1): only the last hook makes the gradient final.
    finals = [(0.0, "a", 100), (0.5, "a", 100)]
    assert harness.exposure_bound(finals, [1.0], 0.01) == pytest.approx(0.5)  # 0.5 + 1.0 - 1.0
    # Two rounds: each round's reductions are its own; a carry shortens every round end but the step's last.
    two = [(0.0, "a", 100), (2.0, "a", 100)]
    assert harness.exposure_bound(two, [0.5, 2.5], 0.01) == pytest.approx(0.5 + 0.5)
    assert harness.exposure_bound(two, [0.5, 2.5], 0.01, carry_seconds=0.2) == pytest.approx(0.3 + 0.5)
    assert harness.exposure_bound(two, [0.5, 2.5], 0.01, carry_seconds=9.0) == pytest.approx(0.5)


def test_exposure_bound_equals_a_first_come_first_served_link_simulated_step_by_step():
    import random

    rng = random.Random(7)
    for _ in range(200):
        finals = [(rng.uniform(0, 1), key, rng.randint(1, 50)) for key in range(rng.randint(1, 12))]
        end, seconds = rng.uniform(1.0, 1.5), rng.uniform(0.001, 0.03)
        busy_until = float("-inf")  # the link serves gradients in the order they became final
        for t, _, elements in sorted(finals):
            busy_until = max(busy_until, t) + elements * seconds
        assert harness.exposure_bound(finals, [end], seconds) == pytest.approx(max(0.0, busy_until - end))


class FakeLink:
    """A wire whose transfer costs 10 ms of CPU plus 1 MB at its rate (tbf's model)."""

    def __init__(self, rate):
        self.rate, self.rates = rate, []

    def set_rate(self, rate):
        self.rate = rate
        self.rates.append(rate)

    def transfer(self):
        return 0.01 + (8e6 / self.rate if self.rate else 0.0)


def test_calibrate_wire_finds_the_rate_at_which_the_transfer_takes_the_target():
    import wire

    link = FakeLink(wire.parse_rate(harness.PROBE_RATE))
    target_seen_at = []

    def target():
        target_seen_at.append(link.rate)
        return 0.05

    picked = harness.calibrate_wire(link, link.transfer, target)
    assert target_seen_at == [None]  # the target is measured on the unshaped wire
    assert link.rates[:2] == [None, 2 * 10**9] and link.rate == picked["rate"]
    assert picked["unshaped"] == pytest.approx(0.01) and picked["probed"] == pytest.approx(0.014)
    assert link.transfer() == pytest.approx(0.05, rel=1e-6)  # 8 Mbit in 40 ms: 200 Mbit/s
    assert picked["checks"] == [[picked["rate"], pytest.approx(0.05)]]  # timed once more there: on target
    assert harness.enter_wire("off").on is False


class OverlappingLink(FakeLink):
    """A transfer whose 10 ms of CPU overlap its wire time: max(CPU, bytes / rate), not their sum."""

    def transfer(self):
        return max(0.01, 8e6 / self.rate if self.rate else 0.0) + 0.001


def test_calibrate_wire_corrects_a_rate_the_two_point_model_misses():
    import wire

    link = OverlappingLink(wire.parse_rate(harness.PROBE_RATE))
    picked = harness.calibrate_wire(link, link.transfer, 0.05)
    first_rate, first_time = picked["checks"][0]
    assert first_rate == wire.rate_for_time(0.05, picked["unshaped"], picked["probed"], picked["probe_rate"])
    assert abs(first_time - 0.05) > 0.5 * 0.05  # at the fast probe the transfer is CPU-bound: the model is far off
    assert link.rate == picked["rate"] and abs(link.transfer() - 0.05) <= 0.1 * 0.05


# ---- --json ------------------------------------------------------------------------------------------------
def test_json_output_sends_the_tables_to_stderr_and_one_record_to_stdout(capsys):
    with harness.json_output(True, "demo_bench", ["--rounds", "1"]) as figures:
        print("a table line")
        figures["rows"] = [{"x": 1}]
    out, err = capsys.readouterr()
    assert err == "a table line\n"
    record = json.loads(out)
    assert out.count("\n") == 1
    assert set(record) == {"bench", "command", "timestamp", "machine", "figures"}
    assert record["bench"] == "demo_bench" and record["command"] == ["bench/demo_bench.py", "--rounds", "1"]
    assert record["timestamp"].endswith("+00:00")
    assert record["machine"]["cpu_count"] == os.cpu_count() and len(record["machine"]["load_average"]) == 3
    assert record["figures"] == {"rows": [{"x": 1}]}


def test_json_output_off_prints_tables_only_and_no_record_after_an_error(capsys):
    with harness.json_output(False, "demo_bench", []) as figures:
        print("a table line")
        figures["x"] = 1
    assert capsys.readouterr() == ("a table line\n", "")
    with pytest.raises(KeyError), harness.json_output(True, "demo_bench", []):
        raise KeyError("no figures")
    assert capsys.readouterr().out == ""


# ---- docs tables from a run made now -----------------------------------------------------------------------
def run_bench(*argv, timeout=120):
    done = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True,
                          timeout=time_allowed(timeout), env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


def json_run(tmp_path, *argv, timeout=120):
    """Run a bench with --json; the saved file and its record (stdout holds only that, the tables go to stderr)."""
    done = run_bench(*argv, "--json", timeout=timeout)
    saved = tmp_path / "run.json"
    saved.write_text(done.stdout)
    assert len(done.stdout.splitlines()) == 1 and done.stderr, f"{argv}: stdout {done.stdout[:2000]}"
    return saved, json.loads(done.stdout)


DOC_RUNS = {  # the longest first: the two simulated runs (no torch, no ranks) take about as long as it
    "cp-memory": ["bench/cp_memory.py", "--cp", "2", "--seq", "4096"],  # one row of it (cp 2 and 4: ~2 min)
    "multimodal-simulated": ["bench/multimodal_pp.py", "simulated"],  # the docs' whole table, defaults
    "multimodal-splits": ["bench/multimodal_pp.py", "simulated", "--bandwidth-gbps", "0"],  # without P2P time
}  # pp-simulated: test_bench_smoke.py, from the run that also renders pp-real


def run_and_check(folder, table, argv):
    """The bench's run with --json (saved), and bench/docs_tables.py --check of the table's doc against it."""
    saved, record = json_run(folder, *argv)
    return record, run_bench("bench/docs_tables.py", table, saved, "--check", docs_tables.TABLES[table].doc)


def ahead_runs(tmp_path_factory, selected):
    """The three runs of the test below (each a single-process bench), queued in the background when the session
    starts (tests/runs_ahead.py)."""
    runs = {table: functools.partial(run_and_check, tmp_path_factory.mktemp(table), table, argv)
            for table, argv in DOC_RUNS.items()}
    needed_by = {table: ("test_docs_table_is_what_a_run_made_now_renders",) for table in runs}
    return runs, needed_by


@pytest.mark.parametrize("table", DOC_RUNS)
def test_docs_table_is_what_a_run_made_now_renders(ahead, table):
    argv = DOC_RUNS[table]
    record, checked = ahead.result(table)
    bench, doc = docs_tables.TABLES[table].bench, docs_tables.TABLES[table].doc
    assert record["bench"] == bench and record["command"] == [*argv, "--json"]
    rendered = docs_tables.render(table, record)
    assert len(rendered.splitlines()) >= 3
    assert docs_tables.missing_lines(rendered, (ROOT / doc).read_text()) == []
    assert "holds the" in checked.stdout


def test_docs_tables_check_names_what_is_missing_and_refuses_another_bench(tmp_path):
    record = {"bench": "cp_memory", "command": ["bench/cp_memory.py"], "figures": {"rows": [
        {"cp": 2, "seq": 4096, "keep": 2**20, "regather": 2**19, "planner_keep": 2**20, "planner_regather": 2**19,
         "planner_gathered_kv": 2**19}]}}
    rendered = docs_tables.render("cp-memory", record)
    assert rendered.splitlines()[-1] == "| 2 | 4K | 1.00 | 0.50 | 0.50 | 1.00 / 0.50 / 0.50 | 1.000 / 1.000 / 1.000 |"
    assert docs_tables.missing_lines(rendered, (ROOT / "docs/cp.md").read_text()) == [rendered.splitlines()[-1]]
    saved = tmp_path / "other.json"
    saved.write_text(json.dumps({**record, "bench": "zero", "command": ["bench/zero.py"]}))
    done = subprocess.run([sys.executable, str(ROOT / "bench/docs_tables.py"), "cp-memory", str(saved)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "bench/cp_memory.py's --json output" in done.stderr and "'zero'" in done.stderr


def test_the_load_balance_table_row_is_what_the_bench_computes():
    """docs/benchmarks.md's S = 8K load-balance row (analytic, seeded) is what cp_attention's work table gives."""
    import contextlib
    import io

    import cp_attention

    with contextlib.redirect_stdout(io.StringIO()):
        record = {"bench": "cp_attention", "command": ["bench/cp_attention.py"],
                  "figures": {"work": cp_attention.work_table([8192], 20)}}
    rendered = docs_tables.render("cp-work", record)
    assert rendered.splitlines()[2].startswith("| 8K | 2 / 4 / 8 | ")
    assert docs_tables.missing_lines(rendered, (ROOT / "docs/benchmarks.md").read_text()) == []


def test_every_docs_table_is_listed_with_the_table_that_renders_it(tmp_path):
    assert docs_tables.docs_check(ROOT) == []
    listed = run_bench("bench/docs_tables.py", "--docs-check")
    assert ("    cp-wire: bench/cp_attention.py --wire auto --json > RUN.json; bench/docs_tables.py cp-wire RUN.json"
            in listed.stdout.splitlines())
    # A table nobody listed, and an entry whose line is gone, are named.
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("| x | y |\n|---|---|\n| 1 | 2 |\n")
    problems = docs_tables.docs_check(tmp_path)
    assert "README.md: table '| x | y |' is not in DOC_FIGURES (name its renderer or why none)" in problems
    assert any(p.startswith("docs/cp.md: no line starts with") for p in problems)


def test_the_measured_multimodal_table_is_the_saved_run_rendered():
    """docs/pipeline.md's measured table (a timing run, not repeatable in a test) is what bench/docs_tables.py
    renders from the run's saved JSON, docs/runs/multimodal_real.json."""
    record = json.loads((ROOT / "docs/runs/multimodal_real.json").read_text())
    rendered = docs_tables.render("multimodal-real", record)
    assert "replicated depth 8" in rendered and "measured split" in rendered
    assert docs_tables.missing_lines(rendered, (ROOT / "docs/pipeline.md").read_text()) == []


@pytest.mark.parametrize("run, table, holds", [
    ("pp_wire_early_vpp2.json", "pp-wire", "agreed-order k=1.5p=3"),
    ("pp_wire_early_vpp3.json", "pp-wire", "agreed-order k=1.5p=3"),
    ("pp_wire_early_vpp4.json", "pp-wire", "agreed-order k=1.5p=3"),
    ("cp_wire_per_rank_8k.json", "cp-wire", "| 8K |"),
    ("cp_wire_per_rank_8k.json", "cp-regather", "| 8K |"),
    ("cp_wire_per_rank_8k_docs.json", "cp-wire", "| 8K |"),
    ("cp_wire_per_rank_8k_docs.json", "cp-regather", "| 8K |"),
    ("zero_megatron_wire.json", "zero-megatron", "ZeRO-2 default"),
    ("zero2_wire_per_rank.json", "zero-wire", "ours ZeRO-2 carry_buckets 0 (before)"),
    ("zero2_wire_carry.json", "zero-wire", "ours ZeRO-2 carry_buckets 3"),
    ("pp_wire_per_rank.json", "pp-wire", "flexible k=1.5p=3"),
    ("cp_wire_per_rank.json", "cp-wire", "| 32K |"),
    ("cp_wire_per_rank.json", "cp-regather", "| 32K |"),
    ("zero2_wire_per_rank_all.json", "zero-wire", "ours ZeRO-2 carry_reductions + overlap_param_gather"),
    ("zero_megatron_wire_carry3.json", "zero-megatron", "ZeRO-2 carry_buckets 2 (before)"),
    ("zero_wire_param_gather.json", "zero-wire", "ours ZeRO-2 overlap_param_gather off (before)"),
    ("pp_wire_send30.json", "pp-wire", "flexible k=1.5p=3"),
    ("pp_wire_send30_vpp34.json", "pp-wire", "flexible k=1.5p=3"),
    ("zero_megatron_wire_param_gather.json", "zero-megatron", "ZeRO-2 overlap_param_gather off (before)"),
])
def test_the_measured_per_rank_wire_tables_are_the_saved_runs_rendered(run, table, holds):
    """docs/benchmarks.md's per-rank wire tables (timing runs, not repeatable in a test) are what
    bench/docs_tables.py renders from the runs' saved JSON under docs/runs/."""
    record = json.loads((ROOT / "docs/runs" / run).read_text())
    rendered = docs_tables.render(table, record)
    assert rendered.startswith("Wire: per-rank links") and holds in rendered
    assert docs_tables.missing_lines(rendered, (ROOT / "docs/benchmarks.md").read_text()) == []


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads /proc/cpuinfo (Linux)")
def test_machine_facts_name_the_cpu_and_the_flags_that_change_compute_speed():
    facts, lines = harness.machine_facts(), Path("/proc/cpuinfo").read_text().splitlines()
    assert facts["cpu_model"] == next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    flags = set(next(line for line in lines if line.startswith("flags")).split(":", 1)[1].split())
    assert facts["cpu_flags"] == [f for f in harness.CPU_FLAGS_OF_NOTE if f in flags]


def test_rounds_with_gradients_checked_names_the_contender_that_differs():
    import torch

    calls = []

    def run(name):
        calls.append(name)
        grad = torch.ones(3) if name != "off" or len(calls) < 4 else torch.tensor([1.0, 1.0, 1.0 + 1e-7])
        return [{"wall": 1.0, "grads": {"w": grad.clone()}}, {"wall": 2.0, "grads": {"w": torch.zeros(2)}}]

    kept, differ = harness.rounds_with_gradients_checked(["a", "off"], run, rounds=2)
    assert differ == {"off"}  # its run in the last round differs in one element; "a" never does
    assert [len(kept[n]) for n in ("a", "off")] == [2, 2]
    assert all("grads" not in r for n in kept for ranks in kept[n] for r in ranks)


def test_span_medians_per_virtual_stage_and_op():
    rounds = [[{"rank": 0, "actions": [("F", 0, 0, 0.0, 1.0), ("F", 1, 1, 0.0, 3.0)]},
               {"rank": 1, "actions": [("B", 0, 0, 0.0, 2.0)]}],
              [{"rank": 0, "actions": [("F", 0, 0, 0.0, 3.0)]}, {"rank": 1, "actions": [("B", 0, 0, 1.0, 2.0)]}]]
    assert harness.span_medians(rounds, 2) == {(0, "F"): 2.0, (2, "F"): 3.0, (1, "B"): 1.5}
