"""The whole pipeline under real DVC in a temporary git repository: caching, reruns on changed params, code and
source images, experiments running their own code (a killed run resumed: tests/faults/test_kill_anywhere.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import Project, free_ports, ran_stages

from coarse2fine import server
from coarse2fine.errors import UserError
from coarse2fine.queue_stop import queue_workers, stop_queue_workers

pytestmark = pytest.mark.slow

# Small but real: enough updates to learn (10 epochs x 13 updates of 32 digits), on few images to keep
# each full run short. The LR follows the linear scaling rule: 0.032 x 32 / 1024 = 1e-3. The student
# pre-trains on the ground truth here (130 updates are too few for token labels and MixToken, measured 71 %),
# at 16 px (2 x 2 tokens), then fine-tunes at 24 px (3 x 3 tokens) with token labels, MixToken and ground-truth
# mixing, as the recipe does; tests/faults/test_kill_anywhere.py pre-trains on token labels.
FAST = {
    "data": {"subset": 0.3},
    "teacher": {"epochs": 3, "batch_size": 32, "optimizer": {"lr_base": 0.032}},
    "pretrain": {
        "img_size": 16, "epochs": 10, "batch_size": 32, "optimizer": {"lr_base": 0.032},
        "token_label": {"enabled": False},
    },
    "finetune": {"img_size": 24, "epochs": 2, "batch_size": 32, "optimizer": {"lr_base": 0.0032}},
    "evaluate": {"pretrain": {"extra_sizes": []}, "finetune": {"extra_sizes": [16]}},
    # No MLflow models (3-5 s of torch.export per training stage) but in the test of the registered result.
    "tracking": {"log_models": False},
}
TOKEN_LABELS = {"pretrain": {"token_label": {"enabled": True, "mix_token": True}}}
EVALUATIONS = {"evaluate@pretrain", "evaluate@finetune", "compare"}
# Run at every full `dvc repro`: the source listing and the MLflow lineage.
ALWAYS = {"source", "lineage"}
EVERY_STAGE = {*ALWAYS, "convert", "teacher", "token_labels", "pretrain", "finetune", *EVALUATIONS}
FINETUNED = {"finetune", "evaluate@finetune", "compare"}
# `dvc repro evaluate@pretrain`: up to the coarse model's evaluation, for the tests whose subject comes before
# fine-tuning (each launched stage costs seconds of start-up).
COARSE_TARGET = "evaluate@pretrain"
UP_TO_COARSE = EVERY_STAGE - FINETUNED - {"lineage"}
# A behaviour change in a module pretrain and the teacher import (not their scripts): the ground-truth objective
# stops learning.
NO_LEARNING = (
    "src/coarse2fine/training/losses.py",
    'return self.criterion(output.merged(), batch["label"])',
    'return 0.0 * self.criterion(output.merged(), batch["label"])',
)
# A change of what evaluate reports, in a module of the library (stage scripts never came from the install).
SENTINEL_TOP1 = ("src/coarse2fine/evaluate.py", 'return {"top1": self.top1,', 'return {"top1": -1.0,')


@pytest.fixture
def project(tmp_path) -> Project:
    """A fresh clone-like copy of the project (git + DVC initialised), with fast params."""
    project = Project(tmp_path / "project")
    project.edit_params(FAST)
    project.commit("fast params")
    return project


# make test-fast's whole DAG: every stage once on a tenth of the digits, an epoch per training stage.
SMOKE = {"data": {"subset": 0.1}, "teacher": {"epochs": 1}, "pretrain": {"epochs": 1}, "finetune": {"epochs": 1}}


@pytest.mark.smoke
def test_every_stage_runs_once_on_a_tiny_subset_under_dvc_and_mlflow(project):
    """What each stage hands the next fits under real DVC and MLflow: every stage runs, its metrics are of the whole
    val split, the comparison reads both evaluations, one pipeline run in MLflow has a run of every stage, and a
    second `dvc repro` finds nothing changed. What is learnt is the slow tests' subject."""
    project.edit_params(SMOKE)
    assert project.repro() == EVERY_STAGE
    val_images = json.loads((project.path / "data/records/manifest.json").read_text())["splits"]["val"]["images"]
    coarse, fine = project.metrics("evaluate/pretrain"), project.metrics("evaluate/finetune")
    assert (coarse["n"], fine["n"], coarse["img_size"], fine["img_size"]) == (val_images, val_images, 16, 24)
    compared = json.loads((project.path / "metrics/compare.json").read_text())
    assert (compared["pretrain"]["top1"], compared["finetune"]["top1"]) == (coarse["top1"], fine["top1"])
    for stage in ("pretrain", "finetune"):  # beside each evaluation, its training's last and best epoch
        trained = project.metrics(stage)
        assert {key: compared[stage][key] for key in ("last_val_top1", "best_val_top1", "best_epoch", "keep")} == {
            "last_val_top1": trained["val_top1"], "best_val_top1": trained["best_val_top1"], "best_epoch": 1,
            "keep": "last",
        }
    (pipeline,) = pipeline_runs(project)
    assert stage_runs(project, pipeline) == {stage: False for stage in TRACKED_STAGES}
    assert project.repro() == ALWAYS


