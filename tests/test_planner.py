"""Planner model and search: hand-computed memory, schedule shortcuts, invariants, the paper's setting."""

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from l3plugin.planner import Hardware, Layout, ModelSpec, PlanRequest, ScheduleCache, evaluate, load_model, plan
from l3plugin.planner.costs import GIB
from l3plugin.planner.schedule_cache import warmup_inflight
from l3plugin.planner.search import NoPlanFits, enumerate_layouts, layer_splits
from l3plugin.schedule.plan import build_schedule
from l3plugin.schedule.simulate import simulate

# h=64, 4 heads of 16, 2 KV heads -> kv_dim 32, ffn 128, vocab 1000
TINY = ModelSpec("tiny", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_kv_heads=2, vocab_size=1000)
# Memory is a few hundred KB for TINY: no fixed reservation, so small --hbm-gb values bite.
BARE = Hardware(reserved_gb=0.0, usable_fraction=1.0)


def tiny_request(**kw):
    args = dict(model=TINY, gpus=2, seq_len=32, global_batch_tokens=32 * 4, gpus_per_node=8, hbm_gb=1.0,
                hardware=BARE)
    args.update(kw)
    return PlanRequest(**args)


def test_presets_have_public_sizes():
    assert round(load_model("llama3-8b").total_params / 1e9, 1) == 8.0
    assert round(load_model("llama3-70b").total_params / 1e9, 1) == 70.6
    assert round(load_model("llama3-405b").total_params / 1e9) == 406
    # layer: Q,O 2*64*64=8192; K,V 2*64*32=4096; SwiGLU 3*64*128=24576; two norms 128
    assert TINY.layer_params == 36992


def test_memory_matches_hand_computation_pp2():
    req = tiny_request()
    layout = Layout(tp=1, cp=1, pp=2, dp=1, vpp=1, group_size=4, microbatches=4, layers=(2, 2), split="even")
    ev = evaluate(req, layout, zero_stage=1)
    # params: rank 0 = 2 layers + embedding 64000 = 137984; rank 1 = 2 layers + output 64000 + norm 64 = 138048
    # ZeRO-1 with DP x CP = 1: bf16 weights 2P + fp32 grads 4P + fp32 master and two moments 12P
    assert ev.memory_per_rank[0]["weights"] == 2 * 137984
    assert ev.memory_per_rank[0]["gradients"] == 4 * 137984
    assert ev.memory_per_rank[1]["optimizer"] == 12 * 138048
    # one layer, 32 tokens: bf16 x (6h + 2kv + 3f = 832) + fp32 softmax stats x 4 heads = 53248 + 512
    # 1F1B p=2: rank 0 holds 2 microbatches in flight (warm-up 1 + one more), rank 1 holds 1
    assert ev.memory_per_rank[0]["activations"] == 2 * (2 * 53760)
    # rank 1 also keeps the final norm in/out (2*32*128 bytes) and logits bf16 + fp32 (6*32*1000)
    assert ev.memory_per_rank[1]["activations"] == 2 * 53760 + 8192 + 192000
    assert ev.memory_bytes == 18 * 138048 + 307712 == 2792576 and ev.worst_rank == 1
    assert ev.peak_inflight == 2


def test_zero2_keeps_two_chunks_of_fp32_gradients():
    model = ModelSpec("tiny8", 8, 64, 128, 4, 2, vocab_size=100)
    req = PlanRequest(model=model, gpus=8, seq_len=32, global_batch_tokens=32 * 16, hbm_gb=1.0, hardware=BARE)
    layout = Layout(tp=1, cp=1, pp=2, dp=4, vpp=4, group_size=2, microbatches=4, layers=(1,) * 8, split="even")
    ev = evaluate(req, layout, zero_stage=2)
    rank1 = ev.memory_per_rank[1]
    P = 4 * 36992 + 6464  # stages 1, 3, 5, 7 and the output layer (100 x 64 + final norm 64)
    C = 36992 + 6464  # largest chunk: the last stage
    assert rank1["gradients"] == 4 * 2 * C + 4 * P / 4  # two whole chunks + the fp32 shard over DP=4
    assert rank1["optimizer"] == 12 * P / 4
    zero1 = evaluate(req, layout, zero_stage=1)
    assert zero1.memory_per_rank[1]["gradients"] == 4 * P > rank1["gradients"]


