"""The Trainer: LR scaling and schedule, weight-decay groups, gradient accumulation, checkpoints; DDP keeping two
real ranks identical. (A SIGKILLed pretrain stage resuming to exactly the uninterrupted result, its MLflow run
continued, is tests/faults/test_kill_mid_epoch.py's subject, after an epoch tests/test_pipeline.py's; that pretrain
learns, tests/test_pipeline.py's.)

Run as a script (`torchrun --nproc_per_node=2 tests/test_train.py RECORDS OUT`), this file is the per-rank
program of `test_ddp_ranks_end_with_identical_weights`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ListLoader, cpu_runtime, make_params, train_val_loaders
from timm.optim import Lamb
from timm.optim import kron as timm_kron
from timm.optim.kron import Kron

from coarse2fine import distributed, models
from coarse2fine.data import records
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.training import train

NUM_CLASSES = 10
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
# Per-epoch metrics that measure the machine, not the training: they differ between any two runs.
TIMING_METRICS = {"train_img_per_s", "train_img_per_s_per_rank", "epoch_seconds"}


def random_batch(size: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 3, 32, 32, generator=generator)
    return {"image": images, "label": torch.randint(0, NUM_CLASSES, (size,), generator=generator)}


def make_trainer(
    tmp_path: Path, *, runtime: Runtime | None = None, batches: int = 10, model_seed: int = 0,
    provenance: dict[str, str] | None = None, loader: dict | None = None, train_batches: list | None = None,
    checkpoint: dict | None = None, **pretrain
) -> train.Trainer:
    """A Trainer of a small VOLO; its loaders yield `train_batches` (train and val), else `batches` Nones (for the
    tests that never iterate them)."""
    params = make_params(pretrain=pretrain, loader=loader or {}, checkpoint=checkpoint or {})
    torch.manual_seed(model_seed)
    model = models.build_model(params.model, NUM_CLASSES, params.pretrain.img_size)
    loader = ListLoader(train_batches or [None] * batches)
    return train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(NUM_CLASSES)],
        train_loader=loader, val_loader=loader, runtime=runtime or cpu_runtime(),
        param_sections=("seed", "model", "pretrain", "loader.backend"),  # pretrain's, less augment
        provenance=provenance or {"data_digest": "digits", "code": "abc"},
        paths=train.StagePaths(tmp_path / "ckpt", tmp_path / "model" / "model.pt", tmp_path / "metrics"),
    )


# ------------------------------------------------------------------------------------------------ optimisation


def test_lr_is_scaled_by_the_global_batch(tmp_path):
    four_ranks = Runtime(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"))
    trainer = make_trainer(tmp_path, runtime=four_ranks, batch_size=16, accum_steps=2, optimizer={"lr_base": 4e-3})
    assert trainer.global_batch == 16 * 2 * 4
    assert trainer.lr == pytest.approx(4e-3 * 128 / 1024)


def test_schedule_warms_up_then_decays_per_update(tmp_path):
    # 10 batches / accum 2 = 5 updates per epoch; 4 epochs = 20 updates, the first 5 (one epoch) warming up.
    schedule = {"warmup_epochs": 1, "warmup_lr": 1e-6, "min_lr": 1e-5}
    trainer = make_trainer(tmp_path, batches=10, accum_steps=2, epochs=4, schedule=schedule)
    peak, warmup_lr, min_lr = trainer.lr, 1e-6, 1e-5
    assert trainer.updates_per_epoch == 5

    def cosine(t: int) -> float:
        return min_lr + 0.5 * (peak - min_lr) * (1 + math.cos(math.pi * t / 20))

    expected = {0: warmup_lr, 2: warmup_lr + 2 * (peak - warmup_lr) / 5, 5: cosine(5), 10: cosine(10), 20: min_lr}
    seen = {}
    for update in range(21):
        if update:
            trainer.optimizer_step()  # no gradients: the parameters stay, the clock advances
        seen[update] = [group["lr"] for group in trainer.optimizer.param_groups]
    for update, lr in expected.items():
        assert seen[update] == pytest.approx([lr] * len(trainer.optimizer.param_groups), rel=1e-9), update


def lrs_per_update(trainer: train.Trainer, updates: int) -> list[float]:
    seen = [trainer.optimizer.param_groups[0]["lr"]]
    for _ in range(updates):
        trainer.optimizer_step()  # no gradients: the parameters stay, the clock advances
        seen.append(trainer.optimizer.param_groups[0]["lr"])
    return seen


def test_cooldown_epochs_hold_min_lr_after_the_decay(tmp_path):
    """The reference's --cooldown-epochs: `epochs` of warm-up + cosine, then the cooldown at min_lr (300 + 10)."""
    schedule = {"warmup_epochs": 1, "min_lr": 1e-5, "cooldown_epochs": 2}
    trainer = make_trainer(tmp_path, batches=5, epochs=3, schedule=schedule)  # 5 updates per epoch
    assert trainer.cfg.total_epochs == 5
    seen = lrs_per_update(trainer, 25)
    assert seen[10] > 1e-5 and seen[15:] == pytest.approx([1e-5] * 11)


