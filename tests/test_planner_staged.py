"""Staged long-context planning (paper 5.1), the machine flags, the ranking table and bad input, through
`l3plugin plan` (main()) and the planner API."""

import json
import re
from dataclasses import replace

import pytest

from l3plugin.cli import main
from l3plugin.planner import Base, Hardware, Layout, ModelSpec, PlanRequest, ScheduleCache, plan, staged_plan
from l3plugin.planner.costs import GIB
from l3plugin.planner.report import megatron_args
from l3plugin.planner.search import NoPlanFits
from l3plugin.planner.staged import rank_in_free_search, term_differences

PAPER = ["plan", "--model", "llama3-405b", "--gpus", "16384", "--global-batch-tokens", "16777216"]
LONG = PAPER + ["--seq-len", "131072"]
SHORT = PAPER + ["--seq-len", "8192"]
SMALL = ["plan", "--model", "llama3-70b", "--gpus", "64", "--seq-len", "8192", "--global-batch-tokens",
         str(8192 * 64)]


def run(argv, capsys, code=0):
    assert main(argv) == code
    captured = capsys.readouterr()
    return captured.out if code == 0 else captured.err


def _quiet_main(argv):
    """stdout of ``main(argv)`` outside a test (module fixtures cannot take capsys)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def long_json():
    """`plan --seq-len 131072 --keep-tp-pp --json` for the paper's 405B run (computed once; the free search's #1 is
    all its tests read of the ranking, and the staged layout's rank comes from a search of its own)."""
    return json.loads(_quiet_main(LONG + ["--keep-tp-pp", "--json", "--top-k", "1"]))


@pytest.fixture(scope="module")
def short_json_file(tmp_path_factory):
    """The short-context stage's own `plan --seq-len 8192 --json` output, as a file for --from."""
    path = tmp_path_factory.mktemp("plans") / "8k.json"
    path.write_text(_quiet_main(SHORT + ["--json", "--top-k", "1"]))
    return path


@pytest.fixture(scope="module")
def staged_text_from_short(short_json_file):
    """The 131K text report with TP/PP kept --from the 8K plan's file (computed once, read by two tests)."""
    return _quiet_main(LONG + ["--from", str(short_json_file), "--top-k", "2"])


def _sizes(record):
    return tuple(record[k] for k in ("tp", "pp", "cp", "dp"))


def test_keep_tp_pp_gives_the_paper_131k_layout_by_the_rule(long_json):
    staged = long_json["staged"]
    assert long_json["answer"] == "staged"
    assert _sizes(staged) == (8, 16, 16, 8)  # the paper's 4D layout at 131K
    assert staged["vpp"] == 8 and staged["rule_cp"] == 16  # VPP 8 of the 8K plan still fits
    assert staged["memory_gb"] <= staged["usable_memory_gb"]
    assert staged["microbatches_per_dp_group"] == 16 >= staged["pp"]  # m >= PP, exactly at the bound
    assert "8192-token plan (tp=8 cp=1 pp=16 dp=128 vpp=8" in staged["kept_from"]
    rule = next(r for r in staged["reasons"] if r.startswith("Rule:"))
    assert "CP >= N / (TP B) = 16" in rule and "CP=8: m = 8 < PP=16" in rule
    # the free search still runs; the staged layout's rank and margin against its #1 are reported
    best = long_json["plans"][0]
    assert staged["free_search_rank"] >= 1
    assert staged["margin_vs_best"] == pytest.approx(staged["step_time_s"] / best["step_time_s"] - 1, abs=1e-4)
    if staged["free_search_rank"] > 1:
        assert staged["step_time_s"] >= best["step_time_s"] and "Terms that differ" in staged["trade_off"]


def test_from_plan_json_gives_the_same_answer(short_json_file, staged_text_from_short):
    """--from the 8K plan's --json file keeps the TP/PP that --keep-tp-pp plans itself (long_json above): the
    same staged answer. (That a staged --json run seeds the next stage: test_emit_megatron_for_the_staged_plan.)"""
    assert _sizes(json.loads(short_json_file.read_text())["plans"][0]) == (8, 16, 1, 128)
    text = staged_text_from_short
    assert f"Staged plan (paper 5.1), TP/PP kept from --from {short_json_file}:" in text
    staged_row = next(line for line in text.splitlines() if line.startswith(" S "))
    assert staged_row.split()[1:5] == ["8", "16", "16", "8"]  # tp cp pp dp
    assert "Why tp=8 cp=16 pp=16 dp=8, vpp=8," in text


