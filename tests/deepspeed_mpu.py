"""TEST-ONLY: a DeepSpeed ``mpu`` over l3plugin's mesh (tests/test_mesh.py hands it to DeepSpeed's groups module to
show that DeepSpeed finds the mesh's groups where it looks for them). The package does not ship it.
"""


class DeepSpeedMPU:
    """The ``mpu`` object DeepSpeed accepts in ``deepspeed.initialize(mpu=...)``, over the mesh's groups.

    DeepSpeed calls "model parallel" what Megatron calls tensor parallel, and reduces gradients over its
    "sequence data parallel" group: we give it DP x CP there, since CP is an extension of DP for
    parameters (every CP rank holds the same weights and sees different tokens).
    """

    def __init__(self, mesh):
        self._mesh = mesh

    def _size(self, group):
        import torch.distributed as dist

        return dist.get_world_size(group)

    def _rank(self, group):
        import torch.distributed as dist

        return dist.get_rank(group)

    # tensor ("model" / "slice") parallel
    def get_model_parallel_group(self):
        return self._mesh.tp_group

    def get_model_parallel_rank(self):
        return self._rank(self._mesh.tp_group)

    def get_model_parallel_world_size(self):
        return self._size(self._mesh.tp_group)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        import torch.distributed as dist

        return dist.get_global_rank(self._mesh.tp_group, 0)

    # data parallel
    def get_data_parallel_group(self):
        return self._mesh.dp_group

    def get_data_parallel_rank(self):
        return self._rank(self._mesh.dp_group)

    def get_data_parallel_world_size(self):
        return self._size(self._mesh.dp_group)

    def get_data_parallel_group_ranks(self):
        return list(self._mesh.group_members("dp"))

    # pipeline parallel
    def get_pipe_parallel_group(self):
        return self._mesh.pp_group

    def get_pipe_parallel_rank(self):
        return self._rank(self._mesh.pp_group)

    def get_pipe_parallel_world_size(self):
        return self._size(self._mesh.pp_group)

    get_pipeline_model_parallel_group = get_pipe_parallel_group
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # context parallel, which DeepSpeed calls sequence parallel; gradients reduce over DP x CP
    def get_sequence_parallel_group(self):
        return self._mesh.cp_group

    def get_sequence_parallel_rank(self):
        return self._rank(self._mesh.cp_group)

    def get_sequence_parallel_world_size(self):
        return self._size(self._mesh.cp_group)

    def get_sequence_data_parallel_group(self):
        return self._mesh.dp_cp_group

    def get_sequence_data_parallel_rank(self):
        return self._rank(self._mesh.dp_cp_group)

    def get_sequence_data_parallel_world_size(self):
        return self._size(self._mesh.dp_cp_group)
