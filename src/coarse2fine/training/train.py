"""The one training loop, shared by every training stage (the teacher, pre-training and fine-tuning).

Per optimizer update: `accum_steps` micro-batches through DDP, FSDP2, tensor or pipeline parallelism
(coarse2fine.parallel: a component built from params; gradients reduced only on the last micro-batch),
optional clipping, the optimizer step, the per-update LR schedule and the EMA. Per epoch: validation,
metrics, and a checkpoint that makes a killed run resumable with bit-identical results on CPU; inside an epoch,
a checkpoint every `checkpoint.every_minutes` or `checkpoint.every_updates` (params; `CheckpointSchedule`), after
an update, from which a resumed run continues the epoch's sample stream (the loaders' `set_epoch(epoch, batch)`).
The objective (losses.py) is given by the stage: label-smoothed cross-entropy on the ground truth by default,
or token labeling (with MixToken when the model was built with it).

Checkpoint (`<checkpoint_dir>/last.pt`, rewritten atomically after every epoch and inside one when due, loadable
with `torch.load(weights_only=True)`; deleted once the stage's outputs are written, see below):

    epoch      epochs completed = the next epoch to run; with `within_epoch`, the loaders' whole state, since their
               stream is a function of (seed, epoch, rank, world)
    within_epoch   None at an epoch's end; inside one, `EpochProgress` as a dict: the micro-batches of epoch `epoch`
               already trained on, and the epoch's sums so far (loss, samples, seconds, skipped updates, the
               objective's target statistics), so that its metrics come out as an uninterrupted epoch's: rank 0's,
               and under `ranks` every rank's, which each resumes
    updates    optimizer updates so far (the scheduler's and the EMA's clock)
    model, optimizer, scheduler, scaler, ema    state dicts (ema: None when off); under FSDP `sharded` instead
               of model and optimizer: the DCP directory beside the file holding them (coarse2fine.parallel)
    rng        one entry per rank: torch / numpy / random (/ cuda) generator states
    run_id     the MLflow run, reopened on resume
    history    every finished epoch's metrics: a resumed run rebuilds its DVCLive curves from them (DVC deletes
               a stage's outputs, the metrics files included, before running it) and logs the last epoch to
               MLflow if the killed run did not get to (`Tracker.resume_history`)
    inputs     what the result depends on: the params the stage reads (as dvc.yaml lists them: no speed knob
               such as loader.workers), the world size, and the stage's `provenance` (the data digest, the
               hash of the code the stage runs, the library versions). A checkpoint written under other
               inputs is set aside (SET_ASIDE_DIR), not resumed: a run killed under one params value must not
               be continued under another, and the outputs must stay a function of what is on disk now; unless
               the user asks for it (RESUME_ANYWAY), which the MLflow run records.

The checkpoint dir is resume state, not a DVC output (dvc.yaml passes `.resume/<stage>`, ignored by git and
DVC): a stage with such an output could not be restored from DVC's run cache. A finished run's result is what DVC
caches, so the checkpoint is deleted once the model file is written.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler, PolyLRScheduler
from timm.scheduler.scheduler import Scheduler
from timm.utils import ModelEmaV3
from torch import nn

from coarse2fine import checkpoints, config, distributed, files, forward
from coarse2fine.data import records
from coarse2fine.data.transforms import eval_transform
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.evaluate import evaluate
from coarse2fine.labels.targets import moved_among
from coarse2fine.parallel import strategies
from coarse2fine.progress import progress
from coarse2fine.tracking.identity import stage_params
from coarse2fine.training import losses

CHECKPOINT_FILE = "last.pt"
BEST_FILE = "best.pt"  # beside the checkpoint, with <stage>.keep: best: the best epoch's eval weights so far
PROGRESS_EVERY = 10  # steps between updates of the progress bar's loss, and checks of a non-finite loss
# Test-only fault injection: "EPOCH:STEP" (1-based) makes that micro-batch's loss NaN before its backward, as a
# diverging run's would be (tests/test_train.py). Unset in any real run.
NONFINITE_LOSS_HOOK = "C2F_TEST_NONFINITE_LOSS_AT"
# "1": resume a checkpoint although it was written under other inputs (other params, code, world size...): what
# differs is printed and tagged on the MLflow run (RESUMED_DESPITE_TAG). Without it such a checkpoint is set aside.
RESUME_ANYWAY = "C2F_RESUME_ANYWAY"
RESUMED_DESPITE_TAG = "resumed_despite"
SET_ASIDE_DIR = "set-aside"  # under the checkpoint directory: checkpoints of other inputs, never deleted
FUSED_OPTIMIZERS = ("adamw", "sgd")  # timm names torch.optim.AdamW and SGD, which have a fused kernel
# torch 2.14's fused SGD has no DTensor rule ("aten._fused_sgd_.default does not have a sharding strategy
# registered"); fused AdamW has. SGD's DTensors (FSDP, TP) take torch's default kernel instead (foreach on a GPU).
FUSED_DTENSOR_OPTIMIZERS = ("adamw",)
# Reading a checkpoint that fails with an OSError (a network file system's hiccup): tries, and seconds between them.
CHECKPOINT_READ_TRIES = 3
CHECKPOINT_READ_RETRY_SECONDS = 5.0


class Objective(Protocol):
    """`objective(train_forward's output, batch) -> scalar loss`, `prepare(batch)` before the forward (see
    losses.py)."""

    def prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def __call__(self, output: forward.TrainOutput, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...
    def target_metrics(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """What the targets taught since the last call, summed over every rank by `all_reduce_sum` (e.g. their
        entropy); {} for none. A collective: every rank calls it."""
        ...
    def state_dict(self) -> dict[str, Any]:
        """This rank's sums behind target_metrics since the last call (a checkpoint inside an epoch holds them)."""
        ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Loader(Protocol):
    """What the Trainer needs of `data.loaders.build_loader`'s result (see docs/contracts.md)."""

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Iterate epoch `epoch` from its batch `start_batch` on, exactly as an uninterrupted epoch goes on there."""
        ...
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...
    def __len__(self) -> int: ...


def seed_everything(seed: int, runtime: Runtime) -> None:
    """Seed torch, numpy and random with seed + rank: ranks draw different drop-path masks, reproducibly."""
    seed += runtime.rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(
    model: nn.Module, cfg: config.Optimizer, lr: float, *, fused: bool = False
) -> torch.optim.Optimizer:
    """`fused` (`Runtime.fused_optimizer`): one fused kernel per step where the class behind timm's name has one
    (torch.optim.AdamW and SGD: create_optimizer_v2 passes `fused` through); timm's LAMB and Kron have none."""
    # timm exempts 1-D params (norms, biases) and model.no_weight_decay() (pos_embed, cls_token) from weight
    # decay, so `model` must be the model itself: through a wrapper the names would not match.
    # Only what the optimizer takes: momentum (sgd, kron) or betas (adamw, lamb); timm drops the others unsaid.
    settings: dict[str, Any] = {"momentum": cfg.momentum} if cfg.name in ("sgd", "kron") else {"betas": cfg.betas}
    if cfg.name == "kron":
        if not torch.backends.opt_einsum.is_available():  # timm's Kron only warns; its einsums then took > 6 GB
            raise UserError("optimizer.name: kron needs the opt_einsum package (requirements.lock pins it): make setup")
        # Its preconditioner's random probes from its own generator (seeded alike on every rank, kept in its state
        # dict), not torch's, which seed_everything seeds per rank: DDP replicas stay identical and resumes exact.
        settings["deterministic"] = True
    kernel = {"fused": True} if fused and cfg.name in FUSED_OPTIMIZERS else {}
    unfused_dtensors = {"fused": False} if kernel and cfg.name not in FUSED_DTENSOR_OPTIMIZERS else {}
    optimizer = create_optimizer_v2(
        model, opt=cfg.name, lr=lr, weight_decay=cfg.weight_decay, **settings, **kernel,
        param_group_fn=lambda model: _groups_of_one_tensor_kind(model, cfg.weight_decay, unfused_dtensors),
    )
    if cfg.name == "kron" and next(model.parameters()).device.type == "cpu":
        # timm torch.compiles Kron's preconditioner maths, per parameter shape. On CPU (2 cores) each shape's
        # compile took 3-9 s, the compiled step was slower than eager (1.5 s vs 0.12 s for a 64x3x7x7 conv) and
        # one 64x64x3x3 conv's compile passed 6 GB: eager here. On a GPU, timm's compiled functions as shipped.
        from timm.optim import kron

        for name in ("_calc_A_and_conjB", "_q_terms", "_precond_grad", "_balance_Q"):
            setattr(optimizer, name, getattr(kron, name))
    return optimizer


