"""The MLflow store: opened (and created) safely, its experiment, and the pipeline run a stage nests under."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping

import mlflow
import yaml
from filelock import FileLock
from mlflow import MlflowClient
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE

from coarse2fine.config import Params, flatten
from coarse2fine.errors import UserError, first_line
from coarse2fine.files import atomic_path
from coarse2fine.tracking.identity import (
    DVC_EXPERIMENT_TAG, PIPELINE_KEY_TAG, PIPELINE_STAGE, STAGE_TAG, run_tags, sqlite_database,
)

MAX_PARAMS_PER_BATCH, MAX_METRICS_PER_BATCH = 100, 1000  # MLflow's limits for one log_batch
HTTP_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# MLflow 3's UI opens an experiment without this tag on its GenAI view (traces, "No data"); with it, on the
# training runs. The UI's own values are this and "genai_development"; MLflow's Python API has no constant.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


def _default_artifact_location(uri: str) -> str | None:
    # MLflow's default artifact root for a sqlite store is ./mlruns relative to the *working directory*;
    # keep artifacts next to the database instead, wherever the process happens to run.
    database = sqlite_database(uri)
    if database is None:
        return None  # a tracking server decides its own artifact store
    return (database.resolve().parent / "mlruns").as_uri()


def _store_lock(uri: str) -> contextlib.AbstractContextManager:
    """Serialise the first touches of a sqlite store: two stages creating it at once (parallel `dvc exp`
    queue workers, concurrent runs) race in MLflow's schema migration and one of them crashes."""
    database = sqlite_database(uri)
    if database is None:
        return contextlib.nullcontext()
    database.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{database}.lock")


@contextlib.contextmanager
def opened_store(uri: str) -> Iterator[MlflowClient]:
    """A client of the store, created if missing, for first touches made under the store's lock.

    Also MLflow's global tracking URI: some of its calls ignore the client's and resolve through it (logging a
    model; registering a version from its `models:/<id>` source), and its default, ./mlflow.db of the working
    directory, is another store in a queued DVC experiment, which runs in a temporary copy of the repo."""
    if uri.startswith(("http://", "https://")):
        for name, value in HTTP_RETRIES.items():
            os.environ.setdefault(name, value)
    mlflow.set_tracking_uri(uri)
    with _store_lock(uri):
        _create_missing_sqlite_store(uri)
        yield MlflowClient(tracking_uri=uri)


def _create_missing_sqlite_store(uri: str) -> None:
    """Create a missing sqlite store under a temporary name and rename it into place. MLflow's schema migration
    takes seconds, and a stage stopped during it (torchrun SIGTERMs every rank when one fails, e.g. on a user
    mistake) would leave a half-migrated database that every later stage fails to open."""
    database = sqlite_database(uri)
    if database is None or database.exists():
        return
    with atomic_path(database) as temporary:
        MlflowClient(tracking_uri=f"sqlite:///{temporary}")  # creates the schema


def log_param_batches(client: MlflowClient, run_id: str, params: Mapping[str, str]) -> None:
    items = [Param(key, value) for key, value in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])


def log_resolved_params(client: MlflowClient, run_id: str, params: Params) -> None:
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


def pipeline_run(client: MlflowClient, params: Params, uri: str) -> tuple[str, dict[str, str], str]:
    """The experiment's id, the tags every run of this pipeline gets, and its pipeline run (found or created)."""
    experiment_id = find_experiment(client, params.tracking.experiment, uri)
    tags = run_tags(params)
    return experiment_id, tags, find_pipeline_run(client, experiment_id, params, tags, uri)


def find_pipeline_run(client: MlflowClient, experiment_id: str, params: Params, tags: dict[str, str], uri: str) -> str:
    """The pipeline run of `tags[PIPELINE_KEY_TAG]`, created if there is none (the package's docstring), RUNNING."""
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
        log_param_batches(client, run_id, {key: str(value) for key, value in flatten(params).items()})
        log_resolved_params(client, run_id, params)
        if sqlite_database(uri) is None:  # no lock against a server: the first one created wins
            first = oldest()
            if first != run_id:
                client.delete_run(run_id)
                run_id = first
    client.update_run(run_id, status="RUNNING")
    return run_id


def refuse_unusable_server(uri: str, error: BaseException) -> None:
    """Raise a UserError if `uri` is a tracking server (http, https) the store could not be opened at: the user named
    it, so going on untracked is not what they asked for (one line, exit 2, before the stage spends its time). A
    local store that cannot be opened stays a warning; a server that goes away later is retried (outbox.py)."""
    if not uri.startswith(("http://", "https://")):
        return
    if isinstance(error, MlflowException) and error.get_http_status_code() in (401, 403):
        problem = ("refuses the credentials: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user of "
                   "the server's")
    else:
        reason = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(error))
        problem = (f"cannot be reached ({reason.group(1) if reason else first_line(error)}): start it (make server), "
                   "or unset MLFLOW_TRACKING_URI to track to ./mlflow.db")
    raise UserError(f"MLFLOW_TRACKING_URI {uri}: the tracking server {problem}") from None
