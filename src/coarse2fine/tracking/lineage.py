"""Lineage (the package's docstring): each stage DVC skipped gets a "<stage> (cached)" run in this pipeline's run,
linked to the run that made its outputs, and the pipeline's result is registered in the model registry: the
candidate alias moves to every result, the champion alias by `champion_verdict`'s rule or by `promote`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE

from coarse2fine.config import Params
from coarse2fine.errors import first_line
from coarse2fine.tracking.identity import (
    CACHED_FROM_TAG, MODEL_ID_TAG, OUTPUTS_TAG, REGISTERED_TAG, RESULT_STAGE, STAGE_TAG, outputs_digest, tracking_uri,
)
from coarse2fine.tracking.mlflow_store import (
    MAX_METRICS_PER_BATCH, log_param_batches, opened_store, pipeline_run, refuse_unusable_server,
)

logger = logging.getLogger(__name__)
SOURCE_TAGS = (MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE)  # the UI's Source column
# What the champion rule reads, kept on each registered version (the UI's version page shows them): its
# evaluation's top-1, the val set that top-1 was measured on (the records' name and digest, the evaluation run's
# Dataset) and the fraction of the data it was trained on (data.subset).
TOP1_TAG, VAL_SET_TAG, SUBSET_TAG = "val.top1", "val.dataset", "data.subset"


def record_lineage(params: Params, lock: Mapping[str, Any]) -> list[str] | None:
    """Complete this pipeline's run from dvc.lock's contents; returns one line per stage linked to a cached result.
    A local store unusable: one warning, nothing recorded, None; a tracking server unusable: a UserError."""
    uri = tracking_uri()
    try:
        with opened_store(uri) as client:
            experiment_id, tags, pipeline_id = pipeline_run(client, params, uri)
        lines, made_by = _link_stages(client, experiment_id, pipeline_id, tags, lock)
        if RESULT_STAGE in made_by:
            evaluation = made_by.get(f"evaluate@{RESULT_STAGE}")
            lines += register_result(client, params, pipeline_id, made_by[RESULT_STAGE], evaluation)
        client.set_terminated(pipeline_id, "FINISHED")
    except Exception as error:
        refuse_unusable_server(uri, error)
        logger.warning("warning: MLflow at %s is not usable (%s): no lineage recorded", uri, first_line(error))
        return None
    return lines


def register_result(
    client: MlflowClient, params: Params, pipeline_id: str, producer: Run, evaluation: Run | None
) -> list[str]:
    """Register the model `producer` (the run that made the pipeline's result) logged, unless that model already is
    a version; tag the version with its `Standing` (from `evaluation`, the run that evaluated it); move the
    candidate alias to it and the champion alias if `champion_verdict` says so; tag the pipeline run with
    "<name>/<version>"."""
    model_id = producer.data.tags.get(MODEL_ID_TAG)
    if model_id is None:
        return []  # trained before models were logged, or with MLflow unusable at the time
    tracking = params.tracking
    name = tracking.registered_model
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="The coarse-to-fine pipeline's result (the fine-tuned model)")
    source, run_id = f"models:/{model_id}", producer.info.run_id
    versions = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    registered = next((found for found in versions if found.source == source), None)
    if registered is None:
        registered = client.create_model_version(name, source=source, run_id=run_id, model_id=model_id)
    version = registered.version
    standing = Standing.of_evaluation(evaluation, params.data.subset)
    for key, value in standing.tags().items():
        client.set_model_version_tag(name, version, key, value)
    client.set_registered_model_alias(name, tracking.candidate_alias, version)
    client.set_tag(pipeline_id, REGISTERED_TAG, f"{name}/{version}")
    lines = [f"{RESULT_STAGE}: model registered as models:/{name}/{version}, alias {tracking.candidate_alias} "
             f"(models:/{name}@{tracking.candidate_alias})"]
    champion = _alias_version(client, name, tracking.champion_alias)
    if champion is not None and champion.version == version:
        return lines  # recorded again: already the champion
    moves, reason = champion_verdict(standing, None if champion is None else Standing.of_version(champion))
    if moves:
        client.set_registered_model_alias(name, tracking.champion_alias, version)
        lines.append(f"{RESULT_STAGE}: alias {tracking.champion_alias} moved to version {version}: {reason}")
    else:
        held = "no version" if champion is None else f"version {champion.version}"
        lines.append(f"{RESULT_STAGE}: alias {tracking.champion_alias} stays on {held}: version {version} {reason} "
                     f"(python -m coarse2fine.promote {version} moves it)")
    return lines


@dataclass(frozen=True)
class Standing:
    """What the champion rule compares of a registered version (tagged on it as TOP1_TAG, VAL_SET_TAG, SUBSET_TAG):
    None where its pipeline has no evaluation on record (MLflow off while it ran)."""

    top1: float | None
    val_set: str | None
    subset: float

    @classmethod
    def of_evaluation(cls, evaluation: Run | None, subset: float) -> Standing:
        if evaluation is None:
            return cls(None, None, subset)
        val = next((entry.dataset for entry in evaluation.inputs.dataset_inputs
                    if any(tag.value == "val" for tag in entry.tags)), None)
        return cls(evaluation.data.metrics.get("top1"), None if val is None else f"{val.name} {val.digest}", subset)

    @classmethod
    def of_version(cls, version: ModelVersion) -> Standing:
        tags = version.tags
        top1 = tags.get(TOP1_TAG)
        return cls(None if top1 is None else float(top1), tags.get(VAL_SET_TAG), float(tags.get(SUBSET_TAG, 1)))

    def tags(self) -> dict[str, str]:
        known = {TOP1_TAG: self.top1, VAL_SET_TAG: self.val_set, SUBSET_TAG: self.subset}
        return {key: str(value) for key, value in known.items() if value is not None}


def champion_verdict(new: Standing, champion: Standing | None) -> tuple[bool, str]:
    """Whether a new result takes the champion alias, and why (said after "version N"). The rule: trained on the
    whole data set (data.subset 1: a subset sweep point never becomes the champion), evaluated, and either the first
    such result or a better top-1 than the champion's on the same val set. Another val set is not comparable: the
    alias stays, and `python -m coarse2fine.promote` moves it by hand."""
    if new.subset < 1:
        return False, f"was trained on data.subset {new.subset:g}, not the whole data set"
    if new.top1 is None or new.val_set is None:
        return False, "has no evaluation on record"
    if champion is None:
        return True, f"the first result trained on the whole data set (top-1 {new.top1:.2f} % on {new.val_set})"
    if champion.val_set != new.val_set or champion.top1 is None:
        return False, f"was evaluated on {new.val_set}, the champion on {champion.val_set}: not comparable"
    if new.top1 > champion.top1:
        return True, f"top-1 {new.top1:.2f} % beats the champion's {champion.top1:.2f} % on {new.val_set}"
    return False, f"has top-1 {new.top1:.2f} %, not above the champion's {champion.top1:.2f} % on {new.val_set}"


def promote(client: MlflowClient, name: str, alias: str, version: str) -> str:
    """Move `alias` of registered model `name` to `version` (a number, or another alias such as candidate)."""
    chosen = client.get_model_version(name, version) if version.isdigit() else _alias_version(client, name, version)
    if chosen is None:
        raise MlflowException(f"registered model {name!r} has no alias {version!r}")
    client.set_registered_model_alias(name, alias, chosen.version)
    return f"models:/{name}@{alias} -> version {chosen.version} ({chosen.tags.get(TOP1_TAG, '?')} % top-1 on " \
           f"{chosen.tags.get(VAL_SET_TAG, 'an unknown val set')})"


def _alias_version(client: MlflowClient, name: str, alias: str) -> ModelVersion | None:
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


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
