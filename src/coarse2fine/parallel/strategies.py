"""How the Trainer spreads its model over the ranks (params `parallel.strategy`): a component it holds, so that its
loop is the same under every strategy (torchtitan's parallelize step).

- `DataParallel` (ddp, the default): every rank holds the whole model; DistributedDataParallel averages the
  gradients, skipped (`no_sync`) on the micro-batches an accumulated update does not end with. Checkpoints hold
  the whole model and optimizer state, written by rank 0.
- `FullyShard` (fsdp): FSDP2's `fully_shard` on every block (a parameterised child of the model's Sequential and
  ModuleList containers: the entries of timm's VOLO `network` and post-network, ViT's blocks, ResNet's residual
  blocks), then on the root; each rank holds 1/world of every parameter, gradient and optimizer moment, and gathers
  one block at a time. Its `MixedPrecisionPolicy` gathers the parameters in the autocast dtype and reduces gradients
  in fp32.
  Checkpoints are `torch.distributed.checkpoint` (DCP) shards, which load at the same or another world size.
  Validation, the model file and MLflow get a plain (unsharded) replica filled from the full state dict, so
  evaluate, predict and the registry never need FSDP (the replica costs one unsharded copy of the weights, no
  gradients or moments). BatchNorm (teacher CNNs) is handled as under DDP: rank 0's weights and buffers at the
  start, its running statistics broadcast before every training forward, averaged at every epoch's end.
  With params `parallel.tensor` > 1 it first splits the transformer blocks over the mesh's tensor dimension
  (tensor_parallel), then shards over the data dimension only (FSDP2 + TP, "2-D"); with
  `strategy: ddp` and one data rank, TP alone, with the same DCP checkpoints and plain replica.
- `Pipelined` (params `parallel.pipeline` > 1): each rank keeps one stage of the model (pipeline_parallel),
  optionally split by TP and sharded by FSDP2 as above, and a micro-batched step runs through
  torch.distributed.pipelining's GPipe or 1F1B schedule (`forward_backward`). DCP checkpoints: every stage writes
  its own keys into one checkpoint, which loads under any layout.

The mesh (coarse2fine.mesh) is built only when a layout needs one; DataParallel runs on the default group.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
import torch.distributed as dist
from timm.utils import distribute_bn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from coarse2fine import distributed
from coarse2fine.config import Parallel
from coarse2fine.distributed import Runtime
from coarse2fine.files import no_space_behind, out_of_space
from coarse2fine.mesh import ParallelDims
from coarse2fine.parallel import model_blocks

# torch.save's zip writer when a file took fewer bytes than it wrote (a full disk, a quota, a file-size limit).
SHORT_WRITE = "unexpected pos"
SHARDS_PREFIX = "shards-"  # beside the checkpoint file: DCP's files under FSDP, a directory per checkpoint


# The Trainer's loss of a micro-batch: its objective on the training forward's output for the batch's `rows`
# (None: all of them; a pipeline's micro-batch: its row indices).
LossOf = Callable[[Any, "torch.Tensor | None"], torch.Tensor]


class Parallelism(Protocol):
    dims: ParallelDims  # the layout: the Trainer's global batch counts the data ranks only

    def shard(self, model: nn.Module) -> None:
        """Before the optimizer exists: spread `model`'s parameters over the ranks (in place)."""
        ...

    def wrap(self, train_forward: nn.Module) -> nn.Module:
        """The module the training loop calls."""
        ...

    def gradient_sync(self, train_forward: nn.Module, enabled: bool) -> ContextManager:
        """Around one micro-batch's backward: whether its gradients are reduced across ranks now."""
        ...

    def forward_backward(self, train_forward: nn.Module, images: torch.Tensor, loss_of: LossOf,
                         autocast: Callable[[], ContextManager], scale: Callable[[torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
        """One micro-batch's forward (under `autocast`) and the backward of `scale(loss)`; returns the loss,
        detached, on every rank."""
        ...

    def clip_grad_norm_(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        ...

    def average_batchnorm(self, module: nn.Module) -> None:
        """BatchNorm running statistics averaged over the ranks that train replicas of them (an epoch's end)."""
        ...

    def whole(self, model: nn.Module) -> nn.Module:
        """`model` (or a copy) as a plain module holding every weight, for validation and export. Every rank calls
        it (under FSDP it is a collective)."""
        ...

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path,
                   tag: int) -> dict[str, Any]:
        """Every rank calls it; what goes into the checkpoint file for the model and optimizer (`tag`: unique and
        increasing within a run, the update count)."""
        ...

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any],
                   checkpoint_dir: Path) -> None:
        ...


def shard_directories(checkpoint_dir: Path) -> list[Path]:
    """The DCP shards the sharded strategies wrote beside a checkpoint file: with it, they are the checkpoint."""
    return sorted(checkpoint_dir.glob(f"{SHARDS_PREFIX}*"))


def build(cfg: Parallel, runtime: Runtime, param_dtype: torch.dtype | None) -> Parallelism:
    dims = ParallelDims.of_run(cfg, runtime.world_size)
    if dims.pipeline > 1:
        return Pipelined(runtime, param_dtype, dims, cfg)
    if cfg.strategy == "fsdp" or dims.tensor > 1:
        return FullyShard(runtime, param_dtype, dims, shard_data=cfg.strategy == "fsdp")
    return DataParallel(runtime)


def plain_forward_backward(train_forward: nn.Module, images: torch.Tensor, loss_of: LossOf,
                           autocast: Callable[[], ContextManager], scale: Callable[[torch.Tensor], torch.Tensor]
                           ) -> torch.Tensor:
    with autocast():
        loss = loss_of(train_forward(images), None)
    scale(loss).backward()
    return loss.detach()


class DataParallel:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.dims = ParallelDims.data_only(runtime.world_size)

    forward_backward = staticmethod(plain_forward_backward)

    def clip_grad_norm_(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def average_batchnorm(self, module: nn.Module) -> None:
        if dist.is_initialized():
            distribute_bn(module, self.runtime.world_size, reduce=True)

    def shard(self, model: nn.Module) -> None:
        pass

    def wrap(self, train_forward: nn.Module) -> nn.Module:
        if not dist.is_initialized():
            return train_forward
        device_ids = [self.runtime.device.index] if self.runtime.is_cuda else None  # CPU modules must get None
        return DistributedDataParallel(train_forward, device_ids=device_ids)

    def gradient_sync(self, train_forward: nn.Module, enabled: bool) -> ContextManager:
        skip = not enabled and isinstance(train_forward, DistributedDataParallel)
        return train_forward.no_sync() if skip else contextlib.nullcontext()

    def whole(self, model: nn.Module) -> nn.Module:
        return model

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path,
                   tag: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any],
                   checkpoint_dir: Path) -> None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])


