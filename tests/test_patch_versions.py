"""Versioned patch sets (l3plugin/upstream/patchset.py): the version is read from the module as imported, a version
outside the checked range gets one message, version-specific rows (variants) are chosen by version, and
`l3plugin doctor` reports the imported version, its path and the variant. The upstream here is a test double
(a module object whose __version__ the test sets)."""

import io
import sys
import types

import pytest

from l3plugin.upstream import patches

from l3plugin.upstream import versions
from l3plugin.upstream.doctor import doctor
from l3plugin.upstream.patches import Patch, PatchMismatch, PatchSet, VersionOutOfRange
from l3plugin.upstream.versions import version_in


def old_api(alpha):
    return ("old stock", alpha)


def new_api(alpha, beta):
    return ("new stock", alpha, beta)


def ours_old(alpha):
    return ("ours", VARIANTS.stock("fake_versioned.entry")(alpha))


def ours_new(alpha, beta):
    return ("ours", VARIANTS.stock("fake_versioned.entry")(alpha, beta))


def fake_module(version, path="/opt/checkout/fake_versioned"):
    module = types.ModuleType("fake_versioned")
    module.__version__ = version
    module.__file__ = f"{path}/__init__.py"
    if version.startswith("1."):
        module.entry = old_api
    else:
        module.entry = new_api
        module.moved = new_api
    return module


here = __name__
VARIANTS = PatchSet("variant set", "fake-versioned", ">=1.2,<3", module="fake_versioned", patches=[
    Patch("fake_versioned", "entry", f"{here}:ours_old", why="old API", signature=("alpha",), versions="<2"),
    Patch("fake_versioned", "entry", f"{here}:ours_new", why="new API", signature=("alpha", "beta"),
          versions=">=2"),
    Patch("fake_versioned", "moved", f"{here}:ours_new", why="only in 2.x", signature=("alpha", "beta"),
          versions=">=2"),
])
patches.SETS.remove(VARIANTS)  # not one of l3plugin's


@pytest.fixture
def upstream(monkeypatch):
    def install(version, **kwargs):
        module = fake_module(version, **kwargs)
        monkeypatch.setitem(sys.modules, "fake_versioned", module)
        monkeypatch.setattr(versions, "_IMPORTED", {})  # read once per process: read this fake
        return module
    monkeypatch.delenv(patches.UNCHECKED_ENV, raising=False)
    yield install
    VARIANTS.undo()


def test_version_ranges_ignore_local_labels_and_a_single_version_means_exactly_it():
    assert version_in("0.19.1+abc1234", ">=0.16.1,<0.20")  # a Megatron-LM git checkout appends its commit
    assert version_in("0.16.1", ">=0.16.1,<0.20") and not version_in("0.16.0", ">=0.16.1,<0.20")
    assert not version_in("0.20.0", ">=0.16.1,<0.20") and not version_in("0.20.0rc0", ">=0.16.1,<0.20")
    assert version_in("2.13.0+cpu", "2.13.0") and not version_in("2.13.1", "2.13.0")
    assert not version_in("unknown", ">=0.16.1,<0.20")  # not PEP 440: in no range


def test_a_malformed_range_fails_at_declaration():
    with pytest.raises(ValueError, match=r"versions '0\.16 to 0\.19' is not a pip-style range"):
        PatchSet("bad", "fake-versioned", "0.16 to 0.19", [], module="fake_versioned")
    with pytest.raises(ValueError, match=r"versions 'after 2' is not a pip-style range"):
        PatchSet("bad", "fake-versioned", ">=1", [Patch("m", "a", "r:f", why="", versions="after 2")])
    patches.SETS[:] = [s for s in patches.SETS if s.name != "bad"]


def test_the_version_is_read_from_the_imported_module_not_pips_metadata(upstream):
    upstream("2.5.0", path="/home/user/Megatron-LM/fake_versioned")
    found = versions.imported_version("fake_versioned")
    assert (found.version, found.path) == ("2.5.0", "/home/user/Megatron-LM/fake_versioned")
    sys.modules["fake_versioned"].__version__ = "9.9.9"
    assert versions.imported_version("fake_versioned").version == "2.5.0"  # read once per process


@pytest.mark.parametrize("version, expected, variant", [
    ("1.4.0", ("ours", ("old stock", 7)), "rows for <2"),
    ("2.1.0", ("ours", ("new stock", 7, 8)), "rows for >=2"),
])
def test_the_rows_for_the_imported_version_are_applied_and_undone(upstream, version, expected, variant):
    module = upstream(version)
    VARIANTS.apply()
    args = (7,) if version.startswith("1.") else (7, 8)
    assert module.entry(*args) == expected
    assert VARIANTS.variant() == variant
    if version.startswith("2."):
        assert module.moved is ours_new
    VARIANTS.undo()
    assert module.entry is (old_api if version.startswith("1.") else new_api)
    assert getattr(module, "moved", new_api) is new_api and not VARIANTS.applied