def test_staged_text_says_why(staged_text_from_short):
    # The text report of a staged plan is the same whichever way TP/PP were kept (--from here, --keep-tp-pp in
    # long_json): both give staged_plan the same base.
    text = staged_text_from_short
    staged_row = next(line for line in text.splitlines() if line.startswith(" S "))
    assert staged_row.split()[1:5] == ["8", "16", "16", "8"]
    for phrase in ("Why tp=8 cp=16 pp=16 dp=8, vpp=8", "CP can replace neither TP nor PP", "VPP=8 kept",
                   "the smallest CP that keeps m >= PP minimises CP communication", "Assumptions",
                   "989 dense BF16 TFLOPs", "50 GB/s per GPU across nodes"):
        assert phrase in text
    # the paper's layout is shown under the free ranking when it is not in the top k
    if " P " in text:
        paper_row = next(line for line in text.splitlines() if line.startswith(" P "))
        assert paper_row.split()[1:5] == staged_row.split()[1:5]


def test_the_rule_follows_the_gpu_count_and_batch():
    """CP >= N / (TP B): half the GPUs need half the CP, half the batch twice the CP (derived, not a constant).
    When the rule's CP does not fit this memory model the next CP is taken, and the report says why:
    test_keeping_the_gathered_kv_needs_a_larger_cp."""
    base = Base(tp=8, pp=16, vpp=8, source="test")
    cache = ScheduleCache()
    for gpus, batch_tokens, cp in ((16384, 16 * 2**20, 16), (16384, 8 * 2**20, 32), (8192, 8 * 2**20, 16)):
        req = PlanRequest("llama3-405b", gpus=gpus, seq_len=131072, global_batch_tokens=batch_tokens)
        result = staged_plan(req, base, cache)
        L = result.evaluation.layout
        assert result.rule_cp == cp and (L.tp, L.pp, L.cp) == (8, 16, cp) and L.tp * L.pp * L.cp * L.dp == gpus
        assert L.microbatches >= L.pp and result.evaluation.fits
        assert L.vpp == 8 and any(r.startswith("VPP=8 kept") for r in result.reasons)


@pytest.fixture(scope="module")
def staged_405b_at_131k():
    """staged_plan of the paper's 131K run with the paper's TP/PP, by --cp-kv (each computed once)."""
    done = {}

    def get(cp_kv):
        if cp_kv not in done:
            req = PlanRequest("llama3-405b", gpus=16384, seq_len=131072, global_batch_tokens=16 * 2**20,
                              hardware=Hardware(cp_kv=cp_kv))
            done[cp_kv] = staged_plan(req, Base(tp=8, pp=16, vpp=8, source="test"))
        return done[cp_kv]

    return get


def test_keeping_the_gathered_kv_needs_a_larger_cp(staged_405b_at_131k):
    """--cp-kv keep holds the all-gathered K/V for backward: CP 16 no longer fits at any VPP, so the staged
    plan moves to the next CP, which shards activations further, and says so."""
    result = staged_405b_at_131k("keep")
    L = result.evaluation.layout
    assert result.rule_cp == 16 and (L.tp, L.pp, L.cp, L.dp) == (8, 16, 32, 4) and result.evaluation.fits
    assert any(r.startswith("CP=16: no VPP fits") for r in result.reasons)
    assert any("the smallest CP that keeps m >= PP and fits minimises CP communication" in r for r in result.reasons)
    # the emitted Megatron arguments name the CP attention the memory was planned for
    args = megatron_args(result.evaluation)
    assert "--context-parallel-size 32" in args and "--cp-comm-type l3plugin_all_gather" in args
    assert "--l3plugin-cp-kv keep" in args


def test_emit_megatron_for_the_staged_plan(capsys, long_json, tmp_path):
    """Emitted --from a staged --json run (long_json, planned with --keep-tp-pp): --from keeps its staged answer
    (the free search's #1 there has PP 4), so a staged run seeds the next stage."""
    long = tmp_path / "131k.json"
    long.write_text(json.dumps(long_json))
    args = run(LONG + ["--from", str(long), "--emit", "megatron", "--top-k", "1"], capsys)  # emits the staged answer
    for flag in ("--tensor-model-parallel-size 8", "--context-parallel-size 16", "--pipeline-model-parallel-size 16",
                 "--cp-comm-type l3plugin_all_gather", "--l3plugin-cp-kv regather", "--global-batch-size 128",
                 "--seq-length 131072",
                 "--microbatch-group-size-per-virtual-pipeline-stage 16"):
        assert flag in args


