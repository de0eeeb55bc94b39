"""The "l3plugin" DeepSpeed config key works without `import l3plugin.deepspeed`: l3plugin-autoload.pth
(installed into site-packages) watches for `import deepspeed` and installs then. Every check runs in a fresh
interpreter of this venv, from an empty directory, so the hook is the installed .pth and nothing here has
imported l3plugin for it; the l3plugin tree under test (the one this test imported) is first on its path. The
cases with the hook on are forked from one such interpreter that has imported torch only (what `import
deepspeed` imports first thing anyway), each child then importing deepspeed for itself: one interpreter start
and torch import for them all (most of each case's seconds). The opt-out case starts its own interpreter (the
hook is off from start-up). The last test builds a regular wheel (with build isolation) and checks it in a fresh
virtualenv."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import zipfile
from pathlib import Path

import pytest

import l3plugin
from l3plugin.ranks.pool import run_command
from runs_ahead import time_allowed

ZERO_TESTS = Path(__file__).resolve().parent / "zero"
# Joined to the l3plugin package's __path__ in a child: test-only modules of the package the wheel does not ship.
PACKAGE_EXTRA = Path(__file__).resolve().parent / "data" / "l3plugin_extra"
TREE = Path(l3plugin.__file__).resolve().parents[1]  # the checkout under test (PYTHONPATH or the editable install)

# l3plugin_autoload is the hook itself; "l3plugin" and "l3plugin.*" are the package.
PACKAGE_MODULES = "sorted(m for m in sys.modules if m == 'l3plugin' or m.startswith('l3plugin.'))"

# "imported": the modules and deepspeed.initialize right after `import deepspeed` (with FIRST empty: that import
# alone, as a user's script makes it; tests/test_import_cost.py reads it). "files": where the package and the hook
# were imported from.
ENGINE = f"""
import json, sys
before = {PACKAGE_MODULES}
if FIRST:
    __import__(FIRST)  # imports deepspeed from inside an l3plugin module
import deepspeed
imported = [sorted(sys.modules), deepspeed.initialize.__name__]
sys.path.insert(0, {str(ZERO_TESTS)!r})
from ds_models import ds_config, make_mlp, quiet_deepspeed
import os, socket
with socket.socket() as port:  # picked here, right before the store binds it (see run)
    port.bind(("127.0.0.1", 0))
    os.environ["MASTER_PORT"] = str(port.getsockname()[1])
deepspeed = quiet_deepspeed()
model = make_mlp()
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=ds_config(2, gas=1, plugin={{"fp32_reduce_zero": True}}))
print(json.dumps({{"before": before, "imported": imported, "optimizer": type(engine.optimizer).__name__,
                  "hf_adapter": any(m.startswith("l3plugin.huggingface") for m in sys.modules),
                  "accelerate": "accelerate" in sys.modules,
                  "files": [getattr(sys.modules.get(m), "__file__", None)
                            for m in ("l3plugin", "l3plugin_autoload")]}}))
