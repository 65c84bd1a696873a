"""How the Trainer spreads its model over the ranks (params `parallel.strategy`): a component it holds, so that its
loop is the same under every strategy (torchtitan's parallelize step).

- `DataParallel` (ddp, the default): every rank holds the whole model; DistributedDataParallel averages the
  gradients, skipped (`no_sync`) on the micro-batches an accumulated update does not end with. Checkpoints hold
  the whole model and optimizer state, written by rank 0.
- `FullyShard` (fsdp): FSDP2's `fully_shard` on every block (a parameterised child of the model's Sequential and
  ModuleList containers: timm's VOLO stages and post-network, ViT's blocks, ResNet's residual blocks), then on the
  root; each rank holds 1/world of every parameter, gradient and optimizer moment, and gathers one block at a time.
  Its `MixedPrecisionPolicy` gathers the parameters in the autocast dtype and reduces gradients in fp32.
  Checkpoints are `torch.distributed.checkpoint` (DCP) shards, which load at the same or another world size.
  Validation, the model file and MLflow get a plain (unsharded) replica filled from the full state dict, so
  evaluate, predict and the registry never need FSDP (the replica costs one unsharded copy of the weights, no
  gradients or moments). BatchNorm (teacher CNNs) is handled as under DDP: rank 0's weights and buffers at the
  start, its running statistics broadcast before every training forward, averaged at every epoch's end.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path
from typing import Any, ContextManager, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from coarse2fine import distributed
from coarse2fine.distributed import Runtime
from coarse2fine.files import no_space_behind, out_of_space

# torch.save's zip writer when a file took fewer bytes than it wrote (a full disk, a quota, a file-size limit).
SHORT_WRITE = "unexpected pos"
SHARDS_PREFIX = "shards-"  # beside the checkpoint file: DCP's files under FSDP, a directory per checkpoint


class Parallelism(Protocol):
    def shard(self, model: nn.Module) -> None:
        """Before the optimizer exists: spread `model`'s parameters over the ranks (in place)."""
        ...

    def wrap(self, train_forward: nn.Module) -> nn.Module:
        """The module the training loop calls."""
        ...

    def gradient_sync(self, train_forward: nn.Module, enabled: bool) -> ContextManager:
        """Around one micro-batch's backward: whether its gradients are reduced across ranks now."""
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


def build(strategy: str, runtime: Runtime, param_dtype: torch.dtype | None) -> Parallelism:
    return FullyShard(runtime, param_dtype) if strategy == "fsdp" else DataParallel(runtime)


class DataParallel:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

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
    def __init__(self, runtime: Runtime, param_dtype: torch.dtype | None):
        self.runtime, self.param_dtype = runtime, param_dtype
        self.replica = nn.Module()  # the model's plain copy, made by shard()

    def shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        distributed.ensure_process_group(self.runtime.device)
        # Ranks seed differently (their own drop-path masks) and so build different weights: start from rank 0's,
        # as DistributedDataParallel's constructor does.
        distributed.broadcast_tensors([*model.parameters(), *model.buffers()])
        self.replica = copy.deepcopy(model)  # plain: validation and export load the gathered weights into it
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for block in blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if hasattr(model, "forward_train"):  # VOLO's training forward (models.TrainForward) gathers as forward does
            register_fsdp_forward_method(model, "forward_train")

    def wrap(self, train_forward: nn.Module) -> nn.Module:
        """BatchNorm as under DDP (its broadcast_buffers): every training forward starts from rank 0's running
        statistics; the Trainer averages them at the epoch's end."""
        buffers = [buffer for module in train_forward.modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)
                   for buffer in (module.running_mean, module.running_var) if buffer is not None]
        if buffers and self.runtime.world_size > 1:
            train_forward.register_forward_pre_hook(lambda module, args: distributed.broadcast_tensors(buffers))
        return train_forward

    def gradient_sync(self, train_forward: nn.Module, enabled: bool) -> ContextManager:
        return _requires_gradient_sync(train_forward, enabled)

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

        model_state, optimizer_state = get_state_dict(model, optimizer)
        name = f"{SHARDS_PREFIX}{tag}"
        partial = checkpoint_dir / f"{name}.partial"
        if self.runtime.is_main:
            named = sorted(checkpoint_dir.glob(f"{SHARDS_PREFIX}*[0-9]"), key=lambda path: int(path.name.split("-")[1]))
            for stale in [*named[:-1], *checkpoint_dir.glob(f"{SHARDS_PREFIX}*.partial")]:
                shutil.rmtree(stale, ignore_errors=True)
        distributed.barrier()
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial)
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

        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=checkpoint_dir / checkpoint["sharded"])  # reshards to this world size
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


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


def blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The units FSDP shards one by one: the members holding parameters of the model's own Sequential and
    ModuleList children, nested containers flattened; a block's inner containers stay inside it."""
    for child in model.children():
        if isinstance(child, (nn.Sequential, nn.ModuleList)):
            yield from _members(child)


def _members(container: nn.Module) -> Iterator[nn.Module]:
    for member in container.children():
        if isinstance(member, (nn.Sequential, nn.ModuleList)):
            yield from _members(member)
        elif any(True for _ in member.parameters()):
            yield member


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
