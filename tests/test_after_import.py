"""after_import: a patch for a module imported after l3plugin installed (accelerate after deepspeed)."""

import subprocess
import sys

from l3plugin.upstream.after_import import after_import, cancel


def test_runs_after_a_later_import_once(tmp_path, monkeypatch):
    (tmp_path / "late_module_for_l3plugin.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def callback():
        seen.append(sys.modules["late_module_for_l3plugin"].VALUE)

    after_import("late_module_for_l3plugin", callback)
    after_import("late_module_for_l3plugin", callback)  # waiting already: not twice
    assert seen == []
    import late_module_for_l3plugin  # noqa: F401

    assert seen == [1]
    after_import("late_module_for_l3plugin", callback)  # imported: at once
    assert seen == [1, 1]
    sys.modules.pop("late_module_for_l3plugin")


def test_cancel_and_a_failing_callback_never_break_the_import(tmp_path, monkeypatch):
    (tmp_path / "late_module_b.py").write_text("VALUE = 2\n")
    (tmp_path / "late_module_c.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    after_import("late_module_b", lambda: seen.append("b"))
    cancel("late_module_b")

    def boom():
        raise RuntimeError("boom")

    after_import("late_module_c", boom)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import late_module_b  # noqa: F401
        import late_module_c

    assert seen == [] and late_module_c.VALUE == 3
    assert any("boom" in str(w.message) for w in caught)
    sys.modules.pop("late_module_b")
    sys.modules.pop("late_module_c")


def test_deepspeed_imported_before_accelerate_still_shards_by_data_parallel_rank():
    """The order ``import deepspeed; import trl`` (or accelerate) gets the data-loader patch too (issue 55)."""
    code = ("import deepspeed, accelerate.accelerator as a; "
            "print(a.prepare_data_loader.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "l3plugin.deepspeed.sequence_parallel", out.stdout
