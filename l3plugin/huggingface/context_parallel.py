"""Turn context parallelism on and off for a transformers model, without touching its modeling code.

    from l3plugin.huggingface import enable_context_parallel
    enable_context_parallel(model, group=cp_group, layout="balanced")   # done for you by the DeepSpeed key
    loss = model(input_ids=ids, position_ids=pos, labels=labels).loss   # full rows in, this rank's part inside

What it does: registers the all-gather CP attention in transformers' ``AttentionInterface`` and selects it
(``model.set_attn_implementation``); adds a forward pre-hook that shards every call's full rows over the CP
group (batch.py) and passes the documents down as a keyword argument; wraps ``model.loss_function`` so the
loss is the whole sequence's token mean (attention.py). Outputs (logits, hidden states) are this rank's
tokens in the layout's local order.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist

from l3plugin.cp import LAYOUT_NAMES
from l3plugin.cp.layout import CPLayout
from l3plugin.huggingface.attention import ATTENTION_NAME, CPLoss, cp_attention_forward
from l3plugin.huggingface.batch import shard_inputs
from l3plugin.huggingface.outputs import whole_sequence_outputs

_STATE = "_l3plugin_cp_state"


def register_attention() -> None:
    """Register the CP attention under ``ATTENTION_NAME`` in transformers' global registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, cp_attention_forward)


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"{type(model).__name__} is not a transformers PreTrainedModel (no config / "
                        "set_attn_implementation); for your own model call l3plugin.cp.all_gather_attention "
                        "with the CP group directly")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; context parallelism is for "
                         "decoder-only causal LMs")


def enable_context_parallel(model, group=None, layout="balanced"):
    """Make ``model`` (a transformers causal LM) run context-parallel over ``group`` (None or size 1: the
    same attention without CP). ``layout``: "balanced" (default: pieces dealt by document-masked work,
    for packed documents) or "2cp" (the paper's two chunks per rank). Returns the model."""
    _check_model(model)
    if not (isinstance(layout, CPLayout) or layout in LAYOUT_NAMES):
        raise ValueError(f"layout={layout!r} is invalid: valid are {LAYOUT_NAMES}")
    if group is not None and not dist.is_initialized():
        raise RuntimeError("enable_context_parallel got a process group but torch.distributed is not initialised")
    state = getattr(model, _STATE, None)
    if state is not None:
        state["group"], state["layout"] = group, layout
        return model
    register_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    signature = inspect.signature(model.forward)
    var_keyword = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)
    state = {"group": group, "layout": layout, "previous": previous}

    def pre_forward(module, args, kwargs):
        call = dict(signature.bind_partial(*args, **kwargs).arguments)  # positional input_ids -> keyword
        if var_keyword is not None:
            call.update(call.pop(var_keyword, {}))
        kwargs = shard_inputs(call, state["group"], state["layout"])
        state["last_batch"] = kwargs["l3plugin_cp"]
        return (), kwargs

    def post_forward(module, args, kwargs, output):
        batch = kwargs.get("l3plugin_cp")
        if batch is None:
            return output
        return whole_sequence_outputs(output, batch, kwargs.get("num_items_in_batch"))

    state["hook"] = model.register_forward_pre_hook(pre_forward, with_kwargs=True)
    state["post_hook"] = model.register_forward_hook(post_forward, with_kwargs=True)
    had_own = "_loss_function" in model.__dict__
    state["stock_loss"] = model.__dict__.get("_loss_function") if had_own else None
    model.loss_function = CPLoss(model.loss_function)
    setattr(model, _STATE, state)
    return model


def disable_context_parallel(model):
    """Undo ``enable_context_parallel``: the previous attention implementation, no hook, the stock loss."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    state["hook"].remove()
    state["post_hook"].remove()
    model.set_attn_implementation(state["previous"])
    if state["stock_loss"] is None:
        model.__dict__.pop("_loss_function", None)
    else:
        model.loss_function = state["stock_loss"]
    delattr(model, _STATE)
    return model


def last_cp_batch(model):
    """The ``CPBatch`` of ``model``'s last forward (its CP group, layouts and documents: what ``full_rows`` needs
    to put that forward's per-token outputs back in sequence order), or None (CP not enabled, or no forward yet)."""
    state = getattr(model, _STATE, None)
    return None if state is None else state.get("last_batch")


def context_parallel_group(model):
    """The CP group ``model`` runs over, or None when CP is not enabled on it."""
    state = getattr(model, _STATE, None)
    return None if state is None else state["group"]


def tokens_seen_once_per_replica():
    """A transformers ``TrainerCallback`` for the one metric the HF Trainer still counts per CP rank:
    ``Trainer(..., callbacks=[tokens_seen_once_per_replica()])`` with ``include_num_input_tokens_seen``.

    The Trainer adds every process's input tokens to ``state.num_input_tokens_seen`` through
    ``accelerator.gather``, which l3plugin leaves over every process (the Trainer gathers ``num_items_in_batch``
    with it too, and there the factor N cancels the loss's x ``num_processes``): under CP N it counts each
    data-parallel replica's batch N times. The callback divides what was added since the last step by the
    model's CP size before the step is logged (no-op without CP). Metrics gathered with ``gather_for_metrics``
    (TRL's ``num_tokens``) need nothing: the DeepSpeed key gathers those once per replica."""
    from transformers import TrainerCallback  # here: this module stays importable without transformers loaded

    class TokensSeenOncePerReplica(TrainerCallback):
        counted = 0  # state.num_input_tokens_seen as the callback last left it

        def on_train_begin(self, args, state, control, **kwargs):
            self.counted = state.num_input_tokens_seen  # 0, or the count a resumed checkpoint carries

        def on_step_end(self, args, state, control, model=None, **kwargs):
            group = None if model is None else context_parallel_group(model)
            cp = 1 if group is None else dist.get_world_size(group)
            state.num_input_tokens_seen = self.counted + (state.num_input_tokens_seen - self.counted) // cp
            self.counted = state.num_input_tokens_seen

    return TokensSeenOncePerReplica()
