"""Every change l3plugin makes to an upstream object (DeepSpeed, Megatron-Core, Megatron-LM, torch), declared
in one place: what is replaced, by which named function, why, and on which upstream versions it was checked.

Neither DeepSpeed nor Megatron has a plug-in interface for what l3plugin changes, so it sets attributes of
their classes and modules. Each such patch is one ``Patch`` row in one ``PatchSet`` below; the adapters call
``SET.apply()`` / ``SET.undo()`` and reach the replaced original through ``SET.stock(name)``. Before anything
is set, every target of the set is imported and checked: it exists and its parameters start with the ones the
replacement was written for. A mismatch raises ``PatchMismatch`` naming the target, what was found and the
upstream version imported, instead of a quiet misbehaviour after an upstream rename. ``l3plugin doctor``
(l3plugin/doctor.py) prints this table with each target's check against the imported versions.

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

Replacements are named by "module:function" strings: this module imports nothing of l3plugin and nothing
upstream until a set is applied or checked.
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

from l3plugin.versions import Imported, imported_version, version_in, version_range


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
      and the entry for the object ``key`` names. replacement: "module:function", a top-level function (or
      object); with ``wraps`` it is a factory called with the original and the attribute name, whose result is
      set. signature: the parameter names the original must start with (None: not checked). optional: a
      missing module or attribute (Megatron-LM beside megatron-core; a torch without that function) is
      skipped. loaded_only: patched only if the module was imported
      already (never imported for it). rebind: modules that imported the original by name get the
      replacement too. instance: ``attribute`` is replaced on single instances (``apply_to``), not the class.
      versions: the upstream versions this row is for ("<0.18", ">=0.18"; None: every version of the set's
      range); rows of other versions are neither applied nor checked.
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
    versions: str | None = None

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

    def apply_on(self, owner, attribute: str, factory: str, *args) -> None:
        """Also replace ``owner.attribute`` (an object known only at run time, e.g. a reference a library
        cached) by ``factory(original, *args)``; ``undo`` puts it back with the rest."""
        original = getattr(owner, attribute)
        self._extra.append((owner, attribute, original))
        setattr(owner, attribute, _resolve(factory)(original, *args))

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
        path = f"{function.__module__}:{function.__name__}"
        return next(p for p in self.rows() if p.instance and p.replacement == path)

    def apply_to(self, instance, function):
        """Replace the attribute of the ``instance`` patch whose replacement is ``function`` on this one
        instance (bound to it; once per instance). Returns what it replaced."""
        patch = self._instance_patch(function)
        self.check([patch])
        if not isinstance(instance, _resolve(patch.target)):
            raise TypeError(f"{patch.name} is patched on {patch.target} instances, got {type(instance).__name__}")
        saved = self._by_instance.setdefault(instance, {})
        if patch.replacement not in saved:
            saved[patch.replacement] = getattr(instance, patch.attribute)
            setattr(instance, patch.attribute, types.MethodType(function, instance))
        return saved[patch.replacement]

    def stock_of(self, instance, function):
        """What ``apply_to(instance, function)`` replaced."""
        return self._by_instance[instance][self._instance_patch(function).replacement]


def _replacement(patch: Patch, original):
    made = _resolve(patch.replacement)
    return made(original, patch.attribute) if patch.wraps else made


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


_ORIGINALS: dict = {}  # (id(owner), attribute or key) -> upstream's own value, while any set has replaced it
SETS: list[PatchSet] = []  # every declared set, in declaration order (``l3plugin doctor`` lists them)


# -- the declarations --------------------------------------------------------------------------------------
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_PIPE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_HOOKS = "l3plugin.deepspeed.engine"

# DeepSpeed: the latest patch of each minor release from 0.16 to 0.19 was run (compat/deepspeed.sh; docs/verified.md).
DEEPSPEED_CHECKED = ">=0.16.9,<0.20"

DEEPSPEED = PatchSet("l3plugin.deepspeed", "deepspeed", DEEPSPEED_CHECKED, [
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
          versions=">=0.18", why="the pipeline calls no post-backward epilogue on its first stages: end-of-backward "
          "reductions"),
    Patch(_PIPE, "_exec_backward_pass", f"{_HOOKS}:exec_backward_pass_with_prologue", signature=("self", "buffer_id"),
          versions="<0.18", why="before 0.18 the pipeline's first stages call neither the optimizer's backward "
          "prologue nor an epilogue: l3plugin's micro-batch start and end-of-backward reductions"),
    Patch(_ENGINE, "_backward_prologue_per_tensor", f"{_HOOKS}:backward_prologue_per_tensor",
          signature=("self", "grad"), versions=">=0.18,<0.19",
          why="0.18 divides the gradient the pipeline's earlier stages receive by the accumulation steps a second "
          "time (0.19's PipelineEngine does not): the last stage only"),
    # The pipeline schedule dispatches through a class-level table of functions, not attribute lookup.
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_reduce_tied_grads", key="deepspeed.runtime.pipe.schedule:ReduceTiedGrads",
          signature=("self",), why="the instruction table entry of _exec_reduce_tied_grads"),
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_backward_pass", key="deepspeed.runtime.pipe.schedule:BackwardPass",
          signature=("self", "buffer_id"), versions=">=0.18", why="the instruction table entry of _exec_backward_pass"),
    Patch(_PIPE, "_INSTRUCTION_MAP", f"{_HOOKS}:exec_backward_pass_with_prologue",
          key="deepspeed.runtime.pipe.schedule:BackwardPass", signature=("self", "buffer_id"), versions="<0.18",
          why="the instruction table entry of _exec_backward_pass"),
    Patch("deepspeed", "initialize", "l3plugin.huggingface.deepspeed_cp:initialize_with_key",
          signature=("args", "model"),
          rebind=True, why='"l3plugin": {"context_parallel_size": N}: DeepSpeed\'s sequence-parallel groups as mpu, '
          "batch size over DP only, a transformers model's attention swapped for the all-gather CP attention"),
    # Only when accelerate is imported already (the HF Trainer imports it before deepspeed).
    Patch("accelerate.accelerator", "prepare_data_loader", "l3plugin.huggingface.deepspeed_cp:prepare_data_loader",
          signature=("dataloader", "device", "num_processes", "process_index"), loaded_only=True,
          why="under context_parallel_size N, shard data over data-parallel ranks only: a CP group shares batches"),
])

# Megatron-Core releases every Megatron set was checked on (docs/verified.md; pyproject.toml says the same).
MEGATRON_CHECKED = ">=0.16.1,<0.20"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_INSTALL = "l3plugin.megatron.install"
_SELECTOR = "one selector answering the flexible schedule when it is selected and pp > 1"

AUTOLOAD = PatchSet("l3plugin_autoload", "deepspeed", DEEPSPEED_CHECKED, [
    Patch("deepspeed", "initialize", "l3plugin_autoload:initialize_after_install",
          why="deepspeed was imported while an l3plugin module was half-built: l3plugin.deepspeed is installed "
              "at the first deepspeed.initialize instead (then the stock function is put back)"),
])


def _selector_rows(versions: str, signature: tuple) -> list[Patch]:
    """The three names of Megatron's selector, for the versions whose selector takes ``signature``."""
    return [
        Patch("megatron.core.pipeline_parallel", "get_forward_backward_func", f"{_INSTALL}:get_forward_backward_func",
              signature=signature, versions=versions, why=_SELECTOR),
        Patch(_SCHEDULES, "get_forward_backward_func", f"{_INSTALL}:get_forward_backward_func",
              signature=signature, versions=versions, why=_SELECTOR),
        Patch("megatron.training.training", "get_forward_backward_func", f"{_INSTALL}:get_forward_backward_func",
              signature=signature, versions=versions, loaded_only=True,
              why="Megatron-LM's training loop imported the selector by name (a module global)"),
    ]


