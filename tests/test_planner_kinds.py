"""`l3plugin plan --kinds/--frozen/--image-tokens`: layers costed by kind, frozen parameters without fp32
gradients or optimizer state, StageSplitter's balanced split per layout; without --kinds, today's output."""

import json
import os
from dataclasses import replace

import pytest

from l3plugin.planner import ModelSpec, PlanRequest, ScheduleCache, evaluate, plan
from l3plugin.planner.costs import FP32, Layout
from l3plugin.planner.encoder_costs import multimodal_kinds
from l3plugin.planner.layer_costs import model_layer_costs
from l3plugin.planner.layer_profile import split_microbatches
from l3plugin.planner.search import enumerate_layouts
from l3plugin.schedule.balance import StageSplitter
from l3plugin.schedule.plan import build_schedule, with_trainable_stages
from l3plugin.schedule.simulate import simulate
from test_planner_cli import run

BEFORE = os.path.join(os.path.dirname(__file__), "data", "plan_before_kinds")
SMALL = ["--model", "llama3-8b", "--gpus", "64", "--seq-len", "8192", "--global-batch-tokens", "4194304"]
SEVENTY = ["--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--global-batch-tokens", "1048576",
           "--top-k", "8"]
MM_KINDS = multimodal_kinds(32, 4)  # SSSSX x 8: Llama 3.2 11B-like
# A small multimodal request: 16 GPUs, 192 text tokens and 1600 image tokens per sample.
MM = dict(model="llama3-8b", gpus=16, seq_len=192, global_batch_tokens=192 * 128, kinds=MM_KINDS, image_tokens=1600)
# The same model for the tests that search: 4 GPUs, 8 samples. StageSplitter's balanced split of every candidate
# layout costs seconds per request at 128 samples; fewer micro-batches make it cheaper, and these tests share its
# (cached) splits.
MM_SEARCH = dict(MM, gpus=4, global_batch_tokens=192 * 8)


def _before(name):
    with open(os.path.join(BEFORE, name)) as handle:
        return handle.read()


@pytest.mark.parametrize("argv, name", [(SMALL + ["--json"], "llama3-8b_64gpus.json"),
                                        (SMALL, "llama3-8b_64gpus.txt"),
                                        (SMALL + ["--emit", "megatron"], "llama3-8b_64gpus.megatron"),
                                        (SEVENTY + ["--json"], "llama3-70b_64gpus_top8.json")])
def test_output_without_kinds_is_what_it_was(argv, name, capsys):
    assert run(argv, capsys) == _before(name)


def _without_layer_keys(data):
    for key in ("kinds", "frozen", "image_tokens"):
        data["request"].pop(key)
    for record in data["plans"]:
        stages = record.pop("stages")
        assert [i for stage in stages for i in stage] == list(range(sum(record["layers_per_stage"])))
    return data


@pytest.mark.parametrize("argv, layers, before", [(SMALL, 32, "llama3-8b_64gpus"),
                                                   (SEVENTY, 80, "llama3-70b_64gpus_top8")])
def test_uniform_kinds_plan_what_no_kinds_plans(argv, layers, before, capsys):
    # Compared with the recorded output without --kinds, which test_output_without_kinds_is_what_it_was checks is
    # what the same arguments print today: equal to it, equal to today's (without planning that again).
    uniform = argv + ["--kinds", "S" * layers]
    assert _without_layer_keys(json.loads(run(uniform + ["--json"], capsys))) == json.loads(_before(before + ".json"))
    if layers == 32:
        assert run(uniform + ["--emit", "megatron"], capsys) == _before(before + ".megatron")


