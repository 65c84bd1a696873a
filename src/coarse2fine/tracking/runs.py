"""`Tracker`: a stage's MLflow run, from opening (or reopening) it to its end status, and its DVCLive files."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dvclive.plots import Metric as LiveMetric
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.utils.mlflow_tags import (
    MLFLOW_DATASET_CONTEXT, MLFLOW_PARENT_RUN_ID, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE,
)
from torch import nn

from coarse2fine import report
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.distributed import Runtime, broadcast_object
from coarse2fine.errors import UserError, first_line
from coarse2fine.files import file_sha256
from coarse2fine.tracking.identity import (
    MODEL_EVALUATED_TAG, MODEL_ID_TAG, MODEL_MADE_BY_TAG, MODEL_WRITTEN_TAG, OUTPUTS_TAG, REPLACED_BY_TAG, STAGE_TAG,
    sqlite_database, stage_params, tracking_uri,
)
from coarse2fine.tracking.live import FileOnlyLive
from coarse2fine.tracking.logged_model import log_model
from coarse2fine.tracking.mlflow_store import (
    log_param_batches, log_resolved_params, opened_store, pipeline_run, refuse_unusable_server,
)
from coarse2fine.tracking.outbox import Outbox

logger = logging.getLogger(__name__)
SYSTEM_METRICS_SECONDS = 10
# The client's methods whose answer a stage needs at once; every other call is a write, kept while the store is away.
READS = frozenset({"get_run", "search_runs", "get_metric_history"})
# How long a stage's end waits for a tracking server that went away to take its last writes (a restart takes about
# a minute); a SQLite file gets one more try.
DRAIN_SECONDS = 300


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
        self.world_size, self.local_rank = runtime.world_size, runtime.local_rank
        self.run_id: str | None = None
        self.pipeline_run_id: str | None = None
        self.uri: str | None = None
        self._client: MlflowClient | None = None  # None: not started, or MLflow off
        self._outbox: Outbox | None = None
        self._live: FileOnlyLive | None = None
        # MLflow's sampler of CPU, memory, disk, network (and GPU) use, every SYSTEM_METRICS_SECONDS in a thread.
        self.system_metrics = system_metrics
        self._monitor: SystemMetricsMonitor | None = None

    def __enter__(self) -> Tracker:
        refused = None
        if self.enabled:
            try:
                self._open()
            except UserError as error:  # a tracking server the user named, and the stage cannot use
                refused = str(error)
        run_id, uri = self.run_id, self.uri
        if self.world_size > 1:  # every rank stops on rank 0's one line, not at its next collective
            refused, run_id, uri = broadcast_object((refused, run_id, uri))
        if refused is not None:
            raise UserError(refused)
        if self.system_metrics:
            self._monitor_this_node(run_id, uri)
        return self

    def _open(self) -> None:
        # DVCLive's INFO line names a random DVC experiment it will never create (save_dvc_exp is off);
        # MLflow's and alembic's INFO lines on creating a store would bury a stage's own messages.
        for name in ("dvclive", "mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        uri = self.uri = tracking_uri()
        try:
            with opened_store(uri) as self._client:
                self.run_id = self._open_run(uri)
            self._outbox = Outbox(self._call, uri)
        except Exception as error:  # whatever the store raised: MlflowException, sqlalchemy, requests, OSError
            refuse_unusable_server(uri, error)
            self._without_mlflow(error)
        try:
            self._live = FileOnlyLive(str(self.metrics_dir))
        except BaseException:
            self._mlflow("set_terminated", self.run_id, "FAILED")
            raise

    def _monitor_this_node(self, run_id: str | None, uri: str | None) -> None:
        """MLflow's system-metrics sampler on the first rank of every node, into rank 0's run (`run_id` at `uri`):
        `system/<metric>` on one node, `system/node<N>/<metric>` (N: torchrun's GROUP_RANK) when there are
        several."""
        nodes = self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if run_id is None or self.local_rank != 0:
            return
        try:
            self._monitor = SystemMetricsMonitor(
                run_id, sampling_interval=SYSTEM_METRICS_SECONDS, resume_logging=self.resume_run_id is not None,
                node_id=f"node{os.environ.get('GROUP_RANK', '0')}" if nodes > 1 else None, tracking_uri=uri,
            )
            self._monitor.start()
        except Exception as error:  # the sampler is a convenience: its store, psutil, a GPU library
            logger.warning("warning: MLflow's system metrics are off on this node (%s)", first_line(error))
            self._monitor = None

    def _without_mlflow(self, error: BaseException) -> None:
        """A local store could not be opened: one warning, then MLflow is off for the stage."""
        logger.warning(
            "warning: MLflow at %s is not usable (%s): %s goes on without it; its metrics are in %s",
            self.uri, first_line(error), self.stage, self.metrics_dir,
        )
        self._client, self.run_id, self.pipeline_run_id = None, None, None

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self._client, method)(*args, **kwargs)

    def _mlflow(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The MLflow client's `method(*args, **kwargs)` through the outbox: a write the store cannot take now waits
        and is retried (outbox.Outbox); a read answers None while the store is away, or when MLflow is off."""
        if self._client is None or self._outbox is None:
            return None
        if method in READS:
            return self._outbox.read(method, *args, **kwargs)
        return self._outbox.write(method, *args, **kwargs)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if not self.enabled:
            if self._monitor is not None:
                self._monitor.finish()
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
            if self._outbox is not None and self._outbox.waiting:
                self._outbox.drain(0 if sqlite_database(self.uri) else DRAIN_SECONDS)

    def _open_run(self, uri: str) -> str:
        if self.resume_run_id is not None:
            run_id = self._reopen(self.resume_run_id, uri)
            if run_id is not None:
                return run_id
        experiment_id, tags, self.pipeline_run_id = pipeline_run(self._client, self.params, uri)
        # Source: the stage's script (torchrun hands it to every worker as argv[0]), beside the git commit.
        tags |= {STAGE_TAG: self.stage, MLFLOW_PARENT_RUN_ID: self.pipeline_run_id,
                 MLFLOW_SOURCE_NAME: sys.argv[0], MLFLOW_SOURCE_TYPE: "LOCAL"}
        run = self._client.create_run(experiment_id, run_name=self.stage, tags=tags)
        self._end_killed_runs(experiment_id, replaced_by=run.info.run_id)
        self._log_params(run.info.run_id, existing={})
        log_resolved_params(self._client, run.info.run_id, self.params)
        return run.info.run_id

    def _end_killed_runs(self, experiment_id: str, replaced_by: str) -> None:
        """Runs of this stage in this pipeline run that DVC never recorded were killed and will not be resumed (a
        resumed training run is reopened, not replaced): one still RUNNING (SIGKILL, a lost node: nothing was left
        to end it), or one FINISHED without the `dvc.outs` tag the lineage stage gives what dvc.lock records (the
        kill came after the stage's run ended but before DVC wrote dvc.lock, so DVC runs the stage again). End them
        KILLED, naming the new run: the UI shows neither a live nor a finished twin. A finished run DVC recorded
        stays finished (`dvc repro --force` reran it on purpose)."""
        query = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{self.pipeline_run_id}' and tags.`{STAGE_TAG}` = '{self.stage}'"
        for earlier in self._client.search_runs([experiment_id], query):
            status, recorded = earlier.info.status, OUTPUTS_TAG in earlier.data.tags
            if earlier.info.run_id != replaced_by and (status == "RUNNING" or (status == "FINISHED" and not recorded)):
                self._client.set_tag(earlier.info.run_id, REPLACED_BY_TAG, replaced_by)
                self._client.set_terminated(earlier.info.run_id, "KILLED")

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
        log_param_batches(self._client, run_id, {key: value for key, value in current.items() if key not in existing})

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
        """The trained model as an MLflow model of this run (`models.log_model`), tagged as MODEL_ID_TAG;
        `lineage.record_lineage` registers the pipeline's result. Nothing with `tracking.log_models` off."""
        if not self.enabled or self._client is None or not self.params.tracking.log_models:
            return
        model_id = log_model(self.run_id, self.stage, model, card)
        self._mlflow("update_run", self.run_id, status="RUNNING")  # log_model's run context ended it; __exit__ decides
        if model_id is not None:
            self._mlflow("set_tag", self.run_id, MODEL_ID_TAG, model_id)

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


def _plain_numbers(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    # Tensors and numpy scalars become Python numbers; ints stay ints so metrics.json shows "n": 108, not 108.0.
    return {name: value.item() if hasattr(value, "item") else value for name, value in metrics.items()}


def _mlflow_metrics(values: Mapping[str, int | float], step: int) -> list[Metric]:
    now = time.time_ns() // 1_000_000  # MLflow timestamps are epoch milliseconds
    return [Metric(name, float(value), now, step) for name, value in values.items()]