"""


def run(code, tmp_path, timeout=90, python=sys.executable, tree=TREE, **env):
    # No MASTER_PORT here: ENGINE picks its own right before binding it. A port picked in this process could be
    # taken by another test's connection while the child imports (minutes at nice 19 in the suite's queue: an
    # EADDRINUSE seen on a clean clone, 2026-11-28).
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "L3PLUGIN_NO_AUTOLOAD", "L3PLUGIN_PIPELINE_SCHEDULE")}
    path = [env.pop("PYTHONPATH")] if "PYTHONPATH" in env else []
    full_env.update({"OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                     "PYTHONWARNINGS": "always::RuntimeWarning", **env})
    if tree is not None or path:
        full_env["PYTHONPATH"] = os.pathsep.join(path + ([str(tree)] if tree is not None else []))
    out = run_command([python, "-c", code], cwd=tmp_path, env=full_env, timeout=time_allowed(timeout))
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def engine_result(tmp_path, first="", python=sys.executable, tree=TREE, **env):
    out = run(f"FIRST = {first!r}\n" + ENGINE, tmp_path, python=python, tree=tree, **env)
    return parse_engine(out.stdout, out.stderr)


def parse_engine(stdout, stderr):
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["before"] == [], "the script imported l3plugin itself"
    return dict(result, stderr=stderr)


@functools.cache
def opt_out_run() -> dict:
    """ENGINE with nothing imported first, the hook opted out (L3PLUGIN_NO_AUTOLOAD=1): an interpreter of its own."""
    with tempfile.TemporaryDirectory(prefix="l3plugin-autoload-") as empty:
        return engine_result(Path(empty), L3PLUGIN_NO_AUTOLOAD="1")


def plain_import_run(opt_out: bool) -> dict:
    """ENGINE with nothing imported first (but torch, see FORKED), the hook on or opted out: run once per session,
    shared by this module's tests and tests/test_import_cost.py."""
    return opt_out_run() if opt_out else forked_result("plain")


# The cases with the hook on, each the code one child runs (a fresh `import deepspeed` of its own).
def half_built_code():
    code = ENGINE.replace("print(json.dumps({", "print(json.dumps({'deferred': deferred, 'restored': "
                          "deepspeed.initialize.__name__, ")
    code = code.replace("deepspeed = quiet_deepspeed()", "deferred = [\"l3plugin.deepspeed\" in sys.modules, "
                        "sys.modules[\"deepspeed\"].initialize.__name__]\ndeepspeed = quiet_deepspeed()")
    join = f"import l3plugin\n    l3plugin.__path__.append({str(PACKAGE_EXTRA)!r})\n"
    code = code.replace("if FIRST:\n", "if FIRST:\n    " + join)
    return "FIRST = 'l3plugin.deepspeed_at_import'\n" + code


# A stand-in `deepspeed` without the engine modules, first on the path (as PYTHONPATH would put it: before
# site-packages): install() fails; `import deepspeed` must not.
FAKE_DEEPSPEED = "import sys\nDONE = 'l3plugin.deepspeed' not in sys.modules\n"
FAILED_INSTALL = """
import sys
sys.path.insert(0, FAKE)
import deepspeed
from l3plugin_autoload import DeepSpeedWatcher
print(deepspeed.DONE, type(deepspeed.__spec__.loader).__name__, DeepSpeedWatcher in sys.meta_path)
"""


def case_code(name, fake):
    return {"plain": lambda: "FIRST = ''\n" + ENGINE,
            "inside": lambda: "FIRST = 'l3plugin.deepspeed.optimizer'\n" + ENGINE,
            "half-built": half_built_code,
            "fake": lambda: f"FAKE = {str(fake)!r}\n" + FAILED_INSTALL}[name]()


# One fresh interpreter imports torch, then forks a child per case, all at once; each child writes its stdout and
# stderr to files of its own (outside the empty working directory) and runs its case as a script would. Before the
# cases of AFTER_DYNAMO it also imports torch._dynamo (seconds), which every deepspeed.initialize imports, stock or
# ours: those cases check where and when the hook installs, not which modules `import deepspeed` loads (the plain
# case's module list, read by tests/test_import_cost.py, is taken in a child forked before that import).
FORKED = """
import json, os, socket, sys, traceback
import torch  # what `import deepspeed` imports first thing: once, for every child

CASES, OUT, AFTER_DYNAMO = json.loads({cases!r}), {out!r}, {after_dynamo!r}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


children = {{}}
for name, code in CASES.items():
    if name in AFTER_DYNAMO:
        import torch._dynamo
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for fd, suffix in ((1, "out"), (2, "err")):
                handle = os.open(os.path.join(OUT, name + "." + suffix), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(handle, fd)
                os.close(handle)
            os.environ["MASTER_PORT"] = str(free_port())
            exec(compile(code, name, "exec"), {{"__name__": "__main__"}})
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    children[name] = pid
print(json.dumps({{name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in children.items()}}))
"""

