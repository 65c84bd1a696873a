"""Kill anywhere: the whole pipeline under real DVC in a temporary git repository, each stage SIGKILLed once at a
seeded random point inside it (dvc and every process under it), `dvc repro` run again each time. A stage that can
resume (the training stages from their checkpoints, token labels from their finished chunks) is killed at that point
or, if it has nothing to resume from yet, as soon as it has: every one of their reruns resumes (a kill before that
only reruns a stage from scratch, as the stages that cannot resume show). The pipeline finishes with byte-identical
data and model artifacts and equal metrics and curves to an uninterrupted run of another copy, and MLflow shows
every killed run as resumed or KILLED, never as a second finished one.

The kill points are drawn from C2F_TEST_KILL_SEED (default 0) inside each stage's span in the uninterrupted run, and
printed (`pytest -s`, or with a failure's captured output): another seed kills elsewhere.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from typing import Callable

import pytest
import torch
import yaml

from coarse2fine.labels import generate
from coarse2fine.training import train
from conftest import Project, merge
from test_pipeline import FAST, TOKEN_LABELS

# Its kill points are fractions of the stages' spans in a run beside it: alone, both see the same machine.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

SEED = int(os.environ.get("C2F_TEST_KILL_SEED", "0"))
# FAST, shorter (learning is not the subject), pre-training on token labels, with checkpoints inside epochs (every 3
# updates) and token labels in 4 chunks (batches of 8: 55 batches, 16 a chunk), so that most kill points fall where
# something can be resumed.
WALK = merge(merge(merge({}, FAST), TOKEN_LABELS), {
    "checkpoint": {"every_minutes": 0, "every_updates": 3},
    "teacher": {"epochs": 2},
    "token_labels": {"batch_size": 8},
    "pretrain": {"epochs": 3},
    "finetune": {"epochs": 1},
})
# Where dvc.yaml has a killed stage keep what it resumes from, and what its rerun then says.
RESUME = ".resume"
RESUMED = {"teacher": "resumed from ", "pretrain": "resumed from ", "finetune": "resumed from ",
           "token_labels": "token_labels: resuming, "}
# Written by the stages, besides what they compute: how long they took. Everything else must be equal.
TIMING_KEYS = re.compile(r"seconds|per_s")
STAGE_LINE = re.compile(r"Running stage '([\w@-]+)'")


class Repro:
    """`dvc repro [targets]` in a process group of its own, its output read as it comes: when each stage started."""

    def __init__(self, project: Project, *targets: str):
        env = {**project.env, "PYTHONUNBUFFERED": "1"}  # DVC's "Running stage" lines as they happen
        self.process = subprocess.Popen(
            ["dvc", "repro", *targets], cwd=project.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        self.started: dict[str, float] = {}
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if match := STAGE_LINE.search(line):
                self.started[match[1]] = time.monotonic()

    def wait_for(self, stage: str, timeout: float = 600) -> bool:
        """Whether `stage` started; False if the repro ended without running it (a kill aimed at an earlier stage
        fell after this one had finished, so DVC has it cached)."""
        deadline = time.monotonic() + timeout
        while stage not in self.started:
            if self.process.poll() is not None and not self._reader.is_alive():
                assert self.process.returncode == 0, self.output
                return False
            assert time.monotonic() < deadline, f"{stage} did not start in {timeout} s:\n{self.output}"
            time.sleep(0.01)
        return True

    def running(self) -> str | None:
        """The stage that started last, None once the repro has ended."""
        if self.process.poll() is not None:
            return None
        return max(self.started, key=self.started.get)

    def wait_until(self, condition: Callable[[], bool], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"waited {timeout} s:\n{self.output}"
            time.sleep(0.01)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        self._reader.join(timeout=60)
        time.sleep(1)  # the workers die with their launcher (PR_SET_PDEATHSIG), a moment after it

    def finish(self) -> float:
        """Wait for a successful end; returns when it ended."""
        assert self.process.wait(timeout=1200) == 0, self.output
        ended = time.monotonic()
        self._reader.join(timeout=60)
        return ended

    @property
    def output(self) -> str:
        return "".join(self.lines)[-5000:]


# DVC's own files, rewritten in place: a kill in that instant can cut one short. The README's remedy: delete it.
# dvc.lock is then rebuilt from DVC's run cache, which restores every stage that had finished without running it;
# the rwlock file only records the locks of running DVC processes.
DVC_FILES_CUT_SHORT = {"'./dvc.lock' validation failed": "dvc.lock", "Unable to read RWLock-file": ".dvc/tmp/rwlock"}


def repro_mending_dvc_files(project: Project) -> Repro:
    """A new `dvc repro`, after the README's remedy if the last kill left one of DVC's files cut short."""
    repro = Repro(project)
    while not repro.started and repro.process.poll() is None:  # DVC reads its files before its first stage
        time.sleep(0.01)
    if repro.process.poll():
        repro._reader.join(timeout=60)
        damaged = [path for sign, path in DVC_FILES_CUT_SHORT.items() if sign in repro.output]
        assert len(damaged) == 1, repro.output
        damaged = damaged[0]
        print(f"{damaged} was left cut short by the kill: deleted")
        (project.path / damaged).unlink()
        return repro_mending_dvc_files(project)
    return repro


def left_to_resume(project: Project, stage: str) -> bool:
    """Whether a killed `stage` left what its rerun resumes from: a training stage's checkpoint, generation's
    finished chunks."""
    kept = project.path / RESUME / stage
    return (kept / train.CHECKPOINT_FILE).is_file() or any((kept / generate.DONE_DIR).glob("chunk-*.json"))


def checkpoint_inputs(project: Project, stage: str) -> dict[str, str]:
    """What the killed training `stage`'s checkpoint was made from (its fingerprint: a rerun resumes only from equal
    inputs)."""
    return torch.load(project.path / RESUME / stage / train.CHECKPOINT_FILE, weights_only=True)["inputs"]


def stage_spans(repro: Repro, ended: float) -> dict[str, float]:
    """Seconds from each stage's start to the next one's (the last: to the end of the repro)."""
    order = sorted(repro.started, key=repro.started.get)
    ends = [repro.started[stage] for stage in order[1:]] + [ended]
    return {stage: end - repro.started[stage] for stage, end in zip(order, ends)}


def results(project: Project) -> dict[str, object]:
    """What the pipeline made, as dvc.lock hashes it, with the metrics files' content (less their timings) in
    place of their hashes."""
    lock = yaml.safe_load((project.path / "dvc.lock").read_text())["stages"]
    made = {}
    for stage in lock.values():
        for out in stage.get("outs", []):
            path = out["path"]
            if path.endswith(".json") and path.startswith("metrics/"):
                content = yaml.safe_load((project.path / path).read_text())
                made[path] = without_timings(content)
            elif path.startswith("metrics/") and "/plots/" in path:  # a curve per metric: the timings' differ
                curves = sorted((project.path / path).glob("*.tsv"))
                made[path] = {curve.name: curve.read_text() for curve in curves if not TIMING_KEYS.search(curve.name)}
            else:
                made[path] = out.get("md5")
    return made


def without_timings(value: object) -> object:
    if isinstance(value, dict):
        return {key: without_timings(item) for key, item in value.items() if not TIMING_KEYS.search(key)}
    return value


def stage_run_statuses(project: Project) -> dict[str, list[str]]:
    """Per stage, the statuses of its own runs (not lineage's "(cached)" links) in the store."""
    client = project.mlflow()
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    statuses: dict[str, list[str]] = {}
    for run in client.search_runs(experiments, "tags.stage != 'pipeline'"):
        if "cached_from" not in run.data.tags:
            statuses.setdefault(run.data.tags["stage"], []).append(run.info.status)
    return statuses


def test_each_stage_killed_anywhere_the_pipeline_ends_as_if_uninterrupted(tmp_path):
    uninterrupted = Project(tmp_path / "uninterrupted")
    walked = Project(tmp_path / "walked")
    for project in (uninterrupted, walked):
        project.edit_params(WALK)
        project.commit("walk params")
    reference = Repro(uninterrupted)
    spans = stage_spans(reference, reference.finish())

    draw = random.Random(SEED)
    landed = []
    repros = []
    resumable = []  # (a killed stage that left something to resume from, the index of the repros after the kill)
    for stage, span in spans.items():
        delay = draw.uniform(0.05, 0.9) * span
        repro = repro_mending_dvc_files(walked)
        repros.append(repro)
        if not repro.wait_for(stage):  # finished under an earlier kill's rerun: a kill that missed its stage
            landed.append(False)
            continue
        time.sleep(delay)
        if stage in RESUMED:
            repro.wait_until(lambda: left_to_resume(walked, stage) or repro.running() != stage)
        if repro.process.poll() is not None:  # the rest of the pipeline was faster here: nothing left to kill
            continue
        running = max(repro.started, key=repro.started.get)  # the stage the kill falls in
        repro.kill()
        left = left_to_resume(walked, running)
        if left:
            resumable.append((running, len(repros)))
            if running == "pretrain":  # its checkpoint is of these token labels: other ones are never resumed
                assert "token_labels_digest" in checkpoint_inputs(walked, running)
        print(f"seed {SEED}: dvc repro killed {delay:.2f} s into {stage} (uninterrupted: {span:.2f} s), in {running}"
              f"{', which left something to resume from' if left else ''}")
        landed.append(running == stage)
    repros.append(repro_mending_dvc_files(walked))
    repros[-1].finish()
    # Timings vary: a kill may fall in the next stage. Most must fall where they were aimed, or the test tests little.
    assert sum(landed) >= 2 / 3 * len(spans), landed
    # The stages that the kills aimed at only once they could resume: pre-training (on token labels, with MixToken)
    # and token labels left something behind.
    assert {"pretrain", "token_labels"} <= {stage for stage, _ in resumable}, resumable
    # A rerun resumes what its killed run left (a run from scratch would reach the same results, only later): the
    # training stages from their checkpoints, inside an epoch too, token labels from their finished chunks; said by
    # the next repro, or by a later one if the next was killed in that stage again before it got that far. Finished
    # stages leave nothing behind (their results are DVC's to keep).
    for stage, after in resumable:
        assert RESUMED[stage] in "".join(line for repro in repros[after:] for line in repro.lines), stage
    for project in (uninterrupted, walked):
        assert [path for path in (project.path / RESUME).rglob("*") if path.is_file()] == []

    assert results(walked) == results(uninterrupted)
    statuses = stage_run_statuses(walked)
    assert set(statuses) == set(stage_run_statuses(uninterrupted))
    for stage, seen in statuses.items():
        # One finished run per stage; a killed one was resumed (the same run, training stages) or ended KILLED.
        assert seen.count("FINISHED") == 1 and set(seen) <= {"FINISHED", "KILLED"}, (stage, seen)
