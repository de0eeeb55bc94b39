"""How l3plugin patches upstream objects: ``Patch`` rows, ``PatchSet`` (check, apply, undo, stock), the version
gate, and ``PrivateState`` (an upstream private name l3plugin reads).

Neither DeepSpeed nor Megatron has a plug-in interface for what l3plugin changes, so it sets attributes of
their classes and modules. Each such patch is one ``Patch`` row in one ``PatchSet``; the adapters call
``SET.apply()`` / ``SET.undo()`` and reach the replaced original through ``SET.stock(name)``. Before anything
is set, every target of the set is imported and checked: it exists and its parameters start with the ones the
replacement was written for. A mismatch raises ``PatchMismatch`` naming the target, what was found and the
upstream version imported, instead of a quiet misbehaviour after an upstream rename. ``l3plugin doctor``
(l3plugin/upstream/doctor.py) prints every set with each target's check against the imported versions, and every
declared ``PrivateState`` as present or missing.

Where patches are declared. Each adapter declares its sets in the module that defines their replacements,
below those functions, and names each replacement by the function object itself; targets stay "module:Attr"
strings, so a declaration imports nothing upstream. Start-up stays light because nothing imports an adapter
before it is used and the adapters import no framework at module level: megatron/install.py, cp_route.py,
batch_hooks.py, attention.py, demo/model.py and debug/patching.py import DeepSpeed, Megatron, transformers and
accelerate only inside functions (tests/test_patches.py checks it in a fresh interpreter); deepspeed/engine.py
and sequence_parallel.py are imported only with deepspeed (importing l3plugin.deepspeed is the install, which
the autoload does once ``import deepspeed`` has finished); l3plugin_autoload, which runs at
every interpreter start and imports nothing of l3plugin there, builds its one set when first needed.
l3plugin/upstream/patches.py is only the registry: which modules declare sets, imported by ``l3plugin doctor``
to list them (and nothing else); the ranges the sets are checked on are l3plugin/upstream/versions.py's. A
private upstream name an adapter reads is a ``PrivateState`` declared beside its reader; doctor checks it is still there.

Versions. A set names the module whose ``__version__`` it reads (``module``, by default the package name with
"-" as ".": "megatron-core" -> ``megatron.core``) and declares the versions it was checked on (``checked``, a
pip-style range such as ">=0.16.1,<0.20", or one version "0.19.8" meaning exactly that one). The version is
read once per process from the IMPORTED module (a Megatron-LM checkout first on PYTHONPATH wins over pip's
megatron-core, whose metadata may say something else). A version outside the range is refused with one
``VersionOutOfRange`` naming the version, where it was imported from and the range, before any row is checked
(``L3PLUGIN_UNCHECKED_VERSIONS=1`` turns that into a warning; every row is then still checked). A row that
holds only for some versions says so (``versions="<0.18"``; another row with ``versions=">=0.18"`` gives
the other target or signature): rows whose ``versions`` exclude the imported version are not applied or
checked. Rows may share a ``name`` when they are variants of one patch, so ``stock(name)`` works on every
version. ``variant()`` names the rows in use; ``l3plugin doctor`` prints it per set with the version and path.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import types
import warnings
import weakref
from dataclasses import dataclass

from l3plugin.upstream.versions import Imported, imported_version, version_in, version_range


class PatchMismatch(RuntimeError):
    """An upstream target is missing or has another signature than the one l3plugin was checked against."""


class VersionOutOfRange(PatchMismatch):
    """The imported upstream version is outside the range a patch set was checked on."""


UNCHECKED_ENV = "L3PLUGIN_UNCHECKED_VERSIONS"  # "1": an out-of-range version warns instead of raising


def _resolve(path: str):
    """The object a "module:Attr.attr" path names ("module" alone: the module)."""
    module_name, _, attrs = path.partition(":")
    obj = importlib.import_module(module_name)
    for name in filter(None, attrs.split(".")):
        obj = getattr(obj, name)
    return obj


@dataclass(frozen=True)
class Patch:
    """One upstream attribute l3plugin replaces.

    target: "module:Class" (or "module") that holds ``attribute``; with ``key``, the dict ``attribute`` holds
      and the entry for the object ``key`` names. replacement: the function (or object) to set; with ``wraps``
      a factory called with the original and the attribute name, whose result is set. A "module:attr" string
      instead is resolved when the row is applied (for a value that is itself upstream's). signature: the
      parameter names the original must start with (None: not checked). optional: a missing module or
      attribute (Megatron-LM beside megatron-core; a torch without that function) is skipped. loaded_only:
      patched only if the module was imported already (never imported for it). rebind: modules that imported the original by name get the
      replacement too. instance: ``attribute`` is replaced on single instances (``apply_to``), not the class.
      versions: the upstream versions this row is for ("<0.18", ">=0.18"; None: every version of the set's
      range); rows of other versions are neither applied nor checked.
    """

    target: str
    attribute: str
    replacement: object
    why: str
    signature: tuple | None = None
    key: str | None = None
    wraps: bool = False
    optional: bool = False
    loaded_only: bool = False
    rebind: bool = False
    instance: bool = False
    versions: str | None = None

    @property
    def name(self) -> str:
        owner = self.target.partition(":")[2] or self.target
        return f"{owner}.{self.attribute}" + (f"[{self.key.rpartition(':')[2]}]" if self.key else "")

    @property
    def replacement_name(self) -> str:
        """"module:function" of the replacement (who patches), as ``l3plugin doctor`` prints it."""
        return self.replacement if isinstance(self.replacement, str) else _path_of(self.replacement)

    def holder(self):
        """(object to set on, key or attribute name), or None when the target may be and is absent."""
        module_name = self.target.partition(":")[0]
        if self.loaded_only and module_name not in sys.modules:
            return None
        try:
            owner = _resolve(self.target)
        except ImportError:
            if self.optional:
                return None
            raise
        if self.key is not None:
            return getattr(owner, self.attribute), _resolve(self.key)
        if self.optional and getattr(owner, self.attribute, None) is None:
            return None  # (None: how DeepSpeed says "this torch has no such function")
        return owner, self.attribute

    def problem(self) -> str | None:
        """Why this patch cannot be applied to the installed upstream (None: it can)."""
        try:
            found = self.holder()
        except (ImportError, AttributeError) as exc:
            return f"{self.target} cannot be imported ({type(exc).__name__}: {exc})"
        if found is None:
            return None
        owner, attribute = found
        present = attribute in owner if self.key is not None else hasattr(owner, attribute)
        if not present:
            return f"{self.name} does not exist"
        if self.signature is None:
            return None
        current = owner[attribute] if self.key is not None else getattr(owner, attribute)
        current = _ORIGINALS.get((id(owner), attribute), current)  # check upstream's, not a patch's
        try:
            params = tuple(inspect.signature(current).parameters)
        except (TypeError, ValueError):
            return None
        if params[:len(self.signature)] != tuple(self.signature):
            return f"{self.name} takes ({', '.join(params)}); l3plugin expects ({', '.join(self.signature)}, ...)"
        return None


class PatchSet:
    """Patches applied and undone together, against one upstream package, checked on the versions ``checked``
    (a pip-style range or one version) of the module ``module`` (default: ``package`` with "-" as ".")."""

    def __init__(self, name: str, package: str, checked: str, patches: list[Patch], module: str | None = None):
        self.name, self.package, self.checked, self.patches = name, package, checked, list(patches)
        self.module = module or package.replace("-", ".")
        for versions in [checked] + [p.versions for p in self.patches if p.versions is not None]:
            version_range(versions)  # a typo fails at declaration, not at the first apply
        self._stock: dict[str, object] = {}  # patch name -> the original, while applied
        self._applied: list[Patch] = []  # the rows whose originals are in _stock, in order
        self._extra: list = []  # (owner, attribute, original) set by apply_on
        self._by_instance = weakref.WeakKeyDictionary()  # instance -> {replacement: original}
        SETS.append(self)

    def __repr__(self):
        return f"PatchSet({self.name!r}, {len(self.patches)} patches, applied={self.applied})"

    @property
    def applied(self) -> bool:
        return bool(self._stock)

    def imported(self) -> Imported:
        return imported_version(self.module)

    def in_range(self) -> bool | None:
        """Whether the imported version is in ``checked`` (None: the module cannot be imported)."""
        found = self.imported()
        return version_in(found.version, self.checked) if found.version else None

    def out_of_range_message(self) -> str:
        found = self.imported()
        return (f"l3plugin ({self.name}) was checked on {self.package} {self.checked}, but {self.module} "
                f"{found.version} is imported (from {found.path}). Use a version in that range, or set "
                f"{UNCHECKED_ENV}=1 to try this one anyway (every patch target is still checked)")

    def check_version(self) -> None:
        """Raise VersionOutOfRange (one message for the whole set) if the imported version is outside
        ``checked``; with L3PLUGIN_UNCHECKED_VERSIONS=1 warn instead."""
        if self.in_range() is not False:
            return
        if os.environ.get(UNCHECKED_ENV, "") not in ("", "0"):
            warnings.warn(self.out_of_range_message().split(". Use")[0] + f"; trying anyway ({UNCHECKED_ENV})",
                          UserWarning, stacklevel=3)
            return
        raise VersionOutOfRange(self.out_of_range_message())

    def uses(self, patch: Patch) -> bool:
        """Whether ``patch`` is a row for the imported version (a row without ``versions`` always is; a
        version-specific row is not when the version cannot be read)."""
        if patch.versions is None:
            return True
        found = self.imported()
        return bool(found.version) and version_in(found.version, patch.versions)

    def rows(self) -> list[Patch]:
        """The rows for the imported version."""
        return [p for p in self.patches if self.uses(p)]

    def variant(self) -> str:
        """Which version-specific rows are in use: "for <0.18" etc., "every row" when none is specific."""
        specific = list(dict.fromkeys(p.versions for p in self.rows() if p.versions is not None))
        if self.patches and not self.rows():
            return "no row for this version"
        return "rows for " + "; ".join(specific) if specific else "every row"

    def check(self, patches=None) -> None:
        """Raise VersionOutOfRange for a version outside ``checked``, else PatchMismatch listing every row
        for the imported version that does not check out (nothing is changed)."""
        self.check_version()
        problems = [p for p in (self.patches if patches is None else patches) if self.uses(p)
                    and p.problem() is not None]
        if problems:
            raise PatchMismatch(
                f"l3plugin ({self.name}) cannot patch {self.module} {self.imported()}: "
                + "; ".join(p.problem() for p in problems)
                + f". It was checked on {self.package} {self.checked}; use such a version or report this.")

    def apply(self, which=None) -> None:
        """Check every row for the imported version not patched yet (of those ``which(patch)`` selects), then
        set their replacements. Idempotent; a later call also patches ``loaded_only`` / ``optional`` targets
        whose module has been imported since."""
        todo = [p for p in self.rows() if not p.instance and p.name not in self._stock
                and (which is None or which(p))]
        self.check(todo)
        for patch in todo:
            found = patch.holder()
            if found is None:
                continue
            owner, attribute = found
            original = _current(owner, attribute, patch)
            self._stock[patch.name] = original
            self._applied.append(patch)
            _ORIGINALS.setdefault((id(owner), attribute), original)
            _set(owner, attribute, _replacement(patch, original), patch.key is not None)
            if patch.rebind:
                _rebind(attribute, original, _current(owner, attribute, patch))

    def apply_on(self, owner, attribute: str, factory, *args) -> None:
        """Also replace ``owner.attribute`` (an object known only at run time, e.g. a reference a library
        cached) by ``factory(original, *args)``; ``undo`` puts it back with the rest."""
        original = getattr(owner, attribute)
        self._extra.append((owner, attribute, original))
        setattr(owner, attribute, factory(original, *args))

    def undo(self) -> None:
        """Put every original back (modules rebound by name too)."""
        while self._extra:
            owner, attribute, original = self._extra.pop()
            setattr(owner, attribute, original)
        while self._applied:
            patch = self._applied.pop()
            owner, attribute = patch.holder()
            original = self._stock.pop(patch.name)
            if patch.rebind:
                _rebind(attribute, _current(owner, attribute, patch), original)
            _set(owner, attribute, original, patch.key is not None)
            if _ORIGINALS.get((id(owner), attribute)) is original:
                del _ORIGINALS[(id(owner), attribute)]
        self._stock.clear()

    @contextlib.contextmanager
    def within(self):
        """Applied inside the block only (left as it was if the set was applied already)."""
        if self.applied:
            yield
            return
        self.apply()
        try:
            yield
        finally:
            self.undo()

    def stock(self, name: str):
        """The original that patch ``name`` (as ``Patch.name``) replaced."""
        return self._stock[name]

    def _instance_patch(self, function) -> Patch:
        path = _path_of(function)
        return next(p for p in self.rows() if p.instance and p.replacement_name == path)

    def apply_to(self, instance, function):
        """Replace the attribute of the ``instance`` patch whose replacement is ``function`` on this one
        instance (bound to it; once per instance). Returns what it replaced."""
        patch = self._instance_patch(function)
        self.check([patch])
        if not isinstance(instance, _resolve(patch.target)):
            raise TypeError(f"{patch.name} is patched on {patch.target} instances, got {type(instance).__name__}")
        saved = self._by_instance.setdefault(instance, {})
        if patch.replacement_name not in saved:
            saved[patch.replacement_name] = getattr(instance, patch.attribute)
            setattr(instance, patch.attribute, types.MethodType(function, instance))
        return saved[patch.replacement_name]

    def stock_of(self, instance, function):
        """What ``apply_to(instance, function)`` replaced."""
        return self._by_instance[instance][self._instance_patch(function).replacement_name]


def _replacement(patch: Patch, original):
    made = _resolve(patch.replacement) if isinstance(patch.replacement, str) else patch.replacement
    return made(original, patch.attribute) if patch.wraps else made


def _path_of(obj) -> str:
    return f"{obj.__module__}:{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}"


def _set(owner, attribute, value, is_key: bool) -> None:
    if is_key:
        owner[attribute] = value
    else:
        setattr(owner, attribute, value)


def _current(owner, attribute, patch: Patch):
    return owner[attribute] if patch.key is not None else getattr(owner, attribute)


def _rebind(attribute: str, old, new) -> None:
    """Modules that imported ``old`` by name (``from x import f`` before the patch) get ``new``. The module that
    defines ``old`` keeps it: there the name is its definition, not an import (a replacement named like the
    attribute it replaces must survive undo)."""
    home = getattr(old, "__module__", None)
    for module in list(sys.modules.values()):
        try:
            if module is not None and module.__name__ != home and vars(module).get(attribute) is old:
                setattr(module, attribute, new)
        except TypeError:  # modules without __dict__
            continue


@dataclass(frozen=True)
class PrivateState:
    """A private name of an upstream module or class that l3plugin reads (no public API gives it), declared
    beside its reader so ``l3plugin doctor`` says whether the imported version still has it.

    target: "module" or "module:Class" holding ``name``. why: what l3plugin reads it for, and what breaks
    without it. probe: for a name set on instances only, a function returning such an instance. version_of:
    the module whose version a report names (default: the target's top-level package)."""

    target: str
    name: str
    why: str
    probe: object = None
    version_of: str | None = None

    def __post_init__(self):
        PRIVATE_STATE.append(self)

    @property
    def label(self) -> str:
        return f"{self.target.replace(':', '.')}.{self.name}"

    def problem(self) -> str | None:
        """None when the imported upstream has the name, else what is missing and in which version. Raises
        ImportError when the target's module is not installed (then there is nothing to read)."""
        versioned = self.version_of or self.target.partition(":")[0].split(".")[0]
        try:
            owner = self.probe() if self.probe is not None else _resolve(self.target)
            missing = None if hasattr(owner, self.name) else f"{self.label} does not exist"
        except ImportError:
            raise
        except Exception as exc:  # noqa: BLE001 - a class gone, or a probe that fails, is the finding
            missing = f"{self.target} cannot be read ({type(exc).__name__}: {exc})"
        return None if missing is None else f"{missing} in {versioned} {imported_version(versioned)}"


_ORIGINALS: dict = {}  # (id(owner), attribute or key) -> upstream's own value, while any set has replaced it
SETS: list[PatchSet] = []  # every declared set, in declaration order (``l3plugin doctor`` lists them)
PRIVATE_STATE: list[PrivateState] = []  # every declared private upstream name, likewise
