"""The parallel dimensions of a training stage (params `parallel.data`, `.tensor`, `.pipeline`) and the one
DeviceMesh they make, whose sub-meshes the strategies of coarse2fine.parallel are handed (torchtitan's
ParallelDims is the model).

The mesh is (pipeline, data, tensor), tensor innermost: the ranks of a tensor-parallel group are consecutive, so on
a GPU node they share NVLink, which TP's per-layer all-reduces need; pipeline outermost, its point-to-point
activations being the cheapest traffic to send across nodes (Megatron-LM and torchtitan order them so).

No torch import at module level: config.py validates the dimensions with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from coarse2fine.errors import UserError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh


class ParallelParams(Protocol):
    """What the dimensions are made of: params `parallel` (config.Parallel, which imports this module)."""

    data: int
    tensor: int
    pipeline: int

DIMENSIONS = ("pipeline", "data", "tensor")  # the mesh's order, outermost first


@dataclass(frozen=True)
class ParallelDims:
    data: int
    tensor: int
    pipeline: int

    @classmethod
    def of(cls, cfg: ParallelParams, world_size: int) -> ParallelDims:
        """The dimensions params `parallel` asks for in a world of `world_size` ranks (`data: 0`: the ranks left);
        a ValueError naming the keys and values when their product is not the world size."""
        model_parallel = cfg.tensor * cfg.pipeline
        data = cfg.data or world_size // model_parallel
        if data * model_parallel != world_size:
            asked = f"data {cfg.data or 'auto'} x tensor {cfg.tensor} x pipeline {cfg.pipeline}"
            raise ValueError(
                f"parallel: {asked} does not make the world of {world_size} ranks (launch.nnodes x "
                f"launch.nproc_per_node): their product must equal it (data: 0 takes the ranks left)"
            )
        return cls(data=data, tensor=cfg.tensor, pipeline=cfg.pipeline)

    @classmethod
    def of_run(cls, cfg: ParallelParams, world_size: int) -> ParallelDims:
        """`of` for the world torchrun gave (params.yaml was checked at the launch keys'): a UserError."""
        try:
            return cls.of(cfg, world_size)
        except ValueError as error:
            raise UserError(f"params.yaml: {error}") from None

    @classmethod
    def data_only(cls, world_size: int) -> ParallelDims:
        return cls(data=world_size, tensor=1, pipeline=1)

    @property
    def model_parallel(self) -> bool:
        """Whether ranks hold parts of the model other than data shards (tensor or pipeline > 1)."""
        return self.tensor > 1 or self.pipeline > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s position on each dimension (the mesh is row-major over DIMENSIONS)."""
        return {"pipeline": rank // (self.data * self.tensor), "data": rank // self.tensor % self.data,
                "tensor": rank % self.tensor}

    def rank_at(self, pipeline: int, data: int, tensor: int) -> int:
        return (pipeline * self.data + data) * self.tensor + tensor

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        """The world's DeviceMesh, named by DIMENSIONS (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (self.pipeline, self.data, self.tensor), mesh_dim_names=DIMENSIONS)