def _groups_of_one_tensor_kind(
    model: nn.Module, weight_decay: float, dtensor_settings: dict[str, Any]
) -> list[dict[str, Any]]:
    """timm's weight-decay groups, each split into DTensors and plain tensors. torch's fused and foreach kernels
    take a group's tensors in one call and refuse a mix of the two ("got mixed torch.Tensor and DTensor"), which
    tensor parallelism without FSDP makes: the split blocks' DTensors beside the replicated stem, outlookers, norms
    and heads. Groups keep one optimizer and one schedule, and DCP keys the optimizer's state and settings by
    parameter name (coarse2fine.parallel), so a checkpoint loads under any grouping. (torchtitan instead makes every
    other parameter a replicated DTensor: VOLO's outlookers and BatchNorm would then run as DTensor operators.)
    `dtensor_settings`: the DTensor groups' own optimizer settings."""
    from torch.distributed.tensor import DTensor

    no_weight_decay = getattr(model, "no_weight_decay", set)()
    groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_weight_decay)
    return [
        {**group, "params": kind, **(dtensor_settings if is_dtensor else {})}
        for group in groups
        for is_dtensor in (False, True)
        if (kind := [param for param in group["params"] if isinstance(param, DTensor) == is_dtensor])
    ]


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: config.Train, updates_per_epoch: int) -> Scheduler:
    """Linear warm-up, then the decay to min_lr over `epochs`, then min_lr for the cooldown epochs; stepped per
    optimizer update (not per epoch)."""
    schedule = cfg.schedule
    warmup = round(schedule.warmup_epochs * updates_per_epoch)
    common = {"warmup_t": warmup, "warmup_lr_init": schedule.warmup_lr, "lr_min": schedule.min_lr, "t_in_epochs": False}
    if schedule.name == "cosine":  # timm's train.py and the reference: the warm-up overlays the cosine's start
        return CosineLRScheduler(optimizer, t_initial=cfg.epochs * updates_per_epoch, **common)
    # Colossal-AI's LinearWarmupLR: the decay starts at the peak where the warm-up ends (power 1: linear).
    return PolyLRScheduler(
        optimizer, t_initial=max(cfg.epochs * updates_per_epoch - warmup, 1), power=1.0, warmup_prefix=True, **common
    )


