"""The ``"l3plugin"`` key of a DeepSpeed config: its options, read once into a frozen ``PluginOptions``, and what
the FP32-reducing ZeRO supports.

A config is read only by DeepSpeed's own loader (``read_config``: a dict, a JSON or hjson file, a base64 string:
whatever DeepSpeed accepts). ``deepspeed.initialize`` (engine.py's ``initialize_with_key``) parses the block
once and hands the result to the engine it builds (``handing_over``); an engine built some other way parses its
own config's block when first asked. To add an option of the ZeRO optimizer: one field in
l3plugin/zero/settings.py (the block accepts it when the field says ``json=``; listed in its ``DEEPSPEED_ONLY``
when Megatron's entry point must refuse it). An option of the block itself (the switch, CP): its help in
``OWN_OPTIONS``, its ``PluginOptions`` field and its check in ``PluginOptions.parse``, all in this file.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping
from dataclasses import dataclass

from l3plugin.arguments.checks import check_int
from l3plugin.upstream.patchset import PrivateState
from l3plugin.zero.settings import boolean, json_options, whole_number

KEY = "l3plugin"
ENABLE = "fp32_reduce_zero"  # the switch; the other ZeRO options are ZeroSettings fields (l3plugin/zero/settings.py)
OWN_OPTIONS = {
    ENABLE: "use the FP32-reducing ZeRO-1/2 optimizer",
    "context_parallel_size": "ranks per context-parallel group (consecutive ranks inside DP): builds DeepSpeed's "
                             "sequence-parallel groups, reduces gradients over DP x CP and gives a transformers "
                             "model l3plugin's all-gather CP attention (default 1)",
    "cp_layout": 'tokens each CP rank holds: "balanced" (default, for packed documents) or "2cp" (the paper\'s)',
}
SUPPORTED = ('Supported with "l3plugin": {"fp32_reduce_zero": true}: "bf16": {"enabled": true}, '
             '"zero_optimization": {"stage": 1 or 2} without offload, an optimizer, no fp16, no MoE, '
             'no torch_autocast; DeepSpeedEngine and PipelineEngine; gradient '
             'accumulation and communication dtypes are chosen with "l3plugin": {"accumulate_dtype", "reduce_dtype"}; '
             'ZeRO-2 reduces every "reduce_every" micro-batches; zero_optimization.overlap_comm false makes '
             'every collective blocking')


class ReadOnlyOptions(Mapping):
    """{option: value}, read-only (unlike a mappingproxy it pickles and copies, as engines and results do)."""

    def __init__(self, values: dict):
        self._values = dict(values)

    def __getitem__(self, name):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        return repr(self._values)


@dataclass(frozen=True)
class PluginOptions:
    """The whole ``"l3plugin"`` block of one config, checked.

    fp32_reduce_zero: the switch of l3plugin's ZeRO; zero: the checked ZeroSettings options the block may set
    ({name: value or default}, read-only); context_parallel_size, cp_layout: CP (sequence_parallel.py)."""

    fp32_reduce_zero: bool
    zero: Mapping
    context_parallel_size: int
    cp_layout: str

    @classmethod
    def parse(cls, block) -> PluginOptions:
        """Check every option of ``block`` (the value under ``"l3plugin"``); bad values name the option, the
        value and the valid range."""
        from l3plugin.cp import LAYOUT_NAMES

        zero = json_options(block, KEY, extra=OWN_OPTIONS)
        own = {name: zero.pop(name) for name in OWN_OPTIONS if name in zero}
        size = whole_number(1, " (ranks per context-parallel group)")(
            "context_parallel_size", own.get("context_parallel_size", 1), KEY)
        layout = own.get("cp_layout", "balanced")
        if layout not in LAYOUT_NAMES:
            raise ValueError(f'"{KEY}.cp_layout" must be one of {list(LAYOUT_NAMES)}, got {layout!r}')
        return cls(fp32_reduce_zero=boolean(ENABLE, own.get(ENABLE, False), KEY), zero=ReadOnlyOptions(zero),
                   context_parallel_size=size, cp_layout=layout)


def options_in(config: dict) -> PluginOptions | None:
    """The options of a config read as a dict; None without the key."""
    return None if config.get(KEY) is None else PluginOptions.parse(config[KEY])


def read_config(config) -> dict:
    """A config (dict, path of a JSON or hjson file, base64 string) as DeepSpeed reads it: by DeepSpeed's own
    loader, the first thing ``DeepSpeedConfig`` does (the engine's settings are not computed here). Raises
    what DeepSpeed's loader raises."""
    if isinstance(config, dict):
        return config
    return _loaded(config)._param_dict


def _loaded(config):
    """A ``DeepSpeedConfig`` that has loaded ``config`` and computed nothing from it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class ReadOnly(DeepSpeedConfig):
        # DeepSpeedConfig.__init__ loads the config into _param_dict, then computes the engine's settings from
        # it through these three methods: skipped (they need the world size, and may raise on what they check).
        def _initialize_params(self, param_dict):
            pass

        def _configure_train_batch_size(self):
            pass

        def _do_sanity_check(self):
            pass

    return ReadOnly(config)


# Read here (read_config, options_for, zero_settings, the accumulation dtype): the config as DeepSpeed loaded it.
PARAM_DICT = PrivateState(
    "deepspeed.runtime.config:DeepSpeedConfig", "_param_dict", probe=lambda: _loaded({}),
    why="the config as DeepSpeed loaded it (engine._config._param_dict; read_config for a file or base64 "
        "string): without it an engine with the key fails at deepspeed.initialize (AttributeError) and a key "
        "in a file or base64 config is not seen")


_HANDED: contextvars.ContextVar = contextvars.ContextVar("l3plugin_handed_options", default=None)


@contextlib.contextmanager
def handing_over(options: PluginOptions):
    """The engine ``deepspeed.initialize`` builds inside this block takes ``options`` (parsed by the caller
    from the same config) instead of parsing its config again."""
    token = _HANDED.set(options)
    try:
        yield
    finally:
        _HANDED.reset(token)


# Where deepspeed.initialize takes its config from, in its order: config, config_params, or the arguments
# object's deepspeed_config (deepscale_config: its deprecated name). Two of them at once: stock refuses the call.
ARGS_FIELDS = ("deepspeed_config", "deepscale_config")


def _given_config(call):
    """(where, the config as given) of a bound ``deepspeed.initialize`` call; (None, None) when there is none or
    stock refuses the call (two configs given)."""
    given = [(name, call.arguments.get(name)) for name in ("config", "config_params")]
    given += [("args", getattr(call.arguments.get("args"), name, None)) for name in ARGS_FIELDS]
    given = [(where, value) for where, value in given if value is not None]
    if given[:1] and given[0][0] == "config" and any(where == "config_params" for where, _ in given):
        given = [g for g in given if g[0] != "config_params"]  # config wins over config_params
    return given[0] if len(given) == 1 else (None, None)


def config_of_call(call):
    """(where, the config as a dict, its options) of a bound ``deepspeed.initialize`` call, read by DeepSpeed's
    own loader; options None without the key or when the config cannot be read (then stock gets the call as it
    is and says what is wrong)."""
    where, given = _given_config(call)
    if given is None:
        return None, None, None
    try:
        config = read_config(given)
    except Exception:  # noqa: BLE001 - DeepSpeed's own loader fails on it: stock raises its own error
        return None, None, None
    return (where, config, options_in(config)) if isinstance(config, dict) else (None, None, None)


def options_for(engine) -> PluginOptions | None:
    """The options of an engine being built: those handed over, else its config's."""
    handed = _HANDED.get()
    return handed if handed is not None else options_in(engine._config._param_dict)


def zero_settings(engine, options: PluginOptions):
    """The optimizer's settings: the engine's config (stage, gradient_clipping, overlap_comm,
    reduce_bucket_size) and the ``"l3plugin"`` options."""
    from l3plugin.zero.settings import ZeroSettings

    opts = dict(options.zero)
    # DeepSpeed's overlap_comm defaults to off because its overlap costs extra buffers; ours holds between
    # micro-batches at most carry_bytes (ZeRO-2; 1/32 of the fp32 gradient shard by default), so it is on unless
    # the config says false.
    overlap = engine._config._param_dict.get("zero_optimization", {}).get("overlap_comm")
    # Under sequence parallelism (Ulysses, or l3plugin's context_parallel_size) DeepSpeed's engine and stock ZeRO
    # sum gradients over the SP ranks of a group and average over data parallelism: our ZeRO, reducing over
    # seq_data_parallel_group (DP x SP), does the same.
    sp = getattr(engine, "sequence_parallel_size", 1)
    scale = None if sp == 1 else sp / engine.seq_dp_world_size
    return ZeroSettings(**opts, bucket_limit=int(engine.zero_reduce_bucket_size()),
                        stage=engine.zero_optimization_stage(), clip_grad=engine.gradient_clipping(),
                        overlap=overlap is not False, gradient_scale=scale, source=KEY)


def _unsupported(problems: list) -> None:
    if problems:
        raise ValueError("l3plugin FP32-reducing ZeRO cannot run this config: " + "; ".join(problems)
                         + ". " + SUPPORTED)


def check_supported(engine, options: PluginOptions) -> None:
    """Raise one ValueError listing everything in the config that the FP32-reducing ZeRO cannot do (the
    model is checked once built: ``check_model_supported``)."""
    import torch

    problems = []
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        problems.append(f"zero_optimization.stage is {stage}; only stage 1 and 2 are supported")
    if engine.fp16_enabled():
        problems.append("fp16 is enabled; only bf16 is supported")
    elif not engine.bfloat16_enabled():
        problems.append('bf16 is not enabled; set "bf16": {"enabled": true}')
    for what in ("optimizer", "param"):
        offload = getattr(engine, f"zero_offload_{what}")()
        device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
        if offload is not None and device not in (None, "none"):
            problems.append(f"zero_optimization.offload_{what} is set (device {device}); offload is not supported")
    if getattr(engine, "torch_autocast_enabled", lambda: False)():  # DeepSpeed >= 0.17 has torch_autocast
        problems.append("torch_autocast is enabled; give the model bf16 weights with bf16.enabled instead")
    if getattr(engine, "zenflow", False):
        problems.append("zenflow is enabled; it is not supported")
    comm = engine._config.communication_data_type
    if comm is not None and comm != torch.float32:
        problems.append(f'communication_data_type is {comm}; use "{KEY}": {{"reduce_dtype": ...}} instead')
    accum = engine._config._param_dict.get("data_types", {}).get("grad_accum_dtype")
    if accum not in (None, "fp32", "float32"):
        problems.append(f'data_types.grad_accum_dtype is {accum!r}; use "{KEY}": {{"accumulate_dtype": ...}} instead')
    every = options.zero["reduce_every"]
    if every is not None and stage == 1:
        problems.append(f'"{KEY}.reduce_every" is {every} with zero_optimization.stage 1; ZeRO-1 reduce-scatters '
                        "once per step (at the gradient-accumulation boundary): remove reduce_every or use stage 2")
    elif every is not None:
        try:
            check_int(f'"{KEY}.reduce_every"', every, 1, engine.gradient_accumulation_steps(),
                      "gradient_accumulation_steps")
        except ValueError as exc:
            problems.append(str(exc))
    carry = options.zero["carry_buckets"]
    for name, value, given in (("carry_reductions", "true", options.zero["carry_reductions"]),
                               ("carry_buckets", carry, carry is not None),
                               ("carry_bytes", options.zero["carry_bytes"], options.zero["carry_bytes"] is not None)):
        if given and stage == 1:
            problems.append(f'"{KEY}.{name}" is {value} with zero_optimization.stage 1; ZeRO-1 reduce-scatters only '
                            "in the last micro-batch, whose reductions the step needs: remove it or use stage 2")
    if carry is not None and options.zero["carry_reductions"]:
        problems.append(f'"{KEY}.carry_buckets" is {carry} with "{KEY}.carry_reductions" true, which carries every '
                        "bucket: set one of them")
    _unsupported(problems)


def check_model_supported(engine) -> None:
    """What only the built model tells (DeepSpeed finds MoE layers after its config checks)."""
    problems = ["the model has MoE layers; they are not supported"] if getattr(engine, "has_moe_layers", False) else []
    _unsupported(problems)
