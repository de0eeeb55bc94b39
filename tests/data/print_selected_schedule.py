"""A stand-in training script for the launcher test: reports what Megatron's selector returns."""
import sys

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel import schedules

print("selected:", get_forward_backward_func(pp_size=4, vp_size=2).__name__)
print("selected-pp1:", schedules.get_forward_backward_func(pp_size=1, vp_size=None).__name__)
print("argv:", sys.argv[1:])
