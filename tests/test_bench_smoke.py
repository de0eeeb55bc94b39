"""Tiny runs of the benches on bench/harness.py, with --json: each runs to the end, prints only its JSON record
on stdout (its tables on stderr) and that record holds the figures it printed. Sizes are far too small for the
timings to mean anything; no timing is asserted. (multimodal_pp simulated, cp_memory and pp_schedule's simulation:
test_bench_harness.py, against the docs; zero.py and hf_cp.py take longer than a smoke test may: run by hand.)
On the per-rank wire (root, ip, tc; skipped otherwise), cp_attention, pp_schedule and a one-variant zero.py
start their ranks on their own links."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))
import wire  # noqa: E402


def json_run(*argv, timeout=300):
    """Run ``bench/<argv>`` with --json; its record (stdout must be exactly one JSON line) and its stderr."""
    done = subprocess.run([sys.executable, *map(str, argv), "--json"], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    assert len(lines) == 1, f"{argv}: stdout holds more than the JSON record: {done.stdout[:2000]}"
    record = json.loads(lines[0])
    assert record["command"] == [str(argv[0]), *map(str, argv[1:]), "--json"]
    assert record["machine"]["cpu_count"] == os.cpu_count()
    return record, done.stderr


def test_cp_attention_timed_rows():
    record, _ = json_run("bench/cp_attention.py", "--seq", "512", "--rounds", "1", "--work-seq", "2048",
                         "--draws", "1")
    figures = record["figures"]
    assert [row["seq"] for row in figures["work"]] == [2048] * 3
    (timed,) = figures["timed"]
    assert set(timed["contenders"]) == {"cp1 non-causal", "cp1 causal", "cp1 docs", "cp2 causal", "cp2 docs 2cp",
                                        "cp2 docs balanced", "ring causal", "ring docs"}
    assert timed["ring_vs_all_gather_max_abs_difference"] < 1e-4  # the ring baseline computes the same attention
    assert all(c["wall_s"] > 0 and len(c["busy_s"]) == 2 for c in timed["contenders"].values())


def test_autoload_startup_rows():
    record, _ = json_run("bench/autoload_startup.py", "--rounds", "1", "--deepspeed-rounds", "0")
    rows = record["figures"]["startup"]
    assert [r["label"] for r in rows] == ["installed", "copy, compiled", "copy, cached"]
    assert all(r["with_s"] > 0 and r["without_s"] > 0 for r in rows)
    assert "import_deepspeed" not in record["figures"]


def test_multimodal_real_section():
    record, _ = json_run("bench/multimodal_pp.py", "real", "--hidden", "32", "--heads", "4", "--text-seq", "16",
                         "--image-tokens", "16", "--encoder-width", "16", "--rounds", "1", "--microbatches", "4")
    rows = {row["contender"]: row for row in record["figures"]["rows"]}
    assert set(rows) == {f"{p} depth {d}" for p in ("pipeline", "broadcast", "replicated") for d in (2, 8)} | {
        "count split", "measured split"}
    assert sum(rows["measured split"]["counts"]) == 12 and set(record["figures"]["layer_times"]) == {"S", "X"}
    assert rows["replicated depth 2"]["step_vs_baseline"] == 1.0  # its own baseline: one round, ratio exactly 1
    assert all(len(row["busy_s"]) == 2 for row in rows.values())


# ---- on the per-rank wire (root, ip, tc): each bench starts its ranks on their own links --------------------


@pytest.mark.wire
@pytest.mark.skipif(wire.why_not_here() is not None, reason=f"the wire needs namespaces: {wire.why_not_here()}")
@pytest.mark.parametrize("bench, options, where", [
    ("cp_attention", ["--seq", "512", "--rounds", "1", "--work-seq", "--masks", "causal"], ()),
    ("pp_schedule", ["--vpp", "2", "--layers", "4", "--microbatches", "4", "--rounds", "1", "--hidden", "32",
                     "--seq", "16", "--mbs", "1", "--agreed-order"], ("wire",)),
    ("zero", ["--quick", "--gas", "2", "--rounds", "1", "--variants", "ours ZeRO-1"], ()),
])
def test_bench_runs_on_the_per_rank_wire(bench, options, where):
    """The bench's ranks ran on their own links (each rank's uplink and downlink carried its traffic: rank 0's
    up is rank 1's down, give or take the control messages), and no namespace outlived the run."""
    before = wire.namespaces()
    record, _ = json_run(f"bench/{bench}.py", "--wire", "200mbit", *options, timeout=900)
    figures = record["figures"]
    for key in where:
        figures = figures[key]
    assert figures["wire_mode"] == "per-rank" and figures["rate_bits"] == 200 * 10**6
    if bench == "pp_schedule":  # the executor's own count of receive buffers posted at once is its plan's
        posted = figures["vpp 2"]["posted_receives"]
        assert sorted(posted) == sorted(figures["vpp 2"]["waits_ms"]) and len(posted) == 5, posted
        assert all(row["executor"] == row["plan"] for row in posted.values()), posted
    traffic = figures["wire_traffic_bytes"]
    assert sorted(traffic) == ["0", "1"]
    for rank, peer in (("0", "1"), ("1", "0")):
        assert traffic[rank]["up"] > 100_000, traffic
        assert abs(traffic[rank]["up"] - traffic[peer]["down"]) < 0.1 * traffic[rank]["up"], traffic
    leaked = {name for name, pid in wire.namespaces().items()
              if name not in before and not os.path.exists(f"/proc/{pid}")}
    assert not leaked, f"{bench} left namespaces behind: {leaked}"