TINY = ModelSpec("tiny", num_layers=8, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                 vocab_size=1000)
BARE = Hardware(reserved_gb=0.0, usable_fraction=1.0)


def test_staged_rank_and_terms_match_an_exhaustive_free_search():
    req = PlanRequest(model=TINY, gpus=32, seq_len=256, global_batch_tokens=256 * 8, gpus_per_node=4, hbm_gb=1.0,
                      hardware=BARE)
    assert req.long_context  # 8 sequences x TP 2 < 32 GPUs
    cache = ScheduleCache()
    result = staged_plan(req, Base(tp=2, pp=2, vpp=2, source="test"), cache)
    L = result.evaluation.layout
    # m = 8 x 2 x 2 x CP / 32 >= 2  <=>  CP >= 2
    assert (L.tp, L.pp, L.cp, L.dp) == (2, 2, 2, 4) and result.rule_cp == 2
    everything = plan(req, top=None, within=None, cache=cache)
    rank, faster = rank_in_free_search(result.evaluation, everything[0], cache)
    assert rank == 1 + sum(ev.step_seconds < result.evaluation.step_seconds and ev.layout != L for ev in everything)
    assert {ev.layout for ev in faster} < {ev.layout for ev in everything}
    d = term_differences(result.evaluation, everything[0])
    # the step-time terms add up: compute + bubble + exposed TP, CP, DP = step
    assert d["step"] == pytest.approx(d["compute"] + d["bubble"] + d["tp_exposed"] + d["cp_exposed"]
                                      + d["dp_exposed"], abs=1e-12)
    assert d["memory_gb"] == pytest.approx((result.evaluation.memory_bytes - everything[0].memory_bytes) / GIB)


def test_ring_collectives_and_cross_node_tp_are_priced_by_hand():
    hw = Hardware(intra_node_gbps=100.0, inter_node_gbps=10.0, latency_s=1e-5, reserved_gb=0.0)
    req = PlanRequest(model=TINY, gpus=8, seq_len=256, global_batch_tokens=256 * 8, gpus_per_node=2, hbm_gb=1.0,
                      hardware=hw, cp_policy="any")
    inside = req.costs(Layout(2, 1, 1, 4, 1, 2, 2, (8,), "even"))
    across = req.costs(Layout(4, 1, 1, 2, 1, 4, 4, (8,), "even"))
    # TP all-gather of 256 tokens x 64 x bf16: (g-1)/g of it, (g-1) ring steps
    assert inside.tp_collective_s == pytest.approx(1 * 1e-5 + 0.5 * 256 * 64 * 2 / 100e9)
    assert across.tp_collective_s == pytest.approx(3 * 1e-5 + 0.75 * 256 * 64 * 2 / 10e9)  # network rate
    cp4 = req.costs(Layout(1, 4, 1, 2, 1, 4, 4, (8,), "even"))
    kv = 0.75 * 2 * 256 * TINY.kv_dim * 2  # K and V of the whole sequence, (cp-1)/cp of it received
    assert cp4.cp_collective_s == pytest.approx(3 * 1e-5 + kv / 10e9)
    assert cp4.rank_cp[0] == pytest.approx(4 * 8 * 3 * cp4.cp_collective_s)  # m x layers x 3 collectives


def test_more_memory_allows_fewer_model_parallel_stages(capsys):
    sizes = []
    for memory in ("40", "80", "160"):
        best = json.loads(run(SMALL + ["--gpu-memory-gb", memory, "--json", "--top-k", "1"], capsys))["plans"][0]
        sizes.append(best["tp"] * best["cp"] * best["pp"])
    assert sizes[0] >= sizes[1] > sizes[2]  # 70B: 64 -> 16 -> 4 GPUs per model replica