MEGATRON = PatchSet("l3plugin.megatron", "megatron-core", MEGATRON_CHECKED, [
    *_selector_rows("<0.19", ("pp_size", "vp_size")),
    # 0.19 adds schedule_pg_collection (Megatron-LM 0.19's loop passes it).
    *_selector_rows(">=0.19", ("pp_size", "vp_size", "schedule_pg_collection")),
    # What a selector bound before install() returns, read from these globals at call time.
    Patch(_SCHEDULES, "forward_backward_pipelining_with_interleaving", f"{_INSTALL}:guard", wraps=True,
          signature=("forward_step_func",),
          why="an early-bound stock selector still runs the flexible schedule while it is selected (warned)"),
    Patch(_SCHEDULES, "forward_backward_pipelining_without_interleaving", f"{_INSTALL}:guard", wraps=True,
          signature=("forward_step_func",),
          why="an early-bound stock selector still runs the flexible schedule while it is selected (warned)"),
])

MEGATRON_LM_ARGS = PatchSet("l3plugin.megatron (Megatron-LM arguments)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.training.initialize", "parse_args", f"{_INSTALL}:parse_args", optional=True,
          signature=("extra_args_provider",), versions="<0.18",
          why="Megatron-LM's parser accepts l3plugin's flags (chained onto the script's extra_args_provider) and "
              "the parsed CP arguments are checked (initialize_megatron calls it)"),
    Patch("megatron.training.arguments", "parse_args", f"{_INSTALL}:parse_args", optional=True,
          signature=("extra_args_provider",), versions=">=0.18",
          why="the same, where pretrain_gpt's parse_and_validate_args calls it (pretrain no longer parses)"),
])