def test_repro_reruns_exactly_what_a_params_or_code_change_affects(project):
    project.edit_params({"tracking": {"log_models": True}})  # the registered model is checked below
    assert project.repro() == EVERY_STAGE
    val_images = json.loads((project.path / "data/records/manifest.json").read_text())["splits"]["val"]["images"]
    coarse, fine = project.metrics("evaluate/pretrain"), project.metrics("evaluate/finetune")
    # Chance is 10 %. Digits all have one scale, so 2 short epochs at 1.5x the resolution do not win it all back
    # (measured here 95.4 % -> 70.4 %; the default pipeline's 24 -> 32 px keeps 98.6 %, and test_finetune.py
    # checks a longer fine-tune against its coarse model).
    assert coarse["top1"] >= 90.0 and fine["top1"] >= 65.0, (coarse, fine)
    assert (coarse["img_size"], fine["img_size"], coarse["n"], fine["n"]) == (16, 24, val_images, val_images)
    # And at the extra test resolution, its position embedding resampled.
    assert fine["top1_at_16"] == pytest.approx(finetuned_top1_at(project, 16)), fine
    compared = json.loads((project.path / "metrics/compare.json").read_text())
    assert compared["finetune"]["top1"] == fine["top1"] and compared["pretrain"]["img_size"] == 16
    # report.py rounds the gain to 4 decimals: equal to within half of that last digit.
    assert compared["finetune_gain_top1"] == pytest.approx(fine["top1"] - coarse["top1"], abs=5e-5)

    assert project.repro() == ALWAYS  # a second run only lists the source, which is unchanged

    # An experiment on a late-stage param: the data, teacher, token labels and the pre-trained model stay cached.
    output = project.run("dvc", "exp", "run", "-S", "finetune.token_label.label_smoothing=0.1").stdout
    assert ran_stages(output) == {*ALWAYS, *FINETUNED}
    # In MLflow the new pipeline run still shows every stage: the cached ones link to the first pipeline's runs.
    first, second = pipeline_runs(project)
    assert stage_runs(project, second) == {stage: True for stage in CACHED_FROM_FIRST} | {
        "finetune": False, "evaluate@finetune": False,
    }
    for stage in CACHED_FROM_FIRST:
        linked = stage_run(project, second, stage)
        made = project.mlflow().get_run(linked.data.tags["cached_from"])
        assert made.data.tags["mlflow.parentRunId"] == first.info.run_id and made.data.tags["stage"] == stage
        assert (linked.data.metrics, linked.data.params) == (made.data.metrics, made.data.params)
        assert [entry.dataset.digest for entry in linked.inputs.dataset_inputs] == [
            entry.dataset.digest for entry in made.inputs.dataset_inputs
        ]
    # The fine-tuned model's evaluation names the run that wrote the file it read.
    assert stage_run(project, second, "evaluate@finetune").data.tags["model.made_by"] == (
        stage_run(project, second, "finetune").info.run_id
    )
    check_pipeline_runs_through_the_rest_api(project, changed={"finetune.token_label.label_smoothing": ("0.0", "0.1")})
    check_the_registered_model_predicts_as_evaluated(project)

    # From here on, DVC's decisions and the metrics are the subject: no more MLflow models (3-5 s of torch.export
    # per training stage). No stage reads tracking.*: with it, a pretrain.* change reruns pretrain and what follows,
    # and the teacher and labels stay cached.
    project.edit_params({"tracking": {"log_models": False}, "pretrain": {"label_smoothing": 0.0}})
    assert project.repro() == {*ALWAYS, "pretrain", "finetune", *EVALUATIONS}
    assert project.metrics("pretrain")["val_top1"] >= 90.0

    # Another teacher: new token labels, and the student that learns from them reruns on them; pre-training on
    # the ground truth here, pretrain does not (test_a_student_without_token_labels_never_waits_for_them).
    project.edit_params({"teacher": {"epochs": 4}})
    assert project.repro() == {*ALWAYS, "teacher", "token_labels", *FINETUNED}
    assert project.metrics("teacher")["val_top1"] >= 50.0  # chance is 10 %

    # An experiment with one knob changed, as a user runs it; it sees the same cache.
    project.commit("params")
    output = project.run("dvc", "exp", "run", "-S", "evaluate.batch_size=128").stdout
    # compare reruns only if an evaluation's metrics file changed (the counts do not depend on the batch size).
    assert {*ALWAYS, "evaluate@pretrain", "evaluate@finetune"} <= ran_stages(output) <= {*ALWAYS, *EVALUATIONS}

    # A behaviour change in a module the training stages import reruns them under the new code (a checkpoint
    # written by other code is never resumed: tests/test_train.py), and no cached result of the old code is restored.
    # (Up to the coarse model's evaluation: the fine-tune stage imports the same modules.)
    project.edit_code(*NO_LEARNING)
    assert project.repro(COARSE_TARGET) == UP_TO_COARSE - {"convert"}
    assert project.metrics("teacher")["val_top1"] < 40.0  # trained under the new code, which learns nothing
    assert project.metrics("pretrain")["val_top1"] < 40.0
    assert project.metrics("evaluate/pretrain")["top1"] < 40.0

    shown = json.loads(project.run("dvc", "metrics", "show", "--json").stdout)
    (workspace,) = shown.values()  # the only revision shown: the workspace
    files = workspace["data"]
    for name, key in (("evaluate/pretrain", "top1"), ("evaluate/finetune", "top1"), ("pretrain", "val_top1")):
        assert files[f"metrics/{name}/metrics.json"]["data"][key] == project.metrics(name)[key]
    assert files["metrics/compare.json"]["data"]["finetune"]["top1"] == project.metrics("evaluate/finetune")["top1"]


