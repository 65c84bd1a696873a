"""Experiment tracking: one MLflow run per stage execution, nested under one run per pipeline, plus DVCLive files
for DVC.

The only module that imports mlflow and dvclive. MLflow keeps the browsable history (params, per-step
metrics, artifacts, tags) in a sqlite store; DVCLive writes plain files under the stage's metrics
directory that dvc.yaml declares as metrics and plots:

    <metrics_dir>/metrics.json               latest value of every metric + the summary (`dvc metrics show`)
    <metrics_dir>/plots/metrics/<name>.tsv   one row per logged step (`dvc plots show`)

Only rank 0 tracks; on other ranks every method is a no-op, so callers never branch on the rank.

Pipeline runs. DVC hands its stages no execution id, and each stage is a process of its own. A stage's run is
nested (MLflow's parentRunId) under the pipeline run of what decides its results, `pipeline_identity`: the code
(every file under src/ and stages/, dirty edits included), the whole params file and the data (the source
stage's listings), hashed into `pipeline.key`. Every stage of one `dvc repro`, `dvc repro <stage>`, `make repro`
or `dvc exp run` computes the same key and finds that run (or creates it: under the store's lock for a sqlite
store; against a server, two racing creators both look again and the later run deletes itself). Another params
value or code edit is another pipeline run; reproducing an unchanged pipeline again nests under the same one.
The pipeline run holds every param; it is RUNNING while one of its stages runs and ends as its last stage did.

Lineage. A stage DVC skipped has no run of its own in the new pipeline run. The last stage of the pipeline
(stages/lineage.py, every `dvc repro`) calls `record_lineage` with dvc.lock: each stage run of this pipeline is
tagged with its outputs' DVC hashes (`dvc.outs`), and each stage without one gets a "<stage> (cached)" run, tagged
`cached_from` = the run whose `dvc.outs` match the outputs DVC kept, with that run's params and metric histories.
The pipeline's result, the model its finetune run (or the run a cached finetune links to) logged, is registered
under params tracking.registered_model and the alias tracking.model_alias is moved to it (`register_result`).

MLflow is a convenience, DVC's files are the record: if the store cannot be reached or written (a bad URI, a
server that is down, a read-only database), the stage prints one warning and goes on without MLflow, and its
metrics still land in the DVCLive files. Against a server, MLflow's HTTP retries are cut to
`HTTP_RETRIES` (its default, 7 with exponential back-off, waits minutes per call) unless the environment sets them.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
import mlflow
from dvclive import Live
from dvclive.plots import Metric as LiveMetric, NumpyEncoder
from filelock import FileLock
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, Run
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.utils.mlflow_tags import (
    MLFLOW_DATASET_CONTEXT, MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE,
)
from torch import nn

from coarse2fine import report
from coarse2fine.config import Params, flatten
from coarse2fine.data import records
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.files import atomic_path, file_sha256

logger = logging.getLogger(__name__)

STAGE_TAG = "stage"
DVC_EXPERIMENT_TAG = "dvc.experiment"
GIT_DIRTY_TAG = "git.dirty"
PIPELINE_KEY_TAG = "pipeline.key"
# On a pipeline run: STAGE_TAG = PIPELINE_STAGE.
PIPELINE_STAGE = "pipeline"
# Lineage (`record_lineage`): a run's outputs as DVC hashed them, and a cached stage's link to the run that made them.
OUTPUTS_TAG = "dvc.outs"
CACHED_FROM_TAG = "cached_from"
# A model file's sha256 on the run that wrote it, and on an evaluation the file it read and the run that wrote it.
MODEL_WRITTEN_TAG = "model.sha256"
MODEL_EVALUATED_TAG = "evaluated.sha256"
MODEL_MADE_BY_TAG = "model.made_by"
# The MLflow model a training run logged (`Tracker.log_model`), and on a pipeline run the registered version of its
# result (`register_result`).
MODEL_ID_TAG = "model.id"
REGISTERED_TAG = "model.registered"
# The stage whose model is the pipeline's result.
RESULT_STAGE = "finetune"
# MLflow 3's UI opens an experiment without this tag on its GenAI view (traces, "No data"); with it, on the
# training runs. The UI's own values are this and "genai_development"; MLflow's Python API has no constant.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
MAX_PARAMS_PER_BATCH, MAX_METRICS_PER_BATCH = 100, 1000  # MLflow's limits for one log_batch
# What `pipeline_identity` hashes, relative to the directory a stage runs in (the repo, or DVC's copy of it).
CODE_DIRS = ("src", "stages")
DATA_LISTINGS = ("data/source.json", "data/teacher_source.json", "data/token_labels_source.json")
SYSTEM_METRICS_SECONDS = 10
SOURCE_TAGS = (MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE)  # the UI's Source column
HTTP_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


# Where DVC runs a queued or temporary experiment (`dvc exp run --queue/--temp`): a copy of the repo in
# <project>/.dvc/tmp/exps/<tmpdir> (DVC's TempDirExecutor), removed when the experiment ends, and DVC_ROOT names
# that copy. Its runs belong in the project's store, not in one that disappears with the copy.
EXPERIMENT_COPIES = (".dvc", "tmp", "exps")


def project_root() -> Path:
    """Where mlflow.db lives: the repo DVC runs us for (DVC_ROOT, else the working directory), or for an
    experiment running in DVC's temporary copy, the project that copy belongs to."""
    root = Path(os.environ.get("DVC_ROOT") or os.getcwd()).resolve()
    if root.parent.parts[-len(EXPERIMENT_COPIES):] == EXPERIMENT_COPIES:
        return root.parents[len(EXPERIMENT_COPIES)]
    return root


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root() / 'mlflow.db'}"


