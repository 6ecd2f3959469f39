"""``engine.mpu``: the Megatron-style "model parallel unit" queries, answered from the mesh.

DeepSpeed hands this object (its ``PipelineParallelGrid``) to code written for Megatron: "model
parallel" means the tensor-parallel axis (DeepSpeed's topology calls it "model", and "slice"
parallel), "pipe" the pipeline axis, "data" the data-parallel one. Sequence parallelism is
reported separately; gradients are averaged over data x sequence (``get_data_parallel_*`` stays
the axis that splits samples, as in DeepSpeed).
"""

from __future__ import annotations

import torch.distributed as dist

from zerotune.distributed.mesh import ProcessMesh


class ModelParallelUnit:
    def __init__(self, mesh: ProcessMesh) -> None:
        self.mesh = mesh

    def _group(self, axis: str) -> dist.ProcessGroup | None:
        return self.mesh.group(axis)

    # data
    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size("dp")

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group("dp")

    # tensor ("model" / "slice" in DeepSpeed's grid, "tensor model" in Megatron)
    def get_model_parallel_rank(self) -> int:
        return self.mesh.rank("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.size("tp")

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group("tp")

    get_slice_parallel_rank = get_tensor_model_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group = get_model_parallel_group

    # pipeline
    def get_pipe_parallel_rank(self) -> int:
        return self.mesh.rank("pp")

    def get_pipe_parallel_world_size(self) -> int:
        return self.mesh.size("pp")

    def get_pipe_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group("pp")

    get_stage_id = get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    # sequence
    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.rank("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.size("sp")

    def get_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        return self._group("sp")

    def get_global_rank(self) -> int:
        return dist.get_rank()