class FullyShard:
    def __init__(self, runtime: Runtime, param_dtype: torch.dtype | None, dims: ParallelDims | None = None,
                 shard_data: bool = True):
        self.runtime, self.param_dtype = runtime, param_dtype
        self.dims = dims or ParallelDims.data_only(runtime.world_size)
        self.shard_data = shard_data  # FSDP on the data dimension (strategy fsdp); else TP alone, on one data rank
        self.mesh: Any = None  # the DeviceMesh, built when the layout has a tensor or pipeline dimension
        self.replica = nn.Module()  # the model's plain copy, made by shard()

    def shard(self, model: nn.Module) -> None:
        self._start(model)
        self._parallelize(model, model)

    def _start(self, model: nn.Module) -> None:
        distributed.ensure_process_group(self.runtime.device)
        # Ranks seed differently (their own drop-path masks) and so build different weights: start from rank 0's,
        # as DistributedDataParallel's constructor does.
        distributed.broadcast_tensors([*model.parameters(), *model.buffers()])
        self.replica = copy.deepcopy(model)  # plain: validation and export load the gathered weights into it
        if self.dims.model_parallel:  # data parallelism alone keeps the default group it always used
            self.mesh = self.dims.build_mesh(self.runtime.device)

    def _parallelize(self, model: nn.Module, root: nn.Module) -> None:
        """TP over the tensor dimension, then FSDP2 over the data dimension on `model`'s blocks and on `root` (the
        module whose forward is called: the model, or a pipeline stage's forward)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        from coarse2fine.parallel import tensor_parallel

        if self.dims.tensor > 1:
            tensor_parallel.parallelize(model, self.mesh["tensor"])
        if not self.shard_data or (self.mesh is not None and self.dims.data == 1):
            return
        data_mesh = self.mesh["data"] if self.mesh is not None else None
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        placement = tensor_parallel.fsdp_placement if self.dims.tensor > 1 else None
        # BatchNorm's weights stay fp32 and its input as autocast made it, as under DDP (and FSDP1's MixedPrecision,
        # whose default _module_classes_to_ignore): its running statistics are fp32, and the CPU's kernel refuses
        # bf16 weights beside them ("expected scalar type BFloat16 but found Float").
        full_precision = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                              cast_forward_inputs=False)
        for norm in (module for module in model.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)):
            fully_shard(norm, mesh=data_mesh, mp_policy=full_precision, shard_placement_fn=placement)
        for block in model_blocks.blocks(model):
            fully_shard(block, mesh=data_mesh, mp_policy=policy, shard_placement_fn=placement)
        fully_shard(root, mesh=data_mesh, mp_policy=policy, shard_placement_fn=placement)
        if root is model and hasattr(model, "forward_train"):  # VOLO's training forward (forward.TrainForward)
            register_fsdp_forward_method(model, "forward_train")  # gathers as forward does

    def _data_group(self) -> tuple[Any, int]:
        """The process group of this rank's data dimension (None: the default group) and its first rank."""
        if self.mesh is None:
            return None, 0
        coordinates = self.dims.coordinates(self.runtime.rank)
        return self.mesh.get_group("data"), self.dims.rank_at(coordinates["pipeline"], 0, coordinates["tensor"])

    def wrap(self, train_forward: nn.Module) -> nn.Module:
        """BatchNorm as under DDP (its broadcast_buffers): every training forward starts from the first data
        rank's running statistics; the Trainer averages them at the epoch's end."""
        buffers = [buffer for module in train_forward.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)
                   for buffer in (module.running_mean, module.running_var) if buffer is not None]
        group, first = self._data_group()
        if buffers and self.dims.data > 1:
            train_forward.register_forward_pre_hook(
                lambda module, args: distributed.broadcast_tensors(buffers, src=first, group=group)
            )
        return train_forward

    def gradient_sync(self, train_forward: nn.Module, enabled: bool) -> ContextManager:
        return _requires_gradient_sync(train_forward, enabled)

    forward_backward = staticmethod(plain_forward_backward)

    def clip_grad_norm_(self, parameters: list[nn.Parameter], max_norm: float) -> None:
        if self.mesh is None:
            torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            return
        # torch's clip_grad_norm_ stacks the per-tensor norms, which fails on TP's mix of DTensor (split blocks)
        # and plain (replicated) gradients, and sees one pipeline stage's: the norm of the whole model's
        # gradient from each tensor's full norm, summed over the stages (torchtitan's clip_grad_norm_ does so).
        from torch.distributed.tensor import DTensor

        grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
        norms = [grad.norm() for grad in grads]
        squares = torch.stack([(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2 for norm in norms])
        total = squares.sum()
        if self.dims.pipeline > 1:
            distributed.all_reduce_sum(total, group=self.mesh.get_group("pipeline"))
        # A 0-dim tensor, not read back (no wait for the device): DTensors take it as a replicated scalar.
        coefficient = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(coefficient)

    def average_batchnorm(self, module: nn.Module) -> None:
        group, _ = self._data_group()
        if self.dims.data == 1 or not dist.is_initialized():
            return
        for name, buffer in module.named_buffers():
            if "running_mean" in name or "running_var" in name:  # as timm's distribute_bn
                distributed.all_reduce_sum(buffer, group=group)
                buffer /= self.dims.data

    def whole(self, model: nn.Module) -> nn.Module:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.replica.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
        return self.replica

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: Path,
                   tag: int) -> dict[str, Any]:
        """DCP shards in `checkpoint_dir/shards-<tag>`, written under a temporary name and renamed by rank 0 once
        every rank has finished. The shards the checkpoint file still names (the newest before these) are kept
        until the next save: a kill before the file is rewritten resumes from a consistent pair."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer, options=_optimizer_by_name())
        name = f"{SHARDS_PREFIX}{tag}"
        partial = checkpoint_dir / f"{name}.partial"
        if self.runtime.is_main:
            named = sorted(checkpoint_dir.glob(f"{SHARDS_PREFIX}*[0-9]"), key=lambda path: int(path.name.split("-")[1]))
            for stale in [*named[:-1], *checkpoint_dir.glob(f"{SHARDS_PREFIX}*.partial")]:
                shutil.rmtree(stale, ignore_errors=True)
        distributed.barrier()
        try:
            dcp.save(_writable({"model": model_state, "optimizer": optimizer_state}), checkpoint_id=partial)
        except dcp.api.CheckpointException as error:  # every rank gets every rank's failures
            raise _out_of_space(error, partial) from None
        distributed.barrier()
        if self.runtime.is_main:
            shutil.rmtree(checkpoint_dir / name, ignore_errors=True)
            partial.rename(checkpoint_dir / name)
        return {"sharded": name}

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: dict[str, Any],
                   checkpoint_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer, options=_optimizer_by_name())
        state = {"model": model_state, "optimizer": optimizer_state}
        readable = _writable(state)
        dcp.load(readable, checkpoint_id=checkpoint_dir / checkpoint["sharded"])  # reshards to this layout
        state = _layout_of(readable, state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_optimizer_by_name())


class Pipelined(FullyShard):
    """One pipeline stage per rank (pipeline_parallel), TP and FSDP2 inside it as FullyShard does, and each
    micro-batched step through torch.distributed.pipelining's schedule."""

    def __init__(self, runtime: Runtime, param_dtype: torch.dtype | None, dims: ParallelDims, cfg: Parallel):
        super().__init__(runtime, param_dtype, dims, shard_data=cfg.strategy == "fsdp")
        self.schedule_name, self.microbatches = cfg.schedule, cfg.microbatches
        self.stage_index = dims.coordinates(runtime.rank)["pipeline"]
        self.parts: dict[str, int] = {}
        self.stage_forward = nn.Module()
        self.stage: Any = None  # the PipelineStage and its schedule, made by wrap()
        self.schedule: Any = None
        self.micro_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None  # the running step's

    def shard(self, model: nn.Module) -> None:
        from coarse2fine.parallel import pipeline_parallel

        self._start(model)
        self.parts = pipeline_parallel.assign(model, self.dims.pipeline)
        pipeline_parallel.keep_stage(model, self.stage_index, self.parts)
        self.stage_forward = pipeline_parallel.StageForward(model, self.stage_index, self.parts)
        # The stage's forward is FSDP's root: the pipeline calls it, not the model, and it holds the top-level
        # parameters (stem, heads); the pipeline's stage then drives FSDP's gradient sync per micro-batch.
        self._parallelize(model, self.stage_forward)

    def wrap(self, train_forward: nn.Module) -> nn.Module:
        """The schedule around this stage (`train_forward`, the Trainer's forward.TrainForward, is replaced by the
        stage's share of it)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.stage = PipelineStage(self.stage_forward, self.stage_index, self.dims.pipeline, self.runtime.device,
                                   group=self.mesh.get_group("pipeline"))
        schedule = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        # Not scale_grads: it divides the .grad tensors in place after each step, also what the Trainer's earlier
        # micro-batches of an accumulated update left there; each micro-batch's loss is divided instead.
        self.schedule = schedule(self.stage, n_microbatches=self.microbatches, scale_grads=False,
                                 loss_fn=lambda output, rows: self.micro_loss(output, rows))
        return super().wrap(self.stage_forward)

    def forward_backward(self, train_forward: nn.Module, images: torch.Tensor, loss_of: LossOf,
                         autocast: Callable[[], ContextManager], scale: Callable[[torch.Tensor], torch.Tensor]
                         ) -> torch.Tensor:
        """The schedule's step: the first stage feeds the images, the last computes each micro-batch's loss on its
        rows of the batch (the schedule splits a row-index target as it splits the images). The mean loss is sent
        from the last stage to the others, whose metrics and checks need it too."""
        from coarse2fine.forward import TrainOutput

        losses = []
        # The schedule's first step infers the shapes of the gradients between stages by a backward from the loss
        # of a forward on uninitialised inputs (PipelineStage's dynamic metadata inference): that loss need only
        # depend on the outputs, and must not reach the objective, whose running sums it would spoil.
        inferring = not getattr(self.schedule, "_stage_backward_initialized", True)

        def micro_loss(output: Any, rows: torch.Tensor) -> torch.Tensor:
            nonlocal inferring
            if inferring:
                inferring = False
                return sum(tensor.sum() for tensor in (output if isinstance(output, tuple) else (output,))) * 0
            loss = loss_of(TrainOutput(*output) if isinstance(output, tuple) else TrainOutput(output), rows)
            losses.append(loss.detach())
            return scale(loss) / self.microbatches  # micro-batch means: their mean is the batch's

        self.micro_loss = micro_loss
        inputs = (images,) if self.stage.is_first else ()
        rows = torch.arange(len(images), device=images.device) if self.stage.is_last else None
        with autocast():
            self.schedule.step(*inputs, target=rows, return_outputs=False)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=images.device)
        coordinates = self.dims.coordinates(self.runtime.rank)
        last = self.dims.rank_at(self.dims.pipeline - 1, coordinates["data"], coordinates["tensor"])
        distributed.broadcast_tensors([loss], src=last, group=self.mesh.get_group("pipeline"))
        return loss

    def whole(self, model: nn.Module) -> nn.Module:
        """The replica filled pipeline stage by pipeline stage: each tensor from the first data and tensor rank of the
        pipeline stage holding it, gathered there over TP and FSDP."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from coarse2fine.parallel import pipeline_parallel

        local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        for key, tensor in self.replica.state_dict().items():
            source = self.dims.rank_at(pipeline_parallel.owner(key, self.parts), 0, 0)
            if self.runtime.rank == source:
                tensor.copy_(local[key])
            distributed.broadcast_tensors([tensor], src=source)
        return self.replica


