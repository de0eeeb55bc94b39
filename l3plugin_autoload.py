"""Make the ``"l3plugin"`` DeepSpeed config key work without ``import l3plugin.deepspeed``, and
``L3PLUGIN_PIPELINE_SCHEDULE`` switch Megatron-Core to l3plugin's schedule without ``l3plugin.megatron.install()``.

``l3plugin-autoload.pth`` (installed into site-packages with the package) imports this module at every
interpreter start. It only puts finders on ``sys.meta_path`` (no torch, no deepspeed, no l3plugin import
here: start-up stays cheap).

DeepSpeed: when ``import deepspeed`` has run ``deepspeed/__init__`` to the end, the finder imports
``l3plugin.deepspeed``, whose import runs ``install()``: from then on ``deepspeed.initialize`` honours the key,
and without the key DeepSpeed stays stock.

Megatron-Core, only where ``L3PLUGIN_PIPELINE_SCHEDULE`` is set (``flexible`` or ``flexible-zb``; a Ray
``runtime_env={"env_vars": {...}}`` carries it to the workers of verl and NeMo-RL): when the package
``megatron.core`` has finished importing (its ``__init__`` imports ``pipeline_parallel`` itself, so no importer
has bound ``get_forward_backward_func`` yet), the finder calls ``l3plugin.megatron.install.install_from_environment()``.
If Megatron-LM's ``megatron.training`` is still importing then (it imports megatron.core from its own
``__init__``; install() imports ``megatron.training.initialize``), the install waits until ``megatron.training``
has finished. Unset (or ``default``): Megatron stays stock and nothing is imported for it.

``L3PLUGIN_NO_AUTOLOAD=1`` turns both off. Nothing here may break interpreter start-up or the framework's
import: failures become a warning.
"""

import os
import sys

DISABLE_ENV = "L3PLUGIN_NO_AUTOLOAD"
SCHEDULE_ENV = "L3PLUGIN_PIPELINE_SCHEDULE"  # as l3plugin.megatron.install.SCHEDULE_ENV (nothing imported here)


def _warn(what: str, exc: BaseException) -> None:
    import warnings

    warnings.warn(f"l3plugin autoload: {what} ({type(exc).__name__}: {exc}). DeepSpeed ignores the \"l3plugin\" "
                  "config key (stock ZeRO runs) unless the script itself does `import l3plugin.deepspeed`; "
                  f"set {DISABLE_ENV}=1 to turn the autoload off.", RuntimeWarning, stacklevel=3)


def _warn_megatron(what: str, exc: BaseException) -> None:
    import warnings

    warnings.warn(f"l3plugin autoload: {what} ({type(exc).__name__}: {exc}). Megatron-Core runs its own pipeline "
                  f"schedules ({SCHEDULE_ENV} is ignored) unless the script calls "
                  "l3plugin.megatron.install(\"flexible\") itself; "
                  f"set {DISABLE_ENV}=1 to turn the autoload off.", RuntimeWarning, stacklevel=3)


def _half_built(package: str, finishing=None) -> bool:
    """True while ``package`` or one of its modules is still executing (imported from inside it). ``finishing``:
    the module whose loader has just run (still marked as importing until the import machinery returns)."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items())
               if name != finishing and (name == package or name.startswith(package + ".")))


def _l3plugin_importing() -> bool:
    """True while some l3plugin module is still executing (deepspeed was imported from inside it): importing
    l3plugin.deepspeed now could meet that half-built module, so the install waits for deepspeed.initialize."""
    return _half_built("l3plugin")


def _install() -> None:
    if "l3plugin.deepspeed" in sys.modules:  # imported already: installed, or uninstall()ed on purpose
        return
    try:
        import l3plugin.deepspeed  # noqa: F401  (its import runs install())
    except Exception as exc:  # noqa: BLE001 - `import deepspeed` must still succeed
        _warn("could not install the FP32-reducing ZeRO into DeepSpeed", exc)


def initialize_after_install(*args, **kwargs):
    """``deepspeed.initialize`` in the deferred case (the patch of ``deferred_install()``): puts the stock
    function back, installs, then calls ``deepspeed.initialize`` as installed (l3plugin may patch it too)."""
    deferred_install().undo()
    _install()
    return sys.modules["deepspeed"].initialize(*args, **kwargs)


_DEFERRED = []  # the patch set below, once built


def deferred_install():
    """The patch set of the deferred case: ``deepspeed.initialize`` -> ``initialize_after_install``. Built at
    first use, not at import: this module runs at every interpreter start and imports nothing of l3plugin."""
    if not _DEFERRED:
        from l3plugin.upstream.versions import DEEPSPEED_CHECKED
        from l3plugin.upstream.patchset import Patch, PatchSet

        _DEFERRED.append(PatchSet("l3plugin_autoload", "deepspeed", DEEPSPEED_CHECKED, [
            Patch("deepspeed", "initialize", initialize_after_install,
                  why="deepspeed was imported while an l3plugin module was half-built: l3plugin.deepspeed is "
                      "installed at the first deepspeed.initialize instead (then the stock function is put back)"),
        ]))
    return _DEFERRED[0]


def _install_at_first_initialize() -> None:
    """Deferred case: install right before the first ``deepspeed.initialize`` call, then unwrap it."""
    deferred_install().apply()


def _deepspeed_loaded(module) -> None:
    if "l3plugin.deepspeed" in sys.modules:
        return
    if _l3plugin_importing():
        _install_at_first_initialize()
    else:
        _install()


class _Loader:
    """Runs the module's own loader, then tells its watcher; the spec gets the original loader back afterwards."""

    def __init__(self, spec, watcher):
        self.spec, self.inner, self.watcher = spec, spec.loader, watcher

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.spec.loader = self.inner
        module.__loader__ = self.inner
        try:
            self.inner.exec_module(module)  # errors in the module's own import propagate unchanged
        except BaseException:
            self._finished(module, ok=False)
            raise
        self._finished(module, ok=True)

    def _finished(self, module, ok):
        try:
            self.watcher.finished(self.spec.name, module, ok)
        except Exception as exc:  # noqa: BLE001
            self.watcher.warn(f"the {self.watcher.framework} import hook failed", exc)

    def __getattr__(self, name):  # get_filename, get_resource_reader, ... are the module's loader's
        if name in ("inner", "spec", "watcher"):
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Watcher:
    """``sys.meta_path`` finder that answers only for the modules ``names``, by asking the finders after it and
    wrapping the loader they return; ``finished`` runs when such a module's own loader has run."""

    names: tuple = ()
    framework = ""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in cls.names:
            return None
        try:
            for finder in sys.meta_path:
                if finder is cls or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec, cls)
                    return spec
        except Exception as exc:  # noqa: BLE001 - let the normal import machinery try on its own
            cls.warn(f"the {cls.framework} import hook failed", exc)
        return None

    @classmethod
    def remove(cls) -> None:
        while cls in sys.meta_path:
            sys.meta_path.remove(cls)

    @classmethod
    def enable(cls) -> None:
        if cls not in sys.meta_path:
            sys.meta_path.insert(0, cls)