def _default_artifact_location(uri: str) -> str | None:
    # MLflow's default artifact root for a sqlite store is ./mlruns relative to the *working directory*;
    # keep artifacts next to the database instead, wherever the process happens to run.
    if not uri.startswith("sqlite:///"):
        return None  # a tracking server decides its own artifact store
    database = Path(uri.removeprefix("sqlite:///")).resolve()
    return (database.parent / "mlruns").as_uri()


def _store_lock(uri: str) -> contextlib.AbstractContextManager:
    """Serialise the first touches of a sqlite store: two stages creating it at once (parallel `dvc exp`
    queue workers, concurrent runs) race in MLflow's schema migration and one of them crashes."""
    if not uri.startswith("sqlite:///"):
        return contextlib.nullcontext()
    database = Path(uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{database}.lock")


@contextlib.contextmanager
def _opened_store(uri: str) -> Iterator[MlflowClient]:
    """A client of the store, created if missing, for first touches made under the store's lock.

    Also MLflow's global tracking URI: some of its calls ignore the client's and resolve through it (logging a
    model; registering a version from its `models:/<id>` source), and its default, ./mlflow.db of the working
    directory, is another store in a queued DVC experiment, which runs in a temporary copy of the repo."""
    mlflow.set_tracking_uri(uri)
    with _store_lock(uri):
        _create_missing_sqlite_store(uri)
        yield MlflowClient(tracking_uri=uri)


def _create_missing_sqlite_store(uri: str) -> None:
    """Create a missing sqlite store under a temporary name and rename it into place. MLflow's schema migration
    takes seconds, and a stage stopped during it (torchrun SIGTERMs every rank when one fails, e.g. on a user
    mistake) would leave a half-migrated database that every later stage fails to open."""
    if not uri.startswith("sqlite:///"):
        return
    database = Path(uri.removeprefix("sqlite:///"))
    if database.exists():
        return
    with atomic_path(database) as temporary:
        MlflowClient(tracking_uri=f"sqlite:///{temporary}")  # creates the schema


def _git_state() -> dict[str, str]:
    """The commit and whether the code differs from it (tags). Asked in the working directory, not
    project_root(): a queued DVC experiment runs a checkout of its own baseline commit in a temporary directory
    while the main repo's HEAD may have moved on."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE_DIRS], capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {MLFLOW_GIT_COMMIT: commit.stdout.strip(), GIT_DIRTY_TAG: str(diff.returncode != 0).lower()}


def _files_digest(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def pipeline_identity(params: Params) -> dict[str, str]:
    """Tags naming the pipeline a stage belongs to: digests of its code, params and data, and the key over them."""
    code = sorted(path for directory in CODE_DIRS for path in Path(directory).rglob("*.py"))
    digests = {
        "code.hash": _files_digest(code),
        "params.hash": hashlib.sha256(json.dumps(flatten(params), sort_keys=True, default=str).encode()).hexdigest()[:16],
        "data.hash": _files_digest([Path(name) for name in DATA_LISTINGS if Path(name).is_file()]),
    }
    key = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:16]
    return {PIPELINE_KEY_TAG: key, **digests}


def stage_params(params: Params, keys: Sequence[str]) -> dict[str, str]:
    """The flattened params under the listed keys (sections like `evaluate` or dotted keys like
    `augment.interpolation`, as dvc.yaml lists them), as MLflow param strings."""
    flat = flatten(params)
    matches = {key: [name for name in flat if name == key or name.startswith(key + ".")] for key in keys}
    unknown = sorted(key for key, names in matches.items() if not names)
    if unknown:  # a typo here would silently log (and fingerprint checkpoints with) fewer params
        raise ValueError(f"no params under {unknown}; sections: {list(Params.model_fields)}")
    # MLflow itself truncates values over its 6000-character limit (with a warning).
    return {name: str(flat[name]) for names in matches.values() for name in names}


class _FileOnlyLive(Live):
    """DVCLive as a writer of files under its `dir`, and nothing else.

    dvc.yaml declares those files as metrics and plots, so Live's repo integration has nothing to add, and
    it has side effects: in a git repo without DVC it runs `dvc init` there, and inside `dvc exp run` it
    `git add`s files of its dir. `_init_dvc` (dvclive 3.49, pinned) is the one place that integration starts;
    test_tracking.py checks that nothing outside metrics_dir is touched.
    """

    def _init_dvc(self) -> None:
        pass

    def make_summary(self) -> None:
        """Live's own summary, written atomically: a kill in the middle of Live's in-place rewrite would leave a
        metrics.json that `dvc metrics show` cannot parse."""
        if self._step is not None:
            self.summary["step"] = self.step
        with atomic_path(self.metrics_file) as temporary:
            temporary.write_text(json.dumps(self.summary, indent=4, cls=NumpyEncoder) + "\n", encoding="utf-8")


class Tracker:
    """`with Tracker("pretrain", params, runtime, metrics_dir=..., param_sections=(...)) as tracker:`

    Starts (or, given `resume_run_id`, reopens) an MLflow run named after the stage, logs the params the
    stage reads and tags it; on leaving the block the run ends FINISHED, or FAILED if an exception escaped
    (KILLED on Ctrl-C), and the DVCLive files are flushed either way.
    """

    def __init__(
        self,
        stage: str,
        params: Params,
        runtime: Runtime,
        *,
        metrics_dir: str | os.PathLike[str],
        param_sections: Sequence[str],
        resume_run_id: str | None = None,
        system_metrics: bool = False,
    ) -> None:
        self.stage = stage
        self.params = params
        self.metrics_dir = Path(metrics_dir)
        self.param_sections = tuple(param_sections)
        self.resume_run_id = resume_run_id
        self.enabled = runtime.is_main
        self.run_id: str | None = None
        self.pipeline_run_id: str | None = None
        self.uri: str | None = None
        self._client: MlflowClient | None = None  # None: not started, or MLflow off
        self._live: Live | None = None
        # MLflow's sampler of CPU, memory, disk, network (and GPU) use, every SYSTEM_METRICS_SECONDS in a thread.
        self.system_metrics = system_metrics
        self._monitor: SystemMetricsMonitor | None = None

    def __enter__(self) -> Tracker:
        if not self.enabled:
            return self
        # DVCLive's INFO line names a random DVC experiment it will never create (save_dvc_exp is off);
        # MLflow's and alembic's INFO lines on creating a store would bury a stage's own messages.
        for name in ("dvclive", "mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = self.uri = tracking_uri()
        if uri.startswith(("http://", "https://")):
            for name, value in HTTP_RETRIES.items():
                os.environ.setdefault(name, value)
        try:
            with _opened_store(uri) as self._client:
                self.run_id = self._open_run(uri)
            if self.system_metrics:
                self._monitor = SystemMetricsMonitor(
                    self.run_id, sampling_interval=SYSTEM_METRICS_SECONDS,
                    resume_logging=self.resume_run_id is not None, tracking_uri=uri,
                )
                self._monitor.start()
        except Exception as error:  # whatever the store raised: MlflowException, sqlalchemy, requests, OSError
            self._without_mlflow(error)
        try:
            # save_dvc_exp=False, dvcyaml=None, report=None: no experiments behind the user's back (that is
            # `dvc exp run`'s job), no edits of dvc.yaml, no report files.
            # resume=False: the files start empty; a resumed run rewrites its history (`resume_history`), since
            # DVC deletes a stage's outputs before it runs it.
            self._live = _FileOnlyLive(
                dir=str(self.metrics_dir),
                resume=False,
                report=None,
                save_dvc_exp=False,
                dvcyaml=None,
            )
        except BaseException:
            self._mlflow("set_terminated", self.run_id, "FAILED")
            raise
        return self

    def _without_mlflow(self, error: BaseException) -> None:
        """One warning, then MLflow is off for the rest of the stage."""
        logger.warning(
            "warning: MLflow at %s is not usable (%s): %s goes on without it; its metrics are in %s",
            self.uri, _first_line(error), self.stage, self.metrics_dir,
        )
        self._client, self.run_id, self.pipeline_run_id = None, None, None

    def _mlflow(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The MLflow client's `method(*args, **kwargs)`; None when MLflow is off or the call fails (-> off)."""
        if self._client is None:
            return None
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except Exception as error:
            self._without_mlflow(error)
            return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if not self.enabled:
            return
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        try:
            self._live.end()
            if self._monitor is not None:
                self._monitor.finish()
        finally:
            self._mlflow("set_terminated", self.run_id, status)
            if self.pipeline_run_id is not None:
                self._mlflow("set_terminated", self.pipeline_run_id, status)

    def _open_run(self, uri: str) -> str:
        if self.resume_run_id is not None:
            run_id = self._reopen(self.resume_run_id, uri)
            if run_id is not None:
                return run_id
        experiment_id, tags, self.pipeline_run_id = _pipeline_run(self._client, self.params, uri)
        # Source: the stage's script (torchrun hands it to every worker as argv[0]), beside the git commit.
        tags |= {STAGE_TAG: self.stage, MLFLOW_PARENT_RUN_ID: self.pipeline_run_id,
                 MLFLOW_SOURCE_NAME: sys.argv[0], MLFLOW_SOURCE_TYPE: "LOCAL"}
        run = self._client.create_run(experiment_id, run_name=self.stage, tags=tags)
        self._log_params(run.info.run_id, existing={})
        _log_resolved_params(self._client, run.info.run_id, self.params)
        return run.info.run_id

    def _reopen(self, run_id: str, uri: str) -> str | None:
        try:
            run = self._client.get_run(run_id)
        except MlflowException:
            logger.warning("MLflow run %s (from the checkpoint) is not in %s; starting a new run", run_id, uri)
            return None
        self._client.update_run(run_id, status="RUNNING")
        self.pipeline_run_id = run.data.tags.get(MLFLOW_PARENT_RUN_ID)
        if self.pipeline_run_id is not None:
            self._client.update_run(self.pipeline_run_id, status="RUNNING")
        self._log_params(run_id, existing=run.data.params)
        return run_id

    def _log_params(self, run_id: str, existing: Mapping[str, str]) -> None:
        current = stage_params(self.params, self.param_sections)
        # MLflow params are immutable: a resumed run keeps the values it started with (the trainer only
        # resumes under unchanged params, so a difference is worth a warning, not a crash).
        for key, value in current.items():
            if key in existing and existing[key] != value:
                logger.warning("resumed run %s keeps %s=%s (now %s)", run_id, key, existing[key], value)
        _log_param_batches(self._client, run_id, {key: value for key, value in current.items() if key not in existing})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One MLflow batch per call, and one row per metric in the DVCLive history at `step`."""
        if not self.enabled:
            return
        values = _plain_numbers(metrics)
        self._mlflow("log_batch", self.run_id, metrics=_mlflow_metrics(values, step))
        self._log_live(values, step)

    def _log_live(self, values: Mapping[str, int | float], step: int) -> None:
        self._live.step = step
        for name, value in values.items():
            self._live.log_metric(name, value)
        # Written every step, not only at the end, so a killed run leaves metrics.json matching the history.
        self._live.make_summary()

    def resume_history(self, history: Sequence[Mapping[str, float]]) -> None:
        """On resuming from a checkpoint whose finished epochs logged `history` (epoch i's metrics at step i): the
        DVCLive files are rewritten from it (they start empty), and the last epoch is logged to MLflow unless the
        killed run got to it (the trainer checkpoints first, then logs; one log_batch is atomic), so both
        histories hold each step exactly once wherever the kill fell. Nothing to do for a fresh run (no history)."""
        if not self.enabled or not history:
            return
        last = len(history) - 1
        values = _plain_numbers(history[last])
        logged = self._mlflow("get_metric_history", self.run_id, next(iter(values)))
        if logged is not None and last not in {entry.step for entry in logged}:
            self._mlflow("log_batch", self.run_id, metrics=_mlflow_metrics(values, last))
        for step, metrics in enumerate(history):
            self._log_live(_plain_numbers(metrics), step)

    def log_summary(self, metrics: Mapping[str, float]) -> None:
        """Final numbers: MLflow metrics and keys of `metrics_dir/metrics.json` (no history rows)."""
        if not self.enabled:
            return
        values = _plain_numbers(metrics)
        self._mlflow("log_batch", self.run_id, metrics=_mlflow_metrics(values, step=0))
        for name, value in values.items():
            self._live.log_metric(name, value, plot=False)
        self._live.make_summary()

    def log_setup(self, numbers: Mapping[str, float]) -> None:
        """Numbers that describe how the stage runs (effective_lr, global_batch, world_size): MLflow metrics at
        step 0, which the UI plots and filters as numbers (tags are text); not results, so not in the DVC files."""
        if self.enabled:
            self._mlflow("log_batch", self.run_id, metrics=_mlflow_metrics(_plain_numbers(numbers), step=0))

    def tag_written_model(self, path: str | os.PathLike[str]) -> None:
        """The model file this run wrote, by sha256: an evaluation of it finds this run (`tag_evaluated_model`)."""
        if self.enabled:
            self._mlflow("set_tag", self.run_id, MODEL_WRITTEN_TAG, file_sha256(path))

    def tag_evaluated_model(self, path: str | os.PathLike[str]) -> None:
        """The model file this run evaluates, by sha256, and the newest run that wrote that file (if any)."""
        if not self.enabled or self._client is None:
            return
        digest = file_sha256(path)
        self._mlflow("set_tag", self.run_id, MODEL_EVALUATED_TAG, digest)
        run = self._mlflow("get_run", self.run_id)
        writers = run and self._mlflow(
            "search_runs", [run.info.experiment_id], f"tags.`{MODEL_WRITTEN_TAG}` = '{digest}'",
            order_by=["attributes.start_time DESC"], max_results=1,
        )
        if writers:
            self._mlflow("set_tag", self.run_id, MODEL_MADE_BY_TAG, writers[0].info.run_id)

    def log_records(self, records_dir: str | os.PathLike[str], split: str) -> None:
        """The records this run reads, as an MLflow dataset input (the UI's Dataset column): named after their
        origin and split, with the shards' digest, the image count and the split as context."""
        if not self.enabled:
            return
        summary = records.split_summary(records_dir, split)
        dataset = Dataset(
            name=summary.name, digest=summary.digest, source_type="local",
            source=json.dumps({"uri": str(Path(records_dir) / f"{split}-*.tfrecord")}),
            profile=json.dumps({"num_rows": summary.images}),
        )
        self._mlflow("log_inputs", self.run_id, [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, split)])])

    def log_model(self, model: nn.Module, card: Mapping[str, Any]) -> None:
        """The trained model as an MLflow model (`mlflow.pytorch.log_model`) in its "pt2" format (torch.export:
        the graph and tensors, loaded without unpickling any code), with a signature ([batch, 3, S, S] images ->
        [batch, classes] logits), an input example and the model file's fields (`card`: classes, eval_transform,
        ...) as metadata. Tagged on the run as MODEL_ID_TAG; `record_lineage` registers the pipeline's result."""
        if not self.enabled or self._client is None:
            return
        import mlflow.pytorch  # about 1 s that only the stages logging a model pay
        from mlflow.models import ModelSignature
        from mlflow.types import Schema, TensorSpec

        side = card["img_size"]
        exported = copy.deepcopy(model).cpu().eval()  # CPU weights load anywhere; the copy leaves training alone
        example = torch.zeros(2, 3, side, side)  # batch 2: a batch of 1 would be exported as a fixed size
        signature = ModelSignature(
            inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, side, side), "images")]),
            outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, len(card["classes"])), "logits")]),
        )
        try:
            with mlflow.start_run(run_id=self.run_id):
                info = mlflow.pytorch.log_model(
                    exported, name="model", signature=signature, input_example=example.numpy(),
                    serialization_format="pt2", metadata=dict(card),
                    # Pinned from this environment, not inferred (inference imports the model's whole stack).
                    pip_requirements=[f"{name}=={version(name)}" for name in ("torch", "timm")],
                    # MLflow would check the example through its pyfunc server path, whose PyTorch flavor takes no
                    # JSON tensor inputs: a warning on every run about a path this project does not use.
                    validate_serving_input=False,
                )
        except Exception as error:  # torch.export refusing the model's code, or the store failing
            logger.warning(
                "warning: %s: the model was not logged to MLflow (%s); the model file holds it",
                self.stage, _first_line(error),
            )
            info = None
        self._mlflow("update_run", self.run_id, status="RUNNING")  # start_run's exit ended the run; __exit__ decides
        if info is not None:
            self._mlflow("set_tag", self.run_id, MODEL_ID_TAG, info.model_id)

    def log_curves(self) -> None:
        """The run's per-epoch curves (its DVCLive history) as curves.png."""
        if not self.enabled or self._client is None:
            return
        figure = report.curves_figure(Path(self._live.plots_dir) / LiveMetric.subfolder, f"{self.stage}: per epoch")
        if figure is not None:
            self._mlflow("log_figure", self.run_id, figure, "curves.png")

    def log_artifact(self, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Copy a file (or a directory's contents) into the run's artifacts, under `artifact_path` if given."""
        if self.enabled:
            method = "log_artifacts" if Path(path).is_dir() else "log_artifact"
            self._mlflow(method, self.run_id, str(path), artifact_path)

    def set_tag(self, key: str, value: Any) -> None:
        if self.enabled:
            self._mlflow("set_tag", self.run_id, key, str(value))


def load_logged_model(uri: str, device: torch.device | str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """A model `Tracker.log_model` logged (`models:/<name>@<alias>`, `models:/<name>/<version>`, `models:/<id>`,
    `runs:/<run>/model`) from this project's store, and its card (classes, img_size, eval_transform, stage).

    Its "pt2" archive is checked by MLflow to hold only tensors and plain data before torch.export loads it:
    no code is unpickled (unless MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true is set). A missing name, alias or
    version is a UserError."""
    import mlflow.pytorch

    uri_of_store = tracking_uri()
    if uri_of_store.startswith("sqlite:///") and not Path(uri_of_store.removeprefix("sqlite:///")).is_file():
        raise UserError(
            f"{uri}: no MLflow store at {uri_of_store} (run the pipeline first, or set MLFLOW_TRACKING_URI)"
        )
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    mlflow.set_tracking_uri(uri_of_store)
    try:
        card = mlflow.models.get_model_info(uri).metadata or {}
        model = mlflow.pytorch.load_model(uri, device=str(device))
    except MlflowException as error:
        raise UserError(f"{uri}: cannot load it from {uri_of_store}: {_first_line(error)}") from None
    if "classes" not in card or "eval_transform" not in card:
        raise UserError(f"{uri}: not logged by this project (its metadata lacks classes and eval_transform)")
    return model, card


def _log_param_batches(client: MlflowClient, run_id: str, params: Mapping[str, str]) -> None:
    items = [Param(key, value) for key, value in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])


def _log_resolved_params(client: MlflowClient, run_id: str, params: Params) -> None:
    """params.yaml as the run read it, defaults filled in: the artifact that reruns it."""
    client.log_text(run_id, yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False), "params.yaml")


def find_experiment(client: MlflowClient, name: str, uri: str) -> str:
    """The experiment's id, created if missing, tagged as model training (EXPERIMENT_KIND_TAG)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(
            name, artifact_location=_default_artifact_location(uri), tags={EXPERIMENT_KIND_TAG: TRAINING_KIND}
        )
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != TRAINING_KIND:  # a store from before this tag
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return experiment.experiment_id


def run_tags(params: Params) -> dict[str, str]:
    """The tags every run gets: the pipeline's identity, the git state and the DVC experiment's name."""
    tags = {**pipeline_identity(params), **_git_state()}
    if exp_name := os.environ.get("DVC_EXP_NAME"):
        tags[DVC_EXPERIMENT_TAG] = exp_name
    return tags


def _pipeline_run(client: MlflowClient, params: Params, uri: str) -> tuple[str, dict[str, str], str]:
    """The experiment's id, the tags every run of this pipeline gets, and its pipeline run (found or created)."""
    experiment_id = find_experiment(client, params.tracking.experiment, uri)
    tags = run_tags(params)
    return experiment_id, tags, find_pipeline_run(client, experiment_id, params, tags, uri)


def find_pipeline_run(client: MlflowClient, experiment_id: str, params: Params, tags: dict[str, str], uri: str) -> str:
    """The pipeline run of `tags[PIPELINE_KEY_TAG]`, created if there is none (module docstring), RUNNING."""
    query = f"tags.`{PIPELINE_KEY_TAG}` = '{tags[PIPELINE_KEY_TAG]}' and tags.`{STAGE_TAG}` = '{PIPELINE_STAGE}'"

    def oldest() -> str | None:
        found = client.search_runs([experiment_id], query, order_by=["attributes.start_time ASC"], max_results=1)
        return found[0].info.run_id if found else None

    run_id = oldest()
    if run_id is None:
        name = f"{PIPELINE_STAGE} {tags.get(DVC_EXPERIMENT_TAG) or tags[PIPELINE_KEY_TAG][:8]}"
        run_id = client.create_run(
            experiment_id, run_name=name,
            tags={**tags, STAGE_TAG: PIPELINE_STAGE, MLFLOW_SOURCE_NAME: "dvc.yaml", MLFLOW_SOURCE_TYPE: "PROJECT"},
        ).info.run_id
        _log_param_batches(client, run_id, {key: str(value) for key, value in flatten(params).items()})
        _log_resolved_params(client, run_id, params)
        if not uri.startswith("sqlite:///"):  # no lock against a server: the first one created wins
            first = oldest()
            if first != run_id:
                client.delete_run(run_id)
                run_id = first
    client.update_run(run_id, status="RUNNING")
    return run_id


def outputs_digest(lock_entry: Mapping[str, Any]) -> str | None:
    """A short digest of a dvc.lock stage entry's outputs (path and DVC hash of each); None without outputs."""
    outs = sorted((out["path"], out.get("md5") or out.get("etag") or "") for out in lock_entry.get("outs", []))
    if not outs:
        return None
    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]