def test_linear_schedule_decays_from_the_warmed_up_peak_to_min_lr(tmp_path):
    """Colossal-AI's LinearWarmupLR: up to the peak at the warm-up's end, then a straight line down to 0."""
    schedule = {"name": "linear", "warmup_epochs": 1, "warmup_lr": 0.0, "min_lr": 0.0}
    trainer = make_trainer(tmp_path, batches=5, epochs=5, schedule=schedule)
    peak, seen = trainer.lr, lrs_per_update(trainer, 25)
    assert seen[:6] == pytest.approx([peak * t / 5 for t in range(6)])  # warm-up: 5 updates
    assert seen[5:] == pytest.approx([peak * (1 - t / 20) for t in range(21)], abs=1e-12)  # 20 updates of decay


def test_a_peak_lr_below_min_lr_is_refused_at_the_world_size_launched(tmp_path):
    """params.yaml passes at launch.nproc_per_node (4 ranks: peak 2.5e-5); a world of one shrinks the global batch
    and the LR below min_lr: refused at start, not trained with a rising "decay"."""
    pretrain = {"batch_size": 4, "optimizer": {"lr_base": 1.6e-3}, "schedule": {"min_lr": 1e-5}}
    params = make_params(launch={"nproc_per_node": 4}, pretrain=pretrain)
    model = models.build_model(params.model, NUM_CLASSES, params.pretrain.img_size)
    with pytest.raises(UserError, match=r"pretrain.optimizer.lr_base: the peak lr 6.25e-06 = lr_base 0.0016 x global "
                                        r"batch 4 / 1024 \(1 ranks\) is at or below schedule.min_lr 1e-05"):
        train.Trainer(
            stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(NUM_CLASSES)],
            train_loader=ListLoader([None]), val_loader=ListLoader([None]), runtime=cpu_runtime(),
            param_sections=("pretrain",), provenance={}, paths=train.StagePaths.under(tmp_path),
        )


def test_no_weight_decay_on_1d_params_pos_embed_and_cls_token(tmp_path):
    trainer = make_trainer(tmp_path, optimizer={"weight_decay": 0.05})
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    names = {id(param): name for name, param in trainer.model.named_parameters()}
    decay = {group["weight_decay"]: {names[id(p)] for p in group["params"]} for group in trainer.optimizer.param_groups}
    assert set(decay) == {0.0, 0.05}
    assert decay[0.0].isdisjoint(decay[0.05]) and decay[0.0] | decay[0.05] == set(names.values())
    assert {"pos_embed", "cls_token"} <= decay[0.0]  # 4-D and 3-D: exempt by the model's no_weight_decay()
    one_d = {name for name, param in trainer.model.named_parameters() if param.ndim == 1}
    assert decay[0.0] - {"pos_embed", "cls_token"} == one_d
    assert "head.weight" in decay[0.05] and "aux_head.weight" in decay[0.05]


@pytest.mark.parametrize("name, optimizer_class", [("lamb", Lamb), ("sgd", torch.optim.SGD), ("kron", Kron)])
def test_optimizer_by_name(tmp_path, name, optimizer_class):
    trainer = make_trainer(tmp_path, optimizer={"name": name})
    assert type(trainer.optimizer) is optimizer_class