def test_machine_flags_move_step_time_the_expected_way(capsys):
    def best(*flags):
        return json.loads(run(SMALL + ["--tp", "8", "--pp", "2", "--json", "--top-k", "1", *flags], capsys))["plans"][0]

    default = best()
    assert best("--mfu", "0.25")["step_terms_s"]["compute"] == pytest.approx(2 * default["step_terms_s"]["compute"],
                                                                             rel=1e-3)
    assert best("--peak-tflops", "1978")["step_time_s"] < default["step_time_s"]
    # TP 8 on 4-GPU nodes crosses hosts: its collectives run at the network rate
    cross = best("--gpus-per-node", "4")
    assert cross["step_terms_s"]["tp_exposed"] > 5 * default["step_terms_s"]["tp_exposed"]
    slower_nvlink = best("--intra-node-gbps", "45")
    assert slower_nvlink["step_terms_s"]["tp_exposed"] > default["step_terms_s"]["tp_exposed"]
    roomy = best("--usable-memory-fraction", "1.0")
    assert roomy["usable_memory_gb"] == pytest.approx(78.0)
    text = run(SMALL + ["--gpus-per-node", "4", "--tp", "8", "--top-k", "1"], capsys)
    assert "TP=8 spans 2 nodes of 4 GPUs" in text and "50 GB/s" in text


def test_ranking_table_is_ordered_with_margins(capsys):
    text = run(SMALL + ["--top-k", "4"], capsys)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  TP"))
    for column in ("mem GiB", "bubble", "step s", "vs #1", "TP exp", "CP exp", "DP exp"):
        assert column in lines[head]
    rows = [line.split() for line in lines[head + 1:] if re.match(r"\s*\d+ ", line)]
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1)) and 1 < len(rows) <= 4
    step = [float(r[12]) for r in rows]
    assert step == sorted(step) and rows[0][13] == "+0.0%"
    data = json.loads(run(SMALL + ["--top-k", "4", "--json"], capsys))  # the same numbers, unrounded
    plans = data["plans"]
    assert len(plans) == len(rows)
    for r, p in zip(rows, plans):
        assert [int(x) for x in r[1:5]] == [p["tp"], p["cp"], p["pp"], p["dp"]]
        assert float(r[12]) == pytest.approx(p["step_time_s"], abs=0.005)
        assert p["margin_vs_best"] == pytest.approx(p["step_time_s"] / plans[0]["step_time_s"] - 1, abs=1e-5)
        assert float(r[13].rstrip("%")) == pytest.approx(100 * p["margin_vs_best"], abs=0.051)
        assert float(r[10]) == pytest.approx(p["memory_gb"], abs=0.051)
        assert float(r[11].rstrip("%")) == pytest.approx(100 * p["bubble_ratio"], abs=0.051)
        for column, term in zip(r[15:18], ("tp_exposed", "cp_exposed", "dp_exposed")):
            assert float(column) == pytest.approx(p["step_terms_s"][term], abs=0.005)
    assert data["machine"]["name"] == "h100" and data["request"]["gpu_memory_gb"] == 80.0
    assert any("989 dense BF16 TFLOPs" in line for line in data["assumptions"])


def test_help_shows_units_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for phrase in ("--gpu-memory-gb", "GiB (h100: 80", "--usable-memory-fraction", "in (0, 1] (h100: 0.95)",
                   "--peak-tflops", "TFLOPs (h100: 989)", "--mfu", "--intra-node-gbps", "GB/s each way (h100: 450",
                   "--inter-node-gbps", "GB/s (h100: 50", "--gpus-per-node", "(h100: 8)", "--machine",
                   "--top-k", "default 5", "--keep-tp-pp", "--from PLAN.json", "--base-seq-len", "default 8192"):
        assert phrase in text


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--tp", "8", "--pp", "3"], r"--gpus=64 is not divisible by --tp x --pp = 24: use a multiple of 24 GPUs"),
    (["--seq-len", "8200", "--global-batch-tokens", str(8200 * 64), "--cp", "8"],
     r"--seq-len=8200 is not divisible by 2 x --cp = 16: .* CP sizes that divide this length: 1, 2, 4,"),
    (["--gpus-per-node", "48"], r"--gpus=64 is not divisible by --gpus-per-node=48"),
    (["--gpu-memory-gb", "2", "--usable-memory-fraction", "0.5"],
     r"--gpu-memory-gb=2 x --usable-memory-fraction=0.5 leaves nothing after the 2 GiB reserved .* > 4"),
    (["--keep-tp-pp", "--tp", "8"], r"--keep-tp-pp / --from .* drop --tp / --pp / --cp"),
    (["--from", "/nonexistent/plan.json"], r"--from /nonexistent/plan.json: no such file"),
])
def test_bad_input_names_the_flag(argv, message, capsys):
    err = run(SMALL + argv, capsys, code=2)
    assert re.search(message, err), err