# The stages with MLflow runs that a finetune.* change leaves cached (source and compare are plain python).
CACHED_FROM_FIRST = ("convert", "teacher", "token_labels", "pretrain", "evaluate@pretrain")


# The stages with an MLflow run of their own (source, compare and lineage are plain python), and those that train.
TRACKED_STAGES = {"convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune"}
EPOCHS = {stage: FAST[stage]["epochs"] for stage in ("teacher", "pretrain", "finetune")}


def check_pipeline_runs_through_the_rest_api(project: Project, changed: dict[str, tuple[str, str]]) -> None:
    """What a user of `mlflow server` sees after two pipeline runs, through its REST API only: every stage of the
    DAG nested under each pipeline run with params and metric histories; in the second, the rerun stages differ
    from the first's only in `changed` (key -> (first, second)) and the skipped ones link to the first's runs."""
    with mlflow_server(project.path / "mlflow.db") as rest:
        experiment = rest.get("experiments/get-by-name", experiment_name="coarse2fine")["experiment"]
        assert {tag["key"]: tag["value"] for tag in experiment["tags"]}["mlflow.experimentKind"] == (
            "custom_model_development"
        )

        def search(query: str) -> list[dict]:
            found = rest.post("runs/search", experiment_ids=[experiment["experiment_id"]], filter=query,
                              order_by=["attributes.start_time ASC"], max_results=1000)
            return found.get("runs", [])

        pipelines = search("tags.stage = 'pipeline'")
        assert len(pipelines) == 2
        stages = []
        for pipeline in pipelines:
            children = search(f"tags.`mlflow.parentRunId` = '{pipeline['info']['run_id']}'")
            by_stage = {tags_of(run)["stage"]: run for run in children}
            assert set(by_stage) == TRACKED_STAGES and len(children) == len(TRACKED_STAGES)
            for stage, run in by_stage.items():
                assert run["data"]["params"], stage
                metric = "val_top1" if stage in EPOCHS else run["data"]["metrics"][0]["key"]
                history = rest.get("metrics/get-history", run_id=run["info"]["run_id"], metric_key=metric)["metrics"]
                assert len(history) == EPOCHS.get(stage, 1), (stage, history)
            stages.append(by_stage)
        first, second = stages
        assert tags_of(pipelines[1])["dvc.experiment"]  # made by `dvc exp run`, named after its experiment
        for stage, run in second.items():
            if stage in CACHED_FROM_FIRST:
                assert tags_of(run)["cached_from"] == first[stage]["info"]["run_id"]
                continue
            ours, theirs = params_of(first[stage]), params_of(run)
            differing = {key: (ours.get(key), theirs.get(key)) for key in ours.keys() | theirs.keys()
                         if ours.get(key) != theirs.get(key)}
            assert differing == {key: value for key, value in changed.items() if key in ours}, stage