def record_lineage(params: Params, lock: Mapping[str, Any]) -> list[str]:
    """Complete this pipeline's run (module docstring, "Lineage") from dvc.lock's contents; returns one line per
    stage linked to a cached result. MLflow unusable: one warning, nothing recorded."""
    uri = tracking_uri()
    try:
        with _opened_store(uri) as client:
            experiment_id, tags, pipeline_id = _pipeline_run(client, params, uri)
        lines, made_by = _link_stages(client, experiment_id, pipeline_id, tags, lock)
        if RESULT_STAGE in made_by:
            lines += register_result(client, params, pipeline_id, made_by[RESULT_STAGE])
        client.set_terminated(pipeline_id, "FINISHED")
    except Exception as error:
        logger.warning("warning: MLflow at %s is not usable (%s): no lineage recorded", uri, _first_line(error))
        return []
    return lines


def register_result(client: MlflowClient, params: Params, pipeline_id: str, producer: Run) -> list[str]:
    """Register the model `producer` (the run that made the pipeline's result) logged, unless that model already is
    a version, and move the alias (params tracking.*) to it; tag the pipeline run with "<name>/<version>"."""
    model_id = producer.data.tags.get(MODEL_ID_TAG)
    if model_id is None:
        return []  # trained before models were logged, or with MLflow unusable at the time
    name, alias = params.tracking.registered_model, params.tracking.model_alias
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="The coarse-to-fine pipeline's result (the fine-tuned model)")
    source, run_id = f"models:/{model_id}", producer.info.run_id
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    registered = next((found for found in versions if found.source == source), None)
    if registered is None:
        registered = client.create_model_version(name, source=source, run_id=run_id, model_id=model_id)
    client.set_registered_model_alias(name, alias, registered.version)
    client.set_tag(pipeline_id, REGISTERED_TAG, f"{name}/{registered.version}")
    return [f"{RESULT_STAGE}: model registered as models:/{name}/{registered.version}, alias {alias} "
            f"(models:/{name}@{alias})"]


