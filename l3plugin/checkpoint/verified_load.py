"""What every checkpoint load shares: read and verify into new tensors, agree across the ranks, then install.

A reader (``deepspeed_layout.read_partitions``, ``deepspeed_universal.read_universal``,
``megatron_dist``'s) returns a ``Loaded`` without touching the model or the optimizer and without a
collective. ``load_agreed`` runs it and has the ranks agree (``l3plugin.collective.fail_together``): an error on one
rank is an error on all of them, raised before the first change and the first collective; then
``apply_loaded`` installs the state and all-gathers the parameters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from l3plugin.collective.fail_together import OneAgreement

READ_PARTITIONS = "read the ZeRO optimizer partitions"  # the outcome agreed on before the first collective


@dataclass
class Loaded:
    """What one rank loads, verified, in new tensors; ``apply_loaded`` installs it."""

    staged: list  # [(bucket, fp32 master shard, optimizer state or None to keep the current one)]
    hyper: list  # per param group: hyper-parameters to set, or None
    global_state: dict | None = None  # a universal checkpoint's zero/optimizer_state.pt


def load_agreed(zero, read, agree=None) -> Loaded:
    """``read()`` (verify everything into new tensors), then agree across the ranks (default: one
    ``OneAgreement`` over the ZeRO group), then install; an error on any rank is raised on all of them
    before anything changes."""
    agree = agree or load_agreement(zero)
    try:
        loaded = read()
    except Exception as exc:  # noqa: BLE001 - every rank raises in agree()
        agree(exc)
        raise
    agree(None, READ_PARTITIONS)
    apply_loaded(zero, loaded)
    return loaded


def load_agreement(zero) -> OneAgreement:
    if not dist.is_initialized():  # one process: nobody to tell
        return OneAgreement(None, what="ZeRO checkpoint load")
    return OneAgreement(zero.group, what="ZeRO checkpoint load", timeout=zero.wait_timeout,
                        device=zero.buckets[0].master.device if zero.buckets else "cpu")


@torch.no_grad()
def apply_loaded(zero, loaded: Loaded) -> None:
    """Install verified state (after the ranks agreed): the first change to the model, then the parameter
    all-gather (collective)."""
    for bucket, master, state in loaded.staged:
        bucket.master.data.copy_(master)
        if state is None:
            continue
        if state:
            zero.optimizer.state[bucket.master] = state
        else:
            zero.optimizer.state.pop(bucket.master, None)
    for g, values in enumerate(loaded.hyper):
        for key, value in (values or {}).items():
            zero.optimizer.param_groups[g][key] = copy.deepcopy(value)
    zero.zero_grad()
    zero.all_gather_params(wait=True)