_CP_ROUTE = "l3plugin.megatron.cp_route"
_ONLY_OURS = "; inert unless cp_comm_type l3plugin_all_gather is selected"
_BATCH_HOOKS = "l3plugin.megatron.batch_hooks"
_BOUNDARIES = ("the batch gains the document boundaries of the full sequence from EOD tokens on TP rank 0, sent over "
               "TP (--reset-attention-mask)" + _ONLY_OURS)

CP_ROUTE = PatchSet("l3plugin.megatron (CP from Megatron-LM's flags)", "megatron-core", MEGATRON_CHECKED, [
    Patch("megatron.core.transformer.attention:SelfAttention", "__init__", f"{_CP_ROUTE}:_self_attention_init",
          signature=("self", "config", "submodules", "layer_number", "attn_mask_type", "cp_comm_type"),
          why="a SelfAttention built with cp_comm_type l3plugin_all_gather gets l3plugin's CP core attention "
              "(whatever the layer spec)" + _ONLY_OURS),
    Patch("megatron.core.models.gpt.gpt_model:GPTModel", "__init__", f"{_CP_ROUTE}:_gpt_model_init",
          signature=("self", "config", "transformer_layer_spec"),
          why="with the balanced CP layout, the model's RoPE follows it" + _ONLY_OURS),
    # Up to 0.17: Megatron-LM's get_batch_on_this_tp_rank (megatron.training.utils) and Megatron-Core's THD
    # sharding, which pretrain_gpt calls with the boundaries and which returns the PackedSeqParams.
    Patch("megatron.core.utils", "get_thd_batch_on_this_cp_rank", f"{_CP_ROUTE}:packed_batch_on_this_cp_rank",
          signature=("batch", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "cp_size", "cp_rank"), rebind=True,
          versions="<0.18",
          why="packed batches sharded by l3plugin's CP layout, PackedSeqParams in sbhd with the global document "
              "boundaries" + _ONLY_OURS),
    Patch("megatron.training.utils", "get_batch_on_this_tp_rank", f"{_CP_ROUTE}:tp_batch_with_documents",
          signature=("data_iterator",), rebind=True, optional=True, versions="<0.18",
          why="Megatron-LM's batch gains the document boundaries from EOD tokens (--reset-attention-mask)"
              + _ONLY_OURS),
    # From 0.18: both batch functions live in megatron.core.utils (THD sharding is gone, NVIDIA/Megatron-LM
    # PR 4103) and pretrain_gpt's forward_step builds a "thd" PackedSeqParams itself (batch_hooks.py).
    Patch("megatron.core.utils", "get_batch_on_this_tp_rank", f"{_BATCH_HOOKS}:tp_batch_with_documents",
          signature=("batch", "is_sft", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank"),
          rebind=True, versions=">=0.18,<0.19", why=_BOUNDARIES),
    Patch("megatron.core.utils", "get_batch_on_this_tp_rank", f"{_BATCH_HOOKS}:tp_batch_with_documents",
          signature=("batch", "has_cu_seqlens", "is_hybrid_cp", "create_attention_mask_in_dataloader",
                     "broadcast_src_rank", "broadcast_group", "cp_size", "tp_rank"),
          rebind=True, versions=">=0.19", why=_BOUNDARIES),
    Patch("megatron.core.utils", "get_batch_on_this_cp_rank", f"{_BATCH_HOOKS}:cp_batch_by_layout",
          signature=("batch", "is_hybrid_cp", "cp_group"), rebind=True, versions=">=0.18",
          why="the batch sharded by l3plugin's CP layout, the document boundaries left global" + _ONLY_OURS),
    Patch("megatron.core.models.gpt.gpt_model:GPTModel", "forward", f"{_BATCH_HOOKS}:gpt_model_forward",
          signature=("self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                     "inference_context", "packed_seq_params"), versions=">=0.18",
          why="pretrain_gpt's PackedSeqParams (qkv_format thd, built from those boundaries) given as sbhd: every "
              "token keeps its global position" + _ONLY_OURS),
])

_ROPE = "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding"

ROPE = PatchSet("l3plugin.megatron (RoPE)", "megatron-core", MEGATRON_CHECKED, [
    Patch(_ROPE, "forward", "l3plugin.megatron.model:rope_on_cpu", instance=True,
          signature=("self", "max_seq_len", "offset", "packed_seq", "cp_group"),
          why="on a CPU-only machine RotaryEmbedding moves its frequencies to the CUDA device and indexes with a "
              "pinned CUDA tensor; the same result computed where inv_freq is"),
    Patch(_ROPE, "forward", "l3plugin.megatron.attention:rope_of_held_positions", instance=True,
          signature=("self", "max_seq_len", "offset", "packed_seq", "cp_group"),
          why="with a CP layout other than the paper's 2cp chunks, each rank's RoPE must follow the positions it "
              "holds (rope_follows_cp_layout)"),
])

# The torch.distributed functions record_collectives / local_collectives route through one wrapper each
# (op specs in l3plugin/debug/patching.py, OPS; tests/debug check both name the same functions).
COLLECTIVE_OPS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                  "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
                  "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier",
                  "send", "recv", "isend", "irecv", "batch_isend_irecv")

COLLECTIVES = PatchSet("l3plugin.debug (record_collectives, local_collectives)", "torch", ">=2.13", [
    Patch(module, op, "l3plugin.debug.patching:collective_wrapper", wraps=True, optional=True,
          why="while a recorder or the local stand-ins are active, each call goes to them (Megatron-Core and "
              "DeepSpeed call these functions through both modules)")
    for module in ("torch.distributed", "torch.distributed.distributed_c10d") for op in COLLECTIVE_OPS])

# -- tied embeddings on a CPU-only machine (l3plugin/megatron/model.py builds GPTModel inside TIED_EMBEDDINGS.within())
_LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module:LanguageModule"

TIED_EMBEDDINGS = PatchSet("l3plugin.megatron (tied embeddings on CPU)", "megatron-core", MEGATRON_CHECKED, [
    Patch(_LANGUAGE_MODULE, "setup_embeddings_and_output_layer", "l3plugin.megatron.model:tied_embeddings_on_cpu",
          wraps=True, signature=("self",),
          why="with tied embeddings at pp > 1 the copy of the first stage's embedding into the last stage moves the "
              "weight to the CUDA device first; on a CPU-only machine the same all-reduce where the weight is"),
])