FORKED_CASES = ("plain", "fake", "inside", "half-built")  # forked in this order
AFTER_DYNAMO = ("inside", "half-built")
_forked_results = {}
_forked_lock = threading.Lock()


def forked_runs(*names) -> dict:
    """{case: its result, or the exception to raise in its test} of the FORKED cases ``names`` (all of them when
    none is given), each run once per session (the first call runs those not run yet, from one interpreter)."""
    names = names or FORKED_CASES
    with _forked_lock:
        missing = [name for name in names if name not in _forked_results]
        if missing:
            _forked_results.update(_run_forked(missing))
        return {name: _forked_results[name] for name in names}


def _run_forked(names):
    with tempfile.TemporaryDirectory(prefix="l3plugin-autoload-") as folder:
        folder = Path(folder)
        empty, out, fake = folder / "empty", folder / "out", folder / "fake" / "deepspeed"
        for d in (empty, out, fake):
            d.mkdir(parents=True)
        (fake / "__init__.py").write_text(FAKE_DEEPSPEED)
        cases = json.dumps({name: case_code(name, fake.parent) for name in FORKED_CASES if name in names})
        script = FORKED.format(cases=cases, out=str(out), after_dynamo=AFTER_DYNAMO)
        codes = json.loads(run(script, empty, timeout=300).stdout.splitlines()[-1])
        results = {}
        for name in names:
            stdout, stderr = ((out / f"{name}.{suffix}").read_text() for suffix in ("out", "err"))
            try:
                assert codes[name] == 0, f"case {name} exited with {codes[name]}:\n{stderr[-3000:]}"
                results[name] = (subprocess.CompletedProcess(name, 0, stdout, stderr) if name == "fake"
                                 else parse_engine(stdout, stderr))
            except Exception as exc:  # noqa: BLE001 - raised by the case's own test
                results[name] = exc
        return results


def forked_result(name):
    result = forked_runs(name)[name]
    if isinstance(result, BaseException):
        raise result
    return result


def test_pth_is_installed_in_site_packages():
    pth = Path(sysconfig.get_paths()["purelib"]) / "l3plugin-autoload.pth"
    assert pth.is_file(), f"{pth} missing: reinstall with `make install` (pip install -e .)"
    assert pth.read_text().strip() == "import l3plugin_autoload"


def test_startup_installs_only_the_watcher(tmp_path):
    code = ("import json, sys; from l3plugin_autoload import DeepSpeedWatcher\n"
            "print(json.dumps([DeepSpeedWatcher in sys.meta_path, sorted(m for m in ('torch', 'deepspeed') "
            f"if m in sys.modules), {PACKAGE_MODULES}]))")
    assert json.loads(run(code, tmp_path).stdout) == [True, [], []]
    off = json.loads(run(code, tmp_path, L3PLUGIN_NO_AUTOLOAD="1").stdout)
    assert off == [False, [], []]


def test_startup_watches_megatron_only_with_the_variable(tmp_path):
    """L3PLUGIN_PIPELINE_SCHEDULE (tests/megatron/test_no_code_switch.py: what it does) puts a second finder on
    sys.meta_path at start-up, importing nothing; unset, or with L3PLUGIN_NO_AUTOLOAD=1, there is none."""
    code = ("import json, sys; from l3plugin_autoload import DeepSpeedWatcher, MegatronWatcher\n"
            "print(json.dumps([[w in sys.meta_path for w in (DeepSpeedWatcher, MegatronWatcher)], sorted(m for m in "
            f"('torch', 'megatron', 'megatron.core') if m in sys.modules), {PACKAGE_MODULES}]))")
    assert json.loads(run(code, tmp_path, L3PLUGIN_PIPELINE_SCHEDULE="flexible").stdout) == [[True, True], [], []]
    assert json.loads(run(code, tmp_path).stdout) == [[True, False], [], []]
    off = run(code, tmp_path, L3PLUGIN_PIPELINE_SCHEDULE="flexible", L3PLUGIN_NO_AUTOLOAD="1")
    assert json.loads(off.stdout) == [[False, False], [], []]