def _optimizer_by_name() -> Any:
    """DCP's options for the optimizer's state dict: its settings (lr, weight decay...) keyed by parameter name like
    its moments, not by param-group position (torchtitan does so). A checkpoint then loads under another grouping
    (coarse2fine.training.train groups by tensor kind) and keeps every pipeline stage's settings: positional groups
    are the same keys on every pipeline stage, and DCP writes one stage's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _writable(state: Any) -> Any:
    """`state` with every DTensor's `_StridedShard` placements (TP's fused q/k/v projections, FSDP's shards of a
    TP shard, and their moments) gathered (Replicate) on their mesh dimensions: DCP writes a rank's piece as one
    contiguous chunk and refuses a strided one ("overlapping chunks"). What it writes is the whole tensor's layout,
    which a plain model, FSDP and another TP size read back. It costs those tensors gathered over the strided
    dimensions while saving (ViT-B/16 under TP alone: its 21 M q/k/v weights, 0.25 GB with AdamW's moments)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(state, dict):
        return {key: _writable(value) for key, value in state.items()}
    if isinstance(state, DTensor) and any(isinstance(placement, _StridedShard) for placement in state.placements):
        placements = [Replicate() if isinstance(placement, _StridedShard) else placement
                      for placement in state.placements]
        return state.redistribute(placements=placements)
    return state


def _layout_of(loaded: Any, like: Any) -> Any:
    """`loaded` (a `_writable` state read back) in the placements of `like` (the state it was made from)."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, dict):
        return {key: _layout_of(loaded[key], value) for key, value in like.items()}
    if isinstance(like, DTensor) and loaded is not like:
        return loaded.redistribute(placements=like.placements)
    return loaded


def _out_of_space(error: BaseException, partial: Path) -> BaseException:
    """DCP's failure as the one-line UserError of a full disk when a rank's write ran out of space (the temporary
    shards removed; the last checkpoint, file and shards, stays whole), else as it is. DCP hands each rank's
    failure over pickled, without the OSError torch.save's RuntimeError was raised from: a short write is the sign."""
    failures = [failure for failure, _ in error.failures.values()]
    full = [failure for failure in map(no_space_behind, failures) if failure is not None]
    if not full and not any(SHORT_WRITE in str(failure) for failure in failures):
        return error
    shutil.rmtree(partial, ignore_errors=True)
    cleanup = "the temporary shards are removed, the last checkpoint kept"
    return out_of_space(partial, full[0] if full else "a shard written short (a full disk or quota)", cleanup)


@contextlib.contextmanager
def _requires_gradient_sync(train_forward: nn.Module, enabled: bool) -> Iterator[None]:
    """FSDP2's no_sync: without sync, the gradients stay unsharded and accumulate locally until the last micro-batch
    (set on every FSDP module of the model, then restored)."""
    from torch.distributed.fsdp import FSDPModule

    modules = [module for module in train_forward.modules() if isinstance(module, FSDPModule)]
    for module in modules:
        module.set_requires_gradient_sync(enabled, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)
