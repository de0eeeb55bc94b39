"""Checkpoints cross between l3plugin and upstream tools, each read by the UPSTREAM tool as the client:

- ours -> a stock DeepSpeed engine (same config without the "l3plugin" key) resumes them with optimizer state;
- stock DeepSpeed's -> our engine, on 1, 2 and 4 data-parallel ranks;
- ours -> DeepSpeed's ds_to_universal (run as a script) -> our engine and a stock engine (load_universal), held to
  what stock's own round trip gives (on DeepSpeed < 0.19 stock's fp32 accessor is wrong after it: _rebound_fp32_views);
- ours -> DeepSpeed's standalone zero_to_fp32.py script;
- PipelineEngine (pp=2 x dp=2, tied weight, ZeRO-1) checkpoints, both directions;
- a truncated or foreign file is a clear error naming it (files are read with weights_only=True).

Equality is checked through DeepSpeed's public accessors (safe_get_full_fp32_param /
safe_get_full_optimizer_state), bit for bit. Each checkpoint is saved once and shared by the tests that read it
(``saved``); DeepSpeed's converters run in one rank of the pool, each as from its own command line
(``converted``).
"""

import importlib.util
import os
import shutil
import sys

import pytest
import torch

from ds_models import ds_config, engine_for, train
from stock_bugs import SKIP_IF_STOCK_ZERO_STEP_FAILS, STOCK_ZERO_STEP_FAILS

ON = {"fp32_reduce_zero": True}
TIMEOUT = 180


# Stock DeepSpeed picks DeepSpeedZeroOptimizer for bf16 ZeRO-1/2, and BF16_Optimizer for bf16 ZeRO-1 with fp32
# gradient accumulation ("bf16_opt" below): both write the same ZeRO-1/2 partition layout.
BF16_OPT = {"data_types": {"grad_accum_dtype": "fp32"}}


def _config(stage, plugin, **extra):
    if stage == "bf16_opt":
        stage, extra = 1, {**BF16_OPT, **extra}
    return ds_config(stage, plugin=plugin, scheduler=True, clip=1.0, **extra)


def _rebound_fp32_views(engine):
    """{param: (its fp32 view, the view of its fp32 master)} for the parameters whose fp32 view (what
    safe_get_full_fp32_param reads) is not in the ZeRO optimizer's fp32 partition. A stock universal load on
    DeepSpeed < 0.19 rebinds it to an optimizer-state buffer (its map_to_flat_opt_states; fixed upstream in
    deepspeedai/DeepSpeed#8474), while the partition the optimizer steps on holds the loaded master."""
    opt, out = engine.optimizer, {}
    for group, flat in zip(getattr(opt, "bit16_groups", []), getattr(opt, "single_partition_of_fp32_groups", [])):
        for p in group:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            address = mapping.get_hp_fragment_address()
            master = flat.narrow(0, address.start, address.numel)
            if mapping.hp_fragment.data_ptr() != master.data_ptr():
                out[p] = (mapping.hp_fragment, master)
    return out


