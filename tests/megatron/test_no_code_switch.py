"""Switching Megatron-Core to the flexible schedule without code (issue 55, item 5): the environment variables
L3PLUGIN_PIPELINE_SCHEDULE (read by the start-up hook, l3plugin_autoload.py, which installs when megatron.core has
finished importing) and L3PLUGIN_MICROBATCH_GROUP_SIZE (k for l3plugin's schedule instead of the config's
microbatch_group_size_per_vp_stage, so verl can keep 1 there and stop rounding m up).

The hook is checked in fresh interpreters of this venv (its installed l3plugin-autoload.pth), from an empty
directory, each importing megatron.core the way verl's engine does; they run at once, queued ahead
(tests/runs_ahead.py). The k knob is checked without processes and in one pp 2 x vpp 2 step on gloo ranks."""

import importlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import l3plugin
import toy_pipeline as toy
from l3plugin.megatron.arguments import GROUP_SIZE_ENV, group_size_setting, microbatch_group_size
from l3plugin.ranks.pool import run_command
from runs_ahead import time_allowed

TREE = Path(l3plugin.__file__).resolve().parents[1]  # the checkout under test, first on the children's path
SCHEDULE_ENV = "L3PLUGIN_PIPELINE_SCHEDULE"

# verl's engine: `from megatron.core import parallel_state` then `from megatron.core.pipeline_parallel import
# get_forward_backward_func` at the top of its module (verl/workers/engine/megatron/transformer_impl.py).
VERL_IMPORTS = """
import json, sys
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
import megatron.core.pipeline_parallel as pp
print(json.dumps({"bound": get_forward_backward_func.__module__,
                  "pp2": get_forward_backward_func(pp_size=2, vp_size=2).__name__,
                  "pp4": pp.get_forward_backward_func(pp_size=4, vp_size=None).__name__,
                  "pp1": pp.get_forward_backward_func(pp_size=1, vp_size=None).__name__,
                  "l3plugin": sorted(m for m in sys.modules if m == "l3plugin" or m.startswith("l3plugin."))}))
"""

# A script that calls install() itself (here "default") with the variable set: its call imports Megatron, the hook
# must leave it alone (installing from inside it would make install() take its own selector for Megatron's).
EXPLICIT_INSTALL = "import l3plugin.megatron\nl3plugin.megatron.install('default')\n" + VERL_IMPORTS

# Megatron-LM's megatron.training imports megatron.core from its own __init__ (through global_vars) and its
# initialize.py imports names of the half-built package: a stand-in with those two traits, next to the installed
# megatron.core (a namespace package). Installing at megatron.core's end would fail to hook parse_args.
FAKE_TRAINING = {
    "__init__.py": "import megatron.core  # noqa: F401 (first, as Megatron-LM's global_vars does)\n"
                   "def get_args():\n    return None\n"
                   "from .training import pretrain  # noqa: F401,E402\n",
    "initialize.py": "from megatron.training import get_args  # noqa: F401 (fails while __init__ is half-built)\n"
                     "def parse_args(extra_args_provider=None, ignore_unknown_args=False):\n    return 'stock'\n",
    "training.py": "from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401\n"
                   "def pretrain():\n    pass\n",
}
MEGATRON_LM = """
import json, sys
import megatron.training
import megatron.training.initialize as initialize
import megatron.training.training as training
print(json.dumps({"training": training.get_forward_backward_func.__module__,
                  "pp2": training.get_forward_backward_func(pp_size=2, vp_size=2).__name__,
                  "parse_args": initialize.parse_args.__module__,
                  "l3plugin": sorted(m for m in sys.modules if m == "l3plugin" or m.startswith("l3plugin."))}))
"""

FLEXIBLE = {SCHEDULE_ENV: "flexible"}
# {case: (code, environment)}
CASES = {
    "flexible": (VERL_IMPORTS, FLEXIBLE),
    "unset": (VERL_IMPORTS, {}),
    "bad-value": (VERL_IMPORTS, {SCHEDULE_ENV: "flexibel"}),
    "opt-out": (VERL_IMPORTS, dict(FLEXIBLE, L3PLUGIN_NO_AUTOLOAD="1")),
    "explicit-install": (EXPLICIT_INSTALL, FLEXIBLE),
    "megatron-lm": (MEGATRON_LM, FLEXIBLE),
}