def kron_trainer(tmp_path: Path, momentum: float = 0.9, **changes) -> train.Trainer:
    """A Trainer with Kron at lr 1e-3 (lr_base x 8 / 1024) from the first update (no warm-up)."""
    optimizer = {"name": "kron", "lr_base": 0.128, "momentum": momentum}
    return make_trainer(tmp_path, batch_size=8, schedule={"warmup_epochs": 0}, optimizer=optimizer, **changes)


def kron_updates(trainer: train.Trainer, batch: dict[str, torch.Tensor], updates: int) -> list[float]:
    """`updates` updates on `batch`: the loss before each."""
    losses = []
    for _ in range(updates):
        losses.append(trainer.backward(batch, micro_steps=1, sync=True).item())
        trainer.optimizer_step()
    return losses


def test_kron_updates_lower_the_loss_of_a_fixed_batch(tmp_path):
    trainer = kron_trainer(tmp_path, momentum=0.8)
    group = trainer.optimizer.param_groups[0]
    assert group["momentum"] == 0.8 and "betas" not in group  # optimizer.momentum, not timm's 0.9; no betas
    losses = kron_updates(trainer, random_batch(8, seed=0), updates=6)
    assert losses[-1] < 0.7 * losses[0], losses  # from 2.33 (chance: ln 10 = 2.30) to 1.49 after five updates
    # On CPU its preconditioner maths runs eagerly (build_optimizer): these are the names timm compiles them under.
    assert trainer.optimizer._precond_grad is timm_kron._precond_grad


def test_kron_updates_do_not_depend_on_the_rank_s_random_stream(tmp_path):
    """seed_everything seeds torch with seed + rank; Kron's random probes of the gradient must not come from it, or
    DDP ranks fed the same all-reduced gradients would drift apart."""
    batch = random_batch(8, seed=0)
    weights = []
    for rank in range(2):
        trainer = kron_trainer(tmp_path / str(rank))
        torch.manual_seed(rank)
        kron_updates(trainer, batch, updates=2)
        weights.append(trainer.model.state_dict())
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)


@pytest.mark.slow
def test_kron_resumes_from_a_checkpoint_to_the_uninterrupted_result(tmp_path):
    batch = random_batch(8, seed=0)
    uninterrupted = kron_trainer(tmp_path / "uninterrupted")
    kron_updates(uninterrupted, batch, updates=3)
    interrupted = kron_trainer(tmp_path / "interrupted")
    kron_updates(interrupted, batch, updates=2)
    checkpoint_at(interrupted, 1, [{}], None)
    resumed = kron_trainer(tmp_path / "interrupted", model_seed=1)
    assert resumed.load_checkpoint() is not None
    kron_updates(resumed, batch, updates=1)
    torch.testing.assert_close(resumed.model.state_dict(), uninterrupted.model.state_dict(), rtol=0, atol=0)