def _link_stages(
    client: MlflowClient, experiment_id: str, pipeline_id: str, tags: dict[str, str], lock: Mapping[str, Any]
) -> tuple[list[str], dict[str, Run]]:
    """Tag or link every stage of `lock`; returns the lines for the cached ones and, per stage, the run that made
    its outputs (its own run in this pipeline, or the producer a cached link points at)."""
    children = client.search_runs(
        [experiment_id], f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{pipeline_id}'", order_by=["attributes.start_time ASC"]
    )
    latest = {run.data.tags.get(STAGE_TAG): run for run in children}  # a stage's newest run in this pipeline
    lines, made_by = [], {}
    for stage, entry in lock.get("stages", {}).items():
        digest = outputs_digest(entry)
        if digest is None:
            continue
        own = latest.get(stage)
        if own is not None:
            if CACHED_FROM_TAG in own.data.tags:
                made_by[stage] = client.get_run(own.data.tags[CACHED_FROM_TAG])
            else:
                made_by[stage] = own
                if own.data.tags.get(OUTPUTS_TAG) != digest:
                    client.set_tag(own.info.run_id, OUTPUTS_TAG, digest)
            continue
        query = f"tags.`{OUTPUTS_TAG}` = '{digest}' and tags.`{STAGE_TAG}` = '{stage}'"
        producers = client.search_runs([experiment_id], query, order_by=["attributes.start_time DESC"], max_results=1)
        if not producers:
            continue  # its stage has no run (plain-python stages), or ran before lineage was recorded
        producer = producers[0]
        if CACHED_FROM_TAG in producer.data.tags:  # another pipeline's link to these outputs: link to their maker
            producer = client.get_run(producer.data.tags[CACHED_FROM_TAG])
        made_by[stage] = producer
        source = {key: producer.data.tags[key] for key in SOURCE_TAGS if key in producer.data.tags}
        link = client.create_run(
            experiment_id, run_name=f"{stage} (cached)",
            tags={**tags, **source, STAGE_TAG: stage, MLFLOW_PARENT_RUN_ID: pipeline_id, OUTPUTS_TAG: digest,
                  CACHED_FROM_TAG: producer.info.run_id},
        ).info.run_id
        # The producer's params, datasets and whole metric histories: the new pipeline run compares and plots like
        # the one that made the outputs.
        _log_param_batches(client, link, producer.data.params)
        if producer.inputs.dataset_inputs:
            client.log_inputs(link, producer.inputs.dataset_inputs)
        history = [
            point for name in producer.data.metrics for point in client.get_metric_history(producer.info.run_id, name)
        ]
        for start in range(0, len(history), MAX_METRICS_PER_BATCH):
            client.log_batch(link, metrics=history[start : start + MAX_METRICS_PER_BATCH])
        client.set_terminated(link, "FINISHED")
        producer_pipeline = producer.data.tags.get(MLFLOW_PARENT_RUN_ID, "none")
        lines.append(f"{stage}: cached, made by run {producer.info.run_id} (pipeline run {producer_pipeline})")
    return lines, made_by


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def _plain_numbers(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    # Tensors and numpy scalars become Python numbers; ints stay ints so metrics.json shows "n": 108, not 108.0.
    return {name: value.item() if hasattr(value, "item") else value for name, value in metrics.items()}


def _mlflow_metrics(values: Mapping[str, int | float], step: int) -> list[Metric]:
    now = time.time_ns() // 1_000_000  # MLflow timestamps are epoch milliseconds
    return [Metric(name, float(value), now, step) for name, value in values.items()]