class DeepSpeedWatcher(_Watcher):
    """Answers for the top-level ``deepspeed`` package; installs l3plugin.deepspeed once it has imported."""

    names = ("deepspeed",)
    framework = "DeepSpeed"
    warn = staticmethod(_warn)

    @classmethod
    def finished(cls, name, module, ok) -> None:
        if ok:  # a failed `import deepspeed` may be tried again: keep watching
            cls.remove()
            _deepspeed_loaded(module)


class MegatronWatcher(_Watcher):
    """Answers for ``megatron.core`` and Megatron-LM's ``megatron.training`` (only where SCHEDULE_ENV is set);
    installs l3plugin's schedule once megatron.core has imported and no megatron.training is half-built."""

    names = ("megatron.core", "megatron.training")
    framework = "Megatron-Core"
    warn = staticmethod(_warn_megatron)

    @classmethod
    def finished(cls, name, module, ok) -> None:
        if ok or name != "megatron.core":  # a failed megatron.training still leaves megatron.core to install into
            _megatron_loaded(name)


_MEGATRON_FAILED = "could not install l3plugin's pipeline schedule into Megatron-Core"
_MEGATRON_DONE = []  # the module whose import installed (or tried to)


def _megatron_loaded(finishing=None) -> None:
    """megatron.core or megatron.training finished importing: install unless megatron.core is missing or half-built
    (its own import failed, or this is megatron.training's import from inside it), or megatron.training is
    half-built (it imported megatron.core from its __init__: wait for its end, the watcher answers for it too)."""
    if _MEGATRON_DONE or "megatron.core" not in sys.modules or _half_built("megatron.core", finishing) \
            or _half_built("megatron.training", finishing):
        return
    _MEGATRON_DONE.append(finishing)  # once per process (a loader wrapped before remove() may still report)
    MegatronWatcher.remove()
    try:
        if _l3plugin_importing():
            raise RuntimeError("megatron.core was imported while an l3plugin module was still being imported")
        from l3plugin.megatron.install import install_from_environment

        install_from_environment()
    except Exception as exc:  # noqa: BLE001 - the framework's import must still succeed
        _warn_megatron(_MEGATRON_FAILED, exc)


def enable() -> None:
    """Watch for ``import deepspeed`` (a no-op when deepspeed is imported already or the watcher is on)."""
    if "deepspeed" in sys.modules:
        _deepspeed_loaded(sys.modules["deepspeed"])
    else:
        DeepSpeedWatcher.enable()


def enable_megatron() -> None:
    """Watch for ``import megatron.core`` to install the schedule SCHEDULE_ENV names (at once when megatron.core
    is imported already)."""
    if "megatron.core" in sys.modules:
        _megatron_loaded()
    else:
        MegatronWatcher.enable()


def _at_startup() -> None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    try:
        enable()
        if os.environ.get(SCHEDULE_ENV, "").strip():
            enable_megatron()
    except Exception:  # noqa: BLE001 - never break interpreter start-up
        pass


_at_startup()
