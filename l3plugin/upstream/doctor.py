"""``l3plugin doctor``: every declared patch set (collected by l3plugin/upstream/patches.py from the adapters)
against the upstream versions imported: per set the version and where it was imported from, the range checked and the
variant in use; per row its target, replacement, status and why. Then every upstream private name l3plugin
reads (``PrivateState``): present, or missing with what breaks. Last, the CP attention kernel that
kernel="auto" uses here and the GPU kernels it looked for."""

from __future__ import annotations

import os
import sys
import warnings

from l3plugin.upstream import patches
from l3plugin.cp import kernels
from l3plugin.upstream.patches import UNCHECKED_ENV, Patch, PatchSet, PrivateState
from l3plugin.upstream.versions import installed_version


def status(patch: Patch) -> str:
    """One patch checked against what is imported: "ok", "skipped: ..." or "MISMATCH: ..."."""
    module_name = patch.target.partition(":")[0]
    if patch.loaded_only and module_name not in sys.modules:
        return "ok (patched only once its module is imported)"
    problem = patch.problem()
    if problem is not None:
        return f"MISMATCH: {problem}"
    if patch.optional and patch.holder() is None:
        return "skipped: not installed"
    return "ok"


def private_status(state: PrivateState) -> str:
    """One private upstream name checked against what is imported: "ok; <why>", "skipped: ...; <why>" or
    "MISMATCH: <what is missing>; what breaks: <why>"."""
    try:
        problem = state.problem()
    except ImportError as exc:  # the reader finds no such module either: nothing to read
        return f"skipped: {state.target.partition(':')[0]} is not importable ({exc}); {state.why}"
    return f"ok; {state.why}" if problem is None else f"MISMATCH: {problem}; what breaks: {state.why}"


def set_header(patch_set: PatchSet) -> str:
    """The set's name, the version imported (and from where) against the range checked, and the variant."""
    found, in_range = patch_set.imported(), patch_set.in_range()
    verdict = {True: "in range", False: "OUT OF RANGE", None: "rows not checked"}[in_range]
    text = (f"{patch_set.name}: {patch_set.module} {found}; checked on {patch_set.package} {patch_set.checked} "
            f"({verdict}); variant: {patch_set.variant()}")
    pip_says = installed_version(patch_set.package)
    if found.version and pip_says not in ("not installed", found.version):
        text += f"\n  (pip's metadata says {patch_set.package} {pip_says}: another copy is imported first)"
    return text


def attention_kernels() -> str:
    """Which CP attention kernel kernel="auto" picks here, for bf16 on CUDA and on CPU, and the GPU kernels found."""
    import torch

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    found = {"flash-attn": kernels._flash_varlen(), "torch varlen_attn": kernels._torch_varlen(),
             "Transformer Engine": kernels._te_attention_class()}
    where = (f"this machine's {torch.cuda.get_device_name()} (sm{capability[0]}{capability[1]})" if capability
             else "a CUDA GPU (none here)")
    return (f"CP attention kernel 'auto': bf16 on {where} -> {kernels.auto_kernel('cuda', torch.bfloat16, capability)}"
            f"; on CPU -> {kernels.auto_kernel('cpu', torch.bfloat16)}\n      GPU kernels: "
            + ", ".join(f"{name} {'installed' if fn is not None else 'absent'}" for name, fn in found.items())
            + f" (torch {torch.__version__})")


def doctor(out=None) -> int:
    """Print every patch set: the upstream version imported (and from where) against the range checked, the
    variant in use, each row's target, replacement (who patches), status and why; then every private upstream
    name read. Returns 1 if a version is out of range, any target does not check out or a private name is
    missing."""
    out = out or sys.stdout
    bad = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # import-time warnings of the frameworks are not ours to show
        sets, private, failed = patches.declared()
        for module, error in failed.items():
            bad += 1
            print(f"{module}: MISMATCH: cannot be imported ({error}); its patch sets are not listed", file=out)
        for patch_set in sets:
            print(set_header(patch_set), file=out)
            out_of_range = patch_set.in_range() is False and os.environ.get(UNCHECKED_ENV, "") in ("", "0")
            if out_of_range:
                bad += 1
                print(f"  {patch_set.out_of_range_message()}", file=out)
            for patch in patch_set.patches:
                scope = f"  [for {patch.versions}]" if patch.versions else ""
                if out_of_range:
                    state = "not checked (version out of range)"
                elif patch_set.in_range() is None:
                    state = f"not checked ({patch_set.module} is not importable)"
                elif not patch_set.uses(patch):
                    state = f"not used with {patch_set.module} {patch_set.imported().version or '(none)'}"
                else:
                    state = status(patch)
                    bad += state.startswith("MISMATCH")
                print(f"  {patch.name}  ->  {patch.replacement_name}{'  (per instance)' if patch.instance else ''}"
                      f"{scope}\n      {state}; {patch.why}", file=out)
        print("upstream private state l3plugin reads:", file=out)
        for state in private:
            found = private_status(state)
            bad += found.startswith("MISMATCH")
            print(f"  {state.label}\n      {found}", file=out)
    print(attention_kernels(), file=out)
    print(f"{sum(len(s.patches) for s in sets)} patches in {len(sets)} sets, {len(private)} private names read; "
          + (f"{bad} problems with the imported versions" if bad else "every target checks out"), file=out)
    return 1 if bad else 0


def add_doctor_parser(sub) -> None:
    doctor_parser = sub.add_parser("doctor", help="list every upstream patch and private name read, and check them "
                                   "against the installed DeepSpeed / Megatron-Core / accelerate / torch",
                                   description=__doc__.split("\n\n")[0])
    doctor_parser.set_defaults(func=lambda _args: doctor())