def fresh(code, env, folder: Path, fake_lm: Path) -> dict:
    """``code`` in a fresh interpreter started with ``env`` (nothing else of ours in its environment): its last
    line of output as JSON, and its stderr."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "L3PLUGIN_NO_AUTOLOAD", SCHEDULE_ENV, GROUP_SIZE_ENV)}
    path = [str(TREE)] + ([str(fake_lm)] if code is MEGATRON_LM else [])
    full.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path), PYTHONWARNINGS="always::RuntimeWarning", **env)
    out = run_command([sys.executable, "-c", code], cwd=folder, env=full, timeout=time_allowed(240))
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


def fresh_runs(tmp_path_factory) -> dict:
    """{case: its result or the exception to raise in its test}, every case of CASES started at once."""
    folder = tmp_path_factory.mktemp("no-code-switch")
    empty, fake_lm = folder / "empty", folder / "megatron_lm"
    empty.mkdir()
    (fake_lm / "megatron" / "training").mkdir(parents=True)
    for name, text in FAKE_TRAINING.items():
        (fake_lm / "megatron" / "training" / name).write_text(text)

    def one(case):
        try:
            return fresh(*CASES[case], empty, fake_lm)
        except Exception as exc:  # noqa: BLE001 - raised by the case's test
            return exc

    with ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(one, CASES)))


FRESH_TESTS = ("test_variable_switches_megatron_to_the_flexible_schedule",
               "test_without_the_variable_megatron_stays_stock",
               "test_a_bad_value_warns_naming_the_variable_and_megatron_stays_stock",
               "test_no_autoload_turns_the_variable_off", "test_a_scripts_own_install_wins_over_the_variable",
               "test_variable_with_megatron_lm_waits_for_megatron_training")


def ahead_runs(tmp_path_factory, selected):
    return {"fresh": lambda: fresh_runs(tmp_path_factory)}, {"fresh": FRESH_TESTS}


@pytest.fixture(scope="module")
def fresh_result(ahead):
    results = ahead.result("fresh")

    def result(case):
        found = results[case]
        if isinstance(found, BaseException):
            raise found
        return found
    return result


STOCK = {"pp2": "forward_backward_pipelining_with_interleaving",
         "pp4": "forward_backward_pipelining_without_interleaving", "pp1": "forward_backward_no_pipelining"}


def test_variable_switches_megatron_to_the_flexible_schedule(fresh_result):
    """L3PLUGIN_PIPELINE_SCHEDULE=flexible: the name verl binds at its import is l3plugin's selector, which answers
    the flexible schedule for pp > 1 (with and without virtual stages) and Megatron's for pp 1."""
    out = fresh_result("flexible")
    assert out["bound"] == "l3plugin.megatron.install"
    assert (out["pp2"], out["pp4"], out["pp1"]) == ("forward_backward_pipelining_flexible",
                                                    "forward_backward_pipelining_flexible", STOCK["pp1"])
    assert "l3plugin autoload" not in out["stderr"]


def test_without_the_variable_megatron_stays_stock(fresh_result):
    out = fresh_result("unset")
    assert out["bound"] == "megatron.core.pipeline_parallel.schedules"
    assert {k: out[k] for k in STOCK} == STOCK
    assert out["l3plugin"] == []  # nothing of l3plugin imported


def test_a_bad_value_warns_naming_the_variable_and_megatron_stays_stock(fresh_result):
    out = fresh_result("bad-value")
    assert {k: out[k] for k in STOCK} == STOCK
    assert "L3PLUGIN_PIPELINE_SCHEDULE='flexibel' is invalid: choose one of default, flexible, flexible-zb" \
        in out["stderr"], out["stderr"][-2000:]
    assert "RuntimeWarning: l3plugin autoload" in out["stderr"]


def test_no_autoload_turns_the_variable_off(fresh_result):
    out = fresh_result("opt-out")
    assert out["bound"] == "megatron.core.pipeline_parallel.schedules"
    assert {k: out[k] for k in STOCK} == STOCK
    assert out["l3plugin"] == []


