"""Patch sets (l3plugin/upstream/patchset.py) and their registry (l3plugin/upstream/patches.py): one declaration per upstream patch,
beside its replacement, checked before anything is set, undone exactly; `l3plugin doctor` checks every declaration
and every private upstream name read against the installed frameworks."""

import io
import sys
import types

import pytest

from l3plugin.upstream import patches

from l3plugin.upstream import versions
from l3plugin.upstream.doctor import doctor
from l3plugin.upstream.patches import Patch, PatchMismatch, PatchSet


def stock_function(alpha, beta=2):
    return ("stock", alpha, beta)


def replacement_function(alpha, beta=2):
    return ("ours", SET.stock("fake_upstream.function")(alpha, beta))


def wrapping_factory(original, attribute):
    return lambda *args: ("wrapped", attribute, original(*args))


def instance_forward(self, x):
    return ("instance", SET.stock_of(self, instance_forward)(x))


class Engine:
    def forward(self, x):
        return ("stock forward", x)


@pytest.fixture
def fake_upstream(monkeypatch):
    module = types.ModuleType("fake_upstream")
    module.function = stock_function
    module.other = stock_function
    module.table = {"key": stock_function}
    module.KEY = "key"
    module.Engine = Engine
    module.__version__ = "1.4.2"
    module.__file__ = "/opt/fake/fake_upstream/__init__.py"
    monkeypatch.setitem(sys.modules, "fake_upstream", module)
    monkeypatch.setattr(versions, "_IMPORTED", {})  # the version is read once per process: read the fake's
    user = types.ModuleType("fake_user_script")  # imported the function by name before the patch
    user.function = stock_function
    monkeypatch.setitem(sys.modules, "fake_user_script", user)
    yield module, user
    SET.undo()


here = __name__
SET = PatchSet("test set", "fake-upstream", ">=1.0,<2", module="fake_upstream", patches=[
    Patch("fake_upstream", "function", replacement_function, why="test", signature=("alpha", "beta"),
          rebind=True),
    Patch("fake_upstream", "other", wrapping_factory, why="test", wraps=True),
    Patch("fake_upstream", "table", replacement_function, why="test", key="fake_upstream:KEY"),
    Patch("fake_upstream:Engine", "forward", instance_forward, why="test", instance=True),
    Patch("fake_upstream_not_installed", "thing", replacement_function, why="test", optional=True),
    Patch("fake_upstream_not_loaded", "thing", replacement_function, why="test", loaded_only=True),
])
patches.SETS.remove(SET)  # not one of l3plugin's


def test_apply_and_undo_restore_every_kind_of_target(fake_upstream):
    module, user = fake_upstream
    SET.apply()
    SET.apply()  # idempotent
    assert module.function(1) == ("ours", ("stock", 1, 2))
    assert user.function is replacement_function  # rebound by name
    assert module.other(1) == ("wrapped", "other", ("stock", 1, 2))
    assert module.table["key"] is replacement_function
    engine, other_engine = Engine(), Engine()
    assert SET.apply_to(engine, instance_forward).__func__ is Engine.forward
    assert engine.forward(3) == ("instance", ("stock forward", 3)) and other_engine.forward(3) == ("stock forward", 3)
    SET.undo()
    assert module.function is stock_function and user.function is stock_function
    assert module.other is stock_function and module.table["key"] is stock_function and not SET.applied


def test_a_replacement_named_like_its_target_survives_undo_and_apply(fake_upstream, monkeypatch):
    """undo rebinds importers back to stock, but not the replacement's own module (where the name is its
    definition): a second apply still finds the replacement."""
    module, user = fake_upstream
    home = types.ModuleType("fake_replacements")
    exec("def function(alpha, beta=2):\n    return 'ours'", vars(home))
    monkeypatch.setitem(sys.modules, "fake_replacements", home)
    same_name = PatchSet("same-name set", "fake-upstream", ">=1.0,<2", module="fake_upstream", patches=[
        Patch("fake_upstream", "function", "fake_replacements:function", why="test", rebind=True)])
    patches.SETS.remove(same_name)
    replacement = home.function
    for _ in range(2):
        same_name.apply()
        assert module.function is replacement and user.function is replacement
        same_name.undo()
        assert module.function is stock_function and user.function is stock_function
        assert home.function is replacement


def test_a_renamed_or_changed_target_is_refused_before_anything_is_set(fake_upstream):
    module, _ = fake_upstream
    module.function = lambda gamma, beta=2: None  # upstream renamed a parameter
    with pytest.raises(PatchMismatch, match=r"cannot patch fake_upstream 1\.4\.2 \(imported from /opt/fake/"
                                            r"fake_upstream\): fake_upstream.function takes \(gamma, beta\); "
                                            r"l3plugin expects \(alpha, beta, \.\.\.\).*checked on "
                                            r"fake-upstream >=1\.0,<2"):
        SET.apply()
    assert module.other is stock_function and not SET.applied  # nothing was set
    del module.table["key"]
    assert "fake_upstream.table[KEY] does not exist" in Patch(
        "fake_upstream", "table", f"{here}:replacement_function", why="", key="fake_upstream:KEY").problem()


