"""Stand-in for Megatron-LM's megatron.training, 0.18 / 0.19 layout (tests only; see ../../README.md)."""
from .global_vars import get_args, get_tokenizer  # noqa: F401