def test_tp_and_cp_shard_activations():
    model = load_model("llama3-8b")
    req = PlanRequest(model=model, gpus=8, seq_len=8192, global_batch_tokens=8192 * 8, cp_policy="any")
    base = req.costs(Layout(1, 1, 1, 8, 1, 1, 1, (32,), "even"))
    tp4 = req.costs(Layout(4, 1, 1, 2, 1, 4, 4, (32,), "even"))
    cp4 = req.costs(Layout(1, 4, 1, 2, 1, 4, 4, (32,), "even"))
    assert tp4.act_layer == pytest.approx(base.act_layer / 4)
    # default --cp-kv regather: only local K/V are saved, so CP shards activations like TP ...
    assert cp4.act_layer == pytest.approx(base.act_layer / 4)
    # ... and backward pays a second K/V all-gather besides the dK/dV reduce-scatter
    kv_gathered = 2 * 2 * 8192 * 3 / 4 * model.kv_dim
    assert cp4.comm_bytes(0, 1)["cp"] == pytest.approx(4 * 32 * 3 * kv_gathered)
    # --cp-kv keep (l3plugin's cp/attention.py): the all-gathered K/V of the whole sequence stay for backward
    keep = replace(req, hardware=Hardware(cp_kv="keep")).costs(Layout(1, 4, 1, 2, 1, 4, 4, (32,), "even"))
    assert keep.act_layer == pytest.approx(base.act_layer / 4 + kv_gathered)
    assert keep.comm_bytes(0, 1)["cp"] == pytest.approx(4 * 32 * 2 * kv_gathered)


@pytest.mark.parametrize("p,v,m,k", [(2, 2, 25, 2), (4, 2, 40, 4), (4, 3, 39, 4), (3, 2, 58, 6), (2, 1, 19, 2),
                                     (4, 4, 33, 4), (4, 2, 65, 4), (4, 2, 80, 8)])
def test_shortened_schedules_match_full_simulation(p, v, m, k):
    cache = ScheduleCache()
    assert len(cache.simulated_lengths(p, m, k)) == 3  # the shortcut is really exercised
    for latency in (0.0, 0.3):
        full = simulate(build_schedule(p, v, m, k), 1.0, 2.1, latency)
        assert cache.bubble(p, v, m, k, 2.1, latency) == pytest.approx(full.bubble_ratio, abs=1e-9)
    full_schedule = build_schedule(p, v, m, k)
    frontier = cache.frontier(p, v, m, k)
    assert [max(map(sum, f)) for f in frontier] == [r.peak_inflight() for r in full_schedule.ranks]


@pytest.mark.parametrize("p,v,m,k", [(4, 2, 8, 4), (4, 3, 5, 4), (4, 2, 3, 3), (2, 4, 9, 4), (3, 1, 7, 7),
                                     (4, 2, 12, 8), (1, 1, 5, 5)])
def test_warmup_lower_bound_is_the_schedule_peak(p, v, m, k):
    schedule = build_schedule(p, v, m, k)
    list_scheduled = v > 1 and k >= p and 0 < m % k < p  # (4, 3, 5, 4): a bound, not the peak
    for rank in range(p):
        bound, peak = sum(warmup_inflight(p, v, m, k, rank)), schedule.ranks[rank].peak_inflight()
        assert bound <= peak if list_scheduled else bound == peak


def test_layer_splits_include_the_paper_405b_split():
    splits = {(v, s): layers for v, layers, s in layer_splits(126, 16)}
    assert splits[(8, "fewer-first-last")] == (0,) + (1,) * 126 + (0,)
    assert not any(v == 8 and s == "even" for v, s in splits)  # 126 does not divide into 128
    small = {(v, s): layers for v, layers, s in layer_splits(16, 2)}
    assert small[(2, "even")] == (4, 4, 4, 4) and small[(3, "fewer-first-last")] == (2, 3, 3, 3, 3, 2)
    assert (1, "fewer-first-last") not in small  # same as the even 8 + 8: listed once