def test_the_check_reads_upstream_under_another_patch(fake_upstream):
    """A target already replaced by a patch is checked by upstream's own signature."""
    SET.apply()
    assert SET.patches[0].problem() is None


def test_every_declared_patch_checks_out_against_the_installed_frameworks():
    import megatron_cpu_shim  # noqa: F401  (declares the test-only sets)

    out = io.StringIO()
    assert doctor(out) == 0, out.getvalue()
    text = out.getvalue()
    assert "DeepSpeedEngine.load_checkpoint  ->  l3plugin.deepspeed.engine:load_checkpoint" in text
    assert "megatron.core.pipeline_parallel.schedules.get_forward_backward_func" in text
    assert "every target checks out" in text


def test_collective_patches_name_every_op_of_the_debug_wrappers():
    from l3plugin.debug.patching import COLLECTIVES, OPS, collective_wrapper

    rows = {(p.target, p.attribute) for p in COLLECTIVES.patches}
    assert rows == {(m, op) for m in ("torch.distributed", "torch.distributed.distributed_c10d") for op in OPS}
    assert all(p.replacement is collective_wrapper for p in COLLECTIVES.patches)


# -- the registry and the private upstream state ---------------------------------------------------------------
def test_every_l3plugin_patch_names_its_replacement_by_the_object_in_its_adapter():
    sets, _, failed = patches.declared()
    assert failed == {}
    ours = [s for s in sets if not s.name.startswith("tests/")]  # megatron_cpu_shim's test-only sets
    assert len(ours) >= 11, [s.name for s in ours]
    for patch_set in ours:
        for patch in patch_set.patches:
            assert callable(patch.replacement) and not isinstance(patch.replacement, str), (patch_set.name, patch)
            module = sys.modules[patch.replacement.__module__]
            assert getattr(module, patch.replacement.__name__) is patch.replacement  # defined there, by that name


def test_the_hf_rows_are_their_own_set_and_deepspeed_initialize_is_the_deepspeed_adapters():
    from l3plugin.deepspeed.engine import DEEPSPEED, initialize_with_key
    from l3plugin.deepspeed.sequence_parallel import ACCELERATE, prepare_data_loader

    assert [(p.target, p.replacement) for p in ACCELERATE.patches] == [("accelerate.accelerator", prepare_data_loader)]
    initialize = [p for p in DEEPSPEED.patches if p.target == "deepspeed"]
    assert [(p.attribute, p.replacement, p.rebind) for p in initialize] == [("initialize", initialize_with_key, True)]
    assert not any(p.target.startswith("accelerate") for p in DEEPSPEED.patches)


