"""Every config form DeepSpeed accepts, with and without the "l3plugin" key, on 2 gloo ranks.

Without the key, DeepSpeed gets the call exactly as given (the same objects) and builds the same engine as with
l3plugin's patches undone (stock DeepSpeed, as with autoload off); with the key every form builds l3plugin's
optimizer from the same options, parsed once per engine (a checkpoint load included).
"""

import argparse
import base64
import importlib.util
import json
import os

import pytest
import torch
import torch.distributed as dist

from ds_models import ds_config, make_mlp, quiet_deepspeed, train
from stock_bugs import SKIP_IF_STOCK_ZERO_STEP_FAILS


def _deepspeed_has_sequence_parallel() -> bool:
    """From the installed files (importing deepspeed in pytest's own process would cost seconds)."""
    spec = importlib.util.find_spec("deepspeed")
    return spec is not None and any(os.path.isdir(os.path.join(d, "runtime", "sequence_parallel"))
                                    for d in spec.submodule_search_locations or ())

ZERO = {"fp32_reduce_zero": True, "reduce_every": 1}
ZERO_CP = {"fp32_reduce_zero": True, "context_parallel_size": 2, "cp_layout": "2cp"}
FORMS = ("dict", "json", "hjson", "base64", "args", "config_params")


def _write_forms(cfg: dict, where: str) -> dict:
    """{form: the deepspeed.initialize keyword arguments giving ``cfg`` that way}."""
    import hjson

    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "ds.json"), "w") as f:
        json.dump(cfg, f)
    hjson_text = "# DeepSpeed reads hjson: comments, unquoted keys, no commas\n" + hjson.dumps(cfg)
    with pytest.raises(ValueError):
        json.loads(hjson_text)  # the form is really not JSON
    with open(os.path.join(where, "ds.hjson"), "w") as f:
        f.write(hjson_text)
    return {"dict": {"config": cfg},
            "json": {"config": os.path.join(where, "ds.json")},
            "hjson": {"config": os.path.join(where, "ds.hjson")},
            "base64": {"config": base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()},
            "args": {"args": argparse.Namespace(deepspeed_config=os.path.join(where, "ds.json"),
                                                local_rank=int(os.environ.get("LOCAL_RANK", 0)))},
            "config_params": {"config_params": cfg}}  # how the HF Trainer and accelerate pass their dict


def _build_and_train(deepspeed, given: dict) -> dict:
    before = {k: (v.deepspeed_config if isinstance(v, argparse.Namespace) else v) for k, v in given.items()}
    model = make_mlp(seed=3)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **given)
    train(engine, 2)
    after = {k: (v.deepspeed_config if isinstance(v, argparse.Namespace) else v) for k, v in given.items()}
    # With a dict, DeepSpeed keeps the very object it was given as the engine's config.
    same_dict = any(engine._config._param_dict is v for v in given.values())
    return {"param_dict": engine._config._param_dict, "same_dict": same_dict, "untouched": before == after,
            "optimizer": type(engine.optimizer).__name__, "weights": [p.detach().float().clone()
                                                                    for p in engine.module.parameters()],
            "engine": engine}


def _stock_and_installed(tmp):
    """Each form without the key: built by stock DeepSpeed (l3plugin's patches undone) and with them on."""
    import l3plugin.deepspeed
    from l3plugin.deepspeed.engine import DEEPSPEED

    deepspeed = quiet_deepspeed()
    forms = _write_forms(ds_config(1, gas=2), os.path.join(tmp, f"rank{dist.get_rank()}"))
    out = {}
    l3plugin.deepspeed.uninstall()
    try:
        assert not DEEPSPEED.applied
        stock = {form: _build_and_train(deepspeed, given) for form, given in forms.items()}
    finally:
        l3plugin.deepspeed.install()
    for form, given in forms.items():
        ours = _build_and_train(deepspeed, given)
        out[form] = {"same_param_dict": ours["param_dict"] == stock[form]["param_dict"],
                     "same_weights": all(torch.equal(a, b) for a, b in zip(ours["weights"], stock[form]["weights"])),
                     "optimizer": (ours["optimizer"], stock[form]["optimizer"]),
                     "dict_kept": (ours["same_dict"], stock[form]["same_dict"]),
                     "untouched": ours["untouched"] and stock[form]["untouched"],
                     "options": l3plugin.deepspeed.options_of(ours["engine"])}
    return out


@SKIP_IF_STOCK_ZERO_STEP_FAILS  # each form trains stock ZeRO-1
def test_without_the_key_every_form_reaches_deepspeed_as_given(ranks, tmp_path):
    out = ranks.run(2, _stock_and_installed, str(tmp_path), timeout=600)
    for rank, forms in enumerate(out):
        assert set(forms) == set(FORMS)
        for form, seen in forms.items():
            where = f"rank {rank}, form {form}"
            assert seen["same_param_dict"] and seen["same_weights"], where
            assert seen["optimizer"][0] == seen["optimizer"][1] != "DeepSpeedFP32ReduceZero", where
            assert seen["dict_kept"][0] == seen["dict_kept"][1] == (form in ("dict", "config_params")), where
            assert seen["untouched"] and seen["options"] is None, where


