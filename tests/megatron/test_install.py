"""Switching Megatron to the flexible schedule: the flag, install() and the launcher."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
from megatron.core import pipeline_parallel
from megatron.core.pipeline_parallel import schedules

import l3plugin.megatron as l3m
from l3plugin.ranks.pool import run_command
from runs_ahead import time_allowed  # tests/runs_ahead.py

SCRIPT = Path(__file__).parent.parent / "data" / "print_selected_schedule.py"
MEGATRON_LM = importlib.util.find_spec("megatron.training") is not None  # a Megatron-LM source checkout


def test_flag_and_chained_provider():
    def existing(parser):
        parser.add_argument("--modelopt-thing", type=int, default=3)
        return parser

    parser = l3m.chain_extra_args(existing)(argparse.ArgumentParser())
    args = parser.parse_args(["--pipeline-schedule", "flexible", "--modelopt-thing", "5"])
    assert args.pipeline_schedule == "flexible" and args.modelopt_thing == 5
    assert parser.parse_args([]).pipeline_schedule == "default"
    assert parser.parse_args(["--pipeline-schedule", "flexible-zb"]).pipeline_schedule == "flexible-zb"
    with pytest.raises(SystemExit):
        parser.parse_args(["--pipeline-schedule", "fast"])


def test_install_is_idempotent_and_reversible():
    stock = schedules.get_forward_backward_func
    try:
        l3m.install("flexible")
        l3m.install("flexible")
        for selector in (pipeline_parallel.get_forward_backward_func, schedules.get_forward_backward_func):
            assert selector(pp_size=2, vp_size=2) is l3m.forward_backward_pipelining_flexible
            assert selector(pp_size=4, vp_size=None) is l3m.forward_backward_pipelining_flexible
            assert selector(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
        l3m.install("flexible-zb")
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=2) is l3m.forward_backward_pipelining_flexible_zb
        l3m.install("default")
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=2) is \
            schedules.forward_backward_pipelining_with_interleaving
        with pytest.raises(ValueError, match="schedule='fast' is invalid"):
            l3m.install("fast")
    finally:
        l3m.uninstall()
    assert schedules.get_forward_backward_func is stock and pipeline_parallel.get_forward_backward_func is stock


def test_the_selector_takes_what_this_versions_training_loop_passes():
    """Megatron-LM 0.19's loop calls get_forward_backward_func(schedule_pg_collection=pg_collection); earlier ones
    pass nothing. The same call reaches the flexible schedule, and Megatron's own selector without it."""
    import inspect

    from megatron.core.process_groups_config import ProcessGroupCollection

    takes_collection = "schedule_pg_collection" in inspect.signature(schedules.get_forward_backward_func).parameters
    kwargs = {"schedule_pg_collection": ProcessGroupCollection()} if takes_collection else {}
    try:
        l3m.install("flexible")
        flexible = pipeline_parallel.get_forward_backward_func(2, None, **kwargs)
        assert flexible is l3m.forward_backward_pipelining_flexible
        if takes_collection:
            from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

            cross_grid = object.__new__(MultiModuleProcessGroupCollection)
            with pytest.raises(NotImplementedError, match="multi-module .* --pipeline-schedule default"):
                pipeline_parallel.get_forward_backward_func(2, None, schedule_pg_collection=cross_grid)
        l3m.install("default")
        assert pipeline_parallel.get_forward_backward_func(2, None, **kwargs) is \
            schedules.forward_backward_pipelining_without_interleaving
    finally:
        l3m.uninstall()


LAUNCHES = {"flexible": ["--pipeline-schedule", "flexible"], "default": []}


def launch_fresh(flag):
    """`python -m l3plugin.megatron.launch` as a user types it: a fresh interpreter (seconds of Megatron-Core
    imports on one core)."""
    return run_command([sys.executable, "-m", "l3plugin.megatron.launch", str(SCRIPT), "--lr", "0.1", *LAUNCHES[flag]],
                       timeout=time_allowed(120), check=True).stdout


def ahead_runs(tmp_path_factory, selected):
    """The fresh launch, queued in the background when the session starts (tests/runs_ahead.py); none where the
    test skips."""
    if MEGATRON_LM:
        return {}
    return {"test_launcher_runs_a_script_with_the_plugin[flexible-forward_backward_pipelining_flexible-True]":
            lambda: launch_fresh("flexible")}


def launch_here(flag, capsys, monkeypatch):
    """The launcher's main() in this process (its argv handling, install() and runpy of the script), install()
    undone after."""
    from l3plugin.megatron.launch import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets the script's argv
    capsys.readouterr()
    try:
        assert main([str(SCRIPT), "--lr", "0.1", *LAUNCHES[flag]]) == 0
    finally:
        l3m.uninstall()
    return capsys.readouterr().out


@pytest.mark.skipif(MEGATRON_LM,
                    reason="the launcher's megatron-core-only path: with Megatron-LM importable (a source checkout) "
                           "Megatron-LM's parser takes the flags, which this plain script never calls")
# One true command-line run (the flag, what the launcher is for); the default in this process: the same main(),
# without a second interpreter importing Megatron-Core.
@pytest.mark.parametrize("flag,expected,fresh", [("flexible", "forward_backward_pipelining_flexible", True),
                                                 ("default", "forward_backward_pipelining_with_interleaving", False)])
def test_launcher_runs_a_script_with_the_plugin(flag, expected, fresh, capsys, monkeypatch, ahead, request):
    out = ahead.result(request.node.name) if fresh else launch_here(flag, capsys, monkeypatch)
    assert f"selected: {expected}" in out
    assert "selected-pp1: forward_backward_no_pipelining" in out
    assert "argv: ['--lr', '0.1']" in out  # our flag is consumed when Megatron-LM is not installed
