"""Process group set-up and the one place that branches on CPU vs GPU.

Stages are launched by torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); run as a
plain `python stages/x.py` they fall back to a world of one. Backend: nccl for CUDA tensors with gloo for CPU
tensors on GPU machines, gloo otherwise (`group_backend`). Every collective of the project goes through here.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def device_id(self) -> int | None:
        """What DALI wants: a GPU ordinal, or None for a CPU-only pipeline."""
        return self.device.index if self.is_cuda else None

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        """None means plain fp32. `auto` is fp32 on CPU (bf16 autocast is slower on these CPUs), bf16 on GPU."""
        if precision == "auto":
            precision = "bf16" if self.is_cuda else "fp32"
        return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def init() -> Runtime:
    """Join the process group torchrun describes (or a world of one) and pick this rank's device."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=group_backend(device), device_id=device if device.type == "cuda" else None)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def group_backend(device: torch.device) -> str:
    """gloo on CPU machines. On GPUs nccl for the GPU's tensors and gloo beside it for the CPU tensors some
    collectives carry (token_labels' timing sums, the pickled objects of all_gather_objects): an nccl-only group
    rejects those."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def session() -> Iterator[Runtime]:
    """`with distributed.session() as rt:` joins the group and always leaves it, even on error."""
    runtime = init()
    try:
        yield runtime
    finally:
        shutdown()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned; a no-op in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (picklable objects; for small metadata, not tensors)."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