def test_paper_405b_8k_setting():
    req = PlanRequest("llama3-405b", gpus=16384, seq_len=8192, global_batch_tokens=16 * 2**20)
    best = plan(req, top=1)[0]  # #1 of any longer ranking too: the search stops once it is known
    L = best.layout
    # Table 2 of the paper: TP 8 within the node, PP 16, DP 128, no CP at 8K, 2048 / 128 = 16 = p
    assert (L.tp, L.cp, L.pp, L.dp) == (8, 1, 16, 128)
    assert L.microbatches >= L.pp and L.tp * L.cp * L.pp * L.dp == 16384
    assert L.vpp == 8 and L.layers[0] == L.layers[-1] == 0  # one layer fewer on the end stages
    assert best.zero_stage == 2 and L.group_size < 2 * L.pp  # the paper's rule: k < 2p -> ZeRO-2
    assert best.fits and 0 < best.bubble_ratio < 0.2


def test_paper_405b_long_context_uses_cp_instead_of_dp():
    req = PlanRequest("llama3-405b", gpus=16384, seq_len=131072, global_batch_tokens=16 * 2**20)
    assert req.long_context
    best = plan(req, top=1)[0]
    L = best.layout
    assert L.tp == 8 and L.cp >= 16 and L.microbatches >= L.pp  # paper: C_p >= 16 for b >= P_p


def test_short_context_plans_avoid_cp_unless_memory_needs_it():
    req = PlanRequest("llama3-8b", gpus=64, seq_len=8192, global_batch_tokens=4 * 2**20)
    assert all(ev.layout.cp == 1 for ev in plan(req, top=5))
    # 8B at 128K on two nodes: enough sequences for 3D parallelism, but nothing fits without CP,
    # so the fallback lets CP cut activations (TP cannot grow past the node)
    tight = PlanRequest("llama3-8b", gpus=16, seq_len=131072, global_batch_tokens=131072 * 16)
    assert not tight.long_context
    best = plan(tight, top=1)[0]
    assert best.request.cp_policy == "memory" and best.layout.cp > 1 and best.fits


def test_top_n_equals_the_exhaustive_ranking():
    model = ModelSpec("m6", 6, 64, 128, 4, 2, 1000)
    req = PlanRequest(model=model, gpus=16, seq_len=64, global_batch_tokens=64 * 32, gpus_per_node=4,
                      hbm_gb=0.002, hardware=BARE, cp_policy="any")
    everything = plan(req, top=None, within=None)
    best = plan(req, top=4, within=None)
    assert [round(e.step_seconds, 12) for e in best] == [round(e.step_seconds, 12) for e in everything[:4]]


def test_nothing_fits_names_the_closest_layout():
    with pytest.raises(NoPlanFits, match=r"no layout fits in --gpu-memory-gb=0\.0001 .* the closest is tp=.* GiB over"):
        plan(tiny_request(hbm_gb=0.0001))


@pytest.mark.parametrize("kwargs,message", [
    (dict(gpus=12), r"--gpus=12 is not divisible by --gpus-per-node=8: .* e\.g\. 8 or 16"),
    (dict(global_batch_tokens=100), r"--global-batch-tokens=100 is not divisible by --seq-len=32: .* 96 or 128"),
    (dict(micro_batch_size=3), r"4 sequences is not divisible by --micro-batch-size=3"),
    (dict(model="llama3-1b"), r"not a known preset: valid presets are llama3-8b, llama3-70b, llama3-405b"),
    (dict(hbm_gb=0), r"--gpu-memory-gb=0 is invalid"),
    (dict(hbm_gb=float("inf")), r"--gpu-memory-gb=inf is invalid: must be a finite number > 0 \(GiB per GPU\)"),
    (dict(hbm_gb=float("nan")), r"--gpu-memory-gb=nan is invalid: must be a finite number > 0"),
])
def test_bad_requests_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_request(**kwargs)