def test_a_scripts_own_install_wins_over_the_variable(fresh_result):
    """install('default') before Megatron is imported, the variable set: the hook (run from inside that call's
    import of Megatron) leaves it alone: stock schedules through l3plugin's selector, Megatron's for pp 1."""
    out = fresh_result("explicit-install")
    assert out["bound"] == "l3plugin.megatron.install"
    assert {k: out[k] for k in STOCK} == STOCK


def test_variable_with_megatron_lm_waits_for_megatron_training(fresh_result):
    """megatron.training imports megatron.core from its __init__: the install waits for megatron.training to finish,
    so Megatron-LM's parse_args gets l3plugin's flags and its training loop's selector is l3plugin's."""
    out = fresh_result("megatron-lm")
    assert out["training"] == "l3plugin.megatron.install"
    assert out["pp2"] == "forward_backward_pipelining_flexible"
    assert out["parse_args"] == "l3plugin.megatron.install", out["stderr"][-2000:]


# -- in this process ------------------------------------------------------------------------------------------------

def install_module():
    return importlib.import_module("l3plugin.megatron.install")  # (the package's `install` is the function)


def test_the_hook_and_the_adapter_read_the_same_variable():
    import l3plugin_autoload

    assert l3plugin_autoload.SCHEDULE_ENV == install_module().SCHEDULE_ENV == SCHEDULE_ENV


def test_install_from_environment(monkeypatch):
    from megatron.core.pipeline_parallel import schedules

    import l3plugin.megatron as l3m

    inst = install_module()
    stock = schedules.get_forward_backward_func
    monkeypatch.delenv(SCHEDULE_ENV, raising=False)
    assert inst.install_from_environment() is None and not inst.MEGATRON.applied
    monkeypatch.setenv(SCHEDULE_ENV, "default")
    assert inst.install_from_environment() is None and not inst.MEGATRON.applied
    monkeypatch.setenv(SCHEDULE_ENV, " flexible-zb ")
    try:
        assert inst.install_from_environment() == "flexible-zb"
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=2) is l3m.forward_backward_pipelining_flexible_zb
    finally:
        inst.uninstall()
    assert schedules.get_forward_backward_func is stock
    monkeypatch.setenv(SCHEDULE_ENV, "zb")
    with pytest.raises(ValueError, match=r"L3PLUGIN_PIPELINE_SCHEDULE='zb' is invalid: choose one of default, "
                                         r"flexible, flexible-zb"):
        inst.install_from_environment()
    assert not inst.MEGATRON.applied


def config_k(k):
    return SimpleNamespace(microbatch_group_size_per_vp_stage=k)


def test_group_size_knob(monkeypatch):
    """L3PLUGIN_MICROBATCH_GROUP_SIZE replaces the config's k (an integer or pp), clipped to m; unset, the
    config's k as before (None: p; p with m < p: m)."""
    monkeypatch.delenv(GROUP_SIZE_ENV, raising=False)
    assert microbatch_group_size(config_k(1), 4, 7)[0] == 1
    assert microbatch_group_size(config_k(None), 4, 7)[0] == 4
    assert microbatch_group_size(config_k(4), 4, 3)[0] == 3
    assert "config.microbatch_group_size_per_vp_stage" in microbatch_group_size(config_k(1), 4, 7)[1]
    for value, p, m, k in [("pp", 4, 7, 4), ("PP", 2, 3, 2), ("pp", 4, 3, 3), ("3", 2, 7, 3), ("6", 2, 5, 5),
                           (" 1 ", 4, 9, 1)]:
        monkeypatch.setenv(GROUP_SIZE_ENV, value)
        assert microbatch_group_size(config_k(1), p, m) == (k, f"{GROUP_SIZE_ENV}={value.strip()}"), value
    monkeypatch.setenv(GROUP_SIZE_ENV, "")
    assert microbatch_group_size(config_k(1), 4, 7)[0] == 1
    for bad in ("0", "-2", "1.5", "p", "auto"):
        monkeypatch.setenv(GROUP_SIZE_ENV, bad)
        with pytest.raises(ValueError, match=rf"{GROUP_SIZE_ENV}={bad!r} is invalid: give a positive integer .* "
                                             r"or 'pp'"):
            microbatch_group_size(config_k(1), 4, 7)
    assert group_size_setting("pp") == "pp" and group_size_setting("") is None


