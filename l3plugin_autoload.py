"""Make the ``"l3plugin"`` DeepSpeed config key work without ``import l3plugin.deepspeed``.

``l3plugin-autoload.pth`` (installed into site-packages with the package) imports this module at every
interpreter start. It only puts a finder on ``sys.meta_path`` (no torch, no deepspeed, no l3plugin import
here: start-up stays cheap). When ``import deepspeed`` has run ``deepspeed/__init__`` to the end, the finder
imports ``l3plugin.deepspeed``, whose import runs ``install()``: from then on ``deepspeed.initialize`` honours
the key, and without the key DeepSpeed stays stock. ``L3PLUGIN_NO_AUTOLOAD=1`` turns this off.

Nothing here may break interpreter start-up or ``import deepspeed``: failures become a warning.
"""

import os
import sys

DISABLE_ENV = "L3PLUGIN_NO_AUTOLOAD"


def _warn(what: str, exc: BaseException) -> None:
    import warnings

    warnings.warn(f"l3plugin autoload: {what} ({type(exc).__name__}: {exc}). DeepSpeed ignores the \"l3plugin\" "
                  "config key (stock ZeRO runs) unless the script itself does `import l3plugin.deepspeed`; "
                  f"set {DISABLE_ENV}=1 to turn the autoload off.", RuntimeWarning, stacklevel=3)


def _l3plugin_importing() -> bool:
    """True while some l3plugin module is still executing (deepspeed was imported from inside it): importing
    l3plugin.deepspeed now could meet that half-built module, so the install waits for deepspeed.initialize."""
    return any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items()) if name == "l3plugin" or name.startswith("l3plugin."))


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
    """Runs deepspeed's own loader, then installs; the spec gets the original loader back afterwards."""

    def __init__(self, spec):
        self.spec, self.inner = spec, spec.loader

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.spec.loader = self.inner
        module.__loader__ = self.inner
        self.inner.exec_module(module)  # errors in deepspeed's own import propagate unchanged
        DeepSpeedWatcher.remove()
        try:
            _deepspeed_loaded(module)
        except Exception as exc:  # noqa: BLE001
            _warn("the DeepSpeed import hook failed", exc)

    def __getattr__(self, name):  # get_filename, get_resource_reader, ... are deepspeed's loader's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class DeepSpeedWatcher:
    """``sys.meta_path`` finder that answers only for the top-level ``deepspeed`` package, by asking the
    finders after it and wrapping the loader they return."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != "deepspeed":
            return None
        try:
            for finder in sys.meta_path:
                if finder is cls or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec)
                    return spec
        except Exception as exc:  # noqa: BLE001 - let the normal import machinery try on its own
            _warn("the DeepSpeed import hook failed", exc)
        return None

    @classmethod
    def remove(cls) -> None:
        while cls in sys.meta_path:
            sys.meta_path.remove(cls)


def enable() -> None:
    """Watch for ``import deepspeed`` (a no-op when deepspeed is imported already or the watcher is on)."""
    if "deepspeed" in sys.modules:
        _deepspeed_loaded(sys.modules["deepspeed"])
    elif DeepSpeedWatcher not in sys.meta_path:
        sys.meta_path.insert(0, DeepSpeedWatcher)


def _at_startup() -> None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    try:
        enable()
    except Exception:  # noqa: BLE001 - never break interpreter start-up
        pass


_at_startup()
