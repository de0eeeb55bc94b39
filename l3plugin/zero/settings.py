"""The FP32-reducing ZeRO optimizer's settings: the one place its options are defined and checked.

Each field is an ``option``: its default, what it does, how a value is checked, and its JSON type(s) when
DeepSpeed's ``"l3plugin"`` config block may set it (``json_options`` reads that block; the Megatron entry
point passes keywords). A bad value is an error naming the option as the user wrote it (``bucket_numel=0``
in Python, ``"l3plugin.bucket_numel"`` in a JSON config), the value and the valid range. To add an option:
one field here with its check; the DeepSpeed block accepts it when ``json`` is given.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field, fields

import torch

from l3plugin.arguments.checks import check_int
from l3plugin.collective.waits import resolve_timeout

# ZeRO-2: what may still be on the wire when the next micro-batch (Megatron: round) starts is bounded in bytes,
# not in buckets: by default the started reductions held past a backward's end (their full fp32 buffers and
# received slices) fit in 1/CARRY_SHARE of this rank's fp32 gradient shard, so between micro-batches the gradient
# memory stays within ~3% of stock ZeRO-2's (the shard). A carried bucket's bytes are what the wire has not moved
# yet: hiding more of a backward's tail under the next forward costs memory (carry_buckets, carry_reductions).
CARRY_SHARE = 32
# Without an explicit bucket_numel the buckets are cut to at most 1/BUCKETS_PER_MODEL of the trainable elements
# (DeepSpeed's default reduce_bucket_size, 5e8, is one bucket for most models: its reduce-scatter could only start
# at the end of backward), so reductions start as backward goes and the last one is a small part of the traffic.
BUCKETS_PER_MODEL = 16
CARRY_BY_BUDGET = "carry_bytes"  # ZeroSettings.carried_buckets: carry by the byte budget (the default)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _name(name: str, source: str | None) -> str:
    return name if source is None else f'"{source}.{name}"'


def _bad(name: str, value, source: str | None, rule: str) -> ValueError:
    """``name=value rule`` in Python; ``"source.name" rule, got value`` for a value read from a JSON config."""
    if source is None:
        return ValueError(f"{name}={value!r} {rule}")
    return ValueError(f"{_name(name, source)} {rule}, got {value!r}")


def whole_number(low: int, why: str = ""):
    """Check: an integer >= low (also a float with a whole value), in the words of ``check_int``; ``why``
    (what the number counts) follows them."""
    def check(name, value, source):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            return check_int(_name(name, source), value, low)
        except ValueError as exc:
            raise ValueError(f"{exc}{why}") from None
    return check


def boolean(name, value, source):
    if not isinstance(value, bool):
        raise _bad(name, value, source, "must be True or False")
    return value


def dtype(name, value, source):
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if value in (torch.float32, torch.bfloat16):
        return value
    raise _bad(name, value, source, f'must be "fp32" or "bf16" (valid are {sorted(DTYPES)}, torch.float32 '
                                    "(default) and torch.bfloat16)")


def seconds(name, value, source):
    resolve_timeout(value, _name(name, source))
    return value


def zero_stage(name, value, source):
    if value not in (1, 2) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: the FP32-reducing ZeRO optimizer supports stage 1 (optimizer states "
                         "sharded) and stage 2 (also gradients); use FSDP/ZeRO-3 for more")
    return value


def clip_norm(name, value, source):
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise _bad(name, value, source, "must be a finite number >= 0 (0 disables clipping)")
    return value


def option(default, help: str, *, check=None, json: tuple | None = None, json_default=...):
    """A ZeroSettings field. ``check(name, value, source)`` returns the value to keep (None is always
    accepted when it is the default); ``json``: the JSON types DeepSpeed's block accepts (None: not settable
    there); ``json_default``: the value when the block leaves it out, if not ``default``."""
    return field(default=default, metadata={"help": help, "check": check, "json": json,
                                            "json_default": default if json_default is ... else json_default})


@dataclass
class ZeroSettings:
    stage: int = option(1, "1: reduce-scatter once per step; 2: also between micro-batches, full buffers freed "
                        "in between (DeepSpeed: zero_optimization.stage)", check=zero_stage)
    bucket_numel: int | None = option(
        None, "elements per gradient bucket, taken as given; default: bucket_limit (DeepSpeed: zero_optimization."
        f"reduce_bucket_size) lowered to 1/{BUCKETS_PER_MODEL} of the trainable elements",
        check=whole_number(1), json=(int,))
    bucket_limit: int = option(25_000_000, "the bucket size when bucket_numel is not given, before it is lowered to "
                               f"1/{BUCKETS_PER_MODEL} of the trainable elements (DeepSpeed: zero_optimization."
                               "reduce_bucket_size)", check=whole_number(1))
    accumulate_dtype: torch.dtype = option(torch.float32, "micro-batch gradient accumulation dtype: fp32 or bf16 "
                                           "(to compare)", check=dtype, json=(str,))
    reduce_dtype: torch.dtype = option(torch.float32, "reduce-scatter dtype: fp32 or bf16 (to compare)",
                                       check=dtype, json=(str,))
    clip_grad: float = option(0.0, "max global L2 norm of the fp32 gradient; 0 = no clipping (DeepSpeed: "
                              "gradient_clipping)", check=clip_norm)
    gradient_scale: float | None = option(None, "multiplies the summed gradient; None = 1 / group size (average)")
    overlap: bool = option(True, "start reduce-scatters as soon as a bucket is final and wait late; False: "
                           "blocking (DeepSpeed: zero_optimization.overlap_comm)", check=boolean)
    overlap_param_gather: bool = option(
        True, "with overlap: the step starts the bf16 parameter all-gathers and each bucket is completed where the "
        "next forward (or any earlier read) first uses its parameters; holds the gathered bf16 buckets until then "
        "(up to a bf16 copy of the parameters); False: completed inside the step", check=boolean, json=(bool,))
    wait_timeout: float | None = option(None, "seconds a collective may take before a rank-named error (default: "
                                        "$L3PLUGIN_WAIT_TIMEOUT or 600)", check=seconds, json=(int, float))
    reduce_every: int | None = option(
        None, "ZeRO-2 only: reduce-scatter every N micro-batches (1..gradient_accumulation_steps, default 1); "
        "larger N holds a full fp32 gradient buffer between reductions but sends 1/N as much",
        check=whole_number(1, " (micro-batches between ZeRO-2 reduce-scatters)"), json=(int,))
    carry_bytes: int | None = option(
        None, "ZeRO-2: at the end of a micro-batch's backward (not the step's last; Megatron: of a round of the "
        "flexible schedule), the reduce-scatters started last run on under the next forward as long as what they "
        "hold (full fp32 buffers and received slices) fits in this many bytes; the others are waited there; default: 1/"
        f"{CARRY_SHARE} of this rank's fp32 gradient shard",
        check=whole_number(0, " (bytes the reductions carried into the next micro-batch may hold)"), json=(int,))
    carry_buckets: int | None = option(
        None, "ZeRO-2, opt-in, costs memory: carry the reduce-scatters of the N buckets started last whatever their "
        "size (instead of carry_bytes); holds up to N buckets' full fp32 buffers and received slices between "
        "micro-batches (printed at construction); 0 waits for every bucket at the end of each backward",
        check=whole_number(0, " (buckets whose reduce-scatter may run on into the next micro-batch)"), json=(int,))
    carry_reductions: bool = option(
        False, "ZeRO-2, opt-in, costs memory: every reduce-scatter still running when a micro-batch's backward ends "
        "runs on under the next forward; holds those buckets' full fp32 buffers across the micro-batch boundary: up to "
        "the full gradient (printed at construction)", check=boolean, json=(bool,))
    checkpoint_allow_nonfinite: bool = option(False, "resume from a checkpoint whose weights or optimizer states "
                                              "hold NaN/Inf (refused by default)", check=boolean, json=(bool,))
    checkpoint_fallback: bool = option(True, "load_checkpoint without a tag falls back to the newest complete tag "
                                       "when the one 'latest' names is torn (a crash during its save), with a "
                                       "warning", check=boolean, json=(bool,))
    source: InitVar[str | None] = None  # where the values come from, for messages (None: Python keywords)

    def __post_init__(self, source):
        for f in fields(self):
            value, check = getattr(self, f.name), f.metadata["check"]
            if check is not None and not (value is None and f.default is None):
                setattr(self, f.name, check(f.name, value, source))
        for other, given in (("carry_buckets", self.carry_buckets is not None),
                             ("carry_reductions", self.carry_reductions)):
            if self.carry_bytes is not None and given:
                raise ValueError(f"{_name('carry_bytes', source)} and {_name(other, source)} are both set; they are "
                                 "two ways of choosing what runs on into the next micro-batch: set one of them")

    @property
    def carried_buckets(self) -> int | str | None:
        """Which started reduce-scatters may run on past a micro-batch (a round) end: None = all of them
        (``carry_reductions``), 0 with blocking collectives, ``carry_buckets`` when given, else ``CARRY_BY_BUDGET``
        (those that fit in ``carry_bytes``)."""
        if not self.overlap:
            return 0
        if self.carry_reductions:
            return None
        return CARRY_BY_BUDGET if self.carry_buckets is None else self.carry_buckets


# Options only the DeepSpeed engine acts on (micro-batch reductions, its checkpoint loading): the Megatron entry
# point reduces per round of the flexible schedule and checkpoints through dist_checkpointing, so it refuses them.
DEEPSPEED_ONLY = ("reduce_every", "carry_reductions", "checkpoint_allow_nonfinite", "checkpoint_fallback")


def json_options(raw, source: str, extra: dict | None = None) -> dict:
    """Every option a JSON block may set, checked: {name: the block's value, else its default}.

    ``raw``: the block (a dict); ``source``: its key, for messages; ``extra``: {name: help} of keys the caller
    reads itself (taken over unchecked)."""
    settable = {f.name: f for f in fields(ZeroSettings) if f.metadata["json"] is not None}
    if not isinstance(raw, dict):
        raise ValueError(f'"{source}" must be an object like {{"fp32_reduce_zero": true}}, got {raw!r}')
    extra = extra or {}
    unknown = sorted(set(raw) - set(settable) - set(extra))
    if unknown:
        valid = "; ".join([f"{k}: {h}" for k, h in extra.items()]
                          + [f"{k}: {f.metadata['help']}" for k, f in settable.items()])
        raise ValueError(f'unknown option(s) {unknown} under "{source}". Valid options: {valid}')
    out = {k: raw[k] for k in extra if k in raw}
    for name, f in settable.items():
        value, types = raw.get(name), f.metadata["json"]
        if value is None:  # left out (or null): the default
            out[name] = f.metadata["json_default"]
            continue
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f'{_name(name, source)} must be {"/".join(t.__name__ for t in types)}, got {value!r}')
        out[name] = f.metadata["check"](name, value, source)
    return out