def tags_of(run: dict) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in run["data"].get("tags", [])}


def params_of(run: dict) -> dict[str, str]:
    return {param["key"]: param["value"] for param in run["data"].get("params", [])}


def check_the_registered_model_predicts_as_evaluated(project: Project) -> None:
    """The pipeline's result under its alias, loaded by MLflow and by `coarse2fine.predict`, gives the top-1 the
    evaluate stage computes from the model file on the same val images (through the real val loader)."""
    import mlflow.pytorch
    from coarse2fine import checkpoints
    from coarse2fine.data import records
    from coarse2fine.data.loaders import build_loader
    from coarse2fine.config import load_params
    from conftest import cpu_runtime

    params = load_params(project.path / "params.yaml")
    uri = f"models:/{params.tracking.registered_model}@{params.tracking.candidate_alias}"
    model_file = project.path / "models/finetune/model.pt"
    payload = checkpoints.read_model_file(model_file)
    version = project.mlflow().get_model_version_by_alias(params.tracking.registered_model, params.tracking.candidate_alias)
    assert version.run_id == stage_run(project, pipeline_runs(project)[-1], "finetune").info.run_id
    evaluated = checkpoints.model_from_payload(payload, model_file)
    loader = build_loader(
        "val", project.path / "data/records", img_size=payload["img_size"], batch_size=8, runtime=cpu_runtime(),
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=params.evaluate.finetune.crop_pct, seed=0,
    )
    batch = next(iter(loader))
    mlflow.set_tracking_uri(project.env["MLFLOW_TRACKING_URI"])
    with torch.inference_mode():
        expected = evaluated(batch["image"]).argmax(1)
        assert torch.equal(mlflow.pytorch.load_model(uri)(batch["image"]).argmax(1), expected)
    # The same images as files, through the command line.
    images = project.path / "val_images"
    images.mkdir()
    (shard, _), *_ = records.shard_files(project.path / "data/records", "val")
    for index, record in zip(range(len(expected)), records.read_shard(shard)):
        (images / f"{index}.jpg").write_bytes(record["image"])
    # (A model file's path through the command line: tests/test_predict.py.)
    result = project.run("python", "-m", "coarse2fine.predict", uri, str(images), "--json")
    predicted = json.loads(result.stdout)["predictions"]
    top1 = [entry["top5"][0]["class"] for entry in sorted(predicted, key=lambda entry: int(Path(entry["image"]).stem))]
    assert top1 == [payload["classes"][label] for label in expected.tolist()]


def finetuned_top1_at(project: Project, img_size: int) -> float:
    """The fine-tuned model rebuilt at `img_size` (its position embedding resampled) on the whole val split through
    the real val loader: its top-1 %."""
    from coarse2fine import checkpoints
    from coarse2fine.config import load_params
    from coarse2fine.data.loaders import build_loader
    from conftest import cpu_runtime

    params = load_params(project.path / "params.yaml")
    model_file = project.path / "models/finetune/model.pt"
    model = checkpoints.model_from_payload(checkpoints.read_model_file(model_file), model_file, img_size=img_size).eval()
    loader = build_loader(
        "val", project.path / "data/records", img_size=img_size, batch_size=64, runtime=cpu_runtime(),
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=params.evaluate.finetune.crop_pct,
        seed=params.seed,
    )
    with torch.inference_mode():
        hits = torch.cat([model(batch["image"]).argmax(1) == batch["label"] for batch in loader])
    return 100.0 * hits.double().mean().item()


