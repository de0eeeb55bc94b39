"""Pools of rank processes for tests and benches: each runs functions on N gloo ranks, spawned once and reused.

``pool.py`` is the parent side (``RankPools``, ``RankPool``), ``server.py`` the forkserver preload, ``worker.py``
what runs inside each rank's process.
"""
