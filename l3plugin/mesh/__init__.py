"""The 4D mesh in the paper's order [TP, CP, PP, DP]: one room owns the layout.

``shape.py`` is the arithmetic (ranks, coordinates, the ranks of each group; no processes), ``groups.py`` the
real process groups (Megatron-Core's ``parallel_state`` initialised in that order, and its teardown).
"""