def test_model_json_file(tmp_path):
    good = tmp_path / "mini.json"
    good.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                                "num_attention_heads": 4, "num_kv_heads": 2}))
    model = load_model(str(good))
    assert model.name == "mini" and model.vocab_size == 128256
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_layers": 4, "hidden": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                               "num_kv_heads": 2}))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['hidden_size'\] and unknown field\(s\) \['hidden'\]"):
        load_model(str(bad))
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                               "num_attention_heads": 4, "num_kv_heads": 3}))
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by num_kv_heads=3"):
        load_model(str(odd))
    with pytest.raises(ValueError, match="no such file"):
        load_model(str(tmp_path / "missing.json"))


# ---- properties over random small clusters ------------------------------------------------------
@st.composite
def small_requests(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    model = ModelSpec("rand", num_layers=draw(st.integers(1, 12)), hidden_size=16 * heads * draw(st.integers(1, 2)),
                      ffn_hidden_size=draw(st.sampled_from([64, 128, 256])), num_attention_heads=heads,
                      num_kv_heads=draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0])),
                      vocab_size=draw(st.sampled_from([100, 1000])))
    per_node = draw(st.sampled_from([1, 2, 4, 8]))
    gpus = draw(st.one_of(st.integers(1, per_node), st.integers(1, 4).map(lambda n: n * per_node)))
    seq = draw(st.sampled_from([16, 32, 64, 128]))
    micro = draw(st.sampled_from([1, 1, 2]))
    return PlanRequest(model=model, gpus=gpus, seq_len=seq,
                       global_batch_tokens=seq * micro * draw(st.integers(1, 12)),
                       gpus_per_node=per_node, hbm_gb=2.0 ** draw(st.floats(-12.0, -2.0)), hardware=BARE,
                       micro_batch_size=micro,
                       cp_policy=draw(st.sampled_from(["long-context", "any"])))


def _all_plans(req):
    try:
        return plan(req, top=None, within=None)
    except NoPlanFits:
        return []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_requests())
def test_every_plan_is_a_valid_layout_that_fits(req):
    plans = _all_plans(req)
    # the search's memory lower bound never prunes a layout that fits (brute force over all layouts);
    # when nothing fits under the paper's CP rule, the planner retries with any CP
    searched = plans[0].request if plans else replace(req, cp_policy="memory")
    fitting = {L for L in enumerate_layouts(searched) if evaluate(searched, L).fits}
    assert {ev.layout for ev in plans} == fitting
    for ev in plans:
        L = ev.layout
        assert L.tp * L.cp * L.pp * L.dp == req.gpus
        # TP may leave the node, but then its collectives are priced at the network rate
        assert ev.costs.tp_bw == 1e9 * (BARE.intra_node_gbps if L.tp <= req.gpus_per_node else BARE.inter_node_gbps)
        assert L.microbatches >= 1 and L.microbatches * L.dp * req.micro_batch_size == req.sequences
        assert sum(L.layers) == req.model.num_layers and len(L.layers) == L.pp * L.vpp
        assert 1 <= L.group_size <= L.microbatches
        assert ev.memory_bytes <= req.usable_bytes
        assert ev.bubble_ratio >= (L.pp - 1) / (L.microbatches * L.vpp) - 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_requests(), st.floats(1.0, 4.0))
def test_more_hbm_never_removes_a_feasible_layout(req, factor):
    def feasible(r):
        return {ev.layout for ev in _all_plans(r)}

    bigger = replace(req, hbm_gb=req.hbm_gb * factor)
    # Same candidate set: every plan stays listed
    free = replace(req, cp_policy="any")
    assert feasible(free) <= feasible(replace(free, hbm_gb=free.hbm_gb * factor))
    # Paper's CP rule: a CP layout listed only because nothing else fitted may give way to a CP-free one
    # when HBM grows, but it still fits
    for layout in feasible(req):
        assert evaluate(bigger, layout).fits


def test_layouts_cover_the_paper_order_and_node_limit():
    req = PlanRequest("llama3-70b", gpus=64, seq_len=8192, global_batch_tokens=8192 * 64, cp_policy="any")
    layouts = list(enumerate_layouts(req))
    assert layouts and all(L.tp <= 8 and 8192 % (2 * L.cp) == 0 for L in layouts)
    assert {L.tp for L in layouts} == {1, 2, 4, 8}
    assert max(ev.memory_bytes for ev in plan(req, top=3)) <= req.usable_bytes < 80 * GIB