def test_accumulated_micro_batches_give_the_big_batch_gradient(tmp_path):
    big = random_batch(16, seed=1)
    halves = [{key: value[part] for key, value in big.items()} for part in (slice(0, 8), slice(8, 16))]

    def gradients(trainer: train.Trainer, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        trainer.train_forward.train()
        # BatchNorm (VOLO's stem) normalises each micro-batch by its own statistics, the one way accumulation
        # can never equal a big batch; with frozen statistics it must match exactly.
        trainer.model.patch_embed.eval()
        for index, batch in enumerate(micro_batches):
            trainer.backward(batch, micro_steps=len(micro_batches), sync=index == len(micro_batches) - 1)
        return {name: param.grad for name, param in trainer.model.named_parameters()}

    accumulated = gradients(make_trainer(tmp_path, batch_size=8, accum_steps=2), halves)
    whole = gradients(make_trainer(tmp_path, batch_size=16, accum_steps=1), [big])
    assert all(grad is not None and grad.abs().sum() > 0 for grad in whole.values())
    torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_update_steps_with_the_true_gradient_clipped_to_clip_grad(tmp_path, precision):
    """SGD's first update moves the weights by lr x (1 + momentum) x the gradient it is given (Nesterov, an
    empty momentum buffer): with clipping, by exactly that x clip_grad; in fp16 only if the scaler's gradients
    were unscaled before clipping. (Adam's first step is lr x sign(gradient) whatever its norm: no test of it.)"""
    clip_grad = 1e-2
    trainer = make_trainer(
        tmp_path, precision=precision, clip_grad=clip_grad, batch_size=8, schedule={"warmup_epochs": 0},
        optimizer={"name": "sgd", "lr_base": 128.0, "weight_decay": 0.0},  # lr 128 x 8 / 1024 = 1
    )
    assert trainer.scaler.is_enabled() == (precision == "fp16")  # loss scaling only where fp16 needs it
    before = [param.detach().clone() for param in trainer.model.parameters()]
    loss = trainer.backward(random_batch(8, seed=0), micro_steps=1, sync=True)
    assert torch.isfinite(loss)
    gradients = [param.grad for param in trainer.model.parameters()]
    true_gradient_norm = torch.nn.utils.get_total_norm(gradients) / trainer.scaler.get_scale()
    assert true_gradient_norm > 10 * clip_grad  # clipping has work to do

    lr, momentum = trainer.optimizer.param_groups[0]["lr"], trainer.cfg.optimizer.momentum
    trainer.optimizer_step()
    moves = [param.detach() - old for param, old in zip(trainer.model.parameters(), before)]
    assert torch.nn.utils.get_total_norm(moves).item() == pytest.approx(lr * (1 + momentum) * clip_grad, rel=1e-3)


def test_a_nonfinite_loss_stops_the_stage_naming_epoch_and_step_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv(train.NONFINITE_LOSS_HOOK, "2:3")  # epoch 2's third micro-batch diverges
    trainer = make_trainer(tmp_path, train_batches=[random_batch(8, seed) for seed in range(4)], epochs=3, batch_size=8)
    expected = (
        r"pretrain: the training loss is not finite at epoch 2, step 3 of 4: stopped before the next checkpoint "
        rf"\(the last, epoch 1's end, in {tmp_path / 'ckpt'} is kept\); lower pretrain.optimizer.lr_base"
    )
    with pytest.raises(UserError, match=expected):
        trainer.fit()
    checkpoint = torch.load(trainer.checkpoint_path, weights_only=True)
    assert checkpoint["epoch"] == 1 and len(checkpoint["history"]) == 1
    assert all(torch.isfinite(weight).all() for weight in checkpoint["model"].values())  # the NaN update is not in it
    assert not trainer.model_file.exists()


@pytest.mark.slow
def test_under_fp16_a_nonfinite_loss_is_a_skipped_update_counted_in_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    batches = [random_batch(8, seed) for seed in range(4)]
    clean = make_trainer(tmp_path / "clean", train_batches=batches, epochs=1, batch_size=8, precision="fp16").fit()
    monkeypatch.setenv(train.NONFINITE_LOSS_HOOK, "1:2")
    poisoned = make_trainer(tmp_path / "poisoned", train_batches=batches, epochs=1, batch_size=8, precision="fp16")
    metrics = poisoned.fit()
    # The scaler halves its scale on every skip; the poisoned step is one more than the clean run's overflows.
    assert metrics["skipped_updates"] == clean["skipped_updates"] + 1
    assert all(torch.isfinite(weight).all() for weight in poisoned.model.state_dict().values())


# ------------------------------------------------------------------------------------------------- checkpoints


def checkpoint_at(trainer: train.Trainer, epochs_done: int, history: list, run_id: str | None) -> None:
    """Write the checkpoint a run of `trainer` would write at the end of epoch `epochs_done`."""
    trainer.history, trainer.run_id = history, run_id
    trainer.save_checkpoint(epochs_done)


def test_checkpoint_restores_the_whole_training_state(tmp_path):
    trainer = make_trainer(tmp_path, ema={"enabled": True, "decay": 0.9})
    for update in range(3):
        trainer.backward(random_batch(8, seed=update), micro_steps=1, sync=True)
        trainer.optimizer_step()
    checkpoint_at(trainer, 1, [{"val_top1": 50.0}], "run-1")
    draws_after_save = (torch.rand(3).tolist(), np.random.rand(), random.random())

    assert torch.load(trainer.checkpoint_path, weights_only=True)["epoch"] == 1
    resumed = make_trainer(tmp_path, ema={"enabled": True, "decay": 0.9}, model_seed=1)
    checkpoint = resumed.load_checkpoint()
    assert checkpoint["run_id"] == "run-1" and checkpoint["history"] == [{"val_top1": 50.0}]
    assert (resumed.start_epoch, resumed.updates) == (1, 3)
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == draws_after_save  # same RNG streams
    for original, restored in ((trainer.model, resumed.model), (trainer.ema.module, resumed.ema.module)):
        torch.testing.assert_close(restored.state_dict(), original.state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(resumed.optimizer.state_dict(), trainer.optimizer.state_dict(), rtol=0, atol=0)
    assert resumed.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]


@pytest.mark.slow
def test_a_run_killed_inside_an_epoch_resumes_from_its_checkpoint_there_to_the_uninterrupted_result(
    tmp_path, monkeypatch, capsys
):
    """Checkpoints every 2 updates (params checkpoint.every_updates): killed in epoch 2's fourth update, the run
    resumes from epoch 2's second (not the epoch's start), trains only the batches after it, and ends with the
    uninterrupted run's weights, EMA and metrics, bit for bit (Mixup draws from the checkpointed RNGs)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    batches = [random_batch(8, seed) for seed in range(5)]
    settings = dict(
        train_batches=batches, epochs=2, batch_size=8, mixup={"mixup_alpha": 0.8}, ema={"enabled": True, "decay": 0.9},
        checkpoint={"every_minutes": 0, "every_updates": 2},
    )
    train.seed_everything(0, cpu_runtime())  # Mixup draws from numpy's global RNG: both runs start from one state
    uninterrupted = make_trainer(tmp_path / "uninterrupted", **settings)
    expected = uninterrupted.fit()

    train.seed_everything(0, cpu_runtime())
    killed = make_trainer(tmp_path / "killed", **settings)
    real_backward = killed.backward

    def backward_until_update_9(*args, **kwargs):
        if killed.updates == 8:  # epoch 2's fourth micro-batch, after the checkpoint of update 8 (batch 3 of 5)
            raise KeyboardInterrupt("killed")
        return real_backward(*args, **kwargs)

    killed.backward = backward_until_update_9
    with pytest.raises(KeyboardInterrupt):
        killed.fit()
    checkpoint = torch.load(killed.checkpoint_path, weights_only=True)
    assert (checkpoint["epoch"], checkpoint["updates"], checkpoint["within_epoch"]["batches"]) == (1, 8, 3)

    resumed = make_trainer(tmp_path / "killed", model_seed=1, **settings)
    trained = []
    real_resumed_backward = resumed.backward
    resumed.backward = lambda batch, *args, **kwargs: trained.append(batch) or real_resumed_backward(batch, *args, **kwargs)
    metrics = resumed.fit()
    assert "resumed from epoch 2, batch 3 of 5" in capsys.readouterr().out
    assert [batch["label"].tolist() for batch in trained] == [batches[k]["label"].tolist() for k in (3, 4)]  # the rest
    timing = {"train_img_per_s", "train_img_per_s_per_rank", "epoch_seconds"}
    assert {k: v for k, v in metrics.items() if k not in timing} == {k: v for k, v in expected.items() if k not in timing}
    for name in ("model", "ema"):
        final = [getattr(trainer, name).state_dict() if name == "model" else trainer.ema.module.state_dict()
                 for trainer in (uninterrupted, resumed)]
        torch.testing.assert_close(final[0], final[1], rtol=0, atol=0, msg=name)


def test_a_checkpoint_that_does_not_read_back_never_replaces_the_last_good_one(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path)
    checkpoint_at(trainer, 1, [{}], None)
    good = trainer.checkpoint_path.read_bytes()
    real_save = torch.save

    def garbling_save(obj, file):  # a storage that cuts the file short
        real_save(obj, file)
        file.truncate(file.tell() - 100)

    monkeypatch.setattr(torch, "save", garbling_save)
    with pytest.raises(UserError, match=r"last.pt: the file just written does not read back .*; the previous one is kept"):
        checkpoint_at(trainer, 2, [{}, {}], None)
    assert trainer.checkpoint_path.read_bytes() == good
    assert [path.name for path in trainer.checkpoint_path.parent.iterdir()] == [train.CHECKPOINT_FILE]  # no leftover


def test_checkpoint_from_other_params_is_set_aside_not_resumed(tmp_path, capsys):
    first = make_trainer(tmp_path)
    checkpoint_at(first, 1, [{}], None)
    written = first.checkpoint_path.read_bytes()
    other = make_trainer(tmp_path, optimizer={"lr_base": 1e-3})
    assert other.load_checkpoint() is None and other.start_epoch == 0
    assert not other.checkpoint_path.exists()  # the new run's first checkpoint cannot overwrite it
    (aside,) = (tmp_path / "ckpt" / train.SET_ASIDE_DIR).iterdir()
    assert aside.name.startswith("epoch1-") and (aside / other.checkpoint_path.name).read_bytes() == written
    out = capsys.readouterr().out
    assert f"written under other pretrain.optimizer.lr_base: set aside in {aside}" in out
    assert f"{train.RESUME_ANYWAY}=1" in out


@pytest.mark.slow
def test_a_checkpoint_of_other_inputs_resumes_anyway_when_asked_and_the_run_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv(train.RESUME_ANYWAY, "1")
    finished = make_trainer(tmp_path, epochs=1)
    checkpoint_at(finished, 1, [{"val_top1": 90.0, "val_top5": 100.0}], None)
    # A log-message edit changes the code digest: a day of training is still worth resuming.
    edited = make_trainer(tmp_path, epochs=1, model_seed=1, provenance={"data_digest": "digits", "code": "def"})
    edited.fit()  # from the checkpoint's last epoch: only writes the outputs (its loader would fail if iterated)
    saved = torch.load(edited.model_file, weights_only=True)["model"]
    torch.testing.assert_close(saved, finished.model.state_dict(), rtol=0, atol=0)
    from mlflow import MlflowClient

    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = store.search_runs([exp.experiment_id for exp in store.search_experiments()], "tags.stage = 'pretrain'")
    assert run.data.tags[train.RESUMED_DESPITE_TAG] == "code"


@pytest.mark.parametrize(
    ("changed", "named"),
    [({"provenance": {"data_digest": "digits", "code": "def"}}, "code"),
     ({"provenance": {"data_digest": "other", "code": "abc"}}, "data_digest"),
     ({"provenance": {"data_digest": "digits", "code": "abc", "version.torch": "9.9"}}, "version.torch")],
)
def test_checkpoint_from_other_code_data_or_libraries_is_not_resumed(tmp_path, capsys, changed, named):
    checkpoint_at(make_trainer(tmp_path), 1, [{}], None)
    other = make_trainer(tmp_path, **changed)
    assert other.load_checkpoint() is None and other.start_epoch == 0
    assert f"written under other {named}" in capsys.readouterr().out


def test_loader_speed_knobs_keep_a_checkpoint_resumable(tmp_path):
    """loader.workers and loader.prefetch change how fast batches come, not which (tests/test_loaders.py), so no
    stage lists them: the run resumes. The backend changes which."""
    checkpoint_at(make_trainer(tmp_path, loader={"workers": 2, "prefetch": 2}), 1, [{}], None)
    resumed = make_trainer(tmp_path, loader={"workers": 0, "prefetch": 4})
    assert resumed.load_checkpoint() is not None and resumed.start_epoch == 1
    assert make_trainer(tmp_path, loader={"backend": "torch"}).load_checkpoint() is None


def test_a_checkpoint_that_cannot_be_read_for_a_transient_reason_is_retried_and_kept(tmp_path, monkeypatch, capsys):
    checkpoint_at(make_trainer(tmp_path), 1, [{}], None)
    trainer = make_trainer(tmp_path)
    written = trainer.checkpoint_path.read_bytes()
    monkeypatch.setattr(train, "CHECKPOINT_READ_RETRY_SECONDS", 0.0)
    real_load, failures = torch.load, []

    def flaky_load(*args, **kwargs):  # a network file system's hiccup: the first two reads fail
        if len(failures) < 2:
            failures.append(1)
            raise OSError(5, "Input/output error")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", flaky_load)
    assert trainer.load_checkpoint() is not None and trainer.start_epoch == 1
    out = capsys.readouterr().out
    assert "reading it failed ([Errno 5] Input/output error); try 2 of 3" in out and "try 3 of 3" in out

    def failing_load(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(UserError, match=r"could not be read in 3 tries \(\[Errno 5\] Input/output error\); it is kept"):
        make_trainer(tmp_path).load_checkpoint()  # not "corrupt, delete it"
    assert trainer.checkpoint_path.read_bytes() == written
    monkeypatch.undo()
    trainer.checkpoint_path.write_bytes(trainer.checkpoint_path.read_bytes()[:100])  # truncated: corrupt
    with pytest.raises(UserError, match="delete it to start afresh"):
        trainer.load_checkpoint()


@pytest.mark.slow
def test_rerun_after_the_last_epoch_only_writes_the_outputs(tmp_path, monkeypatch):
    """Killed between the last checkpoint and the model file: the rerun trains nothing (its loader would fail if
    iterated), writes the checkpoint's weights and metrics, and deletes the checkpoint (DVC caches the result), with
    the half-written one an earlier kill left under its temporary name (as large as a checkpoint)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    finished = make_trainer(tmp_path, epochs=2)
    history = [{"val_top1": 97.5, "val_top5": 100.0}, {"val_top1": 90.0, "val_top5": 100.0}]
    checkpoint_at(finished, 2, history, None)
    (finished.checkpoint_path.parent / f".{train.CHECKPOINT_FILE}.tmp-4242").write_bytes(b"killed mid-write")
    rerun = make_trainer(tmp_path, epochs=2, model_seed=1)
    assert rerun.fit() == {"val_top1": 90.0, "val_top5": 100.0}
    assert not rerun.checkpoint_path.parent.exists()
    saved = torch.load(rerun.model_file, weights_only=True)["model"]
    torch.testing.assert_close(saved, finished.model.state_dict(), rtol=0, atol=0)
    # The curves rebuilt from the checkpoint, up to the last epoch's metrics (a training run's final accuracy is its
    # last val_top1, a column apart from the evaluate stage's top1), and the best epoch's beside them.
    assert json.loads((tmp_path / "metrics" / "metrics.json").read_text()) == {
        "val_top1": 90.0, "val_top5": 100.0, "step": 1, "best_val_top1": 97.5, "best_epoch": 1,
    }
    rows = (tmp_path / "metrics" / "plots" / "metrics" / "val_top1.tsv").read_text().splitlines()
    assert [row.split("\t")[-1] for row in rows] == ["val_top1", "97.5", "90.0"]


@pytest.mark.parametrize("keep", ["best", "last"])
def test_keep_chooses_which_epoch_s_weights_the_model_file_holds_when_the_last_one_is_spoiled(tmp_path, monkeypatch, keep):
    """The LR spikes to 10 for the last epoch's updates, which spoils it: with keep best the model file holds the
    best epoch's weights (as validated then), with keep last the spoiled ones; the best epoch's file goes with the
    checkpoint."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    epochs = 4
    trainer = make_trainer(
        tmp_path, train_batches=[random_batch(8, seed) for seed in range(4)], epochs=epochs, batch_size=8, keep=keep
    )
    validated, validate, step = [], trainer._validate, trainer.optimizer_step

    def validate_and_keep_a_copy() -> dict[str, float]:
        validated.append({key: value.clone() for key, value in trainer.eval_model.state_dict().items()})
        return validate()

    def spiked_step() -> bool:
        if trainer.updates >= trainer.updates_per_epoch * (epochs - 1):
            for group in trainer.optimizer.param_groups:
                group["lr"] = 10.0
        return step()

    monkeypatch.setattr(trainer, "_validate", validate_and_keep_a_copy)
    monkeypatch.setattr(trainer, "optimizer_step", spiked_step)
    trainer.fit()
    best = train.best_epoch(trainer.history)
    assert trainer.history[-1]["val_top1"] < best["best_val_top1"]  # the spike spoiled the last epoch
    saved = torch.load(trainer.model_file, weights_only=True)["model"]
    torch.testing.assert_close(saved, validated[best["best_epoch"] - 1 if keep == "best" else -1], rtol=0, atol=0)
    assert not trainer.best_path.exists() and not trainer.checkpoint_path.parent.exists()


def test_the_best_epoch_is_the_first_with_the_highest_val_top1():
    history = [{"val_top1": value} for value in (80.0, 92.5, 92.5, 91.0)]
    assert train.best_epoch(history) == {"best_val_top1": 92.5, "best_epoch": 2}
    assert train.best_epoch(history[:1]) == {"best_val_top1": 80.0, "best_epoch": 1}


# ------------------------------------------------------------------------------------------ real runs (slow)


def train_two_ranks(records_dir: Path, out: Path, variant: str) -> dict[str, torch.Tensor]:
    """`_rank_main` under torchrun on 2 gloo ranks; rank 0's final weights, after checking rank 1's equal them."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", __file__, str(records_dir), str(out), variant]
    env = {**ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}"}
    subprocess.run(command, check=True, timeout=600, env=env, cwd=Path(__file__).parent)
    rank0, rank1 = (torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2))
    torch.testing.assert_close(rank0, rank1, rtol=0, atol=0)
    train.seed_everything(0, cpu_runtime())  # rank 0's initial weights, which DDP broadcast to rank 1
    initial = models.build_model(two_rank_params("eager").model, NUM_CLASSES, 32).state_dict()
    assert not any(torch.equal(rank0[name], initial[name]) for name in ("head.weight", "pos_embed", "cls_token"))
    saved = torch.load(out / "model.pt", weights_only=True)["model"]  # rank 0 finished the stage
    torch.testing.assert_close(saved, rank0, rtol=0, atol=0)  # (its one epoch is also its best)
    assert json.loads((out / "metrics" / "metrics.json").read_text())["step"] == 0  # its one epoch, logged
    return rank0


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["eager", "compiled"])
def test_ddp_ranks_end_with_identical_weights(digits_records, tmp_path, variant):
    """Two torchrun ranks see different samples and draw different drop-path masks; only averaged gradients
    (through no_sync accumulation, and an epoch-end update of a single micro-batch) keep them identical. Compiled
    (`pretrain.compile`, as the VOLO profiles train under DDP), the stages' backward comes from AOTAutograd's
    graphs, and DDP's gradient hooks must still fire: AOTAutograd without inductor here (`aot_eager`), seconds
    instead of minutes of compiling on a CPU."""
    train_two_ranks(digits_records, tmp_path, variant)


