"""Lineage (the package's docstring): each stage DVC skipped gets a "<stage> (cached)" run in this pipeline's run,
linked to the run that made its outputs, and the pipeline's result is registered in the model registry."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE

from coarse2fine.config import Params
from coarse2fine.tracking.identity import (
    CACHED_FROM_TAG, MODEL_ID_TAG, OUTPUTS_TAG, REGISTERED_TAG, RESULT_STAGE, STAGE_TAG, outputs_digest, tracking_uri,
)
from coarse2fine.tracking.mlflow_store import (
    MAX_METRICS_PER_BATCH, first_line, log_param_batches, opened_store, pipeline_run,
)

logger = logging.getLogger(__name__)
SOURCE_TAGS = (MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE)  # the UI's Source column


def record_lineage(params: Params, lock: Mapping[str, Any]) -> list[str] | None:
    """Complete this pipeline's run from dvc.lock's contents; returns one line per stage linked to a cached result.
    MLflow unusable: one warning, nothing recorded, None."""
    uri = tracking_uri()
    try:
        with opened_store(uri) as client:
            experiment_id, tags, pipeline_id = pipeline_run(client, params, uri)
        lines, made_by = _link_stages(client, experiment_id, pipeline_id, tags, lock)
        if RESULT_STAGE in made_by:
            lines += register_result(client, params, pipeline_id, made_by[RESULT_STAGE])
        client.set_terminated(pipeline_id, "FINISHED")
    except Exception as error:
        logger.warning("warning: MLflow at %s is not usable (%s): no lineage recorded", uri, first_line(error))
        return None
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
        log_param_batches(client, link, producer.data.params)
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
