import pytest

from l3plugin.testing.ranks import RankPools


@pytest.fixture(scope="session")
def ranks():
    """Run a function on N gloo CPU ranks: ``ranks.run(world_size, fn, *args, timeout=...)``.

    Workers are spawned once per world size for the whole session (they preload megatron.core).
    """
    pools = RankPools(preload=("megatron.core",))
    yield pools
    pools.close()