@contextlib.contextmanager
def mlflow_server(database: Path):
    """`mlflow server` on 127.0.0.1 (a free port) over `database`, one worker; yields a tiny REST client of its API."""
    (port,) = free_ports(1)
    with server.mlflow_server(f"sqlite:///{database}", str(database.parent / "mlruns"), port=port, workers=1):
        yield RestClient(f"http://127.0.0.1:{port}/api/2.0/mlflow/")


class RestClient:
    def __init__(self, base: str):
        self.base = base

    def get(self, endpoint: str, **query: str) -> dict:
        with urllib.request.urlopen(f"{self.base}{endpoint}?{urllib.parse.urlencode(query)}", timeout=60) as response:
            return json.load(response)

    def post(self, endpoint: str, **body) -> dict:
        request = urllib.request.Request(
            self.base + endpoint, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)


def pipeline_runs(project: Project) -> list:
    client = project.mlflow()
    experiment = client.get_experiment_by_name("coarse2fine").experiment_id
    return client.search_runs([experiment], "tags.stage = 'pipeline'", order_by=["attributes.start_time ASC"])


def stage_runs(project: Project, pipeline) -> dict[str, bool]:
    """stage -> whether its run in `pipeline` is a link to a cached result."""
    client = project.mlflow()
    children = client.search_runs(
        [pipeline.info.experiment_id], f"tags.`mlflow.parentRunId` = '{pipeline.info.run_id}'"
    )
    return {run.data.tags["stage"]: "cached_from" in run.data.tags for run in children}


def stage_run(project: Project, pipeline, stage: str):
    client = project.mlflow()
    query = f"tags.`mlflow.parentRunId` = '{pipeline.info.run_id}' and tags.stage = '{stage}'"
    (run,) = client.search_runs([pipeline.info.experiment_id], query)
    return run


def store_bytes(project: Project) -> dict[str, bytes]:
    root = project.path / "data/token_labels"
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_a_student_without_token_labels_never_waits_for_them(project):
    """Pre-training on the ground truth (FAST): what it depends on of the token labels is an empty file of their
    store, so another teacher reruns only what learns from the labels; with token labeling off everywhere, the
    labels are an empty store, made without the teacher's forward. Up to pretrain, one epoch each: DVC's decisions
    are the subject here, not the models."""
    project.edit_params({"teacher": {"epochs": 1}, "pretrain": {"epochs": 1}})
    assert project.repro("pretrain") == {"source", "convert", "teacher", "token_labels", "pretrain"}
    assert (project.path / "data/token_labels/log_probs.npy").is_file()  # for finetune, which learns from them

    project.edit_params({"teacher": {"epochs": 2}})
    assert project.repro("pretrain") == {"source", "teacher", "token_labels"}
    labels = store_bytes(project)

    project.edit_params({"finetune": {"token_label": {"enabled": False}}})
    output = project.run("dvc", "repro", "pretrain").stdout
    assert ran_stages(output) == {"source", "token_labels"} and "no teacher forward" in output
    assert store_bytes(project) == {"enabled/false": b""}
    # Back on: DVC's run cache restores the labels made from these inputs before, without running the stage.
    project.edit_params({"finetune": {"token_label": {"enabled": True}}})
    output = project.run("dvc", "repro", "pretrain").stdout
    assert ran_stages(output) == {"source"} and "Stage 'token_labels' is cached - skipping run" in output
    assert store_bytes(project) == labels

    # Speed knobs rerun nothing.
    project.edit_params({"loader": {"workers": 1, "prefetch": 3}, "data": {"convert_workers": 1}})
    assert project.repro("pretrain") == {"source"}


