"""Timelines (text and PNG) and the `schedule` / `simulate` subcommands, run in-process."""

import argparse
import json
import re
import sys

import pytest

from l3plugin.schedule.cli import add_schedule_parser, add_simulate_parser
from l3plugin.schedule.plan import build_schedule
from l3plugin.schedule.simulate import simulate
from l3plugin.schedule.timeline import MissingExtraError, render_png, render_text


def test_render_text_one_row_per_rank_in_plan_order():
    schedule = build_schedule(2, 2, 4, 2)
    text = render_text(schedule)
    header, legend, *rows = text.splitlines()
    assert "pp=2 vpp=2 microbatches=4 group_size=2" in header
    assert "F<mb>.<chunk>" in legend
    assert len(rows) == 2
    for plan, row in zip(schedule.ranks, rows):
        assert row.startswith(f"rank {plan.rank}")
        cells = re.findall(r"[FB]\d+\.\d+", row)
        assert cells == [f"{a.op}{a.microbatch}.{a.chunk}" for a in plan.actions]
    assert rows[1].split("|", 1)[1].startswith(".....F0.0")  # rank 1 waits one slot


def test_render_text_v1_and_timed_boxes():
    schedule = build_schedule(2, 1, 3)
    assert "|F0 F1 ...B0 F2 B1 ...B2" in render_text(schedule)
    wide = render_text(schedule, simulate(schedule))  # backward twice as long as forward
    assert "|F0 F1 ......B0    F2 B1    ...B2" in wide
    # off-grid times (latency) must not glue boxes together: every label still parses
    latency = render_text(schedule, simulate(schedule, p2p_latency=0.3))
    for plan, row in zip(schedule.ranks, latency.splitlines()[2:]):
        cells = re.findall(r"[FB]\d+", row.split("|", 1)[1])
        assert cells == [f"{a.op}{a.microbatch}" for a in plan.actions]
        assert not re.search(r"\d[FB]", row)


def test_render_png_writes_file(tmp_path):
    path = tmp_path / "timeline.png"
    render_png(simulate(build_schedule(3, 2, 6, 3)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_png_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    with pytest.raises(MissingExtraError, match=r"pip install 'l3plugin\[plot\]'"):
        render_png(simulate(build_schedule(2, 1, 2)), str(tmp_path / "x.png"))


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="l3plugin")
    sub = parser.add_subparsers(dest="command", required=True)
    add_schedule_parser(sub)
    add_simulate_parser(sub)
    args = parser.parse_args(argv)
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_schedule_json_is_exactly_to_dict(capsys):
    code, out, err = run_cli(
        ["schedule", "--pp", "4", "--vpp", "2", "--microbatches", "6", "--group-size", "5", "--json"],
        capsys,
    )
    assert code == 0 and err == ""
    assert out == json.dumps(build_schedule(4, 2, 6, 5).to_dict()) + "\n"


def test_schedule_text_and_png(capsys, tmp_path):
    png = tmp_path / "s.png"
    code, out, _ = run_cli(
        ["schedule", "--pp", "2", "--microbatches", "3", "--png", str(png)], capsys
    )
    assert code == 0
    assert "rank 0" in out and "rank 1" in out and f"wrote {png}" in out
    assert png.exists()


def test_simulate_text_and_json(capsys):
    argv = ["simulate", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--group-size", "4"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    assert "makespan: 57" in out and "bubble ratio" in out and "[11, 9, 7, 5]" in out
    code, out, _ = run_cli(argv + ["--forward-time", "2", "--p2p-latency", "0.1", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["backward_time"] == 4.0 and data["p2p_latency"] == 0.1
    assert data["bubble_ratio"] > 3 / 16


@pytest.mark.parametrize(
    "argv,message",
    [
        (["schedule", "--pp", "2", "--microbatches", "4", "--group-size", "0"], "group_size=0"),
        (["simulate", "--pp", "0", "--microbatches", "4"], "pp_size=0"),
        (["simulate", "--pp", "2", "--microbatches", "4", "--forward-time", "0"], "forward_time=0"),
    ],
)
def test_bad_input_prints_error_and_exits_2(argv, message, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err


def test_help_lists_options(capsys):
    for command in ("schedule", "simulate"):
        with pytest.raises(SystemExit) as info:
            run_cli([command, "--help"], capsys)
        assert info.value.code == 0
        out = capsys.readouterr().out
        assert "--group-size" in out and "--json" in out and "--png" in out
    assert "--p2p-latency" in out
