"""The image encoder's cost model and its three placements under PP (pipeline, broadcast, replicated) on the
simulated text pipeline, and the simulated section of bench/multimodal_pp.py."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from l3plugin.planner.encoder_costs import (
    PLACEMENTS,
    EncoderCost,
    EncoderSpec,
    encoder_cost,
    multimodal_kinds,
    multimodal_step,
    placements,
)
from l3plugin.schedule.balance import LayerCost, StageSplitter
from l3plugin.schedule.plan import build_schedule, with_trainable_stages
from l3plugin.schedule.simulate import simulate

ROOT = Path(__file__).resolve().parents[2]


def text_splitter(pp, vpp, m, k=None, frozen_prefix=0, seed=0, p2p_latency=0.0):
    """A text model of 3 layers per virtual stage with random costs; the first ``frozen_prefix`` layers have
    no backward (frozen, nothing trainable before them)."""
    rng = random.Random(seed)
    layers = [LayerCost(rng.uniform(0.5, 2.0), 0.0 if i < frozen_prefix else rng.uniform(0.5, 4.0))
              for i in range(3 * pp * vpp)]
    splitter = StageSplitter(layers, build_schedule(pp, vpp, m, k), head=LayerCost(1.0, 2.0), p2p_latency=p2p_latency)
    return splitter, splitter.count_split()


def by_name(steps):
    return {s.name: s for s in steps}


# -- the encoder's FLOPs --------------------------------------------------------------------------------------
def test_encoder_flops_and_params_by_hand():
    spec = EncoderSpec(width=2, depth=1, mlp_ratio=1, patch_size=1)
    # patch embedding 2*n*3*1*w = 36; layer 2*n*(4+2)*w^2 = 144 plus attention 4*n^2*w = 72; projector 2*n*w*h = 60
    assert spec.forward_flops(3, 5) == 36 + 144 + 72 + 60
    assert spec.params(5) == 3 * 2 + 6 * 4 + 2 * 5


def test_vit_h_14_has_its_published_parameter_count():
    # ViT-H/14: 32 layers of width 1280, MLP 5120, about 632M parameters (Dosovitskiy et al., table 1)
    params = EncoderSpec(depth=32).params(4096)
    assert 0.62e9 < params < 0.65e9


def test_encoder_cost_backward_and_bytes():
    spec = EncoderSpec(width=8, depth=2)
    cost = encoder_cost(spec, 10, 16, flops_per_second=1e3)
    assert cost.forward == spec.forward_flops(10, 16) / 1e3
    assert cost.backward == 2 * cost.forward
    assert cost.token_bytes == 10 * 16 * 4  # fp32 image tokens of the text model's width
    assert cost.grad_bytes == 4 * spec.params(16)
    frozen = encoder_cost(EncoderSpec(width=8, depth=2, trainable=False), 10, 16, flops_per_second=1e3)
    assert (frozen.forward, frozen.backward, frozen.grad_bytes) == (cost.forward, 0.0, 0.0)


# -- the placements -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,vpp,m,k,frozen_prefix,latency", [(2, 1, 4, 2, 0, 0.0), (4, 2, 8, 4, 0, 0.0),
                                                               (3, 2, 5, 3, 4, 0.0), (4, 1, 6, 6, 5, 0.3),
                                                               (2, 2, 3, 1, 2, 0.1)])
def test_pipeline_placement_with_a_free_encoder_is_the_text_pipeline(pp, vpp, m, k, frozen_prefix, latency):
    splitter, counts = text_splitter(pp, vpp, m, k, frozen_prefix, p2p_latency=latency)
    free = EncoderCost(0.0, 0.0, token_bytes=0.0)
    steps = by_name(placements(splitter, counts, free, images_per_microbatch=2, bandwidth_gbps=10.0))
    costs = splitter.stage_costs(counts)
    text = simulate(splitter.schedule_for(costs), stage_times=[(c.forward, c.backward) for c in costs],
                    p2p_latency=latency).makespan
    assert steps["pipeline"].step == text == splitter.evaluate("count", counts).makespan
    for step in steps.values():
        assert (step.step, step.pipeline, step.encoder, step.comm) == (text, text, 0.0, 0.0)


def test_pipeline_placement_is_stage_zero_plus_the_encoder_with_bigger_messages():
    # stage 0 frozen: no backward of its own; a text message takes 1e9 bytes / 100 GB/s
    splitter, counts = text_splitter(3, 2, 7, 4, frozen_prefix=4, p2p_latency=0.01)
    encoder = EncoderCost(0.3, 0.6, token_bytes=2e9)
    step = by_name(placements(splitter, counts, encoder, images_per_microbatch=2, bandwidth_gbps=100.0))["pipeline"]
    costs = splitter.stage_costs(counts)
    times = [(c.forward, c.backward) for c in costs]
    times[0] = (times[0][0] + 0.6, times[0][1] + 1.2)
    # the trainable encoder on stage 0 puts every stage on the gradient path: the image gradients come back
    full = with_trainable_stages(splitter.schedule, [True] * splitter.num_stages)
    latency = (1e9 + 2 * 2e9) / 100e9
    assert step.step == pytest.approx(simulate(full, stage_times=times, p2p_latency=latency).makespan, rel=1e-12)
    without = simulate(full, stage_times=[(c.forward, c.backward) for c in costs], p2p_latency=latency).makespan
    assert step.encoder == pytest.approx(step.step - without, rel=1e-12)
    assert step.comm == pytest.approx(without - step.pipeline, rel=1e-12) and step.comm > 0
    assert 0 < step.encoder <= 7 * 2 * (0.3 + 0.6) + 1e-12  # at most all of rank 0's encoder work


@pytest.mark.parametrize("pp,vpp,m,ipm", [(2, 1, 4, 1), (4, 2, 8, 2), (4, 1, 12, 3), (8, 1, 8, 1)])
def test_replicated_encoder_time_is_broadcast_divided_by_p_plus_its_collectives(pp, vpp, m, ipm):
    splitter, counts = text_splitter(pp, vpp, m, p2p_latency=0.002)
    encoder = EncoderCost(0.25, 0.5, token_bytes=3e8, grad_bytes=5e9)
    steps = by_name(placements(splitter, counts, encoder, images_per_microbatch=ipm, bandwidth_gbps=50.0))
    broadcast, replicated = steps["broadcast"], steps["replicated"]
    images = m * ipm
    assert images % pp == 0
    assert broadcast.encoder == pytest.approx(images * 0.75)
    assert replicated.encoder == pytest.approx(broadcast.encoder / pp)
    assert replicated.images_per_rank == (images // pp,) * pp
    assert broadcast.images_per_rank == (images,) + (0,) * (pp - 1)
    # ring all-gather and reduce-scatter: each rank receives (P-1) shares; all-reduce 2 (P-1)/P of the grads
    per_rank = images // pp * 3e8
    assert replicated.comm_parts["all-gather"] == pytest.approx((pp - 1) * per_rank / 50e9)
    assert replicated.comm_parts["reduce-scatter"] == replicated.comm_parts["all-gather"]
    assert replicated.comm_parts["encoder all-reduce"] == pytest.approx(2 * (pp - 1) / pp * 5e9 / 50e9)
    assert broadcast.comm_parts == pytest.approx({"broadcast": images * 3e8 / 50e9, "reduce": images * 3e8 / 50e9})
    for step in (broadcast, replicated):
        assert step.step == pytest.approx(step.pipeline + step.encoder + step.comm)
        assert step.encoder_share == step.encoder / step.step
    assert broadcast.pipeline == replicated.pipeline == steps["pipeline"].pipeline


def test_replicated_uneven_images_are_padded_to_the_largest_share():
    splitter, counts = text_splitter(2, 1, 5)
    encoder = EncoderCost(1.0, 2.0, token_bytes=0.0)
    replicated = by_name(placements(splitter, counts, encoder, images_per_microbatch=1))["replicated"]
    assert replicated.images_per_rank == (3, 2)
    assert replicated.encoder == 3 * 3.0


def test_a_frozen_encoder_has_no_backward_and_no_gradient_traffic():
    splitter, counts = text_splitter(4, 1, 8)
    encoder = encoder_cost(EncoderSpec(width=64, depth=2, trainable=False), 100, 128, flops_per_second=1e9)
    steps = by_name(placements(splitter, counts, encoder, images_per_microbatch=1, bandwidth_gbps=1.0))
    assert steps["broadcast"].comm_parts["reduce"] == 0.0
    assert steps["replicated"].comm_parts["reduce-scatter"] == 0.0
    assert steps["replicated"].comm_parts["encoder all-reduce"] == 0.0
    assert steps["broadcast"].encoder == pytest.approx(8 * encoder.forward)


@pytest.mark.parametrize("bandwidth", [0.0, 20.0])
def test_steps_grow_with_the_image_count_and_equal_the_text_pipeline_without_images(bandwidth):
    splitter, counts = text_splitter(4, 2, 8, frozen_prefix=3, p2p_latency=1e8 / bandwidth / 1e9 if bandwidth else 0)
    encoder = EncoderCost(0.2, 0.4, token_bytes=1e9, grad_bytes=1e9)
    runs = [by_name(placements(splitter, counts, encoder, images_per_microbatch=n, bandwidth_gbps=bandwidth))
            for n in range(5)]
    for name in PLACEMENTS:
        steps = [run[name].step for run in runs]
        assert steps[0] == runs[0][name].pipeline
        assert all(a < b for a, b in zip(steps, steps[1:])), (name, steps)
        shares = [run[name].encoder_share for run in runs]
        assert shares[0] == 0 and all(a < b for a, b in zip(shares, shares[1:])), (name, shares)


def test_paper_sized_model_replicated_beats_the_others_and_lowers_the_encoder_share():
    kinds = multimodal_kinds(32, 4)
    result = multimodal_step("llama3-8b", kinds, pp=4, vpp=2, microbatches=32, text_seq=192, image_tokens=1200)
    assert result.splits[0].name == "balanced"
    steps = {name: result.placement(name) for name in PLACEMENTS}
    assert steps["replicated"].step < min(steps["pipeline"].step, steps["broadcast"].step)
    assert steps["replicated"].encoder_share < min(steps["pipeline"].encoder_share, steps["broadcast"].encoder_share)
    assert steps["pipeline"].pipeline == pytest.approx(result.split("balanced").makespan, rel=1e-12)
    # the text pipeline's messages: one bf16 activation of T tokens at the model's hidden size
    assert result.text_message_bytes == 2 * 192 * 4096


def test_multimodal_kinds():
    assert multimodal_kinds(32, 4) == "SSSSX" * 8
    assert multimodal_kinds(6, 4) == "SSSSXSS"


@pytest.mark.parametrize("call,needle", [
    (lambda: multimodal_step("llama3-8b", "SSX", pp=0, microbatches=2, text_seq=8, image_tokens=4), "pp_size=0"),
    (lambda: multimodal_step("llama3-8b", "SSX", pp=1, microbatches=2, text_seq=8, image_tokens=4,
                             images_per_sample=-1), "images_per_sample=-1"),
    (lambda: multimodal_step("llama3-8b", "SSX", pp=1, microbatches=2, text_seq=8, image_tokens=0),
     "image_tokens=0"),
    (lambda: multimodal_step("llama3-8b", "SSX", pp=1, microbatches=0, text_seq=8, image_tokens=4),
     "num_microbatches=0"),
    (lambda: multimodal_step("llama3-8b", "SSX", pp=1, microbatches=2, text_seq=8, image_tokens=4,
                             bandwidth_gbps=-1.0), "bandwidth_gbps=-1.0"),
    (lambda: placements(*text_splitter(2, 1, 2), EncoderCost(1, 1, 0), images_per_microbatch=-2),
     "images_per_microbatch=-2"),
    (lambda: EncoderCost(-1.0, 0.0, 0.0), "encoder cost forward=-1.0"),
    (lambda: EncoderSpec(width=0), "encoder width=0"),
    (lambda: EncoderSpec(depth=-1), "encoder depth=-1"),
    (lambda: EncoderSpec(trainable="yes"), "encoder trainable='yes'"),
    (lambda: encoder_cost(EncoderSpec(), 0, 16, 1e12), "tokens_per_image=0"),
    (lambda: encoder_cost(EncoderSpec(), 4, 16, 0.0), "flops_per_second=0.0"),
    (lambda: multimodal_kinds(32, 0), "self_per_cross=0"),
])
def test_bad_inputs_name_the_parameter(call, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("'", "'")) as info:
        call()
    assert "out of range" in str(info.value) or "must be" in str(info.value)


# -- the bench's simulated section ----------------------------------------------------------------------------
def test_bench_simulated_json_smoke():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # The refused run goes alongside the first (each interpreter imports on one core of two).
    bad = subprocess.Popen([sys.executable, str(ROOT / "bench" / "multimodal_pp.py"), "--pp", "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "multimodal_pp.py"), "--json", "--pp", "2", "4",
                           "--vpp", "1", "--microbatches", "4", "--image-tokens", "300"],
                          capture_output=True, text=True, env=env, timeout=60)
    try:
        _, bad_stderr = bad.communicate(timeout=60)
    finally:
        bad.kill()
        bad.communicate()
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["bench"] == "multimodal_pp" and record["command"][1:] == ["simulated", "--json", "--pp", "2", "4",
                                                                           "--vpp", "1", "--microbatches", "4",
                                                                           "--image-tokens", "300"]
    result = record["figures"]
    assert [(row["pp"], row["vpp"]) for row in result["rows"]] == [(2, 1), (4, 1)]
    for row in result["rows"]:
        assert set(row["placements"]) == set(PLACEMENTS)
        assert row["splits"]["balanced"]["makespan"] <= row["splits"]["count"]["makespan"]
        assert len(row["splits"]["balanced"]["counts"]) == row["pp"]
        for place in row["placements"].values():
            assert place["pipeline"] == pytest.approx(row["splits"]["balanced"]["makespan"], rel=1e-12)
            assert 0 < place["encoder_share"] < 1 and math.isfinite(place["step"])
    assert result["settings"]["kinds"] == "SSSSX" * 8
    assert bad.returncode == 2 and "pp_size=0" in bad_stderr