def test_declaring_a_set_imports_nothing_upstream(tmp_path):
    """The registry, the mechanism and the autoload hook import no torch; the adapter modules that declare sets
    (all but l3plugin.deepspeed, whose import is the install) import no DeepSpeed, Megatron, transformers or
    accelerate. A fresh interpreter, autoload off."""
    import json
    import os

    from l3plugin.ranks.pool import run_command

    frameworks = ("torch", "deepspeed", "megatron", "transformers", "accelerate")
    adapters = [m for m in patches.DECLARED_IN if not m.startswith("l3plugin.deepspeed")]
    code = (f"import json, sys\nimport l3plugin.upstream.patches, l3plugin.upstream.patchset, l3plugin_autoload\n"
            f"light = [m for m in {frameworks!r} if m in sys.modules]\n"
            f"for name in {adapters!r}:\n    __import__(name)\n"
            f"print(json.dumps([light, [m for m in {frameworks[1:]!r} if m in sys.modules]]))")
    env = dict(os.environ, L3PLUGIN_NO_AUTOLOAD="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = run_command([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[], []]


@pytest.fixture
def private_upstream(monkeypatch):
    """A fake upstream with one private module global and one private class attribute, and the registry's
    private-state list holding only declarations about it (and one about a module that is not installed)."""
    module = types.ModuleType("fake_private")
    module.__version__, module.__file__ = "2.0.1", "/opt/fake/fake_private/__init__.py"
    module._GLOBAL = None
    module.State = type("State", (), {"_shared": {}})
    monkeypatch.setitem(sys.modules, "fake_private", module)
    monkeypatch.setattr(versions, "_IMPORTED", {})
    declared = [patches.PrivateState("fake_private", "_GLOBAL", why="the parsed arguments: flags ignored"),
                patches.PrivateState("fake_private:State", "_shared", why="whether it runs: data not sharded"),
                patches.PrivateState("fake_private_not_installed", "_X", why="only with that package")]
    for state in declared:
        patches.PRIVATE_STATE.remove(state)  # not one of l3plugin's
    monkeypatch.setattr(patches, "SETS", [])
    monkeypatch.setattr(patches, "PRIVATE_STATE", declared)
    return module


def test_doctor_lists_private_upstream_state_present(private_upstream):
    out = io.StringIO()
    assert doctor(out) == 0, out.getvalue()
    text = out.getvalue()
    assert "  fake_private._GLOBAL\n      ok; the parsed arguments: flags ignored" in text
    assert "  fake_private.State._shared\n      ok; whether it runs" in text
    assert "  fake_private_not_installed._X\n      skipped: fake_private_not_installed is not importable" in text
    assert "3 private names read; every target checks out" in text


def test_doctor_reports_a_missing_private_name_with_what_breaks(private_upstream):
    del private_upstream._GLOBAL
    del private_upstream.State._shared
    out = io.StringIO()
    assert doctor(out) == 1
    text = out.getvalue()
    assert ("fake_private._GLOBAL\n      MISMATCH: fake_private._GLOBAL does not exist in fake_private 2.0.1 "
            "(imported from /opt/fake/fake_private); what breaks: the parsed arguments: flags ignored") in text
    assert "MISMATCH: fake_private.State._shared does not exist in fake_private 2.0.1" in text
    assert "2 problems with the imported versions" in text


def test_doctor_reports_a_private_name_deepspeed_no_longer_has(monkeypatch):
    """The real declaration of DeepSpeed's sequence-parallel group, against the imported DeepSpeed with the
    name removed (as a release that renamed it would be)."""
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the Megatron compat venvs)")
    sp = pytest.importorskip("deepspeed.runtime.sequence_parallel.parallel_state_sp",
                             reason="DeepSpeed < 0.17 has no sequence-parallel groups (nothing to read)")
    out = io.StringIO()
    doctor(out)
    assert "parallel_state_sp._SEQUENCE_PARALLEL_GROUP\n      ok;" in out.getvalue()
    monkeypatch.delattr(sp, "_SEQUENCE_PARALLEL_GROUP")
    out = io.StringIO()
    assert doctor(out) == 1
    assert (f"parallel_state_sp._SEQUENCE_PARALLEL_GROUP\n      MISMATCH: deepspeed.runtime.sequence_parallel."
            f"parallel_state_sp._SEQUENCE_PARALLEL_GROUP does not exist in deepspeed {deepspeed.__version__}") \
        in out.getvalue()
    assert "what breaks: whether DeepSpeed's sequence-parallel groups are built" in out.getvalue()


def test_doctor_lists_the_sets_of_an_adapter_whose_install_failed_and_names_one_that_cannot_be_imported(
        tmp_path, monkeypatch):
    """An adapter whose import applies its sets (l3plugin.deepspeed) and hits a mismatch has declared them
    already: doctor lists them with the mismatch. A declaring module that cannot be imported is named."""
    (tmp_path / "fake_adapter.py").write_text(
        "from l3plugin.upstream.patchset import Patch, PatchSet\n"
        "def ours():\n    pass\n"
        "FAKE = PatchSet('fake adapter', 'fake-upstream', '>=1.0,<2', module='fake_upstream_gone', patches=[\n"
        "    Patch('fake_upstream_gone', 'function', ours, why='gone upstream')])\n"
        "FAKE.apply()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_adapter", raising=False)
    module = types.ModuleType("fake_upstream_gone")
    module.__version__, module.__file__ = "1.5", "/opt/fake/fake_upstream_gone/__init__.py"
    monkeypatch.setitem(sys.modules, "fake_upstream_gone", module)
    monkeypatch.setattr(versions, "_IMPORTED", {})
    monkeypatch.setattr(patches, "SETS", [])
    monkeypatch.setattr(patches, "PRIVATE_STATE", [])
    monkeypatch.setattr(patches, "DECLARED_IN", ("fake_adapter", "fake_adapter_not_installed"))
    monkeypatch.setattr(patchset_module(), "SETS", patches.SETS)  # where PatchSet registers itself
    out = io.StringIO()
    assert doctor(out) == 1
    text = out.getvalue()
    assert "fake adapter: fake_upstream_gone 1.5" in text
    assert "fake_upstream_gone.function  ->  fake_adapter:ours\n      MISMATCH: fake_upstream_gone.function does " \
           "not exist; gone upstream" in text
    assert "fake_adapter_not_installed: MISMATCH: cannot be imported (ModuleNotFoundError" in text


def patchset_module():
    import l3plugin.upstream.patchset

    return l3plugin.upstream.patchset
