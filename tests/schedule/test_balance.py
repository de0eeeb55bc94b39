"""Stage split of layers of different cost: the simulator with per-stage times, the FLOP cost model,
the candidates and the chosen split, `l3plugin balance` and its Megatron layout string."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from l3plugin.cli import main
from l3plugin.planner.layer_costs import model_layer_costs
from l3plugin.planner.models import load_model
from l3plugin.schedule.balance import LayerCost, StageSplitter, megatron_layout
from l3plugin.schedule.plan import build_schedule
from l3plugin.schedule.simulate import Replay, simulate

MULTIMODAL = "SSSSX" * 8  # Llama-3.2-11B-like: 32 self-attention layers, a cross-attention layer every 4


# -- the simulator with per-stage times ---------------------------------------------------------------------
@pytest.mark.parametrize("pp,vpp,m,k", [(2, 1, 3, 2), (4, 2, 8, 4), (3, 2, 5, 2), (4, 3, 7, 6)])
def test_equal_stage_times_give_the_uniform_simulation(pp, vpp, m, k):
    schedule = build_schedule(pp, vpp, m, k)
    uniform = simulate(schedule, forward_time=1.5, backward_time=2.5, p2p_latency=0.25)
    staged = simulate(schedule, p2p_latency=0.25, stage_times=[(1.5, 2.5)] * (pp * vpp))
    assert staged.makespan == uniform.makespan
    assert staged.actions == uniform.actions
    assert staged.bubble_ratio == pytest.approx(uniform.bubble_ratio)


def test_stage_times_by_hand_one_microbatch():
    # m = 1: forward through every stage, then backward back: the sum of all times.
    times = [(1.0, 2.0), (3.0, 0.0), (0.5, 4.0)]
    sim = simulate(build_schedule(3, 1, 1), stage_times=times)
    assert sim.makespan == 1.0 + 3.0 + 0.5 + 4.0 + 0.0 + 2.0
    assert sim.busy == (3.0, 3.0, 4.5)


def test_replay_times_equal_the_simulation():
    schedule = build_schedule(4, 2, 6, 5)
    rng = random.Random(3)
    times = [(rng.uniform(0.5, 2), rng.uniform(0, 3)) for _ in range(8)]
    sim = simulate(schedule, stage_times=times, p2p_latency=0.1)
    assert Replay(schedule).makespan(times, 0.1) == sim.makespan


@pytest.mark.parametrize("times,needle", [([(1.0, 2.0)] * 3, "one (forward, backward) pair per virtual stage"),
                                          ([(1.0, 2.0), (0.0, 1.0)], "stage_times[1] forward"),
                                          ([(1.0, -2.0), (1.0, 1.0)], "stage_times[0] backward")])
def test_bad_stage_times_are_named(times, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        simulate(build_schedule(2, 1, 2), stage_times=times)


# -- the cost model -------------------------------------------------------------------------------------------
def test_frozen_layers_backward_costs_one_forward_after_a_trainable_one_and_nothing_before():
    model = load_model("llama3-8b")
    embedding, layers, head = model_layer_costs(model, "SSXSS", text_seq=192, image_tokens=1200, frozen="SEH")
    assert [c.backward for c in layers[:2]] == [0.0, 0.0]  # frozen prefix: no backward, nothing saved
    assert [c.activation for c in layers[:2]] == [0.0, 0.0]
    assert layers[2].backward == 2 * layers[2].forward  # trainable cross-attention
    assert [c.backward for c in layers[3:]] == [c.forward for c in layers[3:]]  # input gradients only
    assert head.backward == head.forward and embedding.forward == 0.0
    _, trained, _ = model_layer_costs(model, "SSXSS", text_seq=192, image_tokens=1200)
    assert all(c.backward == 2 * c.forward for c in trained)


def test_a_cross_attention_layer_over_many_image_tokens_costs_more_than_a_self_attention_layer():
    _, layers, _ = model_layer_costs(load_model("llama3-8b"), "SX", text_seq=192, image_tokens=3000)
    assert layers[1].forward > 1.5 * layers[0].forward  # GQA keeps the image K/V projections small
    _, few, _ = model_layer_costs(load_model("llama3-8b"), "SX", text_seq=192, image_tokens=100)
    assert few[1].forward < few[0].forward


@pytest.mark.parametrize("kwargs,needle", [(dict(kinds="SSQ"), "--kinds='SSQ'"),
                                           (dict(kinds="SX", frozen="Z"), "--frozen='Z'"),
                                           (dict(kinds="SX", image_tokens=0), "--image-tokens=0")])
def test_bad_cost_inputs_are_named(kwargs, needle):
    kinds = kwargs.pop("kinds")
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        model_layer_costs(load_model("llama3-8b"), kinds, text_seq=128, **kwargs)


# -- the split ------------------------------------------------------------------------------------------------
def test_uniform_layers_give_the_papers_fewer_layers_on_first_and_last_stage():
    """Llama 3 405B: 126 layers on 16 stages, the output head on the last: 7, 8 x 14, 7 (section 3.1.2)."""
    embedding, layers, head = model_layer_costs(load_model("llama3-405b"), "S" * 126, text_seq=8192)
    splits = StageSplitter(layers, build_schedule(16, 1, 32), embedding=embedding, head=head).balance()
    assert splits[0].name == "balanced"
    assert splits[0].counts == (7,) + (8,) * 14 + (7,)


def test_balanced_multimodal_split_beats_counting_layers():
    embedding, layers, head = model_layer_costs(load_model("llama3-8b"), MULTIMODAL, text_seq=192,
                                                image_tokens=3000, frozen="SEH")
    splits = {s.name: s for s in StageSplitter(layers, build_schedule(8, 1, 32), embedding=embedding, head=head,
                                               kinds=MULTIMODAL).balance()}
    assert set(splits) == {"balanced", "count", "grouped", "min-max-stage"}  # 42 = 8 x 5 + 2: no fewer-ends
    assert splits["grouped"].counts == (5,) * 8  # 4 S + 1 X per stage
    assert splits["balanced"].makespan < 0.9 * splits["count"].makespan
    assert splits["balanced"].load_ratio < splits["count"].load_ratio


@settings(max_examples=25, deadline=None)
@given(pp=st.integers(1, 4), vpp=st.integers(1, 3), m=st.integers(1, 9), seed=st.integers(0, 10**6),
       extra=st.integers(0, 6))
def test_the_chosen_split_is_never_worse_than_a_candidate_and_covers_every_layer(pp, vpp, m, seed, extra):
    rng = random.Random(seed)
    num_layers = pp * vpp + extra
    layers = [LayerCost(rng.uniform(0.2, 3), rng.choice([0.0, 1.0, 2.0]) * rng.uniform(0.2, 3), rng.uniform(0, 5))
              for _ in range(num_layers)]
    splitter = StageSplitter(layers, build_schedule(pp, vpp, m), head=LayerCost(rng.uniform(0, 2), 1.0))
    splits = splitter.balance()
    best = splits[0]
    assert all(best.makespan <= s.makespan * (1 + 1e-9) for s in splits)
    assert [i for stage in best.stages() for i in stage] == list(range(num_layers))
    assert len(best.counts) == pp * vpp and min(best.counts) >= 1


def test_too_few_layers_for_the_stages_is_refused():
    with pytest.raises(ValueError, match="3 layers cannot fill pp x vpp = 4 virtual stages"):
        StageSplitter([LayerCost(1, 2)] * 3, build_schedule(2, 2, 4))


def test_megatron_layout_is_read_back_by_megatron():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    stages = PipelineParallelLayerLayout.parse_str_to_list(megatron_layout((7, 8, 8, 7), 2))
    assert [[t.name for t in s] for s in stages] == [["embedding"] + ["decoder"] * 7, ["decoder"] * 8,
                                                     ["decoder"] * 8, ["decoder"] * 7 + ["loss"]]


# -- the command ----------------------------------------------------------------------------------------------
def test_balance_cli_json_lists_every_layer_in_pipeline_order(capsys, tmp_path):
    png = tmp_path / "balance.png"
    assert main(["balance", "--kinds", MULTIMODAL, "--frozen", "SEH", "--pp", "4", "--vpp", "2",
                 "--microbatches", "8", "--text-seq", "192", "--image-tokens", "1200", "--json",
                 "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["stages"]) == 8
    assert [i for stage in out["stages"] for i in stage] == list(range(40))
    assert out["chosen"] == "balanced" and "multimodal_block_spec" in out["layer_spec"]
    # Megatron's layout of the same split ('t' for any layer: the kinds come from the block spec).
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    parsed = PipelineParallelLayerLayout.parse_str_to_list(out["megatron_layout"])
    assert [sum(t.name == "decoder" for t in stage) for stage in parsed] == [len(s) for s in out["stages"]]
    assert {c["name"] for c in out["candidates"]} >= {"balanced", "count", "grouped"}
    assert png.stat().st_size > 1000


def test_balance_cli_prints_the_table_and_the_layout_for_plain_layers(capsys):
    assert main(["balance", "--kinds", "S" * 14, "--pp", "4", "--microbatches", "8", "--model", "llama3-70b",
                 "--text-seq", "4096"]) == 0
    out = capsys.readouterr().out
    assert "chosen: balanced" in out and "--pipeline-model-parallel-layout \"E" in out
    for name in ("count", "fewer-ends", "balanced"):
        assert f"\n{name} " in out


def test_balance_cli_takes_measured_costs(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"layers": [[1, 2]] * 5 + [[4, 8]] + [[1, 2]] * 2, "head": [1, 2]}))
    assert main(["balance", "--kinds", "S" * 8, "--pp", "2", "--microbatches", "4", "--costs", str(costs),
                 "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages == [[0, 1, 2, 3, 4], [5, 6, 7]]  # the heavy layer 5 and the head share the lighter side


@pytest.mark.parametrize("argv,needle", [(["--kinds", "SSQ", "--text-seq", "8"], "--kinds='SSQ'"),
                                         (["--kinds", "SS"], "--text-seq is required"),
                                         (["--kinds", "S", "--text-seq", "8"], "1 layers cannot fill")])
def test_balance_cli_bad_input(capsys, argv, needle):
    assert main(["balance", "--pp", "2", "--microbatches", "2", *argv]) == 2
    assert needle in capsys.readouterr().err
