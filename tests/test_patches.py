"""The patch registry (l3plugin/patches.py): one declaration per upstream patch, checked before anything is
set, undone exactly; `l3plugin doctor` checks every declaration against the installed frameworks."""

import io
import sys
import types

import pytest

from l3plugin import patches, versions
from l3plugin.doctor import doctor
from l3plugin.patches import Patch, PatchMismatch, PatchSet


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
    Patch("fake_upstream", "function", f"{here}:replacement_function", why="test", signature=("alpha", "beta"),
          rebind=True),
    Patch("fake_upstream", "other", f"{here}:wrapping_factory", why="test", wraps=True),
    Patch("fake_upstream", "table", f"{here}:replacement_function", why="test", key="fake_upstream:KEY"),
    Patch("fake_upstream:Engine", "forward", f"{here}:instance_forward", why="test", instance=True),
    Patch("fake_upstream_not_installed", "thing", f"{here}:replacement_function", why="test", optional=True),
    Patch("fake_upstream_not_loaded", "thing", f"{here}:replacement_function", why="test", loaded_only=True),
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
    from l3plugin.debug.patching import OPS

    assert set(patches.COLLECTIVE_OPS) == set(OPS)
