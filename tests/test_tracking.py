"""Tracker against a real MLflow sqlite store and real DVCLive files (and, once, real `dvc repro` / `dvc exp run`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import DIGITS_RECORDS_PARAMS, PROJECT_ROOT, cpu_runtime, make_params
from test_scale_out import start_stage
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID

from coarse2fine import checkpoints, models
from coarse2fine.config import flatten, parse_params
from coarse2fine.data import records
from coarse2fine.data.convert import convert
from coarse2fine.data.transforms import eval_transform
from coarse2fine.errors import UserError
from coarse2fine.distributed import Runtime
from coarse2fine.tracking.identity import (
    DVC_EXPERIMENT_TAG, GIT_COMMIT_TAG, GIT_DIRTY_TAG, OUTPUTS_TAG, PIPELINE_KEY_TAG, PIPELINE_STAGE, REPLACED_BY_TAG,
    STAGE_TAG, outputs_digest, stage_params, tracking_uri,
)
from coarse2fine.tracking import outbox
from coarse2fine.tracking.lineage import record_lineage
from coarse2fine.tracking.logged_model import load_logged_model
from coarse2fine.tracking.runs import Tracker

PRETRAIN_SECTIONS = ("seed", "model", "pretrain")
STAGE_RUNS = f"tags.{STAGE_TAG} != '{PIPELINE_STAGE}'"  # search_runs filter: the stages' runs, not the pipelines'


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sqlite store for the module (creating one takes seconds); tests use their own experiment."""
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture
def workdir(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Path:
    """cwd = a fresh directory; MLFLOW_TRACKING_URI = the module's store; the experiment named after the test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    for name in ("DVC_ROOT", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def client(store: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{store}")


def params_for(request: pytest.FixtureRequest, **sections):
    """Params whose experiment (and registered model) are named after the test, logging models as shipped."""
    tracking = {"experiment": request.node.name, "registered_model": request.node.name, "log_models": True}
    return make_params(tracking=tracking, **sections)


def history(store: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(metric.step, metric.value) for metric in client(store).get_metric_history(run_id, key)]


def tsv_rows(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def test_run_holds_params_metrics_history_tags_and_artifacts(workdir, store, request, monkeypatch):
    git("init", "-q", cwd=workdir)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x", cwd=workdir)
    monkeypatch.setenv("DVC_EXP_NAME", "lucky-lamb")
    # data.root is the only free-text param: a value beyond MLflow's 6000 characters must not fail the run.
    params = params_for(request, data={"source": "imagefolder", "root": "/" + "r" * 7000})
    (workdir / "notes.txt").write_text("hello")
    (workdir / "bundle").mkdir()
    (workdir / "bundle" / "a.json").write_text("{}")
    metrics_dir = workdir / "metrics" / "pretrain"

    with Tracker("pretrain", params, cpu_runtime(), metrics_dir=metrics_dir, param_sections=(*PRETRAIN_SECTIONS, "data")) as tracker:
        for epoch in range(3):
            tracker.log_metrics({"train_loss": 1.0 / (epoch + 1), "val_top1": torch.tensor(10.0 * epoch)}, step=epoch)
        tracker.log_summary({"top1": 97.5, "n": 108})
        tracker.log_artifact(workdir / "notes.txt")
        tracker.log_artifact(workdir / "bundle", artifact_path="extra")
        tracker.set_tag("weights_file", "teacher.pt")
        tracker.log_setup({"global_batch": 64, "effective_lr": 1e-3})

    run = client(store).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "pretrain"
    experiment = client(store).get_experiment(run.info.experiment_id)
    assert experiment.name == request.node.name
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI opens on training runs
    assert run.data.tags[STAGE_TAG] == "pretrain"
    assert run.data.tags[MLFLOW_GIT_COMMIT] == git("rev-parse", "HEAD", cwd=workdir)
    assert run.data.tags[DVC_EXPERIMENT_TAG] == "lucky-lamb"
    assert run.data.tags[GIT_DIRTY_TAG] == "false"
    assert run.data.tags["weights_file"] == "teacher.pt"
    assert run.data.tags["mlflow.source.name"] == sys.argv[0]  # the stage's script, under torchrun
    pipeline = client(store).get_run(run.data.tags[MLFLOW_PARENT_RUN_ID])
    assert pipeline.info.run_name == "pipeline lucky-lamb" and pipeline.info.status == "FINISHED"
    assert pipeline.data.tags[PIPELINE_KEY_TAG] == run.data.tags[PIPELINE_KEY_TAG]
    assert pipeline.data.params.keys() == flatten(params).keys()  # the whole params file, in batches of 100

    logged = run.data.params
    assert logged.keys() == stage_params(params, (*PRETRAIN_SECTIONS, "data")).keys()
    assert logged["seed"] == "0"
    assert logged["pretrain.optimizer.lr_base"] == "0.016"
    assert logged["model.layers"] == "[1, 1, 1, 1]"
    assert logged["data.root"] == ("/" + "r" * 7000)[:6000]
    assert not any(key.startswith(("evaluate.", "loader.", "tracking.")) for key in logged)

    assert history(store, tracker.run_id, "val_top1") == [(0, 0.0), (1, 10.0), (2, 20.0)]
    assert history(store, tracker.run_id, "train_loss") == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert run.data.metrics["top1"] == 97.5 and run.data.metrics["n"] == 108
    assert run.data.metrics["global_batch"] == 64 and run.data.metrics["effective_lr"] == 1e-3  # numbers, not tags

    artifacts = client(store).list_artifacts(tracker.run_id)
    assert sorted(item.path for item in artifacts) == ["extra", "notes.txt", "params.yaml"]
    resolved = client(store).download_artifacts(tracker.run_id, "params.yaml", str(workdir / "downloaded"))
    assert parse_params(yaml.safe_load(Path(resolved).read_text())) == params  # the params as the run read them
    assert [item.path for item in client(store).list_artifacts(tracker.run_id, "extra")] == ["extra/a.json"]
    # Artifacts sit next to the database, not in ./mlruns of whatever directory the stage ran in.
    assert run.info.artifact_uri.startswith((store.parent / "mlruns").as_uri())

    assert tsv_rows(metrics_dir / "plots" / "metrics" / "val_top1.tsv") == [["step", "val_top1"], ["0", "0.0"], ["1", "10.0"], ["2", "20.0"]]
    summary = json.loads((metrics_dir / "metrics.json").read_text())
    assert summary == {"train_loss": pytest.approx(1 / 3), "val_top1": 20.0, "step": 2, "top1": 97.5, "n": 108}
    # DVCLive wrote nothing but its files under metrics_dir: no dvc.yaml, no report, no .dvc/.
    assert sorted(path.name for path in workdir.iterdir()) == [".git", "bundle", "downloaded", "metrics", "notes.txt"]
    assert sorted(path.name for path in metrics_dir.iterdir()) == ["metrics.json", "plots"]


def test_resume_continues_the_same_run_and_history(workdir, store, request):
    params = params_for(request)
    metrics_dir = workdir / "metrics"
    with pytest.raises(RuntimeError, match="killed"):
        with Tracker("pretrain", params, cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as first:
            for epoch in range(2):
                first.log_metrics({"val_top1": float(epoch)}, step=epoch)
            raise RuntimeError("killed")
    assert client(store).get_run(first.run_id).info.status == "FAILED"

    shutil.rmtree(metrics_dir)  # DVC deletes a stage's outputs before running it again
    with Tracker(
        "pretrain", params, cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS, resume_run_id=first.run_id
    ) as resumed:
        resumed.resume_history([{"val_top1": float(epoch)} for epoch in range(2)])  # the checkpoint's history
        for epoch in range(2, 4):
            resumed.log_metrics({"val_top1": float(epoch)}, step=epoch)

    assert resumed.run_id == first.run_id
    experiment = client(store).get_experiment_by_name(request.node.name)
    assert [run.info.run_id for run in client(store).search_runs([experiment.experiment_id], STAGE_RUNS)] == [first.run_id]
    assert client(store).get_run(resumed.pipeline_run_id).info.status == "FINISHED"  # ends as its last stage did
    assert client(store).get_run(first.run_id).info.status == "FINISHED"
    assert history(store, first.run_id, "val_top1") == [(step, float(step)) for step in range(4)]
    rows = tsv_rows(metrics_dir / "plots" / "metrics" / "val_top1.tsv")
    assert [row[0] for row in rows[1:]] == ["0", "1", "2", "3"]
    assert json.loads((metrics_dir / "metrics.json").read_text()) == {"val_top1": 3.0, "step": 3}


@pytest.mark.parametrize("killed", ["before logging", "between MLflow and DVCLive", "after logging"])
@pytest.mark.parametrize("outputs", ["deleted", "kept"])
def test_a_resumed_history_holds_each_step_once_wherever_the_kill_fell(workdir, store, request, killed, outputs):
    """The trainer checkpoints an epoch, then logs it; resuming from that checkpoint calls resume_history with
    the checkpoint's history, whatever part of the logging the killed run got to, and whether the metrics files
    are gone (DVC deletes a stage's outputs before running it) or left by a run outside DVC."""
    params = params_for(request)
    metrics_dir = workdir / "metrics"
    epoch_metrics = [{"val_top1": 10.0 * step, "train_loss": 1.0 / (step + 1)} for step in range(4)]
    with pytest.raises(RuntimeError, match="killed"):
        with Tracker("pretrain", params, cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as first:
            first.log_metrics(epoch_metrics[0], step=0)
            if killed != "before logging":
                first.log_metrics(epoch_metrics[1], step=1)
            raise RuntimeError("killed")
    if killed == "between MLflow and DVCLive":  # undo DVCLive's part of step 1, as if killed before it
        for name in ("val_top1", "train_loss"):
            path = metrics_dir / "plots" / "metrics" / f"{name}.tsv"
            path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    if outputs == "deleted":
        shutil.rmtree(metrics_dir)

    with Tracker(
        "pretrain", params, cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS, resume_run_id=first.run_id
    ) as resumed:
        resumed.resume_history(epoch_metrics[:2])
        for step in range(2, 4):
            resumed.log_metrics(epoch_metrics[step], step=step)

    for name in ("val_top1", "train_loss"):
        expected = [(step, epoch_metrics[step][name]) for step in range(4)]
        assert history(store, first.run_id, name) == expected
        rows = tsv_rows(metrics_dir / "plots" / "metrics" / f"{name}.tsv")
        assert [(int(row[0]), float(row[1])) for row in rows[1:]] == expected
    assert json.loads((metrics_dir / "metrics.json").read_text()) == {**epoch_metrics[3], "step": 3}


def open_and_close(request, stage: str, params, workdir: Path, fail: bool = False) -> Tracker:
    with contextlib.suppress(RuntimeError):
        with Tracker(stage, params, cpu_runtime(), metrics_dir=workdir / stage, param_sections=("seed",)) as tracker:
            if fail:
                raise RuntimeError("diverged")
    return tracker


def test_stages_nest_under_the_pipeline_run_of_their_code_params_and_data(workdir, store, request):
    (workdir / "src").mkdir()
    (workdir / "src" / "module.py").write_text("x = 1\n")
    (workdir / "data").mkdir()
    (workdir / "data" / "source.json").write_text('{"kind": "digits"}\n')
    params = params_for(request)
    convert, teacher = (open_and_close(request, stage, params, workdir) for stage in ("convert", "teacher"))
    assert convert.pipeline_run_id == teacher.pipeline_run_id
    assert client(store).get_run(teacher.run_id).data.tags[MLFLOW_PARENT_RUN_ID] == teacher.pipeline_run_id

    other_params = open_and_close(request, "convert", params_for(request, seed=1), workdir)
    (workdir / "src" / "module.py").write_text("x = 2\n")
    other_code = open_and_close(request, "convert", params, workdir)
    (workdir / "data" / "source.json").write_text('{"kind": "imagefolder"}\n')
    other_data = open_and_close(request, "convert", params, workdir, fail=True)
    pipelines = {tracker.pipeline_run_id for tracker in (convert, other_params, other_code, other_data)}
    assert len(pipelines) == 4
    assert client(store).get_run(other_data.pipeline_run_id).info.status == "FAILED"  # as its last stage
    tags = [client(store).get_run(run_id).data.tags for run_id in pipelines]
    assert all(tag[STAGE_TAG] == PIPELINE_STAGE for tag in tags)
    assert len({(tag["code.hash"], tag["params.hash"], tag["data.hash"]) for tag in tags}) == 4


def lock_with(outputs: dict[str, str]) -> dict:
    """A dvc.lock's contents: stage -> the md5 of its one output."""
    return {"schema": "2.0", "stages": {
        stage: {"cmd": "x", "outs": [{"path": f"out/{stage}", "hash": "md5", "md5": md5}]} for stage, md5 in outputs.items()
    }}


def test_lineage_links_each_cached_stage_to_the_run_that_made_its_outputs(workdir, store, request, capsys):
    first_params, second_params = params_for(request), params_for(request, seed=1)
    made = {stage: open_and_close(request, stage, first_params, workdir) for stage in ("teacher", "pretrain")}
    first_lock = lock_with({"teacher": "a" * 32, "pretrain": "b" * 32, "source": "c" * 32})
    assert record_lineage(first_params, first_lock) == []  # every stage ran here: their runs get their outputs
    assert client(store).get_run(made["teacher"].run_id).data.tags["dvc.outs"] == outputs_digest(
        first_lock["stages"]["teacher"]
    )

    # Another pipeline in which only pretrain ran; the teacher's outputs are the ones the first one made.
    rerun = open_and_close(request, "pretrain", second_params, workdir)
    lines = record_lineage(second_params, lock_with({"teacher": "a" * 32, "pretrain": "d" * 32, "source": "c" * 32}))
    assert lines == [f"teacher: cached, made by run {made['teacher'].run_id} (pipeline run {made['teacher'].pipeline_run_id})"]
    children = client(store).search_runs(
        [client(store).get_experiment_by_name(request.node.name).experiment_id],
        f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{rerun.pipeline_run_id}'",
    )
    assert sorted((run.info.run_name, run.data.tags.get("cached_from")) for run in children) == [
        ("pretrain", None), ("teacher (cached)", made["teacher"].run_id),
    ]
    assert client(store).get_run(rerun.pipeline_run_id).info.status == "FINISHED"

    # A third pipeline with the same teacher outputs (a sweep's next point) links to the run that made them, not to
    # the second pipeline's link, although that link is the newest run tagged with those outputs.
    third_params = params_for(request, seed=2)
    open_and_close(request, "pretrain", third_params, workdir)
    lines = record_lineage(third_params, lock_with({"teacher": "a" * 32, "pretrain": "e" * 32, "source": "c" * 32}))
    assert lines == [f"teacher: cached, made by run {made['teacher'].run_id} (pipeline run {made['teacher'].pipeline_run_id})"]


@pytest.mark.slow
def test_a_training_run_holds_its_datasets_curves_and_model_and_the_result_is_registered(
    workdir, store, request, digits_records
):
    params = params_for(request)
    model = models.build_model(params.model, 10, 16, mix_token=True)  # as pretrain builds it: eval ignores MixToken
    with Tracker("finetune", params, cpu_runtime(), metrics_dir=workdir / "m", param_sections=("model",)) as tracker:
        for split in ("train", "val"):
            tracker.log_records(digits_records, split)
        for epoch in range(3):
            tracker.log_metrics({"train_loss": 1 / (epoch + 1), "val_top1": 30.0 * epoch, "lr": 1e-3}, step=epoch)
        card = checkpoints.save_model_file(
            workdir / "model.pt", model, model_cfg=params.model, img_size=16, classes=list("0123456789"),
            stage="finetune", eval_transform=eval_transform(16, 0.875, "bicubic"),
        )
        tracker.log_model(model, card)
        tracker.log_curves()
    run = client(store).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"  # logging the model through MLflow's fluent API did not end the run early
    datasets = {entry.tags[0].value: entry.dataset for entry in run.inputs.dataset_inputs}
    assert {context: dataset.name for context, dataset in datasets.items()} == {
        "train": "digits train (subset 0.3)", "val": "digits val (subset 0.3)",
    }
    assert json.loads(datasets["val"].profile)["num_rows"] == 108
    assert "curves.png" in {item.path for item in client(store).list_artifacts(tracker.run_id)}

    # The pipeline's last stage registers the finetune run's model and moves the alias to it, once per model.
    # Run as DVC runs it in a queued experiment: the store found through DVC_ROOT (no MLFLOW_TRACKING_URI) from a
    # temporary copy of the repo, whose ./mlflow.db must not be where MLflow looks for the model.
    name = params.tracking.registered_model
    (workdir / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    (workdir / "dvc.lock").write_text(yaml.safe_dump(lock_with({"finetune": "e" * 32})))
    copy = workdir / "exps" / "tmp1234"
    copy.mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if key != "MLFLOW_TRACKING_URI"}
    command = [sys.executable, str(PROJECT_ROOT / "stages" / "lineage.py"), "--params", str(workdir / "params.yaml"),
               "--lock", str(workdir / "dvc.lock")]
    registered = [
        f"lineage: finetune: model registered as models:/{name}/1, alias candidate (models:/{name}@candidate)",
        "lineage: finetune: alias champion stays on no version: version 1 has no evaluation on record "
        "(python -m coarse2fine.promote 1 moves it)",
    ]
    mark = store.with_name(f"{store.name}.lineage.json")

    def lineage() -> list[str]:
        result = subprocess.run(command, cwd=copy, env={**env, "DVC_ROOT": str(store.parent)}, capture_output=True,
                                text=True, check=True)
        return result.stdout.splitlines()

    assert lineage() == registered
    assert lineage() == []  # nothing new since: the mark beside the store says so
    mark.unlink()
    assert lineage() == registered  # recorded again: the same version, the alias where it was
    assert not (copy / "mlflow.db").exists()
    (version,) = client(store).search_model_versions(f"name = '{name}'")
    assert (version.run_id, version.source) == (tracker.run_id, f"models:/{run.data.tags['model.id']}")
    assert client(store).get_model_version_by_alias(name, "candidate").version == version.version

    loaded, loaded_card = load_logged_model(f"models:/{name}@candidate")
    images = torch.randn(5, 3, 16, 16)  # another batch size than the example it was exported with
    with torch.inference_mode():
        torch.testing.assert_close(loaded(images), model.eval()(images))
    assert loaded_card["classes"] == list("0123456789") and loaded_card["eval_transform"]["crop_pct"] == 0.875
    with pytest.raises(UserError, match="@nowhere"):
        load_logged_model(f"models:/{name}@nowhere")


def test_the_champion_moves_only_to_a_better_full_data_result_or_by_promotion(
    workdir, store, request, digits_records, tmp_path_factory, monkeypatch
):
    """Every result takes the candidate alias; the champion only a whole-data result with a better top-1 on the same
    val set: a better pipeline, then a subset sweep point with a higher top-1 on its own (smaller) val set and a
    worse whole-data one leave it on the better; `python -m coarse2fine.promote` moves it by hand."""
    subset_records = tmp_path_factory.mktemp("subset_records")
    convert(make_params(**{**DIGITS_RECORDS_PARAMS, "data": {**DIGITS_RECORDS_PARAMS["data"], "subset": 0.2}}),
            cpu_runtime(), subset_records)
    name = request.node.name
    mlflow = client(store)

    def pipeline(seed: int, top1: float, subset: float = 1.0) -> list[str]:
        params = params_for(request, seed=seed, data={"subset": subset})
        model = models.build_model(params.model, 10, 16)
        with Tracker("finetune", params, cpu_runtime(), metrics_dir=workdir / f"f{seed}",
                     param_sections=("seed",)) as tracker:
            card = checkpoints.save_model_file(
                workdir / f"model{seed}.pt", model, model_cfg=params.model, img_size=16, classes=list("0123456789"),
                stage="finetune", eval_transform=eval_transform(16, 0.875, "bicubic"),
            )
            tracker.log_model(model, card)
        with Tracker("evaluate@finetune", params, cpu_runtime(), metrics_dir=workdir / f"e{seed}",
                     param_sections=("seed",)) as evaluation:
            evaluation.log_records(digits_records if subset == 1 else subset_records, "val")
            evaluation.log_summary({"top1": top1})
        lines = record_lineage(params, lock_with({"finetune": f"{seed:032x}", "evaluate@finetune": f"{seed:032d}"}))
        assert mlflow.get_model_version_by_alias(name, "candidate").run_id == tracker.run_id
        return [line.split(": ", 1)[1] for line in lines if "alias champion" in line]

    def champion() -> int:
        return mlflow.get_model_version_by_alias(name, "champion").version

    val_set = f"digits val (subset 0.3) {records.split_summary(digits_records, 'val').digest}"
    assert pipeline(1, top1=80.0) == [
        f"alias champion moved to version 1: the first result trained on the whole data set (top-1 80.00 % on "
        f"{val_set})"
    ]
    assert pipeline(2, top1=90.0) == [
        f"alias champion moved to version 2: top-1 90.00 % beats the champion's 80.00 % on {val_set}"
    ]
    assert pipeline(3, top1=95.0, subset=0.2) == [
        "alias champion stays on version 2: version 3 was trained on data.subset 0.2, not the whole data set "
        "(python -m coarse2fine.promote 3 moves it)"
    ]
    assert pipeline(4, top1=85.0) == [
        f"alias champion stays on version 2: version 4 has top-1 85.00 %, not above the champion's 90.00 % on "
        f"{val_set} (python -m coarse2fine.promote 4 moves it)"
    ]
    assert champion() == 2
    subset_tags = mlflow.get_model_version(name, "3").tags  # what the rule read, on the version's page
    assert (subset_tags["val.top1"], subset_tags["data.subset"]) == ("95.0", "0.2")
    assert subset_tags["val.dataset"].startswith("digits val (subset 0.2) ")

    params_file = workdir / "params.yaml"
    params_file.write_text(yaml.safe_dump(params_for(request).model_dump(mode="json")))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    promote = [sys.executable, "-m", "coarse2fine.promote", "--params", str(params_file)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}"}
    moved = subprocess.run([*promote, "candidate"], env=env, capture_output=True, text=True, check=True)
    assert moved.stdout == f"models:/{name}@champion -> version 4 (85.0 % top-1 on {val_set})\n"
    assert champion() == 4
    missing = subprocess.run([*promote, "9"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: cannot promote {name!r} '9' at sqlite:")
    assert len(missing.stderr.splitlines()) == 1 and champion() == 4
    nowhere = subprocess.run([*promote, "4"], env={**env, "MLFLOW_TRACKING_URI": f"sqlite:///{workdir}/none.db"},
                             capture_output=True, text=True)
    assert (nowhere.returncode, nowhere.stderr) == (
        2, f"error: no MLflow store at {workdir}/none.db: run the pipeline first, or set MLFLOW_TRACKING_URI\n"
    )


class DataDependent(torch.nn.Module):
    """A model torch.export refuses: its control flow depends on the input's values."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = images.mean(dim=(2, 3))
        return self.linear(pooled) if pooled.sum() > 0 else -self.linear(pooled)


def test_a_model_torch_export_refuses_is_one_warning_and_the_run_goes_on(workdir, store, request, caplog):
    with Tracker("finetune", params_for(request), cpu_runtime(), metrics_dir=workdir / "m", param_sections=("seed",)) as tracker:
        tracker.log_model(DataDependent(), {"img_size": 4, "classes": ["a", "b"]})
        tracker.log_metrics({"val_top1": 50.0}, step=0)
        tracker.log_curves()
    run = client(store).get_run(tracker.run_id)
    assert caplog.text.count("the model was not logged to MLflow") == 1 and "not usable" not in caplog.text
    assert run.info.status == "FINISHED" and "model.id" not in run.data.tags
    assert "curves.png" in {item.path for item in client(store).list_artifacts(tracker.run_id)}  # MLflow stayed on


@pytest.mark.slow
def test_a_warning_after_mlflow_pytorch_is_imported_still_reaches_the_terminal():
    """mlflow.pytorch's import calls logging.basicConfig(level=ERROR): imported as is, every later warning of the
    project (a model that was not logged, above) is dropped on its way to stderr, in a stage's process."""
    code = ("import logging; from coarse2fine.tracking import logged_model; logged_model.imported_mlflow_pytorch(); "
            "logging.getLogger('coarse2fine.tracking.logged_model').warning('warning: seen')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")})
    assert result.returncode == 0 and result.stderr.splitlines()[-1] == "warning: seen", result.stderr[-2000:]


def test_with_log_models_off_a_training_run_logs_no_model_and_lineage_registers_none(workdir, store, request):
    name = request.node.name
    params = make_params(tracking={"experiment": name, "registered_model": name, "log_models": False})
    model = models.build_model(params.model, 10, 16)
    with Tracker("finetune", params, cpu_runtime(), metrics_dir=workdir / "m", param_sections=("model",)) as tracker:
        tracker.log_model(model, {"img_size": 16, "classes": list("0123456789")})
        tracker.log_metrics({"val_top1": 50.0}, step=0)
    run = client(store).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and "model.id" not in run.data.tags
    assert client(store).search_logged_models([run.info.experiment_id]) == []
    assert record_lineage(params, lock_with({"finetune": "e" * 32})) == []  # its outputs recorded, nothing registered
    assert client(store).search_registered_models(f"name = '{name}'") == []


def test_lineage_without_a_usable_store_is_one_warning(workdir, request, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    assert record_lineage(params_for(request), lock_with({"teacher": "a" * 32})) is None
    assert caplog.text.count("is not usable (") == 1 and "no lineage recorded" in caplog.text


def test_the_git_commit_tag_is_mlflows():
    assert GIT_COMMIT_TAG == MLFLOW_GIT_COMMIT  # spelled out in identity.py, which must not import mlflow


@pytest.mark.slow
@pytest.mark.own_processes  # its subject is what the stage's process imports (in a stage server, a fork records)
def test_a_lineage_with_nothing_new_to_record_does_not_import_mlflow(workdir, store, request):
    """stages/lineage.py as dvc.yaml runs it, under `python -X importtime`: the first run records (and imports
    MLflow), a second with the same pipeline, outputs and store prints nothing and imports no MLflow; other
    outputs, or a store written to since, record again."""
    (workdir / "params.yaml").write_text(yaml.safe_dump({"tracking": {"experiment": request.node.name}}))
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")}

    def lineage(outputs: dict[str, str]) -> tuple[bool, str]:
        """Whether the run imported mlflow, and what it printed."""
        (workdir / "dvc.lock").write_text(yaml.safe_dump(lock_with(outputs)))
        result = subprocess.run(
            [sys.executable, "-X", "importtime", str(PROJECT_ROOT / "stages/lineage.py")],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return " mlflow\n" in result.stderr, result.stdout

    made = open_and_close(request, "teacher", parse_params({"tracking": {"experiment": request.node.name}}), workdir)
    assert lineage({"teacher": "a" * 32}) == (True, "")  # its run gets its outputs' tag: nothing to print
    tagged = client(store).get_run(made.run_id).data.tags["dvc.outs"]
    assert tagged == outputs_digest(lock_with({"teacher": "a" * 32})["stages"]["teacher"])
    assert lineage({"teacher": "a" * 32}) == (False, "")
    assert lineage({"teacher": "b" * 32})[0]  # other outputs
    assert not lineage({"teacher": "b" * 32})[0]
    client(store).create_experiment(f"{request.node.name} written since")
    assert lineage({"teacher": "b" * 32})[0]


def test_an_experiment_from_an_older_store_gets_the_training_kind(workdir, store, request):
    experiment_id = client(store).create_experiment(request.node.name)  # as stores made before the tag have it
    open_and_close(request, "convert", params_for(request), workdir)
    assert client(store).get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_an_evaluation_names_the_run_that_wrote_its_model_file(workdir, store, request):
    model_file = workdir / "model.pt"
    model_file.write_bytes(b"weights")
    params = params_for(request)
    with Tracker("pretrain", params, cpu_runtime(), metrics_dir=workdir / "p", param_sections=("seed",)) as writer:
        writer.tag_written_model(model_file)
    with Tracker("evaluate@pretrain", params, cpu_runtime(), metrics_dir=workdir / "e", param_sections=("seed",)) as evaluation:
        evaluation.tag_evaluated_model(model_file)
    tags = client(store).get_run(evaluation.run_id).data.tags
    assert tags["model.made_by"] == writer.run_id
    assert tags["evaluated.sha256"] == client(store).get_run(writer.run_id).data.tags["model.sha256"]


def test_metrics_json_is_replaced_whole_or_not_at_all(workdir, request):
    """DVCLive rewrites metrics.json in place; a kill in the middle would leave JSON that `dvc metrics show`
    cannot read. Ours writes a temporary file and renames it: a failed write leaves the previous file."""
    params = params_for(request)
    metrics_dir = workdir / "metrics"
    with Tracker("pretrain", params, cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as tracker:
        tracker.log_metrics({"val_top1": 50.0}, step=0)
        before = (metrics_dir / "metrics.json").read_text()
        tracker._live.summary["broken"] = object()  # the encoder fails half-way through the summary
        with pytest.raises(TypeError):
            tracker._live.make_summary()
        assert (metrics_dir / "metrics.json").read_text() == before
        assert [path.name for path in metrics_dir.iterdir() if path.name.startswith(".")] == []
        del tracker._live.summary["broken"]


def test_failure_marks_the_run_failed_and_flushes_dvclive(workdir, store, request):
    metrics_dir = workdir / "metrics"
    with pytest.raises(ValueError, match="diverged"):
        with Tracker("pretrain", params_for(request), cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as tracker:
            tracker.log_metrics({"train_loss": float("nan")}, step=0)
            raise ValueError("diverged")
    assert client(store).get_run(tracker.run_id).info.status == "FAILED"
    assert json.loads((metrics_dir / "metrics.json").read_text()) == {"train_loss": "nan", "step": 0}

    with pytest.raises(KeyboardInterrupt):
        with Tracker("pretrain", params_for(request), cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as tracker:
            raise KeyboardInterrupt
    assert client(store).get_run(tracker.run_id).info.status == "KILLED"


def test_a_run_left_running_by_a_kill_ends_killed_when_its_stage_runs_again(workdir, store, request):
    """SIGKILL leaves a run RUNNING (nothing could end it). The stage's next run in the same pipeline run ends it
    KILLED and names itself on it: the UI never shows a live or a second finished run of one stage."""
    params = params_for(request)

    def opened(stage: str) -> Tracker:  # entered and never left: as a killed process leaves it
        return Tracker(stage, params, cpu_runtime(), metrics_dir=workdir / stage, param_sections=()).__enter__()

    killed, other_stage = opened("convert"), opened("evaluate@pretrain")
    with Tracker("convert", params, cpu_runtime(), metrics_dir=workdir / "again", param_sections=()) as rerun:
        pass
    runs = {run_id: client(store).get_run(run_id) for run_id in (killed.run_id, other_stage.run_id, rerun.run_id)}
    assert runs[killed.run_id].info.status == "KILLED"
    assert runs[killed.run_id].data.tags[REPLACED_BY_TAG] == rerun.run_id
    assert runs[other_stage.run_id].info.status == "RUNNING"  # another stage's run is its own stage's business
    assert runs[rerun.run_id].info.status == "FINISHED"


def test_a_finished_run_dvc_never_recorded_ends_killed_when_its_stage_runs_again(workdir, store, request):
    """A kill after a stage's run ended but before DVC wrote dvc.lock: DVC runs the stage again, and the run it
    never recorded (no dvc.outs tag from the lineage stage) ends KILLED, replaced. A run DVC recorded, rerun by
    `dvc repro --force`, stays FINISHED."""
    params = params_for(request)

    def finished(stage: str) -> Tracker:
        with Tracker(stage, params, cpu_runtime(), metrics_dir=workdir / stage, param_sections=()) as tracker:
            pass
        return tracker

    unrecorded, recorded = finished("evaluate@pretrain"), finished("convert")
    client(store).set_tag(recorded.run_id, OUTPUTS_TAG, "a" * 16)
    rerun, forced = finished("evaluate@pretrain"), finished("convert")
    runs = {run_id: client(store).get_run(run_id) for run_id in (unrecorded.run_id, recorded.run_id)}
    assert runs[unrecorded.run_id].info.status == "KILLED"
    assert runs[unrecorded.run_id].data.tags[REPLACED_BY_TAG] == rerun.run_id
    assert runs[recorded.run_id].info.status == "FINISHED" and REPLACED_BY_TAG not in runs[recorded.run_id].data.tags
    assert {client(store).get_run(run.run_id).info.status for run in (rerun, forced)} == {"FINISHED"}


def test_resuming_a_run_missing_from_the_store_starts_a_new_one(workdir, store, request, caplog):
    with Tracker(
        "pretrain", params_for(request), cpu_runtime(), metrics_dir=workdir / "m", param_sections=PRETRAIN_SECTIONS, resume_run_id="0" * 32
    ) as tracker:
        pass
    assert tracker.run_id != "0" * 32
    assert client(store).get_run(tracker.run_id).info.status == "FINISHED"
    assert "0" * 32 in caplog.text


def test_other_ranks_touch_nothing(workdir, request, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'untouched.db'}")
    rank1 = Runtime(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    with Tracker("pretrain", params_for(request), rank1, metrics_dir=workdir / "m", param_sections=PRETRAIN_SECTIONS) as tracker:
        tracker.log_metrics({"a": 1.0}, step=0)
        tracker.log_summary({"a": 1.0})
        tracker.log_artifact(workdir / "missing.txt")
        tracker.set_tag("k", "v")
    assert tracker.run_id is None
    assert list(workdir.iterdir()) == []


def test_store_defaults_to_the_project_root(workdir, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking_uri() == f"sqlite:///{workdir.resolve() / 'mlflow.db'}"
    # DVC sets DVC_ROOT to the repo it runs; for a queued or temporary experiment that is a copy of the project in
    # .dvc/tmp/exps, which is removed when the experiment ends: its runs go to the project's store.
    monkeypatch.setenv("DVC_ROOT", "/somewhere/repo")
    assert tracking_uri() == "sqlite:////somewhere/repo/mlflow.db"
    monkeypatch.setenv("DVC_ROOT", "/somewhere/repo/.dvc/tmp/exps/tmpab12cd")
    assert tracking_uri() == "sqlite:////somewhere/repo/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri() == "http://127.0.0.1:5000"


def test_unknown_params_section_is_a_bug():
    with pytest.raises(ValueError, match="pretrian"):
        stage_params(make_params(), ("pretrian",))


STAGE_SCRIPT = """
    import torch
    from coarse2fine.config import load_params
    from coarse2fine.distributed import Runtime
    from coarse2fine.tracking.runs import Tracker

    params = load_params()
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with Tracker("pretrain", params, runtime, metrics_dir="metrics/pretrain", param_sections=("pretrain",)) as tracker:
        for epoch in range(params.pretrain.epochs):
            tracker.log_metrics({"val_top1": 10.0 * epoch}, step=epoch)
        tracker.log_summary({"top1": 10.0 * epoch})
"""

DVC_YAML = """
    stages:
      pretrain:
        cmd: {python} train.py
        deps:
          - train.py
        params:
          - pretrain.epochs
        metrics:
          - metrics/pretrain/metrics.json:
              cache: false
        plots:
          - metrics/pretrain/plots/metrics:
              x: step
              cache: false
"""


@pytest.mark.slow
def test_dvclive_inside_dvc_repro_and_exp_run_only_writes_its_files(workdir, store, request, monkeypatch):
    """DVCLive must neither edit dvc.yaml, nor make experiments itself, nor stage files in git."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    repo = workdir
    dvc = [str(Path(sys.executable).parent / "dvc")]

    def run(*command: str) -> str:
        return subprocess.run(command, cwd=repo, check=True, capture_output=True, text=True, timeout=300).stdout

    def experiments() -> list[str]:  # what `dvc exp ls` lists, without starting dvc (refs/exps/exec: run state)
        refs = git("for-each-ref", "--format=%(refname)", "refs/exps", cwd=repo).split()
        return [ref.rsplit("/", 1)[1] for ref in refs if not ref.startswith("refs/exps/exec/")]

    git("init", "-q", cwd=repo)
    run(*dvc, "init", "-q")
    params = yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text())
    params["pretrain"]["epochs"] = 3
    params["tracking"]["experiment"] = request.node.name
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "train.py").write_text(textwrap.dedent(STAGE_SCRIPT))
    dvc_yaml = textwrap.dedent(DVC_YAML).format(python=sys.executable)
    (repo / "dvc.yaml").write_text(dvc_yaml)
    git("add", "-A", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init", cwd=repo)

    run(*dvc, "repro")
    assert (repo / "dvc.yaml").read_text() == dvc_yaml
    assert experiments() == []
    assert git("status", "--porcelain", "--untracked-files=all", cwd=repo).splitlines() == [
        "?? dvc.lock", "?? metrics/pretrain/metrics.json", "?? metrics/pretrain/plots/metrics/val_top1.tsv",
    ]
    plots = json.loads(run(*dvc, "plots", "show", "--json"))["data"]
    values = plots["metrics/pretrain/plots/metrics/val_top1.tsv"][0]["content"]["data"]["values"]
    assert [(row["step"], row["val_top1"]) for row in values] == [("0", "0.0"), ("1", "10.0"), ("2", "20.0")]

    git("add", "-A", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "repro", cwd=repo)
    run(*dvc, "exp", "run", "-n", "four-epochs", "-S", "pretrain.epochs=4")
    assert (repo / "dvc.yaml").read_text() == dvc_yaml
    assert experiments() == ["four-epochs"]
    assert git("diff", "--cached", "--name-only", cwd=repo) == ""  # nothing staged behind the user's back
    assert json.loads((repo / "metrics/pretrain/metrics.json").read_text()) == {"val_top1": 30.0, "step": 3, "top1": 30.0}

    mlflow = client(store)
    runs = mlflow.search_runs(
        [mlflow.get_experiment_by_name(request.node.name).experiment_id], STAGE_RUNS, order_by=["attributes.start_time"]
    )
    assert [(run.data.params["pretrain.epochs"], run.data.tags.get(DVC_EXPERIMENT_TAG)) for run in runs] == [("3", None), ("4", "four-epochs")]


OPEN_A_RUN = textwrap.dedent(
    """
    import sys
    from conftest import cpu_runtime, make_params
    from coarse2fine.tracking.runs import Tracker

    with Tracker("convert", make_params(), cpu_runtime(), metrics_dir=sys.argv[1], param_sections=("seed",)) as tracker:
        tracker.log_summary({"ok": 1.0})
    """
)


@pytest.mark.slow
def test_stages_creating_a_fresh_store_at_once_both_succeed(tmp_path):
    # Parallel `dvc exp` queue workers start on a project without mlflow.db: MLflow's schema migration
    # races unless the store's creation is serialised.
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": str(Path(sys.executable).parent),
           "PYTHONPATH": str(Path(__file__).parent), "MLFLOW_DISABLE_TELEMETRY": "true"}
    runs = [
        subprocess.Popen([sys.executable, "-c", OPEN_A_RUN, str(tmp_path / f"metrics{i}")], cwd=tmp_path, env=env,
                         stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=300)  # reads the pipe as it goes: a full one cannot stall the run
        assert run.returncode == 0, stderr
    found = MlflowClient(env["MLFLOW_TRACKING_URI"]).search_runs(
        [MlflowClient(env["MLFLOW_TRACKING_URI"]).get_experiment_by_name("coarse2fine").experiment_id]
    )
    stages = [run for run in found if run.data.tags[STAGE_TAG] != PIPELINE_STAGE]
    assert sorted(run.data.metrics["ok"] for run in stages) == [1.0, 1.0]
    # The same code, params and data: one pipeline run, created once, both stages under it.
    [pipeline] = [run for run in found if run.data.tags[STAGE_TAG] == PIPELINE_STAGE]
    assert {run.data.tags[MLFLOW_PARENT_RUN_ID] for run in stages} == {pipeline.info.run_id}


def server_gone(*args, **kwargs):
    raise MlflowException("API request failed: connection refused")


def test_writes_mlflow_cannot_take_wait_in_order_and_reach_the_run_when_it_is_back(
    workdir, store, request, monkeypatch, caplog
):
    metrics_dir = workdir / "metrics"
    with Tracker("pretrain", params_for(request), cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as tracker:
        tracker.log_metrics({"train_loss": 2.0}, step=0)
        with monkeypatch.context() as away:
            away.setattr(MlflowClient, "log_batch", server_gone)
            away.setattr(MlflowClient, "set_tag", server_gone)
            tracker.log_metrics({"train_loss": 1.0}, step=1)
            tracker.set_tag("k", "v")
            tracker.log_metrics({"train_loss": 0.5}, step=2)
        tracker.log_summary({"top1": 90.0})
    assert caplog.text.count("is not reachable (API request failed: connection refused)") == 1, caplog.text
    assert caplog.text.count("is back:") == 1, caplog.text
    run = client(store).get_run(tracker.run_id)
    assert history(store, tracker.run_id, "train_loss") == [(0, 2.0), (1, 1.0), (2, 0.5)]
    assert (run.data.tags["k"], run.data.metrics["top1"], run.info.status) == ("v", 90.0, "FINISHED")
    assert tsv_rows(metrics_dir / "plots/metrics/train_loss.tsv")[1:] == [["0", "2.0"], ["1", "1.0"], ["2", "0.5"]]


def test_a_store_that_never_comes_back_costs_one_warning_each_way_and_no_metric(
    workdir, store, request, monkeypatch, caplog
):
    metrics_dir = workdir / "metrics"
    with Tracker("pretrain", params_for(request), cpu_runtime(), metrics_dir=metrics_dir, param_sections=PRETRAIN_SECTIONS) as tracker:
        tracker.log_metrics({"train_loss": 2.0}, step=0)
        run_id = tracker.run_id
        monkeypatch.setattr(MlflowClient, "log_batch", server_gone)
        monkeypatch.setattr(MlflowClient, "set_terminated", server_gone)
        tracker.log_metrics({"train_loss": 1.0}, step=1)
        tracker.set_tag("k", "v")
        tracker.log_summary({"top1": 90.0})
    assert caplog.text.count("is not reachable (") == 1, caplog.text
    # log_batch twice, set_tag, the stage's and the pipeline's set_terminated: a SQLite store gets one last try.
    assert caplog.text.count("still unreachable: 5 write(s) not sent") == 1, caplog.text
    assert tsv_rows(metrics_dir / "plots/metrics/train_loss.tsv")[1:] == [["0", "2.0"], ["1", "1.0"]]
    assert json.loads((metrics_dir / "metrics.json").read_text())["top1"] == 90.0
    monkeypatch.undo()
    assert history(store, run_id, "train_loss") == [(0, 2.0)]  # what MLflow had before it went


def test_the_outbox_backs_off_keeps_order_and_bounds_what_waits(monkeypatch, caplog):
    now = [0.0]
    sent, down = [], [True]

    def send(method, args, kwargs):
        if down[0]:
            raise OSError("connection refused")
        sent.append(args[0])

    monkeypatch.setattr(outbox, "MAX_WRITES", 4)
    box = outbox.Outbox(send, "http://server", clock=lambda: now[0])
    for second in range(0, 200):
        now[0] = float(second)
        box.write("log", second)
    assert box.waiting == 4  # the newest four; the rest dropped, with one warning
    assert caplog.text.count("the oldest are dropped") == 1
    down[0] = False
    now[0] = 200.0
    assert box.drain(0) and sent == [196, 197, 198, 199]
    box.write("log", 200)
    assert sent[-1] == 200  # nothing waits: sent at once


def test_the_outbox_retries_at_doubling_intervals_up_to_a_minute():
    now, tries = [0.0], []

    def send(method, args, kwargs):
        tries.append(now[0])
        raise OSError("connection refused")

    box = outbox.Outbox(send, "http://server", clock=lambda: now[0])
    for second in range(0, 300):
        now[0] = float(second)
        box.write("log", second)
    # The first failure, then 5, 10, 20, 40 and 60 s after each failed retry.
    assert tries[:7] == [0.0, 5.0, 15.0, 35.0, 75.0, 135.0, 195.0]
    assert all(later - earlier == 60.0 for earlier, later in zip(tries[5:], tries[6:]))


def stage_run(client: MlflowClient, experiment: str, stage: str):
    """The run of `stage` in `experiment`, None before there is one."""
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], f"tags.stage = '{stage}'") if found else []
    return runs[0] if runs else None


@pytest.mark.slow
def test_a_tracking_server_away_for_a_minute_mid_stage_loses_no_epoch(team_server, digits_records, tmp_path, request):
    """A training stage, launched as dvc.yaml launches it with two ranks, goes on through a real server's restart
    (PostgreSQL behind it) in its middle: the stage finishes, its run holds every epoch's metrics as the stage's
    DVCLive files have them, in order, and ends FINISHED."""
    server, experiment = MlflowClient(team_server.uri), request.node.name
    changes = {"tracking": {"experiment": experiment}, "pretrain": {"epochs": 4}}
    stage = start_stage(tmp_path, digits_records, {"nproc_per_node": 2}, changes,
                        env={"MLFLOW_TRACKING_URI": team_server.uri})
    try:
        deadline = time.monotonic() + 300
        while (run := stage_run(server, experiment, "pretrain")) is None or "val_top1" not in run.data.metrics:
            assert stage.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        team_server.stop()  # after the first epoch's metrics, before the last
        time.sleep(60)
    finally:
        team_server.start()
        _, stderr = stage.communicate(timeout=600)
    assert stage.returncode == 0, stderr[-3000:]
    assert f"warning: MLflow at {team_server.uri} is not reachable (" in stderr, stderr[-3000:]
    run = server.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    for name in ("train_loss", "val_top1"):
        logged = [(metric.step, metric.value) for metric in server.get_metric_history(run.info.run_id, name)]
        rows = tsv_rows(tmp_path / "metrics" / "plots" / "metrics" / f"{name}.tsv")[1:]
        assert logged == [(int(step), pytest.approx(float(value))) for step, value in rows] and len(logged) == 4, name


def schema_revision(database: Path) -> str | None:
    with contextlib.closing(sqlite3.connect(database)) as connection:
        try:
            return connection.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        except (sqlite3.OperationalError, TypeError):  # no table yet, or no row
            return None


@pytest.mark.slow
def test_the_store_appears_only_once_its_schema_is_complete(tmp_path):
    """MLflow's schema migration takes seconds; torchrun SIGTERMs every rank when one fails (a user mistake on
    rank 1 while rank 0 creates mlflow.db), and a stage stopped inside the migration left a database every later
    stage failed to open. So the store is made under a temporary name: the moment mlflow.db exists, it is whole."""
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": str(Path(sys.executable).parent),
           "PYTHONPATH": str(Path(__file__).parent), "MLFLOW_DISABLE_TELEMETRY": "true"}
    creator = subprocess.Popen([sys.executable, "-c", OPEN_A_RUN, str(tmp_path / "metrics")], cwd=tmp_path, env=env,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "mlflow.db").exists():
        assert creator.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    creator.send_signal(signal.SIGKILL)  # stop it the moment the store appears
    creator.wait(timeout=60)

    MlflowClient(f"sqlite:///{tmp_path / 'reference.db'}")  # a store made to the end, for its schema revision
    assert schema_revision(tmp_path / "mlflow.db") == schema_revision(tmp_path / "reference.db") is not None


@pytest.mark.parametrize(
    "stage", ["convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune"]
)
def test_each_stage_logs_exactly_the_params_dvc_tracks_for_it(stage):
    """MLflow's params of a run and DVC's rerun decisions must cover the same keys: a stage's PARAM_SECTIONS
    (evaluate's `param_sections(item)`) is its `params:` list in dvc.yaml (with `${item}` filled in)."""
    dvc_yaml = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())
    script, _, item = stage.partition("@")
    spec = importlib.util.spec_from_file_location(f"stage_{script}", PROJECT_ROOT / "stages" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if item:
        listed = [key.replace("${item}", item) for key in dvc_yaml["stages"][script]["do"]["params"]]
        sections = module.param_sections(item)
    else:
        listed, sections = dvc_yaml["stages"][script]["params"], module.PARAM_SECTIONS
    assert list(sections) == listed
    stage_params(parse_params({}), sections)  # raises if an entry names no params


# How fast a stage runs, never what it writes: the loaders' streams (tests/test_loaders.py), the token labels
# (tests/test_generate.py) and the records (tests/test_convert.py) are the same whatever their values.
SPEED_KNOBS = ("loader.workers", "loader.prefetch", "loader.mmap", "data.convert_workers")
# How often the training stages checkpoint: a resumed run ends as an uninterrupted one (tests/faults/).
CHECKPOINT_KNOBS = ("checkpoint.every_minutes", "checkpoint.every_updates")


def test_no_stage_reruns_for_a_speed_knob():
    """No stage lists a speed knob (nor the whole section it is in): changing one reruns nothing under DVC, and no
    checkpoint or partial token labels made under another value are discarded (their inputs are these params).
    Everything else of the loader and data sections is listed where they are read."""
    dvc_stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    listed = {name: stage.get("do", stage).get("params", []) for name, stage in dvc_stages.items()}
    for name, keys in listed.items():
        for knob in SPEED_KNOBS + CHECKPOINT_KNOBS:
            assert not any(knob == key or knob.startswith(f"{key}.") for key in keys), (name, knob)
    params = parse_params({})
    read = {key for name in ("convert", "teacher") for key in stage_params(params, listed[name])}
    # data.root is not a speed knob but where the images are: the source stage lists it, convert reads the images
    # through their listing (relative paths and content), so another path to the same images reruns nothing.
    assert set(stage_params(params, listed["source"])) >= {"data.root"}
    assert {key for key in flatten(params) if key.startswith(("data.", "loader."))} - read == {*SPEED_KNOBS, "data.root"}


def test_stage_params_rejects_keys_that_name_no_params():
    params = parse_params({})
    assert stage_params(params, ("augment.interpolation",)) == {"augment.interpolation": "bicubic"}
    for typo in ("augment.interp", "evaluat"):
        with pytest.raises(ValueError, match=typo):
            stage_params(params, ("seed", typo))