def test_a_row_for_another_version_is_not_checked(upstream):
    upstream("1.4.0")  # has no "moved": that row is for >=2 only
    VARIANTS.check()
    module = upstream("2.1.0")
    module.entry = old_api  # the >=2 row's signature does not hold: that row's mismatch, named
    with pytest.raises(PatchMismatch, match=r"cannot patch fake_versioned 2\.1\.0 \(imported from /opt/checkout/"
                                            r"fake_versioned\): fake_versioned\.entry takes \(alpha\); l3plugin "
                                            r"expects \(alpha, beta, \.\.\.\)"):
        VARIANTS.apply()
    assert module.entry is old_api and not VARIANTS.applied


def test_a_version_outside_the_range_gets_one_message_naming_version_path_and_range(upstream):
    module = upstream("3.0.1", path="/home/user/newer/fake_versioned")
    del module.moved  # rows would not check out either: still ONE message, about the version
    with pytest.raises(VersionOutOfRange) as raised:
        VARIANTS.apply()
    message = str(raised.value)
    assert message == ("l3plugin (variant set) was checked on fake-versioned >=1.2,<3, but fake_versioned 3.0.1 is "
                       "imported (from /home/user/newer/fake_versioned). Use a version in that range, or set "
                       "L3PLUGIN_UNCHECKED_VERSIONS=1 to try this one anyway (every patch target is still checked)")
    assert "moved" not in message and module.entry is new_api and not VARIANTS.applied
    upstream("1.1.0")
    with pytest.raises(VersionOutOfRange, match=r"fake_versioned 1\.1\.0 is imported"):
        VARIANTS.check()


def test_the_unchecked_versions_switch_warns_and_still_checks_every_row(upstream, monkeypatch):
    module = upstream("3.0.1")
    monkeypatch.setenv(patches.UNCHECKED_ENV, "1")
    with pytest.warns(UserWarning, match=r"checked on fake-versioned >=1\.2,<3, but fake_versioned 3\.0\.1 is "
                                         r"imported .*trying anyway"):
        VARIANTS.apply()
    assert module.entry(1, 2) == ("ours", ("new stock", 1, 2))
    VARIANTS.undo()
    del module.moved
    with pytest.warns(UserWarning), pytest.raises(PatchMismatch, match=r"fake_versioned\.moved does not exist"):
        VARIANTS.apply()


def test_doctor_reports_the_imported_version_its_path_the_range_and_the_variant(upstream, monkeypatch):
    monkeypatch.setattr(patches, "SETS", [VARIANTS])
    upstream("2.1.0", path="/home/user/Megatron-LM/fake_versioned")
    out = io.StringIO()
    assert doctor(out) == 0, out.getvalue()
    text = out.getvalue()
    assert text.startswith("variant set: fake_versioned 2.1.0 (imported from /home/user/Megatron-LM/fake_versioned); "
                           "checked on fake-versioned >=1.2,<3 (in range); variant: rows for >=2\n")
    assert f"fake_versioned.entry  ->  {here}:ours_old  [for <2]\n      not used with fake_versioned 2.1.0; " \
           "old API" in text
    assert "[for >=2]\n      ok; new API" in text and "every target checks out" in text

    upstream("3.0.1")
    out = io.StringIO()
    assert doctor(out) == 1
    text = out.getvalue()
    assert "(OUT OF RANGE)" in text and text.count("fake_versioned 3.0.1 is imported") == 1
    assert text.count("not checked (version out of range)") == 3 and "MISMATCH" not in text


def test_doctor_says_when_pips_metadata_names_another_version_than_the_imported_one(upstream, monkeypatch):
    pip_named = PatchSet("pip set", "pytest", ">=1", [], module="fake_versioned")  # pytest: some installed dist
    patches.SETS.remove(pip_named)
    monkeypatch.setattr(patches, "SETS", [pip_named])
    upstream("2.1.0")
    out = io.StringIO()
    doctor(out)
    assert f"(pip's metadata says pytest {versions.installed_version('pytest')}: another copy is imported first)" \
        in out.getvalue()


def test_megatrons_sets_report_the_megatron_core_that_is_imported():
    import megatron.core

    out = io.StringIO()
    doctor(out)
    header = next(line for line in out.getvalue().splitlines() if line.startswith("l3plugin.megatron: "))
    assert f"megatron.core {megatron.core.__version__} (imported from {megatron.core.__path__[0]})" in header
    assert f"checked on megatron-core {patches.MEGATRON_CHECKED} (in range)" in header