class CheckpointSchedule:
    """When a checkpoint is due inside an epoch (params `checkpoint`): every `every_updates` optimizer updates, or
    once `every_minutes` have passed since the last checkpoint. The clock is read every PROGRESS_EVERY updates and
    agreed on by every rank (one scalar all-reduce then: all of them must save together)."""

    def __init__(self, cfg: config.Checkpoint, device: torch.device):
        self.cfg, self.device = cfg, device
        self.last = time.monotonic()

    def due(self, updates: int) -> bool:
        if self.cfg.every_updates and updates % self.cfg.every_updates == 0:
            return True
        if not self.cfg.every_minutes or updates % PROGRESS_EVERY:
            return False
        late = time.monotonic() - self.last >= self.cfg.every_minutes * 60
        return distributed.all_reduce_sum(torch.tensor(float(late), device=self.device)).item() > 0

    def saved(self) -> None:
        self.last = time.monotonic()


@dataclass
class EpochProgress:
    """An epoch's running sums on this rank: its metrics at the end come from them. A checkpoint inside the epoch
    holds them (`within_epoch`), so that a resumed epoch's metrics are an uninterrupted one's."""

    batches: int = 0  # micro-batches trained on
    loss_sum: torch.Tensor | None = None  # sum of the micro-batch losses x their sizes (on the device)
    samples: int = 0
    seconds: float = 0.0  # of training, before this process resumed the epoch
    skipped_updates: int = 0
    objective: dict[str, Any] = field(default_factory=dict)  # the objective's state_dict

    def to_checkpoint(self) -> dict[str, Any]:
        return {**asdict(self), "loss_sum": self.loss_sum.cpu()}

    @classmethod
    def from_checkpoint(cls, within_epoch: dict[str, Any], rank: int, device: torch.device) -> EpochProgress:
        """Rank `rank`'s progress (the checkpoint's `within_epoch`); a rank the checkpointed run did not have
        (resumed anyway at another world size) goes on from the same batch with empty sums."""
        ranks = within_epoch.get("ranks", [within_epoch])  # a checkpoint from before `ranks`: rank 0's alone
        if rank >= len(ranks):
            return cls(batches=within_epoch["batches"], loss_sum=torch.zeros((), device=device))
        state = ranks[rank]
        objective = {key: value.to(device) if isinstance(value, torch.Tensor) else value
                     for key, value in state["objective"].items()}
        return cls(**{**state, "loss_sum": state["loss_sum"].to(device), "objective": objective})


