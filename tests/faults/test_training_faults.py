"""Numerical faults and stale checkpoints through the real pretrain stage (launcher, torchrun, MLflow store): a
loss that turns NaN stops the stage with one line and keeps the last good checkpoint; the user's fix (a lower LR)
makes that checkpoint stale, so the rerun sets it aside, whole, and trains afresh; `C2F_RESUME_ANYWAY=1` resumes
a set-aside checkpoint moved back, and MLflow says so."""

from __future__ import annotations

import shutil

import pytest
import torch
from mlflow import MlflowClient

from coarse2fine.training import train
from conftest import merge
from test_scale_out import finish, start_stage

pytestmark = pytest.mark.slow

# 434 records in batches of 32: 13 updates an epoch.
PRETRAIN = {"pretrain": {"epochs": 2, "batch_size": 32, "token_label": {"enabled": False}}}
LOWER_LR = merge(merge({}, PRETRAIN), {"pretrain": {"optimizer": {"lr_base": 1e-3}}})


def stage_runs(out) -> list:
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return client.search_runs(experiments, "tags.stage = 'pretrain'", order_by=["attributes.start_time ASC"])


def test_a_diverging_stage_stops_keeps_its_checkpoint_and_a_fixed_rerun_sets_it_aside(digits_records, tmp_path):
    checkpoint = tmp_path / "ckpt" / train.CHECKPOINT_FILE
    diverging = start_stage(tmp_path, digits_records, {}, PRETRAIN, env={train.NONFINITE_LOSS_HOOK: "2:3"})
    stderr = diverging.communicate(timeout=600)[1]
    assert diverging.returncode == 2, stderr
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [  # beside the progress bars
        f"error: pretrain: the training loss is not finite at epoch 2, step 3 of 13: stopped before the next "
        f"checkpoint (the last, epoch 1's end, in {checkpoint.parent} is kept); lower pretrain.optimizer.lr_base, "
        f"set pretrain.clip_grad, or train in fp32"
    ]
    kept = checkpoint.read_bytes()
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 1
    (failed,) = stage_runs(tmp_path)
    assert failed.info.status == "FAILED"

    # The fix: a lower LR. The checkpoint was made under the old one: set aside, never overwritten.
    stdout = finish(start_stage(tmp_path, digits_records, {}, LOWER_LR))
    (aside,) = (checkpoint.parent / train.SET_ASIDE_DIR).iterdir()
    assert f"written under other pretrain.optimizer.lr_base: set aside in {aside}, starting afresh" in stdout
    assert (aside / train.CHECKPOINT_FILE).read_bytes() == kept
    assert (tmp_path / "model" / "model.pt").is_file()

    # Asked to, the old run resumes from it, under the new LR, and its MLflow run (reopened) records why.
    shutil.move(aside / train.CHECKPOINT_FILE, checkpoint)
    stdout = finish(start_stage(tmp_path, digits_records, {}, LOWER_LR, env={train.RESUME_ANYWAY: "1"}))
    assert "resuming" in stdout and "written under other pretrain.optimizer.lr_base" in stdout
    resumed = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(failed.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert resumed.data.tags[train.RESUMED_DESPITE_TAG] == "pretrain.optimizer.lr_base"
