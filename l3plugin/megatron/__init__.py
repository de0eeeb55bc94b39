"""Megatron-Core adapter: the flexible pipeline schedule (and its zero-bubble variant) as a forward_backward_func,
and its switch."""

from l3plugin.megatron.arguments import add_arguments, chain_extra_args
from l3plugin.megatron.install import install, uninstall
from l3plugin.megatron.pipeline import forward_backward_pipelining_flexible, forward_backward_pipelining_flexible_zb

__all__ = ["add_arguments", "chain_extra_args", "forward_backward_pipelining_flexible",
           "forward_backward_pipelining_flexible_zb", "install", "uninstall"]
