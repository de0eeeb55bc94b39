"""Run an unmodified Megatron-LM training script with l3plugin installed.

    python -m l3plugin.megatron.launch pretrain_gpt.py <Megatron-LM args> --pipeline-schedule flexible

Works under torchrun too (``torchrun ... -m l3plugin.megatron.launch pretrain_gpt.py ...``). It
installs the schedule selector and the CP route (``--cp-comm-type l3plugin_all_gather``, see
cp_route.py) and, when Megatron-LM is importable, makes its argument parser accept l3plugin's flags by
chaining them to whatever extra_args_provider the script passes.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from l3plugin.megatron.arguments import add_arguments
from l3plugin.megatron.install import hook_megatron_lm_arguments, install


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    script, script_args = argv[0], argv[1:]
    parser = add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    ours, others = parser.parse_known_args(script_args)
    if hook_megatron_lm_arguments():
        install()  # Megatron-LM parses our flags itself; the choices are read at run time
    else:
        install(ours.pipeline_schedule)
        script_args = others
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
