"""Megatron-LM keeps the parsed arguments and the tokenizer in these module globals."""
_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None


def get_args():
    return _GLOBAL_ARGS


def get_tokenizer():
    return _GLOBAL_TOKENIZER