def test_frozen_text_model_has_less_gradient_and_optimizer_memory():
    frozen = PlanRequest(**MM, frozen="SEH")
    trainable = PlanRequest(**MM)
    layout = Layout(tp=1, cp=1, pp=2, dp=8, vpp=2, group_size=2, microbatches=16, layers=(10, 10, 10, 10),
                    split="even")
    cache = ScheduleCache()
    f, t = evaluate(frozen, layout, zero_stage=1, cache=cache), evaluate(trainable, layout, zero_stage=1, cache=cache)
    model = frozen.model
    for rank in range(2):
        # only the X layers of the rank's stages are trained: 12 bytes of optimizer state per parameter over DP
        stages = [(0, 10), (20, 30)] if rank == 0 else [(10, 20), (30, 40)]
        cross = sum(MM_KINDS[a:b].count("X") for a, b in stages)
        assert f.memory_per_rank[rank]["optimizer"] == pytest.approx(3 * FP32 * cross * model.layer_params / 8)
        assert f.memory_per_rank[rank]["gradients"] == pytest.approx(FP32 * cross * model.layer_params)
        assert f.memory_per_rank[rank]["weights"] == t.memory_per_rank[rank]["weights"]
        assert f.memory_per_rank[rank]["optimizer"] < t.memory_per_rank[rank]["optimizer"]
    # and the frozen prefix (embedding + layers 0-3) keeps no activations
    assert f.costs.stage_act[0] < t.costs.stage_act[0]
    # the searched best plans too (on fewer GPUs: the same model and kinds)
    best_f, best_t = plan(PlanRequest(**MM_SEARCH, frozen="SEH"), top=1)[0], plan(PlanRequest(**MM_SEARCH), top=1)[0]
    assert (best_f.memory_per_rank[best_f.worst_rank]["optimizer"]
            < best_t.memory_per_rank[best_t.worst_rank]["optimizer"])