def _unreadable_configs(tmp):
    """Configs DeepSpeed's loader refuses: the error is stock's, with l3plugin's patches on or off."""
    import l3plugin.deepspeed

    deepspeed = quiet_deepspeed()
    bad_file = os.path.join(tmp, f"bad{dist.get_rank()}.json")
    with open(bad_file, "w") as f:
        f.write('{"train_micro_batch_size_per_gpu": [2, }')
    errors = {}
    for installed in (False, True):
        (l3plugin.deepspeed.install if installed else l3plugin.deepspeed.uninstall)()
        for name, config in (("missing path", os.path.join(tmp, "no-such-file.json")), ("broken file", bad_file)):
            try:
                deepspeed.initialize(model=make_mlp(), model_parameters=make_mlp().parameters(), config=config)
                errors[name, installed] = None
            except Exception as exc:  # noqa: BLE001 - compared below
                errors[name, installed] = (type(exc).__name__, str(exc))
    return errors


def test_a_config_deepspeed_cannot_read_fails_as_in_stock(ranks, tmp_path):
    errors = ranks.run(2, _unreadable_configs, str(tmp_path), timeout=300)[0]
    for name in ("missing path", "broken file"):
        assert errors[name, True] is not None and errors[name, True] == errors[name, False], (name, errors)


def _with_the_key(tmp):
    import l3plugin.deepspeed
    import l3plugin.deepspeed.engine as hooks
    from l3plugin.deepspeed import PluginOptions
    from l3plugin.deepspeed.sequence_parallel import release_groups

    deepspeed = quiet_deepspeed()
    rank = dist.get_rank()
    parses, checks = [], []
    parse, check = PluginOptions.parse.__func__, hooks.check_supported
    PluginOptions.parse = classmethod(lambda cls, block: parses.append(1) or parse(cls, block))
    hooks.check_supported = lambda *a: checks.append(1) or check(*a)
    out = {}
    try:
        forms = _write_forms(ds_config(2, gas=2, plugin=ZERO), os.path.join(tmp, f"zero{rank}"))
        for form, given in forms.items():
            parses.clear(), checks.clear()
            built = _build_and_train(deepspeed, given)
            engine = built.pop("engine")
            engine.save_checkpoint(os.path.join(tmp, f"ckpt-{form}"))
            engine.load_checkpoint(os.path.join(tmp, f"ckpt-{form}"))
            out[form] = {**built, "options": l3plugin.deepspeed.options_of(engine), "parses": len(parses),
                         "checks": len(checks)}
        # CP from the key in the forms that must be rewritten for DeepSpeed (a file; the arguments object); DeepSpeed
        # 0.16 has no sequence-parallel groups (CP is refused there: tests/hf/test_hf_deepspeed_cp.py).
        cp_forms = _write_forms(ds_config(1, gas=2, plugin=ZERO_CP), os.path.join(tmp, f"cp{rank}"))
        with_sp = importlib.util.find_spec("deepspeed.runtime.sequence_parallel") is not None
        for form in ("hjson", "args") if with_sp else ():
            parses.clear()
            built = _build_and_train(deepspeed, cp_forms[form])
            engine = built.pop("engine")
            out["cp " + form] = {**built, "parses": len(parses), "sp": engine.sequence_parallel_size,
                                 "dp": engine.seq_dp_world_size, "batch": engine.train_batch_size(),
                                 "block": engine._config._param_dict["l3plugin"]}
            release_groups()
    finally:
        PluginOptions.parse, hooks.check_supported = classmethod(parse), check
    return out


def test_with_the_key_every_form_builds_the_same_engine_parsing_the_block_once(ranks, tmp_path):
    from l3plugin.deepspeed import PluginOptions

    out = ranks.run(2, _with_the_key, str(tmp_path), timeout=900)
    for rank, forms in enumerate(out):
        reference = forms["dict"]
        for form in FORMS:
            seen, where = forms[form], f"rank {rank}, form {form}"
            assert seen["optimizer"] == "DeepSpeedFP32ReduceZero", where
            assert seen["options"] == PluginOptions.parse(ZERO), where
            assert seen["parses"] == 1 and seen["checks"] == 1, (where, seen["parses"], seen["checks"])
            assert seen["param_dict"] == reference["param_dict"] and seen["untouched"], where
            assert all(torch.equal(a, b) for a, b in zip(seen["weights"], reference["weights"])), where
        for form in ("hjson", "args") if _deepspeed_has_sequence_parallel() else ():
            seen, where = forms["cp " + form], f"rank {rank}, CP from {form}"
            assert seen["optimizer"] == "DeepSpeedFP32ReduceZero" and seen["parses"] == 1, where
            assert (seen["sp"], seen["dp"], seen["batch"]) == (2, 2, 2 * 2 * 1), where  # micro 2 x gas 2 x DP 1
            assert seen["block"] == ZERO_CP and seen["untouched"], where  # the CP keys reach the engine too