def ahead_runs(tmp_path_factory, selected):
    """This module's fresh interpreters (each seconds of imports on one core), the wheel and its virtualenv, queued
    in the background when the session starts (tests/runs_ahead.py); the wheel's chain, the longest, first."""
    runs = {"wheel": lambda: wheel_and_its_virtualenv(tmp_path_factory.mktemp("wheel")),
            "forked": forked_runs,
            "test_opt_out_gives_stock_zero": lambda: opt_out_run()["optimizer"]}
    needed_by = {"wheel": ("test_wheel_holds_only_product_code", "test_wheel_in_a_fresh_virtualenv_installs_the_hook"),
                 "forked": ("test_config_key_works_without_import", "test_deepspeed_imported_from_inside_l3plugin",
                            "test_deepspeed_imported_while_another_l3plugin_module_is_half_built",
                            "test_failed_install_warns_and_deepspeed_still_imports")}
    return runs, needed_by


def test_config_key_works_without_import(ahead):
    """... and a DeepSpeed run without context_parallel_size never imports the Hugging Face adapter, also when
    accelerate is imported (DeepSpeed 0.16 imports it itself; 0.19 does not)."""
    ahead.result("forked")
    result = plain_import_run(opt_out=False)
    assert result["optimizer"] == "DeepSpeedFP32ReduceZero"
    assert result["hf_adapter"] is False


def test_opt_out_gives_stock_zero(ahead):
    assert ahead.result("test_opt_out_gives_stock_zero") == "DeepSpeedZeroOptimizer"


def test_deepspeed_imported_from_inside_l3plugin(ahead):
    """deepspeed finishes importing while the l3plugin.deepspeed package is half-built (its optimizer module
    imports deepspeed at its top): the hook must not import the package again; the package installs itself."""
    ahead.result("forked")
    assert forked_result("inside")["optimizer"] == "DeepSpeedFP32ReduceZero"


def test_deepspeed_imported_while_another_l3plugin_module_is_half_built(ahead):
    """deepspeed finishes importing while an l3plugin module outside the adapter is half-built: the hook does not
    install then; deepspeed.initialize installs at its first call (the registry's AUTOLOAD set) and is put back."""
    ahead.result("forked")
    result = forked_result("half-built")
    assert result["deferred"] == [False, "initialize_after_install"]
    assert result["optimizer"] == "DeepSpeedFP32ReduceZero"
    assert result["restored"] == "initialize_with_key"  # the trampoline gave way to l3plugin.deepspeed's install


def test_failed_install_warns_and_deepspeed_still_imports(ahead):
    """A stand-in `deepspeed` without the engine modules: install() fails; `import deepspeed` must not."""
    ahead.result("forked")
    out = forked_result("fake")
    # The hook ran after deepspeed/__init__ finished, then gave the module its own loader back and left.
    assert out.stdout.split() == ["True", "SourceFileLoader", "False"]
    assert "l3plugin autoload: could not install the FP32-reducing ZeRO into DeepSpeed" in out.stderr
    assert "deepspeed.runtime" in out.stderr  # names the failure


# What the wheel is built from (a copy: building in the checkout would leave build/ and *.egg-info there).
WHEEL_SOURCES = ("pyproject.toml", "setup.py", "README.md", "l3plugin_autoload.py", "l3plugin-autoload.pth", "l3plugin")
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
# Test and bench support lives in tests/ and bench/; none of it may ship (checked by name as well, in case it
# comes back inside the package).
SUPPORT = re.compile(r"(^|/)(testing|tests|bench)/|(^|/)(wire|toy_pipeline|tiny_gpt|megatron_cpu_shim|"
                     r"deepspeed_at_import|deepspeed_mpu)\.py$")


