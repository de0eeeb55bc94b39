"""Checks of values, one wording everywhere (``checks.py``), and the argparse types and flags the `l3plugin`
subcommands share (``flags.py``)."""