def _snapshot(engine, stock=False):
    """{name: [fp32 master, exp_avg, exp_avg_sq]} through DeepSpeed's accessors, plus counters. For a stock
    engine whose fp32 views were rebound (above), the master is read through them pointed back at it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if stock and not engine.optimizer._hp_optimizer_states_linked:
        # A stock engine links its optimizer-state fragments lazily (at its first step); do it now so the
        # accessors read the loaded state.
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    rebound = _rebound_fp32_views(engine) if stock else {}
    out = {}
    try:
        for p, (_, master) in rebound.items():
            p._hp_mapping.hp_fragment = master
        for name, p in engine.module.named_parameters():
            states = [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
            out[name] = [safe_get_full_fp32_param(p).clone()] + [None if s is None else s.clone() for s in states]
            out[name].append(p.detach().clone())
    finally:
        for p, (view, _) in rebound.items():  # stock goes on as it was
            p._hp_mapping.hp_fragment = view
    step = None
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            step = float(state["step"])
    return {"params": out, "lr": engine.get_lr(), "global_steps": engine.global_steps, "adam_step": step,
            "optimizer": type(engine.optimizer).__name__, "rebound_fp32_views": len(rebound)}


def _same(a, b):
    bad = [n for n in a["params"] if len(a["params"][n]) != len(b["params"].get(n, []))
           or not all(x is not None and y is not None and torch.equal(x, y)
                      for x, y in zip(a["params"][n], b["params"][n]))]
    return bad


def _stock():
    import l3plugin.deepspeed as l3ds

    class Stock:
        def __enter__(self):
            l3ds.uninstall()

        def __exit__(self, *exc):
            l3ds.install()
    return Stock()


def save_leg(stage, save_dir, ours, steps=2):
    """Train ``steps`` optimizer steps with our engine (ours=True) or stock DeepSpeed, save, snapshot; ours also
    exports its fp32 state dict (l3plugin.deepspeed.export_fp32_state_dict, what zero_to_fp32.py must rebuild) and
    trains one step more: ``after``, the snapshot a resume of this checkpoint in our engine reaches (bit-exact:
    test_zero_deepspeed.py's test_checkpoint_resume_is_bit_exact), which stock's continuation is compared with."""
    if ours:
        import l3plugin.deepspeed as l3ds

        engine = engine_for(_config(stage, ON))
        train(engine, steps)
        engine.save_checkpoint(save_dir, tag="t")
        saved = _snapshot(engine) | {"exported": l3ds.export_fp32_state_dict(engine)}
        train(engine, 1, first_step=steps)
        return saved | {"after": _snapshot(engine)}
    with _stock():
        engine = engine_for(_config(stage, None))
        train(engine, steps)
        engine.save_checkpoint(save_dir, tag="t")
        return _snapshot(engine, stock=True)


def load_leg(stage, load_dir, ours, tag="t", universal=False, then_train=1):
    """Build a fresh engine (other seed), load, snapshot; train ``then_train`` more steps; snapshot."""
    extra = {"checkpoint": {"load_universal": True}} if universal else {}
    if ours:
        engine = engine_for(_config(stage, ON, **extra), seed=7)
        path, _ = engine.load_checkpoint(load_dir, tag=tag)
        loaded = _snapshot(engine)
        train(engine, then_train, first_step=2)
        return {"path": path, "loaded": loaded, "after": _snapshot(engine)}
    with _stock():
        engine = engine_for(_config(stage, None, **extra), seed=7)
        path, _ = engine.load_checkpoint(load_dir, tag=tag)
        loaded = _snapshot(engine, stock=True)
        train(engine, then_train, first_step=2)
        return {"path": path, "loaded": loaded, "after": _snapshot(engine, stock=True)}


def load_error(stage, load_dir, tag="t", universal=False):
    extra = {"checkpoint": {"load_universal": True}} if universal else {}
    try:
        engine_for(_config(stage, ON, **extra), seed=7).load_checkpoint(load_dir, tag=tag)
    except Exception as exc:  # noqa: BLE001 - the message is what we check
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """``saved(stage, ours)``: (folder, snapshot) of the checkpoint ``save_leg`` wrote, saved on first use and shared
    (every reader only reads it; a test that changes files works on a copy)."""
    cache = {}

    def get(stage, ours):
        if (stage, ours) not in cache:
            folder = str(tmp_path_factory.mktemp(f"{'ours' if ours else 'stock'}-{stage}"))
            cache[(stage, ours)] = folder, ranks.run(2, save_leg, stage, folder, ours, timeout=TIMEOUT)[0]
        return cache[(stage, ours)]
    return get


def _copy(folder, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(folder, dst)
    return dst


def _assert_resumed(saved, legs, expect_optimizer):
    for leg in legs:
        assert leg["path"] is not None
        loaded = leg["loaded"]
        assert loaded["optimizer"] == expect_optimizer
        assert _same(saved, loaded) == [], "fp32 master / Adam moments / bf16 weights differ after loading"
        assert loaded["lr"] == saved["lr"] and loaded["global_steps"] == saved["global_steps"] == 2
        assert loaded["adam_step"] == saved["adam_step"] == 2.0
        after = leg["after"]
        assert after["global_steps"] == 3 and after["adam_step"] == 3.0
        assert after["lr"] != saved["lr"]  # WarmupLR goes on from step 2
        assert _same(loaded, after) != []  # and the weights moved


def _on_deepspeed(versions: str) -> bool:
    from importlib.metadata import version  # deepspeed itself is not imported in pytest's process

    from l3plugin.upstream.versions import version_in

    return version_in(version("deepspeed"), versions)


# Stock DeepSpeed 0.17 itself (measured with l3plugin not importable, docs/verified.md):
# - its ZeRO-2 update with bf16 and gradient accumulation is wrong here (torch 2.13, CPU/gloo): 0.94 off an fp64
#   reference where its stage 1's is 0.014 (0.16.9's stage 2: 0.014);
# - for bf16 + ZeRO-1 + fp32 accumulation it builds FP16_UnfusedOptimizer, not BF16_Optimizer (its DDP_BFLOAT16 and
#   BFLOAT16 constants are both "bf16"): no ZeRO partitions to cross.
STOCK_ZERO2_WRONG = _on_deepspeed(">=0.17,<0.18")
STOCK_NO_BF16_OPTIMIZER = _on_deepspeed(">=0.17,<0.18")

# -- ours -> stock ------------------------------------------------------------------------------------------
STOCK = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", "bf16_opt": "BF16_Optimizer"}


def stock_optimizer_name(stage):
    with _stock():
        return type(engine_for(_config(stage, None)).optimizer).__name__


def _skip_without_stock_bf16_optimizer(ranks, stage):
    if stage == "bf16_opt" and STOCK_NO_BF16_OPTIMIZER:
        assert ranks.run(2, stock_optimizer_name, stage, timeout=TIMEOUT)[0] == "FP16_UnfusedOptimizer"
        pytest.skip("DeepSpeed 0.17 builds FP16_UnfusedOptimizer (no ZeRO) for bf16 + ZeRO-1 + fp32 accumulation")


# Stock steps a ZeRO-1/2 engine in each (on after loading ours, or training its own checkpoint).
STAGES = [pytest.param(1, marks=SKIP_IF_STOCK_ZERO_STEP_FAILS), pytest.param(2, marks=SKIP_IF_STOCK_ZERO_STEP_FAILS),
          "bf16_opt"]


@pytest.mark.parametrize("stage", STAGES)
def test_stock_engine_resumes_our_checkpoint(ranks, saved, stage):
    _skip_without_stock_bf16_optimizer(ranks, stage)
    folder, ours_saved = saved(stage, True)
    assert ours_saved["optimizer"] == "DeepSpeedFP32ReduceZero"
    stock = ranks.run(2, load_leg, stage, folder, False, timeout=TIMEOUT)
    _assert_resumed(ours_saved, stock, STOCK[stage])
    # The stock continuation and ours agree (not bit-exact: stock reduces in bf16).
    ours = ours_saved
    assert ours["after"]["lr"] == stock[0]["after"]["lr"]
    agree = {name: torch.allclose(fp32, stock[0]["after"]["params"][name][0], rtol=0, atol=2e-3)
             for name, (fp32, *_rest) in ours["after"]["params"].items()}
    if stage == 2 and STOCK_ZERO2_WRONG:
        assert not all(agree.values())  # stock 0.17's own ZeRO-2 step (above); the loaded state was checked
    else:
        assert all(agree.values()), agree


# -- stock -> ours, any DP size -----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_our_engine_resumes_stock_checkpoint_on_any_dp_size(ranks, saved, stage):
    _skip_without_stock_bf16_optimizer(ranks, stage)
    folder, stock_saved = saved(stage, False)
    assert stock_saved["optimizer"] == STOCK[stage]
    # Stage 2 onto 1 and 4 ranks, the others onto 2 (the saved DP size): the reader takes each rank's ranges of every
    # saved partition whatever the DP size, the same path.
    for world in (1, 4) if stage == 2 else (2,):
        legs = ranks.run(world, load_leg, stage, folder, True, timeout=TIMEOUT)
        _assert_resumed(stock_saved, legs, "DeepSpeedFP32ReduceZero")


# -- DeepSpeed's converters: ds_to_universal (module) and zero_to_fp32.py (the script saved with the checkpoint) ----
def run_tools(runs):
    """On a rank (torch and DeepSpeed imported there already, l3plugin's engine patches removed while the tools
    run): each tool as from its command line, `python -m MODULE ...` or `python SCRIPT ...`, run as __main__.
    None, or the error and where."""
    import runpy
    import traceback

    argv = sys.argv
    try:
        with _stock():
            for tool in runs:
                if tool[0] == "-m":
                    sys.argv = tool[1:]
                    runpy.run_module(tool[1], run_name="__main__", alter_sys=True)
                elif tool[0] == "-c":  # the script's converter, unsharded (max_shard_size=None: no huggingface_hub)
                    ns = runpy.run_path(tool[1])
                    ns["convert_zero_checkpoint_to_fp32_state_dict"](tool[2], tool[3], tag="t", max_shard_size=None)
                else:
                    sys.argv = tool
                    runpy.run_path(tool[0], run_name="__main__")
    except SystemExit as exc:  # a tool's CLI ending with sys.exit(0) succeeded
        if exc.code not in (None, 0):
            return f"SystemExit({exc.code!r}) from {sys.argv}\n{traceback.format_exc()}"
    except Exception as exc:  # noqa: BLE001 - _converted reports it
        return f"{type(exc).__name__}: {exc} (running {sys.argv})\n{traceback.format_exc()}"
    finally:
        sys.argv = argv
    return None


def _ds_to_universal_argv(folder):
    return ["-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(folder, "t"),
            "--output_folder", os.path.join(folder, "t_universal"), "--inject_missing_state",
            "--num_extract_workers", "1", "--num_merge_workers", "1"]


def _zero_to_fp32_argv(folder):
    script = os.path.join(folder, "zero_to_fp32.py")  # copied there by DeepSpeed's save_checkpoint
    if importlib.util.find_spec("huggingface_hub") is not None:  # the script's CLI needs it (shard splitting)
        return [script, folder, os.path.join(folder, "out"), "--tag", "t"]
    return ["-c", script, folder, os.path.join(folder, "out")]


@pytest.fixture(scope="module")
def converted(ranks, saved, tmp_path_factory):
    """Copies of our stage-2 checkpoint and of stock's stage-1 one, converted by DeepSpeed's own tools in one rank of
    the pool (a fresh interpreter would import torch and deepspeed again, most of a tool's time): ds_to_universal on
    both (folder / t_universal) and zero_to_fp32.py on ours (folder / out). {"ours": folder, "stock": folder (absent
    where stock cannot train), "error": None or what a tool raised}."""
    folders = {"ours": _copy(saved(2, True)[0], tmp_path_factory.mktemp("ours-converted"))}
    runs = [_ds_to_universal_argv(folders["ours"]), _zero_to_fp32_argv(folders["ours"])]
    if not STOCK_ZERO_STEP_FAILS:  # stock trains that checkpoint
        folders["stock"] = _copy(saved(1, False)[0], tmp_path_factory.mktemp("stock-converted"))
        runs.append(_ds_to_universal_argv(folders["stock"]))
    return folders | {"error": ranks.run(1, run_tools, runs, timeout=300)[0]}


def _converted(converted):
    assert converted["error"] is None, converted["error"][-6000:]
    return converted


def _stock_rebinds_fp32_views() -> bool:
    """Whether this DeepSpeed's universal loader rebinds the fp32 views (< 0.19; see _rebound_fp32_views)."""
    return _on_deepspeed("<0.19")


def _assert_stock_universal_load(saved, stock):
    """A stock engine's universal load: its master, moments and counters are the saved ones; on DeepSpeed < 0.19
    its fp32 accessor reads an optimizer-state buffer instead (stock's own bug, the same for stock's checkpoints:
    test_universal_checkpoint_from_stock_loads_in_ours), before and after the next step."""
    _assert_resumed(saved, stock, "DeepSpeedZeroOptimizer")
    for leg in stock:
        assert (leg["loaded"]["rebound_fp32_views"] > 0) == _stock_rebinds_fp32_views(), leg["loaded"]
        assert leg["after"]["rebound_fp32_views"] == leg["loaded"]["rebound_fp32_views"]


@SKIP_IF_STOCK_ZERO_STEP_FAILS  # its last leg steps stock
def test_universal_checkpoint_from_ours_loads_in_ours_and_stock(ranks, saved, converted, tmp_path):
    ours_saved = saved(2, True)[1]
    folder = _converted(converted)["ours"]
    assert os.path.isfile(os.path.join(folder, "t_universal", "zero", "2.weight", "exp_avg.pt"))
    for world in (4, 1):  # changing the DP size is what universal checkpoints are for
        legs = ranks.run(world, load_leg, 2, folder, True, "t_universal", True, timeout=TIMEOUT)
        _assert_resumed(ours_saved, legs, "DeepSpeedFP32ReduceZero")
    stock = ranks.run(2, load_leg, 2, folder, False, "t_universal", True, timeout=TIMEOUT)
    _assert_stock_universal_load(ours_saved, stock)
    # A NaN in one universal file (of a copy): every rank refuses to resume from it (the rank owning it names the
    # file).
    folder = _copy(folder, tmp_path)
    path = os.path.join(folder, "t_universal", "zero", "2.weight", "exp_avg.pt")
    state = torch.load(path, weights_only=False)
    (state["param"] if isinstance(state, dict) else state).view(-1)[0] = float("nan")
    torch.save(state, path)
    errors = ranks.run(2, load_error, 2, folder, "t_universal", True, timeout=TIMEOUT)
    assert all(errors), errors
    assert any(f"{path}: holds non-finite values" in e and "checkpoint_allow_nonfinite" in e for e in errors), errors


@SKIP_IF_STOCK_ZERO_STEP_FAILS  # stock trains the checkpoint
def test_universal_checkpoint_from_stock_loads_in_ours(ranks, saved, converted):
    stock_saved = saved(1, False)[1]
    folder = _converted(converted)["stock"]
    # Onto 1 rank (reading every universal file whole); ours' universal checkpoint is read onto 4 and 1 above, the same
    # reader and file format.
    legs = ranks.run(1, load_leg, 1, folder, True, "t_universal", True, timeout=TIMEOUT)
    _assert_resumed(stock_saved, legs, "DeepSpeedFP32ReduceZero")
    # Stock's own round trip (stock save -> ds_to_universal -> stock load): what the stock leg above is held to.
    stock = ranks.run(2, load_leg, 1, folder, False, "t_universal", True, timeout=TIMEOUT)
    _assert_stock_universal_load(stock_saved, stock)


# -- zero_to_fp32.py, the standalone script ----------------------------------------------------------------
# Stage 2 only (stage 1 was a case of its own): our partition files differ between the stages only in their
# zero_stage entry (DeepSpeedFP32ReduceZero.state_dict), and the script reads both stages with one function
# (_get_fp32_state_dict_from_zero2_checkpoint). Stock reads our stage-1 files in
# test_stock_engine_resumes_our_checkpoint[1].
def test_standalone_zero_to_fp32_script_reads_ours(saved, converted):
    exported = saved(2, True)[1]["exported"]
    folder = _converted(converted)["ours"]
    assert os.path.isfile(os.path.join(folder, "zero_to_fp32.py"))  # copied there by DeepSpeed's save_checkpoint
    rebuilt = torch.load(os.path.join(folder, "out", "pytorch_model.bin"), weights_only=True)
    assert set(rebuilt) == set(exported)
    assert all(torch.equal(rebuilt[k], exported[k]) for k in exported)


# -- bad files ------------------------------------------------------------------------------------------------
def test_truncated_partition_is_a_clear_error(ranks, saved, tmp_path):
    folder = _copy(saved(2, True)[0], tmp_path)
    victim = tmp_path / "ckpt" / "t" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[:len(data) // 2])
    message = ranks.run(2, load_error, 2, folder, timeout=TIMEOUT)[0]
    assert message is not None and str(victim) in message and "truncated" in message, message


def test_foreign_and_unsafe_files_are_clear_errors(tmp_path):
    import datetime

    from l3plugin.checkpoint.deepspeed_layout import load_sharded_state_dict
    from l3plugin.checkpoint.partition_files import load_file

    unsafe = tmp_path / "unsafe.pt"
    torch.save({"when": datetime.date(2024, 1, 1)}, unsafe)  # a pickled global not on the allow-list
    with pytest.raises(ValueError, match="unsafe.pt.*datetime"):
        load_file(unsafe)
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(ValueError, match="foreign.pt is not a ZeRO-1/2 optimizer partition"):
        load_sharded_state_dict(object(), [foreign])
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_file(tmp_path / "missing.pt")


# -- PipelineEngine (pp=2 x dp=2, a weight tied across the stages), ZeRO-1: stock refuses ZeRO-2 there --------
def pipe_leg(save_dir, load_dir, ours):
    """Train one step and save (save_dir), or load (load_dir); return the snapshot through the accessors."""
    import test_zero_deepspeed_pipe as pipe

    def run():
        engine = pipe.pipe_engine(1, ON if ours else None, seed=0 if save_dir else 3)
        if load_dir:
            assert engine.load_checkpoint(load_dir, tag="t")[0] is not None
            if not ours:
                engine.optimizer._lazy_init_hp_params_optimizer_state()  # see _snapshot
        else:
            pipe.train(engine, 1)
            engine.save_checkpoint(save_dir, tag="t")
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        snap = {n: [p.detach().clone(), safe_get_full_fp32_param(p)]
                + [safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")]
                for n, p in engine.module.named_parameters()}
        return {"optimizer": type(engine.optimizer).__name__, "steps": engine.global_steps, "snapshot": snap}
    if ours:
        return run()
    with _stock():
        return run()


def pipe_legs(legs):
    """``pipe_leg`` for each of ``legs`` in turn, in one call (the pool resets DeepSpeed's global mpu, which a
    PipelineEngine sets, between calls: so does this between legs)."""
    from deepspeed.utils import groups

    out = []
    for leg in legs:
        out.append(pipe_leg(*leg))
        groups.mpu = None
    return out


@pytest.fixture(scope="module")
def pipe_crossings(ranks, tmp_path_factory):
    """{direction: (saved, loaded) per rank}: both saves in one call of 4 ranks, both loads in another (a PipelineEngine
    leaves 6 process groups in every worker: one call per leg passed the pool's limit of 16 at the third and
    restarted its workers, which then imported DeepSpeed again)."""
    legs = {"ours_to_stock": (str(tmp_path_factory.mktemp("pipe-ours")), True)}
    if not STOCK_ZERO_STEP_FAILS:  # stock trains its checkpoint
        legs["stock_to_ours"] = (str(tmp_path_factory.mktemp("pipe-stock")), False)
    saved = ranks.run(4, pipe_legs, [(folder, None, ours) for folder, ours in legs.values()], timeout=TIMEOUT)
    loaded = ranks.run(4, pipe_legs, [(None, folder, not ours) for folder, ours in legs.values()], timeout=TIMEOUT)
    return {direction: ([r[i] for r in saved], [r[i] for r in loaded]) for i, direction in enumerate(legs)}


DIRECTIONS = ["ours_to_stock", pytest.param("stock_to_ours", marks=SKIP_IF_STOCK_ZERO_STEP_FAILS)]  # stock trains there


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pipeline_engine_checkpoints_cross(pipe_crossings, direction):
    ours_saves = direction == "ours_to_stock"
    saved, loaded = pipe_crossings[direction]
    assert {r["optimizer"] for r in loaded} == {"DeepSpeedZeroOptimizer" if ours_saves else "DeepSpeedFP32ReduceZero"}
    for a, b in zip(saved, loaded):
        assert b["steps"] == a["steps"] == 1
        assert a["snapshot"].keys() == b["snapshot"].keys()
        for name in a["snapshot"]:
            assert all(x is not None and y is not None and torch.equal(x, y)
                       for x, y in zip(a["snapshot"][name], b["snapshot"][name])), name
            assert len(a["snapshot"][name]) == len(b["snapshot"][name]) == 4  # bf16, fp32, exp_avg, exp_avg_sq