@pytest.mark.parametrize("kwargs, flag", [
    (dict(kinds="SSQ"), "--kinds"), (dict(kinds=""), "--kinds"),
    (dict(kinds="SSX", frozen="Z"), "--frozen"), (dict(frozen="S"), "--frozen"),
    (dict(kinds="SSX"), "--image-tokens"), (dict(kinds="SSX", image_tokens=-1), "--image-tokens"),
    (dict(kinds="SSX", image_tokens=8, cp=2), "--cp"), (dict(kinds="SSX", frozen="SXEH"), "--frozen"),
])
def test_bad_layer_flags_are_refused_by_name(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        PlanRequest(model="llama3-8b", gpus=8, seq_len=192, global_batch_tokens=192 * 64, **kwargs)


def test_bad_kinds_on_the_command_line(capsys):
    from l3plugin.cli import main

    assert main(["plan", *SMALL, "--kinds", "SSQ"]) != 0
    assert "--kinds='SSQ' is invalid" in capsys.readouterr().err


def test_kinds_give_the_layer_count_and_stage_lists_cover_every_layer_once(capsys):
    argv = ["--model", "llama3-8b", "--gpus", str(MM_SEARCH["gpus"]), "--seq-len", "192", "--global-batch-tokens",
            str(MM_SEARCH["global_batch_tokens"]), "--kinds", MM_KINDS, "--frozen", "SEH", "--image-tokens", "1600"]
    data = json.loads(run(argv + ["--json"], capsys))
    assert data["request"]["kinds"] == MM_KINDS and data["request"]["frozen"] == "SEH"
    for record in data["plans"]:
        assert sum(record["layers_per_stage"]) == 40
        assert sorted(i for stage in record["stages"] for i in stage) == list(range(40))
        assert [len(s) for s in record["stages"]] == record["layers_per_stage"]
    text = run(argv, capsys)
    assert "32 S + 8 X layers, frozen SEH, 1600 image tokens per sample" in text
    listed = [line for line in text.splitlines() if line.startswith("  virtual stage")]
    best = data["plans"][0]
    assert len(listed) == best["pp"] * best["vpp"]
    assert "".join(line.split(": ")[1].split()[2] for line in listed if "no layers" not in line) == MM_KINDS
    assert "multimodal_block_spec" in text and "--pipeline-model-parallel-layout" in text


def test_balanced_layouts_are_stage_splitters_choice():
    req = PlanRequest(**MM_SEARCH, frozen="SEH")
    balanced = [layout for layout in enumerate_layouts(req) if layout.split == "balanced"]
    assert balanced
    embedding, layers, head = model_layer_costs(req.model, MM_KINDS, text_seq=192, image_tokens=1600, frozen="SEH")
    for layout in balanced[:6]:
        p, v, m, k = layout.pp, layout.vpp, layout.microbatches, layout.group_size
        k = min(p, m) if v == 1 and k >= p else k
        splitter = StageSplitter(layers, build_schedule(p, v, split_microbatches(p, m, k), k), embedding=embedding,
                                 head=head, kinds=MM_KINDS)
        assert layout.layers == splitter.balance()[0].counts


@pytest.mark.parametrize("frozen", ["SEH", ""])
def test_step_is_the_simulated_schedule_with_each_stages_times(frozen):
    req = PlanRequest(**MM, frozen=frozen)
    layout = Layout(tp=2, cp=1, pp=4, dp=2, vpp=2, group_size=4, microbatches=64, layers=(4, 6, 5, 5, 5, 5, 5, 5),
                    split="balanced")  # stage 0: SSSS, frozen with the embedding in SEH
    ev = evaluate(req, layout, cache=ScheduleCache())
    costs = ev.costs
    times = list(zip(costs.stage_fwd, costs.stage_bwd))
    first = next(s for s, (_, b) in enumerate(times) if b > 0)
    assert (first > 0) == bool(frozen)  # a frozen prefix: stage 0 runs no backward
    schedule = with_trainable_stages(build_schedule(4, 2, 64, 4), [s >= first for s in range(8)])
    # 16 rounds of k: the planner times 4, 5, 6 rounds and extrapolates; this is the full schedule
    full = simulate(schedule, stage_times=times, p2p_latency=costs.p2p_s)
    assert ev.times["pipeline"] == pytest.approx(full.makespan, rel=1e-12)
    assert max(full.busy) == pytest.approx(max(costs.rank_busy), rel=1e-12)
    # activations: the most bytes a rank holds, forward by forward, in the full schedule
    for rank, plan_ in enumerate(schedule.ranks):
        held, peak = 0.0, 0.0
        for action in plan_.actions:
            size = costs.stage_act[schedule.stage_of(rank, action.chunk)]
            held += size if action.op == "F" else -size
            peak = max(peak, held)
        assert ev.memory_per_rank[rank]["activations"] == pytest.approx(peak, rel=1e-12)


def test_cross_attention_plans_have_no_cp():
    long_text = dict(MM, gpus=8, seq_len=8192, global_batch_tokens=8192 * 8)
    req = PlanRequest(**long_text, cp_policy="any")
    assert {layout.cp for layout in enumerate_layouts(req)} == {1}
    # without the X layers the same request is planned with CP
    text_only = PlanRequest(**dict(long_text, kinds=None, image_tokens=0), cp_policy="any")
    assert {layout.cp for layout in enumerate_layouts(text_only)} > {1}


def test_kinds_override_the_model_layer_count_not_its_shapes():
    model = ModelSpec("m", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2)
    req = PlanRequest(model=model, gpus=2, seq_len=32, global_batch_tokens=32 * 8, kinds="SSXSSX", image_tokens=16)
    assert req.model == replace(model, num_layers=6)


def test_keep_tp_pp_is_refused_with_cross_attention():
    from l3plugin.planner import Base, staged_plan

    req = PlanRequest(**dict(MM, seq_len=8192, global_batch_tokens=8192 * 16))
    with pytest.raises(ValueError, match="--keep-tp-pp"):
        staged_plan(req, Base(tp=1, pp=2, vpp=1, source="test"))


def test_emit_megatron_for_a_one_chunk_balanced_split():
    from megatron.core.transformer import pipeline_parallel_layer_layout as megatron_layout

    from l3plugin.planner.report import megatron_args

    req = PlanRequest(**MM, frozen="SEH")
    layers = (7, 11, 12, 10)  # middle stages differ: --decoder-first/last-pipeline-num-layers cannot say it
    ev = evaluate(req, Layout(1, 1, 4, 4, 1, 8, 8, layers, "balanced"), cache=ScheduleCache())
    text = megatron_args(ev)
    assert "--decoder-first-pipeline-num-layers" not in text and "multimodal_block_spec" in text
    layout = text.split("--pipeline-model-parallel-layout ")[1].split()[0].strip("'")
    stages = megatron_layout.PipelineParallelLayerLayout.parse_str_to_list(layout)
    assert [[t.name for t in stage].count("decoder") for stage in stages] == list(layers)