@dataclass(frozen=True)
class StagePaths:
    """Where a training stage reads and writes: the Trainer's checkpoint directory, model file and metrics; the
    records its loaders read (None: synthetic batches, in tests), and what the stage assembly reads besides."""

    checkpoint_dir: Path
    model_file: Path
    metrics_dir: Path
    records: Path | None = None  # logged as the run's dataset inputs and artifacts
    token_labels: Path | None = None  # the students' store (read only when they learn from token labels)
    init_from: Path | None = None  # fine-tuning: the pre-trained model file

    @classmethod
    def under(cls, directory: Path, records: Path | None = None) -> StagePaths:
        """`directory`/ckpt, /model.pt and /metrics."""
        return cls(directory / "ckpt", directory / "model.pt", directory / "metrics", records)


class Trainer:
    """`Trainer(...).fit()` trains `model` for `cfg.total_epochs`, resuming from the checkpoint if there is one.

    Seed first (`seed_everything`), then build the model, so that a fresh run is reproducible.
    """

    def __init__(
        self,
        *,
        stage: str,
        params: config.Params,
        cfg: config.Train,
        model: nn.Module,
        classes: Sequence[str],
        train_loader: Loader,
        val_loader: Loader,
        runtime: Runtime,
        param_sections: Sequence[str],
        provenance: Mapping[str, str],
        paths: StagePaths,
        objective: Objective | None = None,
        model_cfg: config.Model | None = None,
    ):
        self.stage, self.params, self.cfg, self.runtime = stage, params, cfg, runtime
        self.classes = list(classes)
        self.train_loader, self.val_loader = train_loader, val_loader
        self.param_sections = tuple(param_sections)
        self.checkpoint_path = paths.checkpoint_dir / CHECKPOINT_FILE
        self.best_path = paths.checkpoint_dir / BEST_FILE
        self.model_file, self.metrics_dir = paths.model_file, paths.metrics_dir
        # The records the loaders read, for the run's dataset inputs and artifacts; None: synthetic batches (tests).
        self.records_dir = paths.records
        self.model_cfg = model_cfg or params.model  # what the model file records as the architecture

        self.autocast_dtype = runtime.autocast_dtype(cfg.precision)
        # DDP, FSDP, TP, a pipeline (params parallel): the loop below is the same under all of them.
        self.parallel = strategies.build(params.parallel, runtime, self.autocast_dtype)
        self.model = runtime.place(model)
        self.parallel.shard(self.model)
        # Only the training forward is compiled (forward.compiled_train_forward).
        train_forward = forward.compiled_train_forward(self.model) if cfg.compile else forward.TrainForward(self.model)
        self.train_forward = self.parallel.wrap(train_forward)

        self.data_ranks = self.parallel.dims.data  # the ranks reading distinct batches
        self.global_batch = cfg.global_batch(self.data_ranks)
        try:  # params.yaml was checked at the launch keys' world size; this is the world torchrun gave
            cfg.check_lr_decays(self.data_ranks)
        except ValueError as error:
            raise UserError(f"params.yaml: {stage}.{error}") from None
        self.lr = cfg.optimizer.peak_lr(self.global_batch)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.lr, fused=runtime.fused_optimizer)
        self.updates_per_epoch = math.ceil(len(train_loader) / cfg.accum_steps)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.updates_per_epoch)
        self.objective = objective or losses.GroundTruthObjective.from_params(cfg, len(self.classes))
        # Only fp16 needs loss scaling; a disabled scaler passes everything straight through.
        self.scaler = torch.amp.GradScaler(runtime.device.type, enabled=self.autocast_dtype == torch.float16)
        hook = os.environ.get(NONFINITE_LOSS_HOOK)
        self.nonfinite_loss_at = tuple(map(int, hook.split(":"))) if hook else None
        self.ema = ModelEmaV3(self.model, decay=cfg.ema.decay) if cfg.ema.enabled else None
        self.checkpoints = CheckpointSchedule(params.checkpoint, runtime.device)
        self.updates = 0
        self.start_epoch = 0
        self.resumed_epoch: EpochProgress | None = None  # where a checkpoint taken inside an epoch left it
        self.history: list[dict[str, float]] = []  # every finished epoch's metrics
        self.run_id: str | None = None  # the MLflow run (checkpointed: a resumed run continues it)
        self.last_checkpoint: str | None = None  # what the checkpoint on disk holds (for messages); None: none
        self.resumed_despite: list[str] = []  # the inputs a checkpoint resumed under RESUME_ANYWAY differed in
        # What the run's outcome depends on: a checkpoint written under anything else is stale.
        self.run_inputs = {
            **stage_params(params, self.param_sections), "world_size": str(runtime.world_size), **provenance
        }

    # ---------------------------------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, float]:
        """Train the remaining epochs; write the final model file and metrics; return the last epoch's metrics."""
        # Imported here, not at the top: the Trainer's steps run without MLflow and DVCLive (bench/gpu_step.py on a
        # GPU node that has only torch and timm).
        from coarse2fine.tracking.runs import Tracker

        self.load_checkpoint()
        with Tracker(
            self.stage, self.params, self.runtime, metrics_dir=self.metrics_dir, param_sections=self.param_sections,
            resume_run_id=self.run_id, system_metrics=True,
        ) as tracker:
            self.run_id = tracker.run_id
            tracker.resume_history(self.history)
            if self.resumed_despite:
                tracker.set_tag(RESUMED_DESPITE_TAG, ", ".join(self.resumed_despite))
            cfg, world = self.cfg, self.data_ranks
            self._print(
                f"{cfg.optimizer.describe_lr(self.global_batch)} (global batch {self.global_batch} = "
                f"{cfg.batch_size} per device x {cfg.accum_steps} accumulated x {world} ranks)"
            )
            tracker.log_setup(
                {"effective_lr": self.lr, "global_batch": self.global_batch, "world_size": self.runtime.world_size}
            )
            for split in ("train", "val") if self.records_dir else ():
                tracker.log_records(self.records_dir, split)
            for epoch in range(self.start_epoch, self.cfg.total_epochs):
                metrics = self.train_epoch(epoch) | self._validate()
                self.history.append(metrics)
                if self.cfg.keep == "best" and best_epoch(self.history)["best_epoch"] == epoch + 1:
                    self._save_best()  # before the checkpoint whose history names this epoch best
                self.save_checkpoint(epoch + 1)
                tracker.log_metrics(metrics, step=epoch)
                self._print(
                    f"epoch {epoch + 1}/{self.cfg.total_epochs}: train loss {metrics['train_loss']:.4f}, "
                    f"val top-1 {metrics['val_top1']:.2f} % top-5 {metrics['val_top5']:.2f} %, lr {metrics['lr']:.3g}, "
                    f"{metrics['train_img_per_s']:.0f} img/s, {metrics['epoch_seconds']:.1f} s"
                )
            if self.history:  # beside the last epoch's: what timm's and the reference's train.py report as best
                tracker.log_summary(best_epoch(self.history))
            final = self.eval_model  # under FSDP a collective: every rank gathers
            if self.runtime.is_main:
                if self.cfg.keep == "best" and self.history:
                    best = best_epoch(self.history)
                    final.load_state_dict(checkpoints.load_file(self.best_path, "the best epoch's weights"))
                    self._print(f"keeps epoch {best['best_epoch']}'s weights (val top-1 {best['best_val_top1']:.2f} %, "
                                f"the best; the last epoch's {self.history[-1]['val_top1']:.2f} %)")
                card = checkpoints.save_model_file(
                    self.model_file, final,
                    model_cfg=self.model_cfg, img_size=self.cfg.img_size, classes=self.classes, stage=self.stage,
                    eval_transform=eval_transform(
                        self.cfg.img_size, self.cfg.val_crop_pct, self.params.augment.interpolation
                    ),
                )
                tracker.tag_written_model(self.model_file)
                tracker.log_model(final, card)
            tracker.log_curves()
            for name in (records.CLASSES_FILE, records.MANIFEST_FILE) if self.records_dir else ():
                tracker.log_artifact(self.records_dir / name)
        if self.runtime.is_main:  # the outputs are written: DVC's cache keeps the result from here on
            for kept in (self.checkpoint_path, self.best_path):
                for written in (kept, *files.temporaries_of(kept)):
                    written.unlink(missing_ok=True)
            for shards in strategies.shard_directories(self.checkpoint_path.parent):
                shutil.rmtree(shards)
            with contextlib.suppress(OSError):  # the dir, if nothing else is in it
                self.checkpoint_path.parent.rmdir()
        return self.history[-1] if self.history else {}

    @property
    def eval_model(self) -> nn.Module:
        """What is validated and saved, as a plain module: the EMA weights when EMA is on."""
        return self.parallel.whole(self.ema.module if self.ema else self.model)

    def train_epoch(self, epoch: int) -> dict[str, float]:
        sums = self.resumed_epoch or EpochProgress(loss_sum=torch.zeros((), device=self.runtime.device))
        self.resumed_epoch = None
        self.objective.load_state_dict(sums.objective)
        self.train_loader.set_epoch(epoch, sums.batches)
        self.train_forward.train()
        num_batches = len(self.train_loader)
        # Micro-batches whose loss was not finite, and the first one's index: on the device, read at the checks.
        nonfinite = torch.zeros((), dtype=torch.long, device=self.runtime.device)
        first_nonfinite = torch.full((), -1, dtype=torch.long, device=self.runtime.device)
        self.runtime.synchronize()  # GPU timings wait for the queued work, at both ends
        start = time.perf_counter()
        batches = progress(
            self.train_loader, total=num_batches, initial=sums.batches,
            desc=f"{self.stage} epoch {epoch + 1}/{self.cfg.total_epochs}", disable=not self.runtime.is_main,
            leave=False,
        )
        for index, batch in enumerate(batches, start=sums.batches):
            # An update averages `accum_steps` micro-batches; the epoch's last one may get fewer.
            first = index - index % self.cfg.accum_steps
            micro_steps = min(self.cfg.accum_steps, num_batches - first)
            is_last_micro_step = index == first + micro_steps - 1
            poisoned = self.nonfinite_loss_at == (epoch + 1, index + 1)
            loss = self.backward(batch, micro_steps, sync=is_last_micro_step, poisoned=poisoned)
            if is_last_micro_step:
                sums.skipped_updates += self.optimizer_step()
            batch_size = len(batch["label"])
            sums.loss_sum += loss * batch_size
            sums.samples += batch_size
            sums.batches = index + 1
            if not self.scaler.is_enabled():  # fp16's scaler skips such steps itself (skipped_updates)
                bad = ~torch.isfinite(loss)
                first_nonfinite = torch.where(bad & (first_nonfinite < 0), index, first_nonfinite)
                nonfinite += bad
            if index % PROGRESS_EVERY == 0:  # loss.item() waits for the GPU: not on every step
                self._stop_on_nonfinite_loss(epoch, nonfinite, first_nonfinite, num_batches)
                batches.set_postfix(loss=f"{loss.item():.3f}", lr=f"{self._current_lr():.2e}", refresh=False)
            # Inside the epoch only: its end checkpoints anyway, after validation.
            if is_last_micro_step and sums.batches < num_batches and self.checkpoints.due(self.updates):
                self._stop_on_nonfinite_loss(epoch, nonfinite, first_nonfinite, num_batches)  # never save a NaN
                self.runtime.synchronize()
                sums.seconds += time.perf_counter() - start
                sums.objective = self.objective.state_dict()
                self.save_checkpoint(epoch, within_epoch=sums)
                start = time.perf_counter()
        self._stop_on_nonfinite_loss(epoch, nonfinite, first_nonfinite, num_batches)
        self.runtime.synchronize()
        seconds = sums.seconds + time.perf_counter() - start
        # DDP gives every forward rank 0's BatchNorm statistics, but each rank's last forward updated its
        # own: average them (as timm's train.py does), so that every rank validates the same model.
        for module in (self.model, self.ema.module) if self.ema else (self.model,):
            self.parallel.average_batchnorm(module)
        totals = distributed.all_reduce_sum(torch.stack([sums.loss_sum, sums.loss_sum.new_tensor(float(sums.samples))]))
        # The ranks of a tensor or pipeline group read the same batches: the images trained on, each once.
        images = totals[1].item() * self.data_ranks / self.runtime.world_size
        return {
            "train_loss": (totals[0] / totals[1]).item(),
            "lr": self._current_lr(),
            "train_img_per_s": images / seconds,  # global: every data rank's images
            # Ranks step together (every update waits for the all-reduce), so each rank's rate is the mean.
            "train_img_per_s_per_rank": images / seconds / self.runtime.world_size,
            "epoch_seconds": seconds,
            # fp16: the updates the grad scaler skipped for inf/NaN gradients (rank 0's; every rank skips alike).
            **({"skipped_updates": sums.skipped_updates} if self.scaler.is_enabled() else {}),
            # Every rank's sums on the device (a pipeline's earlier stages hold none: they compute no loss).
            **self.objective.target_metrics(lambda sums: distributed.all_reduce_sum(sums.to(self.runtime.device))),
        }

    def _stop_on_nonfinite_loss(
        self, epoch: int, nonfinite: torch.Tensor, first_nonfinite: torch.Tensor, num_batches: int
    ) -> None:
        """Stop the stage at a non-finite loss (a collective: every rank stops together), before this epoch's
        checkpoint, so the last good one stays. Not under fp16, whose grad scaler skips such updates (counted)."""
        if self.scaler.is_enabled() or distributed.all_reduce_sum(nonfinite.clone()).item() == 0:
            return
        step = min(first for first in distributed.all_gather_objects(first_nonfinite.item()) if first >= 0) + 1
        kept = (f"the last, {self.last_checkpoint}, in {self.checkpoint_path.parent} is kept" if self.last_checkpoint
                else "there was none yet")
        raise UserError(
            f"{self.stage}: the training loss is not finite at epoch {epoch + 1}, step {step} of {num_batches}: "
            f"stopped before the next checkpoint ({kept}); lower {self.stage}.optimizer.lr_base, set "
            f"{self.stage}.clip_grad, or train in fp32"
        )

    def backward(
        self, batch: dict[str, torch.Tensor], micro_steps: int, sync: bool, poisoned: bool = False
    ) -> torch.Tensor:
        """Accumulate the gradient of one micro-batch (1/micro_steps of the update); returns its detached loss.

        Without `sync`, the gradients are not reduced across ranks (DDP's no_sync, FSDP's
        set_requires_gradient_sync): only once, on the update's last micro-batch. `poisoned`: the loss made NaN
        (NONFINITE_LOSS_HOOK, tests only). The strategy runs the forward and backward (a pipeline's schedule splits
        the batch further, into its own micro-batches, and asks for the loss of each one's rows).
        """
        with self.parallel.gradient_sync(self.train_forward, sync):
            dtype = self.autocast_dtype
            batch = self.objective.prepare(batch)

            def loss_of(output: forward.TrainOutput, rows: torch.Tensor | None) -> torch.Tensor:
                loss = self.objective(output, batch if rows is None else micro_batch(batch, rows))
                return loss * float("nan") if poisoned else loss

            return self.parallel.forward_backward(
                self.train_forward, batch["image"], loss_of,
                lambda: torch.autocast(self.runtime.device.type, dtype=dtype, enabled=dtype is not None),
                lambda loss: self.scaler.scale(loss / micro_steps),
            )

    def optimizer_step(self) -> bool:
        """One update; returns whether fp16's grad scaler skipped it (inf/NaN gradients). With fp16 that costs a
        wait for the device per update (the scale is read back); without it, nothing."""
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        if self.cfg.clip_grad > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the fp16-scaled ones
            self.parallel.clip_grad_norm_(list(self.model.parameters()), self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        self.scheduler.step_update(self.updates)
        if self.ema:
            self.ema.update(self.model, step=self.updates)
        return scale is not None and self.scaler.get_scale() < scale  # the scaler backs off on every skip

    def _validate(self) -> dict[str, float]:
        result = evaluate(self.eval_model, self.val_loader, self.runtime, len(self.classes), self.cfg.precision)
        return {"val_top1": result.top1, "val_top5": result.top5, "val_loss": result.loss}

    def _current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _print(self, message: str) -> None:
        if self.runtime.is_main:
            print(f"{self.stage}: {message}", flush=True)

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, epochs_done: int, within_epoch: EpochProgress | None = None) -> None:
        """Every rank calls it (collectives); rank 0 writes the file (`within_epoch`: taken inside epoch
        `epochs_done`, its progress so far)."""
        rng = distributed.all_gather_objects(_rng_state(self.runtime))
        # Each rank's sums: the ranks of a pipeline's last stage alone hold the objective's, each data rank its loss.
        progress = distributed.all_gather_objects(within_epoch.to_checkpoint()) if within_epoch else None
        # Named by the update count: unique among a run's checkpoints, an epoch's end and inside one alike.
        weights = self.parallel.save_state(self.model, self.optimizer, self.checkpoint_path.parent, self.updates)
        self.checkpoints.saved()
        self.last_checkpoint = self._describe_checkpoint(epochs_done, within_epoch)
        if not self.runtime.is_main:
            return
        checkpoints.atomic_save(
            {
                "epoch": epochs_done,
                "within_epoch": {**progress[0], "ranks": progress} if progress else None,
                "updates": self.updates,
                **weights,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "ema": self.ema.module.state_dict() if self.ema else None,
                "rng": rng,
                "run_id": self.run_id,
                "history": list(self.history),
                "inputs": self.run_inputs,
            },
            self.checkpoint_path,
        )

    def _save_best(self) -> None:
        """The eval weights (the EMA's when on) as the best so far: every rank calls it (FSDP gathers), rank 0
        writes BEST_FILE."""
        state = self.eval_model.state_dict()
        if self.runtime.is_main:
            checkpoints.atomic_save(state, self.best_path)

    def _describe_checkpoint(self, epoch: int, within_epoch: EpochProgress | None) -> str:
        """For messages: "epoch 3's end", "epoch 4, batch 120 of 500"."""
        if within_epoch:
            return f"epoch {epoch + 1}, batch {within_epoch.batches} of {len(self.train_loader)}"
        return f"epoch {epoch}'s end"

    def _read_checkpoint(self) -> dict[str, Any]:
        """The checkpoint file on the CPU (RNG states must stay CPU tensors; load_state_dict moves the rest). A
        corrupt file is a UserError; an OSError (a network file system's hiccup) is retried, then a UserError
        saying the file is kept; lack of memory propagates as itself."""
        attempt = 1
        while True:
            try:
                return checkpoints.load_file(self.checkpoint_path, "checkpoint")
            except UserError as error:
                raise UserError(f"{error}; delete it to start afresh") from None
            except OSError as error:
                if attempt == CHECKPOINT_READ_TRIES:
                    raise UserError(
                        f"{self.checkpoint_path}: could not be read in {attempt} tries ({error}); it is kept: rerun "
                        f"once the file system is back"
                    ) from None
                attempt += 1
                self._print(
                    f"{self.checkpoint_path}: reading it failed ({error}); try {attempt} of {CHECKPOINT_READ_TRIES} "
                    f"in {CHECKPOINT_READ_RETRY_SECONDS:g} s"
                )
                time.sleep(CHECKPOINT_READ_RETRY_SECONDS)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Restore everything from the checkpoint, if there is one written under the same params."""
        if not self.checkpoint_path.exists():
            return None
        checkpoint = self._read_checkpoint()
        saved_inputs = checkpoint.get("inputs", {})
        changed = sorted(key for key in self.run_inputs.keys() | saved_inputs.keys()
                         if self.run_inputs.get(key) != saved_inputs.get(key))
        if changed and os.environ.get(RESUME_ANYWAY) != "1":
            aside = self._set_aside(checkpoint["epoch"])
            self._print(
                f"{self.checkpoint_path} was written under other {', '.join(changed)}: set aside in {aside}, starting "
                f"afresh (to resume it anyway: stop, move its files back to {self.checkpoint_path.parent} and rerun "
                f"with {RESUME_ANYWAY}=1)"
            )
            return None
        if changed:
            self._print(f"resuming {self.checkpoint_path} written under other {', '.join(changed)} ({RESUME_ANYWAY}=1)")
            self.resumed_despite = changed
        self.parallel.load_state(self.model, self.optimizer, checkpoint, self.checkpoint_path.parent)
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        if self.ema:
            self.ema.module.load_state_dict(checkpoint["ema"])
        if self.runtime.rank < len(checkpoint["rng"]):  # a rank the checkpointed run did not have keeps its seed
            _set_rng_state(checkpoint["rng"][self.runtime.rank])
        self.updates = checkpoint["updates"]
        self.start_epoch = checkpoint["epoch"]
        self.history, self.run_id = list(checkpoint["history"]), checkpoint["run_id"]
        within_epoch = checkpoint.get("within_epoch")
        if within_epoch:
            self.resumed_epoch = EpochProgress.from_checkpoint(within_epoch, self.runtime.rank, self.runtime.device)
        self.last_checkpoint = self._describe_checkpoint(self.start_epoch, self.resumed_epoch)
        self._print(f"resumed from {self.last_checkpoint} ({self.checkpoint_path})")
        return checkpoint

    def _set_aside(self, epoch: int) -> Path:
        """Move the checkpoint (file and DCP shards) under SET_ASIDE_DIR, once every rank has read it: a run under
        other inputs must not overwrite what may be days of training. Returns where it went."""
        directory = self.checkpoint_path.parent
        aside = directory / SET_ASIDE_DIR / f"epoch{epoch}-{time.strftime('%Y%m%dT%H%M%S')}"
        distributed.barrier()
        if self.runtime.is_main:
            aside.mkdir(parents=True, exist_ok=True)
            for path in [self.checkpoint_path, *strategies.shard_directories(directory)]:
                path.rename(aside / path.name)
        distributed.barrier()
        return aside


def best_epoch(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The best val top-1 of the finished epochs and its epoch (1-based; the first of equals, as timm's
    CheckpointSaver keeps the first checkpoint no later one beats, and sail-sg/volo's main.py reports it)."""
    best = max(range(len(history)), key=lambda epoch: history[epoch]["val_top1"])
    return {"best_val_top1": history[best]["val_top1"], "best_epoch": best + 1}


def micro_batch(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """A pipeline micro-batch's share of `batch`, `rows` its row indices: the rows of every per-sample tensor, and
    `moved` (indices into the batch, not a row per sample) for its own rows."""
    size = len(batch["image"])
    part = {key: value[rows] if value.ndim and len(value) == size else value
            for key, value in batch.items() if key != "moved"}
    if "moved" in batch:
        part["moved"] = moved_among(rows, batch["moved"])
    return part


def _rng_state(runtime: Runtime) -> dict[str, Any]:
    """This process's generator states as tensors and plain types (what weights_only loading accepts)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(runtime.device) if runtime.is_cuda else None,
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "random": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    random.setstate(state["random"])
