"""Megatron-LM 0.18+ still has megatron.training.initialize (argument parsing moved to arguments.py)."""
