"""`l3plugin plan` called in-process through its argparse handler."""

import argparse
import json
import shlex

import pytest

from l3plugin.planner import add_plan_parser
from l3plugin.planner.report import layout_string

PAPER = ["--model", "llama3-405b", "--gpus", "16384", "--seq-len", "8192", "--global-batch-tokens", "16777216"]
SMALL = ["--model", "llama3-8b", "--gpus", "64", "--seq-len", "8192", "--global-batch-tokens", "4194304"]


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="l3plugin")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run(["--help"], capsys)
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--gpus", "--seq-len", "--global-batch-tokens", "--gpus-per-node", "--hbm-gb",
                   "--top", "--json", "--emit", "--micro-batch-size", "--cp-policy"):
        assert option in text


def test_text_output_ranks_and_explains(capsys):
    out = run(PAPER + ["--top", "3"], capsys)
    table = [line for line in out.splitlines() if line[:2].strip().isdigit()]
    assert 1 <= len(table) <= 3 and table[0].split()[:5] == ["1", "8", "1", "16", "128"]
    assert "Why #1 (tp=8 cp=1 pp=16 dp=128" in out
    for phrase in ("stays inside one 8-GPU node", "m >= PP=16", "CP=1", "Uneven split", "ZeRO-2",
                   "Rank order [TP, CP, PP, DP]"):
        assert phrase in out


def test_json_lists_plans_best_first(capsys):
    data = json.loads(run(SMALL + ["--json", "--top", "4"], capsys))
    assert set(data) == {"request", "machine", "assumptions", "answer", "plans", "staged"}
    assert data["answer"] == "free" and data["staged"] is None  # 8K on 64 GPUs: not long context
    plans = data["plans"]
    assert 1 <= len(plans) <= 4
    keys = {"tp", "cp", "pp", "dp", "vpp", "group_size", "microbatches_per_dp_group", "zero_stage", "schedule",
            "memory_gb", "bubble_ratio", "layers_per_stage"}
    for i, plan in enumerate(plans, 1):
        assert keys <= set(plan) and plan["rank"] == i
        assert plan["tp"] * plan["cp"] * plan["pp"] * plan["dp"] == 64
        assert plan["microbatches_per_dp_group"] * plan["dp"] == 4194304 // 8192
        assert sum(plan["layers_per_stage"]) == 32 and len(plan["layers_per_stage"]) == plan["pp"] * plan["vpp"]
        assert plan["memory_gb"] <= plan["usable_memory_gb"] and plan["zero_stage"] in (1, 2)
        assert set(plan["comm_gb_per_step"]) == {"tp", "cp", "pp", "dp"}
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    # the table's columns: margin to the best, step-time terms, exposed communication
    for plan in plans:
        assert plan["margin_vs_best"] == pytest.approx(plan["step_time_s"] / times[0] - 1, abs=1e-4)
        terms = plan["step_terms_s"]
        assert set(terms) == {"compute", "bubble", "tp_exposed", "cp_exposed", "dp_exposed"}
        assert plan["exposed_comm_s"] == pytest.approx(terms["tp_exposed"] + terms["cp_exposed"]
                                                       + terms["dp_exposed"], abs=1e-4)
        # step = (compute + exposed TP/CP) x (1 + bubble ratio) + exposed DP
        busy = terms["compute"] + terms["tp_exposed"] + terms["cp_exposed"]
        assert plan["step_time_s"] == pytest.approx(busy + terms["bubble"] + terms["dp_exposed"], abs=1e-3)
        assert terms["bubble"] == pytest.approx(busy * plan["bubble_ratio"], rel=1e-3, abs=1e-4)


def _megatron_args(out):
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    tokens = shlex.split(" ".join(line.rstrip("\\") for line in lines))
    args, i = {}, 0
    while i < len(tokens):
        has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        args[tokens[i]] = tokens[i + 1] if has_value else True
        i += 2 if has_value else 1
    return args


