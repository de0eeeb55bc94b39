"""Run an unmodified Megatron-LM training script with l3plugin installed.

    python -m l3plugin.megatron.launch pretrain_gpt.py <Megatron-LM args> --pipeline-schedule flexible

Works under torchrun too (``torchrun ... -m l3plugin.megatron.launch pretrain_gpt.py ...``). It
installs the schedule selector and, when Megatron-LM is importable, makes its argument parser accept
l3plugin's flags by chaining them to whatever extra_args_provider the script passes.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from l3plugin.megatron.install import add_arguments, chain_extra_args, install


def _accept_our_flags_in_megatron_lm() -> bool:
    try:
        import megatron.training.initialize as initialize
    except ImportError:
        return False  # megatron-core alone: no Megatron-LM argument parser to extend
    parse_args = initialize.parse_args
    if getattr(parse_args, "_l3plugin", False):
        return True

    def parse_args_with_l3plugin(extra_args_provider=None, *args, **kwargs):
        return parse_args(chain_extra_args(extra_args_provider), *args, **kwargs)

    parse_args_with_l3plugin._l3plugin = True
    initialize.parse_args = parse_args_with_l3plugin
    return True


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    script, script_args = argv[0], argv[1:]
    parser = add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    ours, others = parser.parse_known_args(script_args)
    if _accept_our_flags_in_megatron_lm():
        install()  # Megatron-LM parses --pipeline-schedule itself; the choice is read at run time
    else:
        install(ours.pipeline_schedule)
        script_args = others
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
