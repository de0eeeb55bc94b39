"""Run a function right after a module finishes importing, if it is not imported yet (for patches of a module a
script may import after l3plugin installs: accelerate after deepspeed, as ``import deepspeed; import trl`` does).

    after_import("accelerate.accelerator", ACCELERATE.apply)

A finder at the front of ``sys.meta_path`` answers only for that name: it asks the finders after it, wraps the
loader they return so the callback runs once the module's code has run, and removes itself. Errors in the module's
own import propagate unchanged; an error in the callback becomes a warning (an import must not fail for a patch).
"""

from __future__ import annotations

import sys
import warnings


class _AfterLoader:
    def __init__(self, spec, callback):
        self.spec, self.inner, self.callback = spec, spec.loader, callback

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.spec.loader = module.__loader__ = self.inner
        self.inner.exec_module(module)
        try:
            self.callback()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"l3plugin: patching {self.spec.name} after its import failed ({type(exc).__name__}: "
                          f"{exc})", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name):  # get_filename, get_resource_reader, ...: the inner loader's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Watcher:
    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        remove(self)
        for finder in list(sys.meta_path):
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterLoader(spec, self.callback)
                return spec
        return None


def after_import(name: str, callback) -> None:
    """``callback()`` now if ``name`` is imported, else right after it is (once; a second call for the same name
    and callback while waiting adds nothing)."""
    if name in sys.modules:
        callback()
        return
    if not any(isinstance(f, _Watcher) and f.name == name and f.callback == callback for f in sys.meta_path):
        sys.meta_path.insert(0, _Watcher(name, callback))


def remove(watcher) -> None:
    while watcher in sys.meta_path:
        sys.meta_path.remove(watcher)


def cancel(name: str) -> None:
    """Stop waiting for ``name`` (uninstall)."""
    for finder in [f for f in sys.meta_path if isinstance(f, _Watcher) and f.name == name]:
        remove(finder)
