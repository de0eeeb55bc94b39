"""Every change l3plugin makes to an upstream object (DeepSpeed, Megatron-Core, Megatron-LM, torch), declared
in one place: what is replaced, by which named function, why, and against which upstream version it was checked.

Neither DeepSpeed nor Megatron has a plug-in interface for what l3plugin changes, so it sets attributes of
their classes and modules. Each such patch is one ``Patch`` row in one ``PatchSet`` below; the adapters call
``SET.apply()`` / ``SET.undo()`` and reach the replaced original through ``SET.stock(name)``. Before anything
is set, every target of the set is imported and checked: it exists and its parameters start with the ones the
replacement was written for. A mismatch raises ``PatchMismatch`` naming the target, what was found and the
upstream version installed, instead of a quiet misbehaviour after an upstream rename. ``l3plugin doctor``
prints this table with each target's check against the installed versions.

Replacements are named by "module:function" strings: this module imports nothing of l3plugin and nothing
upstream until a set is applied or checked.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import weakref
from dataclasses import dataclass


class PatchMismatch(RuntimeError):
    """An upstream target is missing or has another signature than the one l3plugin was checked against."""


def _resolve(path: str):
    """The object a "module:Attr.attr" path names ("module" alone: the module)."""
    module_name, _, attrs = path.partition(":")
    obj = importlib.import_module(module_name)
    for name in filter(None, attrs.split(".")):
        obj = getattr(obj, name)
    return obj


def installed_version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclass(frozen=True)
class Patch:
    """One upstream attribute l3plugin replaces.

    target: "module:Class" (or "module") that holds ``attribute``; with ``key``, the dict ``attribute`` holds
      and the entry for the object ``key`` names. replacement: "module:function", a top-level function (or
      object); with ``wraps`` it is a factory called with the original, whose result is set. signature: the
      parameter names the original must start with (None: not checked). optional: a missing target module
      (Megatron-LM beside megatron-core) is skipped. loaded_only: patched only if the module was imported
      already (never imported for it). rebind: modules that imported the original by name get the
      replacement too. instance: ``attribute`` is replaced on single instances (``apply_to``), not the class.
    """

    target: str
    attribute: str
    replacement: str
    why: str
    signature: tuple | None = None
    key: str | None = None
    wraps: bool = False
    optional: bool = False
    loaded_only: bool = False
    rebind: bool = False
    instance: bool = False

    @property
    def name(self) -> str:
        owner = self.target.partition(":")[2] or self.target
        return f"{owner}.{self.attribute}" + (f"[{self.key.rpartition(':')[2]}]" if self.key else "")

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
        try:
            params = tuple(inspect.signature(current).parameters)
        except (TypeError, ValueError):
            return None
        if params[:len(self.signature)] != tuple(self.signature):
            return f"{self.name} takes ({', '.join(params)}); l3plugin expects ({', '.join(self.signature)}, ...)"
        return None


class PatchSet:
    """Patches applied and undone together, against one upstream package."""

    def __init__(self, name: str, package: str, checked: str, patches: list[Patch]):
        self.name, self.package, self.checked, self.patches = name, package, checked, list(patches)
        self._stock: dict[str, object] = {}  # patch name -> the original, while applied
        self._by_instance = weakref.WeakKeyDictionary()  # instance -> {patch name: original}
        SETS.append(self)

    def __repr__(self):
        return f"PatchSet({self.name!r}, {len(self.patches)} patches, applied={self.applied})"

    @property
    def applied(self) -> bool:
        return bool(self._stock)

    def check(self, patches=None) -> None:
        """Raise PatchMismatch listing every target that does not check out (nothing is changed)."""
        problems = [p for p in (self.patches if patches is None else patches) if p.problem() is not None]
        if problems:
            found = installed_version(self.package)
            raise PatchMismatch(
                f"l3plugin ({self.name}) cannot patch {self.package} {found}: "
                + "; ".join(p.problem() for p in problems)
                + f". It was checked against {self.package} {self.checked}; use that version or report this.")

    def apply(self) -> None:
        """Check every target, then set every replacement (idempotent)."""
        if self.applied:
            return
        todo = [p for p in self.patches if not p.instance]
        self.check(todo)
        for patch in todo:
            found = patch.holder()
            if found is None:
                continue
            owner, attribute = found
            original = owner[attribute] if patch.key is not None else getattr(owner, attribute)
            self._stock[patch.name] = original
            _set(owner, attribute, _replacement(patch, original), patch.key is not None)
            if patch.rebind:
                _rebind(attribute, original, _current(owner, attribute, patch))

    def undo(self) -> None:
        """Put every original back (modules rebound by name too)."""
        for patch in reversed(self.patches):
            if patch.name not in self._stock:
                continue
            owner, attribute = patch.holder()
            original = self._stock.pop(patch.name)
            if patch.rebind:
                _rebind(attribute, _current(owner, attribute, patch), original)
            _set(owner, attribute, original, patch.key is not None)
        self._stock.clear()

    def stock(self, name: str):
        """The original that patch ``name`` (as ``Patch.name``) replaced."""
        return self._stock[name]

    def apply_to(self, instance, attribute: str):
        """Replace ``attribute`` on this one instance (an ``instance`` patch); returns the original."""
        patch = next(p for p in self.patches if p.instance and p.attribute == attribute)
        self.check([patch])
        if not isinstance(instance, _resolve(patch.target)):
            raise TypeError(f"{patch.name} is patched on {patch.target} instances, got {type(instance).__name__}")
        saved = self._by_instance.setdefault(instance, {})
        if patch.name not in saved:
            saved[patch.name] = getattr(instance, attribute)
            setattr(instance, attribute, types.MethodType(_resolve(patch.replacement), instance))
        return saved[patch.name]

    def stock_of(self, instance, attribute: str):
        """What ``apply_to`` replaced on ``instance``."""
        patch = next(p for p in self.patches if p.instance and p.attribute == attribute)
        return self._by_instance[instance][patch.name]


def _replacement(patch: Patch, original):
    made = _resolve(patch.replacement)
    return made(original) if patch.wraps else made


def _set(owner, attribute, value, is_key: bool) -> None:
    if is_key:
        owner[attribute] = value
    else:
        setattr(owner, attribute, value)


def _current(owner, attribute, patch: Patch):
    return owner[attribute] if patch.key is not None else getattr(owner, attribute)


def _rebind(attribute: str, old, new) -> None:
    """Modules that imported ``old`` by name (``from x import f`` before the patch) get ``new``."""
    for module in list(sys.modules.values()):
        try:
            if module is not None and vars(module).get(attribute) is old:
                setattr(module, attribute, new)
        except TypeError:  # modules without __dict__
            continue


SETS: list[PatchSet] = []  # every declared set, in declaration order (``l3plugin doctor`` lists them)


# -- the declarations --------------------------------------------------------------------------------------
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_PIPE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_HOOKS = "l3plugin.deepspeed.engine"

DEEPSPEED = PatchSet("l3plugin.deepspeed", "deepspeed", "0.19.8", [
    # Each replacement falls through to the original unless the config has "l3plugin": {"fp32_reduce_zero": true}.
    Patch(_ENGINE, "_do_sanity_check", f"{_HOOKS}:do_sanity_check", signature=("self",),
          why="check the l3plugin options first, so their message wins over DeepSpeed's generic ones"),
    Patch(_ENGINE, "_do_optimizer_sanity_check", f"{_HOOKS}:do_optimizer_sanity_check",
          signature=("self", "basic_optimizer"),
          why="route to _configure_zero_optimizer, also where stock would pick BF16_Optimizer"),
    Patch(_ENGINE, "_configure_zero_optimizer", f"{_HOOKS}:configure_zero_optimizer", signature=("self", "optimizer"),
          why="build l3plugin's FP32-reducing ZeRO-1/2 optimizer on DeepSpeed's seq_data_parallel_group"),
    Patch(_ENGINE, "_load_zero_checkpoint", f"{_HOOKS}:load_zero_checkpoint",
          signature=("self", "load_dir", "tag", "load_optimizer_states"),
          why="apply the partitions load_checkpoint read and verified (ours, stock's at any DP size, universal)"),
    Patch(_ENGINE, "save_checkpoint", f"{_HOOKS}:save_checkpoint",
          signature=("self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters"),
          why="crash-consistent saves: temporary names, manifests, 'latest' moved after every rank agreed"),
    Patch(_ENGINE, "load_checkpoint", f"{_HOOKS}:load_checkpoint",
          signature=("self", "load_dir", "tag", "load_module_strict", "load_optimizer_states",
                     "load_lr_scheduler_states", "load_module_only", "custom_load_fn"),
          why="verify the tag and the partitions on every rank and agree before stock touches anything"),
    Patch(_ENGINE, "zero_optimization_stage", f"{_HOOKS}:zero_optimization_stage", signature=("self",),
          why="PipelineEngine.__init__ asserts stage < 2 for DeepSpeed's optimizer; ours supports stage 2"),
    Patch(_PIPE, "__init__", f"{_HOOKS}:pipeline_engine_init", signature=("self",),
          why="end the stage-2 disguise of zero_optimization_stage once PipelineEngine's assert has passed"),
    Patch(_PIPE, "_exec_reduce_tied_grads", f"{_HOOKS}:exec_reduce_tied_grads", signature=("self",),
          why="tied weights' gradients live in l3plugin's fp32 buckets, not in weight.grad"),
    Patch(_PIPE, "_exec_backward_pass", f"{_HOOKS}:exec_backward_pass", signature=("self", "buffer_id"),
          why="the pipeline calls no post-backward epilogue on its first stages: end-of-backward reductions"),
    # The pipeline schedule dispatches through a class-level table of functions, not attribute lookup.
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_reduce_tied_grads", key="deepspeed.runtime.pipe.schedule:ReduceTiedGrads",
          signature=("self",), why="the instruction table entry of _exec_reduce_tied_grads"),
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_backward_pass", key="deepspeed.runtime.pipe.schedule:BackwardPass",
          signature=("self", "buffer_id"), why="the instruction table entry of _exec_backward_pass"),
])