def build_wheel(tmp_path):
    """A regular wheel of the tree under test, built with build isolation (setuptools from the package index)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in WHEEL_SOURCES:
        copy = shutil.copytree if (TREE / name).is_dir() else shutil.copy
        copy(TREE / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                            if (TREE / name).is_dir() else {}))
    run_command([*PIP, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(source)], timeout=time_allowed(300),
                check=True)
    built, = (tmp_path / "dist").glob("l3plugin-*.whl")
    return built


def install_in_a_fresh_virtualenv(wheel, tmp_path):
    """The wheel installed with pip into a fresh virtualenv, then ENGINE run by its interpreter: (its
    site-packages, ENGINE's result). torch and DeepSpeed come from this venv through a path entry."""
    venv = tmp_path / "venv"
    run_command([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=time_allowed(120), check=True)
    python = str(venv / "bin" / "python")
    site = Path(run_command([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            timeout=time_allowed(60), check=True).stdout.strip())
    # This venv's packages after the new venv's own (a plain path entry: its .pth files are not run).
    (site / "zz-packages-of-the-test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Without PYTHONPATH: a checkout on it (the compat runs put it there) holds l3plugin.egg-info of the same
    # version, and pip would take that for an installed l3plugin and skip the wheel ("already installed").
    no_path = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run_command([*PIP, "--python", python, "install", "--no-deps", "--no-index", str(wheel)], timeout=time_allowed(300),
                check=True, env=no_path)
    return site, engine_result(tmp_path, python=python, tree=None)


def wheel_and_its_virtualenv(tmp_path):
    """(the wheel, what install_in_a_fresh_virtualenv returned or raised): one run ahead for both wheel tests, a
    failure of the virtualenv part kept for its own test."""
    wheel = build_wheel(tmp_path)
    try:
        return wheel, install_in_a_fresh_virtualenv(wheel, tmp_path)
    except Exception as exc:  # noqa: BLE001 - raised again by the test of the virtualenv
        return wheel, exc


@pytest.fixture(scope="module")
def wheel(ahead):
    return ahead.result("wheel")[0]


def test_wheel_holds_only_product_code(wheel):
    """The wheel holds the package (every module of the tree's l3plugin/, nothing else), the start-up hook and its
    .pth, and its metadata: no test or bench support."""
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"l3plugin", "l3plugin_autoload.py", "l3plugin-autoload.pth"}, top
    shipped = sorted(name for name in names if SUPPORT.search(name))
    assert not shipped, f"test or bench support in the wheel: {shipped}"
    tree = {path.relative_to(TREE).as_posix() for path in (TREE / "l3plugin").rglob("*.py")}
    package = {name for name in names if name.startswith("l3plugin/")}
    assert package == tree, f"only in the tree: {sorted(tree - package)}; only in the wheel: {sorted(package - tree)}"
    assert "l3plugin/demo/model.py" in package  # the demo's model is product (`l3plugin demo`)


def test_wheel_in_a_fresh_virtualenv_installs_the_hook(ahead):
    """The wheel installed with pip into a fresh virtualenv: the .pth lands in its site-packages (listed in the
    wheel's RECORD, so pip uninstalls it) and the key works with no import, the hook and the package being the
    wheel's."""
    wheel, installed = ahead.result("wheel")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = archive.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    assert "l3plugin-autoload.pth" in names and "l3plugin_autoload.py" in names
    assert any(line.startswith("l3plugin-autoload.pth,sha256=") for line in record.splitlines())

    if isinstance(installed, Exception):
        raise installed
    site, result = installed
    assert (site / "l3plugin-autoload.pth").read_text().strip() == "import l3plugin_autoload"
    found = result["files"]  # what the hook imported: the wheel's, not the tree's
    assert all(f is not None and Path(f).resolve().is_relative_to(site.resolve()) for f in found), found
    assert {k: result[k] for k in ("before", "optimizer")} == {"before": [], "optimizer": "DeepSpeedFP32ReduceZero"}
