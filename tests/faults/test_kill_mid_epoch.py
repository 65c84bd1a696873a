"""A training stage SIGKILLed inside an epoch loses only the work since its last time-based checkpoint
(params `checkpoint.every_minutes`) and ends bit-identical to an uninterrupted run: pretrain with one process (its
MLflow run continued, not a second one), finetune with two ranks (DDP on gloo). Real launcher, real torchrun, real
stage scripts on the digits' records.

The uninterrupted reference never checkpoints inside an epoch (every_minutes 0), so the equality also shows that
checkpointing changes nothing of what is computed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from coarse2fine.training import train
from conftest import make_params
from test_scale_out import finish, outcome, start_stage

# 434 training records in batches of 8: 54 updates an epoch with one rank, 27 with two. A checkpoint is due at
# every 10th update (the clock's check) once 6 ms have passed, i.e. at every check: mid-epoch ones at updates 10,
# 20, ... of each epoch's span.
TRAINING = {"epochs": 2, "batch_size": 8, "token_label": {"enabled": False}}
OFTEN = {"checkpoint": {"every_minutes": 0.0001}}
NEVER_INSIDE_AN_EPOCH = {"checkpoint": {"every_minutes": 0}}
# The pipeline tests' sizes (24 px pre-training, 32 px fine-tuning: 3 x 3 and 4 x 4 tokens); drop-path draws from the
# torch RNG, which the checkpoints carry.
MODEL = {"model": {"patch_size": 4, "drop_path": 0.1}}
PRETRAIN = MODEL | {"pretrain": {**TRAINING, "img_size": 24}}
FINETUNE = MODEL | {"pretrain": {"img_size": 24}, "finetune": {**TRAINING, "img_size": 32}}


def kill_after_a_checkpoint_inside_an_epoch(process: subprocess.Popen, checkpoint_file: Path) -> dict:
    """SIGKILL the stage's whole process group (launcher, torchrun, every rank) as soon as a checkpoint taken inside
    an epoch is on disk; return the checkpoint the rerun will find."""
    deadline = time.monotonic() + 600
    while True:
        assert process.poll() is None, process.communicate(timeout=60)[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint inside an epoch after 600 s"
        if checkpoint_file.exists() and torch.load(checkpoint_file, weights_only=True)["within_epoch"]:
            break
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    return torch.load(checkpoint_file, weights_only=True)


def kill_and_resume(
    out: Path, records: Path, launch: dict, changes: dict, stage: str, arguments=()
) -> tuple[str, dict]:
    """Start the stage, kill it after its first checkpoint inside an epoch, rerun it; returns the rerun's stdout and
    the checkpoint it resumed from."""
    checkpoint_file = out / "ckpt" / train.CHECKPOINT_FILE
    process = start_stage(out, records, launch, changes | OFTEN, stage, arguments)
    killed_at = kill_after_a_checkpoint_inside_an_epoch(process, checkpoint_file)
    assert not (out / "model" / "model.pt").exists()
    batches_done = killed_at["within_epoch"]["batches"]
    stdout = finish(start_stage(out, records, launch, changes | OFTEN, stage, arguments))
    # The rerun starts where the checkpoint was taken, inside the epoch: what it lost is the time since then.
    assert f"resumed from epoch {killed_at['epoch'] + 1}, batch {batches_done} of " in stdout
    assert batches_done > 0 and not checkpoint_file.exists()
    return stdout, killed_at


@pytest.fixture(scope="module")
def uninterrupted_pretrain(digits_records, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted_pretrain")
    finish(start_stage(out, digits_records, {}, PRETRAIN | NEVER_INSIDE_AN_EPOCH))
    return out


@pytest.mark.slow
def test_pretrain_killed_inside_an_epoch_loses_only_the_time_since_its_checkpoint(
    uninterrupted_pretrain, digits_records, tmp_path
):
    _, killed_at = kill_and_resume(tmp_path, digits_records, {}, PRETRAIN, "pretrain")
    (weights, metrics), (expected_weights, expected_metrics) = outcome(tmp_path), outcome(uninterrupted_pretrain)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    assert metrics == expected_metrics
    # In MLflow the killed run is continued, not a second one started (start_stage's store is out/mlflow.db).
    from mlflow import MlflowClient

    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = store.get_experiment_by_name(make_params().tracking.experiment).experiment_id
    (run,) = store.search_runs([experiment], "tags.stage = 'pretrain'")
    assert run.info.run_id == killed_at["run_id"]


@pytest.mark.slow
def test_finetune_with_two_ranks_killed_inside_an_epoch_resumes_bit_identical(
    uninterrupted_pretrain, digits_records, tmp_path
):
    init = ("--init-from", str(uninterrupted_pretrain / "model" / "model.pt"))
    two_ranks = {"nproc_per_node": 2}
    reference = tmp_path / "uninterrupted"
    finish(start_stage(reference, digits_records, two_ranks, FINETUNE | NEVER_INSIDE_AN_EPOCH, "finetune", init))
    stdout, _ = kill_and_resume(tmp_path / "killed", digits_records, two_ranks, FINETUNE, "finetune", init)
    assert "x 2 ranks" in stdout
    (weights, metrics), (expected_weights, expected_metrics) = outcome(tmp_path / "killed"), outcome(reference)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=0)
    assert metrics == expected_metrics