@pytest.mark.slow
def test_a_compiled_fsdp_stage_trains_and_writes_its_model(digits_records, tmp_path):
    """FSDP2 and `compile` together: a sharded VOLO cannot be viewed by its block groups (forward.compiled_train_forward),
    so it is compiled whole; building that view crashed the Trainer. The weights compared are each rank's gathered
    copy (`Trainer.eval_model`)."""
    train_two_ranks(digits_records, tmp_path, "compiled-fsdp")


def two_rank_params(variant: str):
    # 217 training samples per rank: 13 batches of 16, i.e. 6 updates of 2 micro-batches and a last one of 1.
    return make_params(
        # FSDP keeps its best epoch: the best weights gathered from the shards at every improvement, loaded at the end.
        pretrain={"epochs": 1, "batch_size": 16, "accum_steps": 2, "compile": variant != "eager",
                  "keep": "best" if variant.endswith("fsdp") else "last"},
        model={"drop_path": 0.1}, parallel={"strategy": "fsdp" if variant.endswith("fsdp") else "ddp"},
    )


def _rank_main(records_dir: str, out_dir: str, variant: str) -> None:
    """One rank of train_two_ranks: train, then dump this rank's weights (gathered, under FSDP)."""
    out = Path(out_dir)
    params = two_rank_params(variant)
    if params.pretrain.compile:
        torch.compile = functools.partial(torch.compile, backend="aot_eager")
    with distributed.session() as runtime:
        loaders = train_val_loaders(Path(records_dir), params, runtime, batch_size=16)
        train.seed_everything(params.seed, runtime)
        model = models.build_model(params.model, NUM_CLASSES, 32)
        trainer = train.Trainer(
            stage="pretrain", params=params, cfg=params.pretrain, model=model,
            classes=records.read_classes(records_dir), train_loader=loaders[0], val_loader=loaders[1],
            runtime=runtime, param_sections=("pretrain",), provenance={"data_digest": "digits"},
            paths=train.StagePaths.under(out),
        )
        trainer.fit()
        torch.save(trainer.eval_model.state_dict(), out / f"rank{runtime.rank}.pt")


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