def test_memory_below_any_layout_says_what_would_fit(capsys):
    err = run(SMALL + ["--gpu-memory-gb", "4"], capsys, code=2)
    match = re.search(r"no layout fits in --gpu-memory-gb=4 .* the closest is (tp=.*); (tp=.*); (tp=.*): "
                      r"[\d.]+ GiB over\. --gpu-memory-gb >= ([\d.]+) would fit the first", err)
    assert match, err
    enough = float(match.group(4)) + 0.1
    best = json.loads(run(SMALL + ["--gpu-memory-gb", str(enough), "--json", "--top-k", "1"], capsys))["plans"][0]
    assert best["memory_gb"] <= best["usable_memory_gb"]


def test_infeasible_pins_list_the_closest_feasible_layouts(capsys):
    err = run(SMALL + ["--tp", "1", "--pp", "1"], capsys, code=2)  # 70B unsharded fits no 80 GiB GPU
    assert "--tp 1 --pp 1: no layout fits" in err and "Closest feasible layouts without the pinned sizes: tp=" in err


def test_staged_rule_without_a_valid_cp_lists_the_closest_feasible_layouts():
    req = PlanRequest(model=TINY, gpus=32, seq_len=256, global_batch_tokens=256 * 2, gpus_per_node=4, hbm_gb=1.0,
                      hardware=BARE)
    # 2 sequences cannot give PP=4 micro-batches to any pipeline
    with pytest.raises(NoPlanFits, match=r"no CP gives every pipeline >= PP=4 micro-batches .* "
                                         r"Closest feasible layouts \(free search\): tp="):
        staged_plan(req, Base(tp=2, pp=4, vpp=1, source="test"))
    with pytest.raises(ValueError, match=r"--gpus=32 is not divisible by TP x PP = 2 x 3 = 6 kept from test: use "
                                         r"a multiple of 6 GPUs, e.g. 30 or 36"):
        staged_plan(req, Base(tp=2, pp=3, vpp=1, source="test"))


@pytest.mark.parametrize("flag,value", [("--mfu", "0"), ("--mfu", "1.5"), ("--usable-memory-fraction", "nan"),
                                        ("--intra-node-gbps", "-1"), ("--peak-tflops", "inf"),
                                        ("--inter-node-gbps", "0"), ("--latency-us", "-1"), ("--machine", "a100"),
                                        ("--top-k", "0")])
def test_bad_machine_flags_are_rejected_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        main(SMALL + [flag, value])
    assert flag in capsys.readouterr().err


def test_hardware_validates_its_fields():
    for kwargs, message in ((dict(mfu=0.0), r"--mfu=0.0 is invalid: must be a finite number in \(0, 1\]"),
                            (dict(inter_node_gbps=float("nan")), r"--inter-node-gbps=nan is invalid"),
                            (dict(cp_kv="drop"), r"--cp-kv='drop' is invalid: choose one of regather, keep")):
        with pytest.raises(ValueError, match=message):
            Hardware(**kwargs)
    assert replace(Hardware(), mfu=1.0).mfu == 1.0


@pytest.mark.parametrize("cp_kv, cp", [("regather", 16), ("keep", 32)])
def test_emitted_cp_flags_select_l3plugins_attention_with_the_planned_kv(staged_405b_at_131k, cp_kv, cp):
    """The CP flags of --emit megatron go through the launcher's own arguments (l3plugin/megatron/cp_route.py)
    to the route that builds the attention, keeping for backward what the memory was planned for: the
    paper's 131K plan (CP 16) with l3plugin's own attention when it regathers."""
    import argparse
    import shlex

    from l3plugin.megatron.arguments import CPRoute, add_cp_arguments, check_cp_args

    ev = staged_405b_at_131k(cp_kv).evaluation
    words = shlex.split(megatron_args(ev).replace("\\\n", " "), comments=True)  # notes are shell comments
    megatron_like = argparse.ArgumentParser()  # Megatron-LM's definitions of the two flags (arguments.py)
    megatron_like.add_argument("--context-parallel-size", type=int, default=1)
    megatron_like.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    add_cp_arguments(megatron_like)
    args, _ = megatron_like.parse_known_args(words)
    args.transformer_impl = "local"
    assert args.context_parallel_size == ev.layout.cp == cp
    assert check_cp_args(args) == CPRoute(layout="2cp", cp_kv=cp_kv, documents=False)
