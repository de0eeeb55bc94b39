"""Imported first by RankPool's fork server, before torch and megatron.core: every worker it forks then starts
single-threaded (only 2 cores: OMP/MKL read these at load) and with the CPU-only upstream warnings filtered."""

import os

from l3plugin.ranks.worker import silence_cpu_meaningless_warnings

os.environ.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
silence_cpu_meaningless_warnings()
