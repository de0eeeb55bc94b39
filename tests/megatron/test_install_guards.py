"""install() after a script bound get_forward_backward_func by name: warned at install(), and the stock
pipelined schedule that the early-bound selector returns runs the flexible one (with a warning) while it is
selected; default schedule and uninstall() leave Megatron untouched."""

import importlib
import sys
import types
import warnings

import pytest
from megatron.core.pipeline_parallel import schedules

import l3plugin.megatron as l3m

l3install = importlib.import_module("l3plugin.megatron.install")  # the package re-exports a function of that name
l3pipeline = importlib.import_module("l3plugin.megatron.pipeline")


@pytest.fixture
def early_script(monkeypatch):
    """A user script module that did `from megatron.core.pipeline_parallel import get_forward_backward_func`
    before install(); the flexible schedule is replaced by a recorder (no pipeline runs here)."""
    script = types.ModuleType("user_train_script")
    script.get_forward_backward_func = schedules.get_forward_backward_func
    monkeypatch.setitem(sys.modules, "user_train_script", script)
    calls = []
    monkeypatch.setattr(l3pipeline, "forward_backward_pipelining_flexible",
                        lambda **kwargs: calls.append(kwargs) or "flexible ran")
    originals = {name: getattr(schedules, name) for name in l3install._PIPELINED}
    yield script, calls, originals
    l3m.uninstall()


def test_early_bound_selector_is_warned_and_still_runs_the_flexible_schedule(early_script):
    script, calls, originals = early_script
    with pytest.warns(l3install.EarlyBoundSelectorWarning, match="user_train_script bound Megatron's"):
        l3m.install("flexible")
    for pp, vp in ((2, 2), (4, None)):
        fn = script.get_forward_backward_func(pp_size=pp, vp_size=vp)  # Megatron's own selector
        assert fn is not l3pipeline.forward_backward_pipelining_flexible
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fn(num_microbatches=3) == "flexible ran"
        assert [w.category for w in caught] == ([l3install.EarlyBoundSelectorWarning] if pp == 2 else [])
    assert calls == [{"num_microbatches": 3}, {"num_microbatches": 3}]
    l3m.uninstall()
    assert all(getattr(schedules, n) is fn for n, fn in originals.items())  # Megatron as it was


def test_default_schedule_passes_through_to_stock(early_script):
    _script, calls, originals = early_script
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when the flexible schedule is not selected
        l3m.install("default")
    guarded = schedules.forward_backward_pipelining_with_interleaving
    assert guarded is not originals["forward_backward_pipelining_with_interleaving"]
    assert guarded.__wrapped__ is originals["forward_backward_pipelining_with_interleaving"]
    stock_ran = []
    probe = l3install.guarded_schedule(lambda **kw: stock_ran.append(kw) or "stock ran", "probe")
    assert probe(num_microbatches=2) == "stock ran" and stock_ran and not calls