# The emit tests plan with --top 1: what they print is #1's configuration, whatever the length of the ranking
# (the default --top 5 prints the same, at three times the search).
def test_emit_megatron_for_the_paper_setting(capsys):
    args = _megatron_args(run(PAPER + ["--emit", "megatron", "--top", "1"], capsys))
    assert args["--tensor-model-parallel-size"] == "8" and args["--context-parallel-size"] == "1"
    assert args["--pipeline-model-parallel-size"] == "16" and args["--pipeline-schedule"] == "flexible"
    assert args["--microbatch-group-size-per-virtual-pipeline-stage"] == "16"
    assert args["--micro-batch-size"] == "1" and args["--global-batch-size"] == "2048"
    assert args["--seq-length"] == "8192" and args["--sequence-parallel"] is True
    # one layer fewer on the first and last of 128 virtual stages: a per-stage layout
    assert args["--pipeline-model-parallel-layout"] == "E|(t|)*126L"


def test_emit_megatron_even_and_per_rank_uneven_splits(capsys):
    args = _megatron_args(run(["--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192",
                               "--global-batch-tokens", str(8192 * 64), "--emit", "megatron", "--top", "1"], capsys))
    pp, layers = int(args["--pipeline-model-parallel-size"]), 80
    if "--num-layers-per-virtual-pipeline-stage" in args:
        vpp_layers = int(args["--num-layers-per-virtual-pipeline-stage"])
        assert layers % (pp * vpp_layers) == 0
    elif "--decoder-first-pipeline-num-layers" in args:
        assert int(args["--decoder-first-pipeline-num-layers"]) < layers // pp
    else:
        assert "--pipeline-model-parallel-layout" in args or pp == 1


def test_layout_strings_parse_in_megatron():
    from megatron.core.transformer import pipeline_parallel_layer_layout as layout
    for layers in [(0,) + (1,) * 126 + (0,), (3, 4, 4, 4, 4, 3), (1, 2), (5, 6, 6, 7)]:
        stages = layout.PipelineParallelLayerLayout.parse_str_to_list(layout_string(layers))
        names = [[t.name for t in stage] for stage in stages]
        assert [n.count("decoder") for n in names] == list(layers)
        assert names[0][0] == "embedding" and names[-1][-1] == "loss"


def test_emit_deepspeed(capsys):
    config = json.loads(run(SMALL + ["--emit", "deepspeed", "--top", "1"], capsys))
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["stage"] in (1, 2)
    # The block is one l3plugin's own parser takes (it refuses unknown keys), as deepspeed.initialize would.
    from l3plugin.deepspeed.config import options_in

    options = options_in(config)
    assert options.fp32_reduce_zero is True
    layout = config["l3plugin_plan"]
    assert options.context_parallel_size == layout["cp"]
    assert (config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * layout["dp"]
            == config["train_batch_size"] == 512)
    assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == 64


@pytest.mark.parametrize("argv,message", [
    (["--model", "llama3-8b", "--gpus", "12", "--seq-len", "8192", "--global-batch-tokens", "81920"],
     r"--gpus=12 is not divisible by --gpus-per-node=8"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch-tokens", "10000"],
     r"--global-batch-tokens=10000 is not divisible by --seq-len=8192: .* e\.g\. 8192 or 16384"),
    (["--model", "gpt-4", "--gpus", "8", "--seq-len", "8192", "--global-batch-tokens", "81920"],
     r"valid presets are llama3-8b, llama3-70b, llama3-405b"),
    (["--model", "llama3-405b", "--gpus", "8", "--seq-len", "8192", "--global-batch-tokens", "81920"],
     r"no layout fits in --gpu-memory-gb=80 .* the closest is tp=\d+ cp=\d+ pp=\d+ .* GiB over"),
])
def test_bad_input_is_a_clear_value_error(argv, message, capsys):
    with pytest.raises(ValueError, match=message):
        run(argv, capsys)


def test_bad_option_values_are_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        run(SMALL + ["--gpus-per-node", "0"], capsys)
    assert "must be an integer >= 1" in capsys.readouterr().err
    for value in ("inf", "nan", "-1"):
        with pytest.raises(SystemExit):
            run(SMALL + ["--hbm-gb", value], capsys)
        assert "--hbm-gb" in (err := capsys.readouterr().err) and "is invalid: must be a finite number > 0" in err
    with pytest.raises(SystemExit):
        run(SMALL + ["--json", "--emit", "megatron"], capsys)
