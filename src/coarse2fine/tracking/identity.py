"""What names a pipeline run, where its store is and what the last lineage record saw: tags, the pipeline key, the
store's URI, `LineageMark`. Plain Python (no MLflow import), for the stages that decide from these alone that
MLflow has nothing to do."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coarse2fine.config import Params, flatten
from coarse2fine.files import atomic_path

STAGE_TAG = "stage"
DVC_EXPERIMENT_TAG = "dvc.experiment"
GIT_DIRTY_TAG = "git.dirty"
PIPELINE_KEY_TAG = "pipeline.key"
# MLflow's MLFLOW_GIT_COMMIT (mlflow.utils.mlflow_tags; importing it imports all of mlflow): the UI's commit column.
# tests/test_tracking.py pins the two equal.
GIT_COMMIT_TAG = "mlflow.source.git.commit"
# On a stage run found RUNNING when a new run of that stage starts in the same pipeline run: it was killed (nothing
# could end it) and is ended KILLED, naming the run that replaced it.
REPLACED_BY_TAG = "replaced_by"
# On a pipeline run: STAGE_TAG = PIPELINE_STAGE.
PIPELINE_STAGE = "pipeline"
# Lineage: a run's outputs as DVC hashed them, and a cached stage's link to the run that made them.
OUTPUTS_TAG = "dvc.outs"
CACHED_FROM_TAG = "cached_from"
# A model file's sha256 on the run that wrote it, and on an evaluation the file it read and the run that wrote it.
MODEL_WRITTEN_TAG = "model.sha256"
MODEL_EVALUATED_TAG = "evaluated.sha256"
MODEL_MADE_BY_TAG = "model.made_by"
# The MLflow model a training run logged (`Tracker.log_model`), and on a pipeline run the registered version of its
# result (`lineage.register_result`).
MODEL_ID_TAG = "model.id"
REGISTERED_TAG = "model.registered"
# The stage whose model is the pipeline's result.
RESULT_STAGE = "finetune"

# What `pipeline_identity` hashes, relative to the directory a stage runs in (the repo, or DVC's copy of it).
CODE_DIRS = ("src", "stages")
DATA_LISTINGS = (
    "data/source.json", "data/teacher_source.json", "data/pretrain_source.json", "data/finetune_source.json",
    "data/token_labels_source.json",
)
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


def sqlite_database(uri: str) -> Path | None:
    """The database file of a sqlite store's URI; None for a tracking server."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def _git_state() -> dict[str, str]:
    """The commit and whether the code differs from it (tags). Asked in the working directory, not
    project_root(): a queued DVC experiment runs a checkout of its own baseline commit in a temporary directory
    while the main repo's HEAD may have moved on."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *CODE_DIRS], capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {GIT_COMMIT_TAG: commit.stdout.strip(), GIT_DIRTY_TAG: str(diff.returncode != 0).lower()}


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


def run_tags(params: Params) -> dict[str, str]:
    """The tags every run gets: the pipeline's identity, the git state and the DVC experiment's name."""
    tags = {**pipeline_identity(params), **_git_state()}
    if exp_name := os.environ.get("DVC_EXP_NAME"):
        tags[DVC_EXPERIMENT_TAG] = exp_name
    return tags


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


def outputs_digest(lock_entry: Mapping[str, Any]) -> str | None:
    """A short digest of a dvc.lock stage entry's outputs (path and DVC hash of each); None without outputs."""
    outs = sorted((out["path"], out.get("md5") or out.get("etag") or "") for out in lock_entry.get("outs", []))
    if not outs:
        return None
    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]


class LineageMark:
    """What a sqlite store's last lineage record saw, kept beside it (`<database>.lineage.json`): the pipeline's key,
    dvc.lock's outputs, and the database's size and modification time once recorded. All unchanged (a `dvc repro`
    that ran nothing): there is nothing to record, and the lineage stage neither imports nor opens MLflow (a
    fraction of a second instead of seconds). Any run written since, another pipeline or other outputs: recorded
    again. A tracking server has no mark: its lineage is always recorded."""

    def __init__(self, params: Params, lock: Mapping[str, Any], uri: str) -> None:
        self._database = sqlite_database(uri)
        self._seen = {
            PIPELINE_KEY_TAG: pipeline_identity(params)[PIPELINE_KEY_TAG],
            "outputs": {stage: outputs_digest(entry) for stage, entry in lock.get("stages", {}).items()},
        }

    @property
    def _path(self) -> Path | None:
        return None if self._database is None else self._database.with_name(self._database.name + ".lineage.json")

    def _current(self) -> dict[str, Any]:
        stat = self._database.stat() if self._database.is_file() else None
        return {**self._seen, "database": None if stat is None else [stat.st_size, stat.st_mtime_ns]}

    def is_recorded(self) -> bool:
        if self._path is None:
            return False
        try:
            return json.loads(self._path.read_text(encoding="utf-8")) == self._current()
        except (OSError, ValueError):  # no mark yet, or a damaged one: record
            return False

    def save(self) -> None:
        """After a record: the database as the record left it."""
        if self._path is not None:
            with atomic_path(self._path) as temporary:
                temporary.write_text(json.dumps(self._current()), encoding="utf-8")
