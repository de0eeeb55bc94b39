"""The tests' name for ``l3plugin.ranks`` (the harness that runs a function on N CPU ranks lives there, a
product module: ``l3plugin demo`` starts its ranks with it)."""

from l3plugin.ranks import (DEFAULT_TIMEOUT, DistributedTestError, RankFailure, RankPool, RankPools,  # noqa: F401
                            _alive, _free_port, kill_live_workers, live_workers, run_command)