def test_group_size_knob_gives_the_plan_of_k_p():
    """With the knob at pp and the config at 1 a step plans with k = p, whose plan is not k = 1's (pp 2, 2 virtual
    stages, m 3: k = 2 leaves a last group of 1, list-scheduled; k = 1 runs all-forward-all-backward)."""
    from l3plugin.schedule.plan import build_schedule

    p, v, m = 2, 2, 3
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(GROUP_SIZE_ENV, "pp")
        k, _ = microbatch_group_size(config_k(1), p, m)
    assert k == p
    assert build_schedule(p, v, m, k).ranks != build_schedule(p, v, m, 1).ranks  # k changes what the ranks run


# -- one step on gloo ranks: pp 2 x vpp 2, m 3 --------------------------------------------------------------------
P, V, M, HIDDEN, SEQ = 2, 2, 3, 8, 4


def run_group_sizes(cases):
    """On every rank: one training step of the flexible schedule per (config k, knob value) on fresh chunks; the
    k each step planned with, its losses and gradients."""
    from megatron.core.transformer import TransformerConfig

    from l3plugin.megatron import forward_backward_pipelining_flexible, pipeline
    from l3plugin.mesh.groups import init_mesh

    mesh = init_mesh(pp=P, vpp=V)
    batches = toy.make_microbatches(M, SEQ, 1, HIDDEN, seed=3)
    planned, out = pipeline._cached_plan, []
    for k, knob in cases:
        ks = []

        def spy(*args):
            ks.append(args[3])  # (pp, vpp, m, k, ...)
            return planned(*args)
        pipeline._cached_plan = spy
        if knob is not None:
            os.environ[GROUP_SIZE_ENV] = knob
        try:
            config = TransformerConfig(
                num_layers=2 * P * V, hidden_size=HIDDEN, num_attention_heads=1, pipeline_model_parallel_size=P,
                virtual_pipeline_model_parallel_size=V, pipeline_dtype=torch.float32,
                microbatch_group_size_per_vp_stage=k, batch_p2p_comm=False, deallocate_pipeline_outputs=True)
            chunks = toy.build_chunks(config, num_layers=2 * P * V, hidden=HIDDEN, pp_rank=mesh.coords["pp"],
                                      pp_size=P, vpp_size=V)
            result = forward_backward_pipelining_flexible(
                forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
                num_microbatches=M, seq_length=SEQ, micro_batch_size=1)
        finally:
            pipeline._cached_plan = planned
            os.environ.pop(GROUP_SIZE_ENV, None)
        out.append({"k": ks, "losses": [d["loss"] for d in result],
                    "grads": {lid: g for c in chunks for lid, g in c.grads().items()}})
    return out


def test_group_size_knob_runs_k_p_with_the_config_at_1(ranks):
    """verl's setting (config k = 1, so it does not round m = 3 up) with the knob at pp runs the step of config
    k = 2, bit for bit, and both equal a serial run; config k = 1 alone plans with k = 1."""
    cases = [(1, "pp"), (2, None), (1, None)]
    per_rank = ranks.run(P, run_group_sizes, cases, timeout=120)
    knob, config_two, config_one = zip(*per_rank)
    assert [r["k"] for r in knob] == [[2]] * P and [r["k"] for r in config_two] == [[2]] * P
    assert [r["k"] for r in config_one] == [[1]] * P
    batches = toy.make_microbatches(M, SEQ, 1, HIDDEN, seed=3)
    for results in (knob, config_two):
        toy.assert_matches_serial(list(results), batches, num_layers=2 * P * V, hidden=HIDDEN)
    for a, b in zip(knob, config_two):
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
        assert a["grads"].keys() == b["grads"].keys()
        assert all(torch.equal(x, y) for lid in a["grads"] for x, y in zip(a["grads"][lid], b["grads"][lid]))
