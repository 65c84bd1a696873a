"""Process group set-up and the one place that branches on CPU vs GPU.

Stages are launched by torchrun (which sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT);
run as a plain `python stages/x.py` they fall back to a world of one. Device: `launch.device` (`select_device`):
one GPU per local rank, never shared, and `cuda` never falls back to the CPU. Backend: nccl for CUDA tensors with
gloo for CPU tensors on GPU machines, gloo otherwise (`group_backend`). On a GPU: cuDNN autotuning and TF32
matmuls (`use_gpu_defaults`), channels-last images (`Runtime.image_memory_format`), fused AdamW
(`Runtime.fused_optimizer`), timings that wait for the device (`Runtime.synchronize`). Every stage says which of
these it runs with in one line at start (`Runtime.announce`). Every collective of the project goes through here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from coarse2fine.errors import UserError

if TYPE_CHECKING:
    from coarse2fine.mesh import ParallelDims

PRECISION_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    @property
    def fused_optimizer(self) -> bool:
        """torch's fused AdamW kernel (one launch for every tensor) on a GPU; the default elsewhere."""
        return self.is_cuda

    def precision(self, precision: str) -> str:
        """`auto` is fp32 on CPU (bf16 autocast is slower on these CPUs), bf16 on GPU."""
        if precision == "auto":
            return "bf16" if self.is_cuda else "fp32"
        return precision

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        """None means plain fp32."""
        return PRECISION_DTYPES[self.precision(precision)]

    def place(self, model: nn.Module) -> nn.Module:
        """`model` on this rank's device (in place, returned). Its parameters keep their layout: FSDP2 shards
        contiguous ones only, and channels-last images are enough to make the convolutions NHWC
        (`image_memory_format`)."""
        return model.to(self.device)

    @property
    def image_memory_format(self) -> torch.memory_format:
        """The layout of the images the loaders and token-label generation give the model. Channels-last on a GPU
        (timm's train.py --channels-last): cuDNN runs NHWC convolutions on tensor cores without transposes. NCHW
        on a CPU, though oneDNN is faster NHWC there too (`python bench/layout.py`, 2 cores: a training step of
        the default teacher 1.04-1.11x, of the default student 1.09-1.14x): it rounds differently, and the
        default pipeline then ended elsewhere in its seed spread (the fine-tuned model 82.2 % against the
        guide's 86.3), so the docs' CPU results would no longer be what `make repro` gives."""
        return torch.channels_last if self.is_cuda else torch.contiguous_format

    def data_view(self, dims: ParallelDims) -> Runtime:
        """This runtime as the training data sees it: its rank and world on the mesh's data dimension
        (coarse2fine.mesh). The ranks of one tensor or pipeline group read the same batches (they compute one model
        replica's step) and seed alike (the drop-path masks of a replicated activation must agree). With data
        parallelism only, the runtime itself."""
        return dataclasses.replace(self, rank=dims.coordinates(self.rank)["data"], world_size=dims.data)

    def synchronize(self) -> None:
        """Wait for the device's queued work: a GPU timing read without it measures the launches, not the work."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def describe(self, precision: str | None = None, loader: str | None = None) -> str:
        """'device cuda:0 x8, backend cpu:gloo,cuda:nccl, precision bf16, loader dali (gpu graph)': `precision` is
        a params value (auto resolved here), `loader` the loader backend the stage reads with (dali | torch)."""
        group = group_backend(self.device) if dist.is_initialized() else "none (a world of one)"
        parts = [f"device {self.device} x{self.world_size}", f"backend {group}"]
        if precision is not None:
            parts.append(f"precision {self.precision(precision)}")
        if loader is not None:
            parts.append(f"loader {loader} ({loader_graph(loader, self)})")
        return ", ".join(parts)

    def announce(self, stage: str, precision: str | None = None, loader: str | None = None) -> None:
        """The stage's one start-up line on rank 0: what it runs on (`describe`)."""
        if self.is_main:
            print(f"{stage}: {self.describe(precision, loader)}", flush=True)


def loader_graph(loader: str, runtime: Runtime) -> str:
    """Where a loader backend does its work on `runtime`: DALI decodes `mixed` on a GPU (dali_backend's
    decode device follows `Runtime.device_id`), the torch backend in CPU worker processes."""
    if loader == "dali":
        return "gpu graph" if runtime.is_cuda else "cpu graph"
    return "cpu workers"


def init(device: str = "auto") -> Runtime:
    """Join the process group torchrun describes (or a world of one) on the device `launch.device` asks for."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    chosen = select_device(device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
        use_gpu_defaults()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=group_backend(chosen), device_id=chosen if chosen.type == "cuda" else None)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=chosen)


def select_device(requested: str, local_rank: int, local_world_size: int) -> torch.device:
    """`launch.device`: cpu; cuda (this rank's own GPU, or a UserError); auto (cuda when torch sees a GPU, else
    cpu, said in the stage's start-up line). One GPU per local rank: ranks sharing a GPU would run at a fraction
    of its speed and memory, so too few GPUs is an error under auto too."""
    if requested == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 and requested == "auto":
        return torch.device("cpu")
    if gpus == 0:
        raise UserError(
            f"launch.device: cuda, but torch {torch.__version__} finds no usable GPU ({_no_gpu_reason()}); "
            f"set launch.device: cpu (or auto) to run on the CPU"
        )
    if gpus < local_world_size:
        raise UserError(
            f"launch.device: {requested}: {local_world_size} ranks on this node (launch.nproc_per_node) but torch "
            f"finds {gpus} GPU(s), and ranks would share GPUs: set launch.nproc_per_node to {gpus} or fewer"
        )
    return torch.device("cuda", local_rank)


def _no_gpu_reason() -> str:
    if torch.version.cuda is None:
        return "a CPU-only build of torch"
    return f"no GPU visible, or a driver too old for this build's CUDA {torch.version.cuda}"


def use_gpu_defaults() -> None:
    """What a GPU user expects (timm's and torchtitan's training scripts set the same):
    - cudnn.benchmark: every step has the same shapes, so cuDNN's fastest algorithm is found once and kept;
    - TF32 matmuls (cuDNN convolutions already default to TF32). torch 2.14 has two APIs for this: setting the new
      per-backend `torch.backends.cuda.matmul.fp32_precision` alone makes the legacy getters, which inductor
      still calls (`torch.get_float32_matmul_precision()` when it autotunes), raise "mix of the legacy and new
      APIs"; `set_float32_matmul_precision("high")` sets both consistently, with no deprecation warning."""
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")


def group_backend(device: torch.device) -> str:
    """gloo on CPU machines. On GPUs nccl for the GPU's tensors and gloo beside it for the CPU tensors some
    collectives carry (token_labels' timing sums, the pickled objects of all_gather_objects): an nccl-only group
    rejects those."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def ensure_process_group(device: torch.device) -> None:
    """A group even in a world of one, where init() joins none (FSDP's device mesh needs one); shutdown() ends it."""
    if not dist.is_initialized():
        dist.init_process_group(group_backend(device), store=dist.HashStore(), rank=0, world_size=1)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def session(device: str = "auto") -> Iterator[Runtime]:
    """`with distributed.session(params.launch.device) as rt:` joins the group and always leaves it, even on
    error."""
    runtime = init(device)
    try:
        yield runtime
    finally:
        shutdown()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over the ranks of `group` (None: all), in place and returned; a no-op in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, group: Any = None) -> None:
    """Overwrite the `tensors` (in place) of every rank of `group` (None: all) with global rank `src`'s; a no-op
    in a world of one."""
    if dist.is_initialized():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=src, group=group)


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