# The queue tests share one queue, as a user's queue holds several sweeps: one baseline (a short teacher and
# students: what is trained does not matter, which stages run and what they report does), then queued on it a
# pretrain.* sweep, a teacher.* sweep and an experiment of edited code, run by one `dvc exp run --run-all --jobs 2`
# (two at a time: one MLflow store, one DVC cache). Each test asserts on what the queue left; only the pretrain
# sweep's test edits the workspace afterwards, so everything the other two read is taken before it.
SWEEP_EPOCHS = {"teacher": {"epochs": 1}, "pretrain": {"epochs": 3}, "finetune": {"epochs": 1}}
SHARED = ("convert", "teacher", "token_labels")  # a pretrain.* sweep must restore these, not run them
FROM_PRETRAIN = {"pretrain", "evaluate@pretrain", *FINETUNED}
LR_POINTS = [0.016, 0.064]  # the baseline's pretrain.optimizer.lr_base is FAST's 0.032
TEACHER_POINTS = [2, 3]  # the baseline's teacher.epochs is SWEEP_EPOCHS' 1


def without_tracking_uri(project: Project) -> dict[str, str]:
    """The project's environment as a user's shell has it: MLflow's store found by the stages' default."""
    return {name: value for name, value in project.env.items() if name != "MLFLOW_TRACKING_URI"}


def experiment_results(project: Project) -> dict[str, dict]:
    """name -> the experiment's params.yaml and metrics, as `dvc exp show` has them (a metrics file of a stage the
    experiment's target did not reach is left out: DVC shows it as an error)."""
    shown = json.loads(project.run("dvc", "exp", "show", "--json").stdout)
    return {
        experiment["name"]: {
            "params": experiment["revs"][0]["data"]["params"]["params.yaml"]["data"],
            "metrics": {
                path: entry["data"] for path, entry in experiment["revs"][0]["data"]["metrics"].items() if "data" in entry
            },
        }
        for baseline in shown for experiment in baseline.get("experiments") or []
    }


def restored_not_run(log: str, stage: str) -> bool:
    """DVC's log says the stage's outputs came from its cache: unchanged against the baseline, or a run-cache hit."""
    return f"Stage '{stage}' didn't change, skipping" in log or f"Stage '{stage}' is cached - skipping run" in log


def queued_names(project: Project) -> set[str]:
    """The names of the experiments waiting in the queue (`dvc queue status`: task, name, created, status)."""
    rows = [line.split() for line in project.run("dvc", "queue", "status").stdout.splitlines()]
    return {row[1] for row in rows if len(row) > 2 and row[-1] == "Queued"}


