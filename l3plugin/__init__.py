"""l3plugin: Llama 3 parallelism (flexible interleaved 1F1B, all-gather CP attention,
FP32-reducing ZeRO) for existing Megatron-Core and DeepSpeed training jobs."""

__version__ = "0.1.0"
