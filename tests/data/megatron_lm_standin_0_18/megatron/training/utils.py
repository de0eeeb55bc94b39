"""Megatron-LM 0.18+'s megatron.training.utils keeps only this of what get_batch reaches."""
from megatron.core import parallel_state


def is_first_or_last_pipeline_stage(vp_stage=None):
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))