def test_a_queue_worker_that_misses_every_shutdown_broadcast_is_stopped_and_no_other_process_is(tmp_path):
    """kombu's filesystem broker can lose a `dvc queue stop` broadcast (coarse2fine.queue_stop): here every one is
    lost, for real, by unbinding the worker from the broadcast exchange. `make sweep`'s stop must still end it,
    and must never signal a process that only took a stale pid file's pid."""
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(command, cwd=tmp_path, check=True)
    venv_first = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["dvc", "queue", "start"], cwd=tmp_path, env=venv_first, check=True)  # spawns `dvc` from PATH
    exchange = tmp_path / ".dvc/tmp/exps/celery/broker/control/celery.pidbox.exchange"
    deadline = time.monotonic() + 60
    while not (exchange.is_file() and "dvc-exp-" in exchange.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    (worker,) = queue_workers(tmp_path)
    exchange.write_text("[]")
    said = []
    with subprocess.Popen(["sleep", "120"]) as stranger:
        try:
            (tmp_path / ".dvc/tmp/exps/celery/dvc-exp-worker-2.pid").write_text(str(stranger.pid))
            assert list(queue_workers(tmp_path)) == [worker]
            stop_queue_workers(tmp_path, broadcasts=2, broadcast_wait_s=3, say=said.append)
            assert not queue_workers(tmp_path) and stranger.poll() is None
        finally:
            stranger.kill()
            for pid in queue_workers(tmp_path):  # none unless this test fails: leave no worker behind
                os.kill(pid, signal.SIGKILL)
    assert len(said) == 2 and "again (2 of 2)" in said[0] and f"[{worker}]" in said[1] and "SIGTERM" in said[1]
    assert "Warm shutdown" in (tmp_path / ".dvc/tmp/exps/celery/dvc-exp-worker-1.out").read_text()


def test_stopping_the_queue_outside_a_dvc_repository_is_one_line_naming_it(tmp_path):
    with pytest.raises(UserError, match=f"no DVC repository at {tmp_path}"):
        stop_queue_workers(tmp_path)


@dataclasses.dataclass
class Queue:
    project: Project
    batches: dict[str, set[str]]  # "lr", "teacher", "sentinel" -> the names of the experiments queued by each
    results: dict[str, dict]  # experiment_results once the queue ran
    logs: dict[str, str]  # name -> `dvc queue logs`
    listed: str  # `dvc exp list --name-only`
    reported: float  # the workspace's coarse top-1 before the queue ran
    reported_after: float  # and after


@pytest.fixture(scope="module")
def queue(tmp_path_factory) -> Queue:
    project = Project(tmp_path_factory.mktemp("queue") / "project")
    project.edit_params(FAST)
    project.edit_params(SWEEP_EPOCHS)
    project.commit("fast params")
    assert project.repro() == EVERY_STAGE
    project.commit("baseline")
    reported = project.metrics("evaluate/pretrain")["top1"]
    env = without_tracking_uri(project)
    batches = {}

    def enqueue(batch: str, *args: str) -> None:
        before = queued_names(project)
        project.run("dvc", "exp", "run", "--queue", *args, env=env)
        batches[batch] = queued_names(project) - before

    enqueue("lr", "-S", f"pretrain.optimizer.lr_base={','.join(map(str, LR_POINTS))}")  # make sweep's workflow
    enqueue("teacher", "-S", f"teacher.epochs={','.join(map(str, TEACHER_POINTS))}", COARSE_TARGET)
    project.edit_code(*SENTINEL_TOP1)
    enqueue("sentinel", "--name", "sentinel", COARSE_TARGET)
    project.run("git", "checkout", "--", SENTINEL_TOP1[0])  # the workspace's code reports the truth again
    project.run("dvc", "exp", "run", "--run-all", "--jobs", "2", env=env)
    stop_queue_workers(project.path)  # as make sweep does: a worker may outlive the run (kombu's race)
    assert not queue_workers(project.path)

    results = experiment_results(project)
    return Queue(
        project=project, batches=batches, results=results,
        logs={name: project.run("dvc", "queue", "logs", name).stdout for name in results},
        listed=project.run("dvc", "exp", "list", "--name-only").stdout, reported=reported,
        reported_after=project.metrics("evaluate/pretrain")["top1"],
    )


def test_a_queued_experiment_runs_its_own_code(queue):
    """`dvc exp run --queue` snapshots the workspace; its run must import that snapshot's src/, not the
    workspace's (nor the editable install's). (The sentinel's module reruns the teacher and pretrain too.)"""
    assert queue.batches["sentinel"] == {"sentinel"} and "sentinel" in queue.listed
    results = queue.results["sentinel"]["metrics"]
    assert results["metrics/evaluate/pretrain/metrics.json"]["top1"] == -1.0
    assert queue.reported_after == queue.reported  # the workspace is untouched


def test_a_queued_sweep_pays_only_for_the_stages_its_param_reaches(queue):
    """`make sweep`'s workflow on pretrain.optimizer.lr_base, two points run side by side (--jobs 2: one MLflow
    store, one DVC cache): each experiment restores convert, the teacher and the token labels from the cache and
    runs pretrain and what follows; each reaches the top-1 the same point reaches in the workspace; its MLflow
    pipeline run (in the project's store, though the experiment ran in a temporary copy) links the cached stages."""
    project = queue.project
    results = {name: queue.results[name] for name in queue.batches["lr"]}
    assert sorted(result["params"]["pretrain"]["optimizer"]["lr_base"] for result in results.values()) == LR_POINTS
    pipelines = {run.data.tags.get("dvc.experiment"): run for run in pipeline_runs(project)}
    for name, result in results.items():
        log = queue.logs[name]
        assert ran_stages(log) == {*ALWAYS, *FROM_PRETRAIN}, log
        assert all(restored_not_run(log, stage) for stage in SHARED), log
        assert "is not usable" not in log, log  # MLflow's store took both experiments' writes
        assert stage_runs(project, pipelines[name]) == {stage: True for stage in SHARED} | {
            stage: False for stage in FROM_PRETRAIN - {"compare"}
        }
        for stage in SHARED:  # linked to the baseline's run that made the outputs, not to the other point's link
            made = project.mlflow().get_run(stage_run(project, pipelines[name], stage).data.tags["cached_from"])
            assert made.data.tags["mlflow.parentRunId"] == pipelines[None].info.run_id, (name, stage)

    # Each point again in the workspace, computed anew (--no-run-cache: the experiments' runs are in the run cache).
    for result in results.values():
        project.edit_params({"pretrain": {"optimizer": {"lr_base": result["params"]["pretrain"]["optimizer"]["lr_base"]}}})
        assert ran_stages(project.run("dvc", "repro", "--no-run-cache").stdout) == {*ALWAYS, *FROM_PRETRAIN}
        for model in ("pretrain", "finetune"):
            path = f"metrics/evaluate/{model}/metrics.json"
            assert result["metrics"][path]["top1"] == project.metrics(f"evaluate/{model}")["top1"], (model, result)


def test_a_queued_sweep_of_a_teacher_param_reruns_the_teacher_and_its_labels(queue):
    """Up to the coarse model: the teacher and its token labels rerun in each point, the records are restored, and
    pretrain (on the ground truth here, FAST) stays cached: it does not learn from the labels."""
    results = {name: queue.results[name] for name in queue.batches["teacher"]}
    assert sorted(result["params"]["teacher"]["epochs"] for result in results.values()) == TEACHER_POINTS
    for name in results:
        log = queue.logs[name]
        assert ran_stages(log) == {"source", "teacher", "token_labels"}, log
        assert all(restored_not_run(log, stage) for stage in ("convert", "pretrain", "evaluate@pretrain")), log


def write_image_tree(root: Path) -> None:
    """A small ImageFolder of digits-like images: 3 classes, JPEG and PNG mixed, one broken file."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    for split, count in (("train", 40), ("val", 12)):
        for label in (0, 1, 7):
            folder = root / split / f"class {label}"
            folder.mkdir(parents=True)
            images = digits.images[digits.target == label]
            for i in rng.choice(len(images), count, replace=False):
                image = digit_image(images[i])
                suffix = ".png" if i % 3 == 0 else ".jpg"
                image.save(folder / f"{i}{suffix}")
    (root / "train" / "class 0" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")


def digit_image(pixels: np.ndarray) -> Image.Image:
    grey = Image.fromarray((pixels * 255 / 16).astype(np.uint8))
    return grey.resize((32, 32), Image.Resampling.BICUBIC).convert("RGB")


def test_same_pipeline_on_an_imagefolder_and_a_changed_folder_reruns(project, tmp_path):
    images = tmp_path / "images"
    write_image_tree(images)
    project.edit_params({
        "data": {"source": "imagefolder", "root": str(images), "subset": 1.0},
        # 120 images: 7 updates/epoch
        "pretrain": {"batch_size": 16, "optimizer": {"lr_base": 0.064}},
        "token_labels": {"top_k": 3},  # of 3 classes
    })
    assert project.repro(COARSE_TARGET) == UP_TO_COARSE
    manifest = json.loads((project.path / "data/records/manifest.json").read_text())
    assert manifest["splits"]["train"]["images"] == 120
    # The broken file, and only it, skipped with why (its bytes start like a JPEG's).
    skipped = [item for split in manifest["splits"].values() for item in split["skipped"]]
    assert [item["path"] for item in skipped] == ["train/class 0/broken.jpg"], skipped
    assert skipped[0]["reason"].startswith("cannot decode: "), skipped
    assert json.loads((project.path / "data/records/classes.json").read_text()) == ["class 0", "class 1", "class 7"]
    assert project.metrics("evaluate/pretrain")["n"] == 36
    assert project.metrics("evaluate/pretrain")["top1"] > 60.0  # chance is 33 %

    assert project.repro(COARSE_TARGET) == {"source"}  # the folder is unchanged: nothing else runs

    from sklearn.datasets import load_digits

    digit_image(load_digits().images[0]).save(images / "val" / "class 0" / "added.png")
    assert project.repro(COARSE_TARGET) == UP_TO_COARSE
    assert project.metrics("evaluate/pretrain")["n"] == 37
