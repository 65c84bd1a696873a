"""User mistakes and bad inputs, run exactly as dvc.yaml runs each stage (its rendered command, under the launcher
and torchrun, two ranks where it matters): one line naming the key, file or value, exit code 2, no torchrun
report. Among them the bad inputs of the later stages: a teacher weights file cut short or not a weights file, a
model file of another architecture given to finetune, a token-label store cut short, an empty params.yaml,
token_labels.top_k above the class count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from coarse2fine import checkpoints, cli, launch, models
from coarse2fine.config import CustomVolo, TimmModel
from coarse2fine.labels.store import CLASSES_FILE, write_store
from conftest import Project


def class_tree(root: Path, layout: dict[str, list[str]]) -> Path:
    """root/<split>/<class>/ with one tiny PNG each (an empty list: no folder for the split at all)."""
    from PIL import Image

    for split, classes in layout.items():
        for name in classes:
            (root / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8), "white").save(root / split / name / "a.png")
    return root


def empty_class(root: Path) -> Path:
    class_tree(root, {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    (root / "train" / "dog" / "a.png").unlink()
    return root


def pretrained_model(project: Project, classes: list[str]) -> None:
    """An untrained tiny VOLO over `classes` as models/pretrain/model.pt."""
    model_cfg = CustomVolo()
    model = models.build_model(model_cfg, num_classes=len(classes), img_size=32)
    checkpoints.save_model_file(
        project.path / "models/pretrain/model.pt", model, model_cfg=model_cfg, img_size=32, classes=classes,
        stage="pretrain",
    )


def model_with_other_classes(project: Project) -> None:
    pretrained_model(project, [f"class {i}" for i in range(10)])


def teacher_file(project: Project, classes: list[str], num_classes: int | None = None) -> Path:
    """A resnet10t teacher model file over `classes` (its head sized for `num_classes` if given)."""
    model_cfg = TimmModel(name="resnet10t", output_stride=8)
    model = models.build_model(model_cfg, num_classes=num_classes or len(classes), img_size=32)
    path = project.path / "models/teacher/model.pt"
    checkpoints.save_model_file(path, model, model_cfg=model_cfg, img_size=32, classes=classes, stage="teacher")
    return path


def teacher_weights_file(tmp: Path, content: bytes | None) -> dict:
    """Import mode with a resnet10t state dict for the 10 digits, cut to its first half (`content` None: a copy that
    died half-way) or replaced by `content` (the wrong file, e.g. a download's error page)."""
    path = tmp / "resnet10t.pt"
    torch.save(models.build_model(TimmModel(name="resnet10t"), num_classes=10, img_size=32).state_dict(), path)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2] if content is None else content)
    return {"teacher": {"mode": "import", "weights": str(path), "model": {"name": "resnet10t"}}}


def wider_pretrained_model(project: Project) -> dict:
    """models/pretrain/model.pt of a VOLO wider than params' model: finetune must refuse to start from it."""
    wider = CustomVolo(embed_dims=(64, 128, 128, 256), num_heads=(2, 4, 4, 8))
    path = project.path / "models/pretrain/model.pt"
    checkpoints.save_model_file(path, models.build_model(wider, 10, 32), model_cfg=wider, img_size=32, classes=DIGITS,
                           stage="pretrain")
    return {"finetune": GROUND_TRUTH}


def truncated_token_labels(project: Project) -> dict:
    """A token-label store for the digits' 434 training records with its classes array cut short."""
    store = project.path / "data/token_labels"
    write_store(store, np.zeros((434, 2, 2, 2)), np.zeros((434, 2, 2, 2)), num_classes=10)
    classes = store / CLASSES_FILE
    classes.write_bytes(classes.read_bytes()[:1000])
    return {"pretrain": {"token_label": {"enabled": True}}}


def imagenet_weights(project: Project, tmp: Path) -> dict:
    """Import mode with a 1000-class resnet10t state dict: it does not fit the 10 digit classes."""
    path = tmp / "resnet10t_imagenet.pt"
    torch.save(models.build_model(TimmModel(name="resnet10t"), num_classes=1000, img_size=32).state_dict(), path)
    return {"teacher": {"mode": "import", "weights": str(path), "model": {"name": "resnet10t"}}}


GROUND_TRUTH = {"token_label": {"enabled": False}}  # pretrain without a token-label store
DIGITS = [str(digit) for digit in range(10)]

# (stage, params change, set-up of files given (project, tmp_path) -> params change, words the line must hold)
MISTAKES: dict[str, tuple[str, Callable[[Project, Path], dict], list[str]]] = {
    "missing data root": (
        "convert", lambda project, tmp: {"data": {"source": "imagefolder", "root": str(tmp / "nowhere")}},
        ["nowhere", "data root not found"],
    ),
    "no val folder": (
        "convert", lambda project, tmp: {"data": {"source": "imagefolder",
                                                  "root": str(class_tree(tmp / "tree", {"train": ["cat"]}))}},
        ["val", "missing"],
    ),
    "empty class folder": (
        "convert", lambda project, tmp: {"data": {"source": "imagefolder", "root": str(empty_class(tmp / "tree"))}},
        ["train/dog", "empty class folder"],
    ),
    "class only in val": (
        "convert", lambda project, tmp: {"data": {"source": "imagefolder", "root": str(
            class_tree(tmp / "tree", {"train": ["cat"], "val": ["cat", "dog"]}))}},
        ["class folders differ", "extra: ['dog']"],
    ),
    "more shards than images": (
        "convert", lambda project, tmp: {"data": {"subset": 0.01, "val_shards": 50}},
        ["data.val_shards", "50 shards for only 10 val images"],
    ),
    "batch larger than a rank's share": (
        "pretrain", lambda project, tmp: {"pretrain": {"batch_size": 300, **GROUND_TRUTH}},
        ["batch_size 300", "217 training records each of 2 rank(s)"],
    ),
    "model and records classes differ": (
        "evaluate@pretrain", lambda project, tmp: model_with_other_classes(project) or {},
        ["model.pt has 10 classes", "differ at label 0", "'class 0' vs '0'"],
    ),
    "rand_augment magnitude above 10": (
        "pretrain", lambda project, tmp: {"augment": {"rand_augment": "rand-m12"}, "pretrain": GROUND_TRUTH},
        ["augment.rand_augment", "m12"],
    ),
    "rand_augment option no backend honours": (
        "pretrain", lambda project, tmp: {"augment": {"rand_augment": "rand-m9-p0.3"}, "pretrain": GROUND_TRUTH},
        ["augment.rand_augment", "p0.3"],
    ),
    "teacher weights for another class count": (
        "teacher", imagenet_weights, ["teacher.weights", "does not fit ResNet with 10 classes", "fc.weight (1000, 512)"],
    ),
    "misspelt model name (checked by the workers, not the launcher)": (
        "teacher", lambda project, tmp: {"teacher": {"model": {"name": "resnet10tt"}}},
        ["teacher.model.name", "'resnet10tt' is neither volo_custom nor a timm model", "did you mean"],
    ),
    "no token labels yet": (
        "pretrain", lambda project, tmp: {}, ["data/token_labels", "run the token_labels stage first"],
    ),
    "launch.device cuda without a GPU (this machine's)": (
        "teacher", lambda project, tmp: {"launch": {"nproc_per_node": 2, "device": "cuda"}},
        ["launch.device: cuda", "finds no usable GPU", "set launch.device: cpu"],
    ),
    "teacher weights cut short": (
        "teacher", lambda project, tmp: teacher_weights_file(tmp, None), ["resnet10t.pt", "not a readable"],
    ),
    "teacher weights that are not a weights file": (
        "teacher", lambda project, tmp: teacher_weights_file(tmp, b"<html>404 Not Found</html>"),
        ["resnet10t.pt", "not a readable"],
    ),
    "a model file of another architecture to fine-tune from": (
        "finetune", lambda project, tmp: wider_pretrained_model(project),
        ["models/pretrain/model.pt", "another architecture than model.*", "embed_dims"],
    ),
    "a token-label store cut short": (
        "pretrain", lambda project, tmp: truncated_token_labels(project),
        ["data/token_labels", "not a readable token-label store", "rerun the token_labels stage"],
    ),
    "more top-k classes than classes": (
        "token_labels", lambda project, tmp: teacher_file(project, DIGITS) and {"token_labels": {"top_k": 11}},
        ["token_labels.top_k", "11 is more than the 10 classes"],
    ),
}


# make test-fast's one mistake through a real 2-rank launch: the workers find it, not the launcher.
SMOKE_MISTAKE = "misspelt model name (checked by the workers, not the launcher)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "mistake",
    [pytest.param(name, marks=pytest.mark.smoke) if name == SMOKE_MISTAKE else name for name in sorted(MISTAKES)],
)
def test_a_user_mistake_is_one_line_and_exit_2(mistake, digits_records, tmp_path):
    stage, set_up, words = MISTAKES[mistake]
    project = Project(tmp_path / "project")
    if stage != "convert":  # what convert made, for the later stages (never written through: convert's output)
        (project.path / "data").mkdir()
        (project.path / "data/records").symlink_to(digits_records)
    project.edit_params({"launch": {"nproc_per_node": 2}, **set_up(project, tmp_path)})

    result = subprocess.run(
        project.stage_command(stage), shell=True, cwd=project.path, env=project.env,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    # Progress bars may precede it on stderr; the mistake is the one line after them, said once.
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:], result.stderr[-3000:]
    assert all(word in errors[0] for word in words), errors[0]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


@pytest.mark.parametrize("stopped_rank_wrote_first", [False, True])
def test_a_user_mistake_stays_one_line_whichever_rank_torch_calls_the_first_failure(stopped_rank_wrote_first, tmp_path):
    """CI's race: rank 1 wrote its error file, then rank 0 exited 2 and the agent stopped rank 1 (SIGTERM) before
    it exited; torch's first failure (the older error file) was rank 1's -15, and the mistake became a traceback."""
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": "UserError", "extraInfo": {"timestamp": "1"}}}))
    failures = {
        0: ProcessFailure(0, 100, cli.USER_ERROR_EXIT, str(tmp_path / "none.json")),
        1: ProcessFailure(1, 101, -signal.SIGTERM, str(error_file) if stopped_rank_wrote_first else "none.json"),
    }
    (tmp_path / "rank0.txt").write_text("teacher.weights: x.pt: not a readable weights file")
    (tmp_path / "rank1.txt").write_text("teacher.weights: x.pt: not a readable weights file")
    failure = ChildFailedError("stages/teacher.py", failures)
    assert failure.get_first_failure()[0] == (1 if stopped_rank_wrote_first else 0)
    assert launch._user_errors(failure, tmp_path) == ["teacher.weights: x.pt: not a readable weights file"]
    # A crash beside the mistake keeps torchrun's report.
    failures[1] = ProcessFailure(1, 101, 1, "none.json")
    assert launch._user_errors(ChildFailedError("stages/teacher.py", failures), tmp_path) == []


RANK_THAT_FAILS = """
import json, os, signal
from coarse2fine import cli

def stopped_mid_write(data, file):  # the agent's SIGTERM, arriving while the rank records its failure
    file.write(json.dumps(data)[:10])
    file.flush()
    os.kill(os.getpid(), signal.SIGTERM)

if os.environ["STOPPED_MID_WRITE"] == "1":
    json.dump = stopped_mid_write

def main(params, args):
    raise RuntimeError("a crash on every rank")

cli._recorded(main)(None, None)
"""


@pytest.mark.parametrize("stopped_mid_write", [False, True])
def test_a_rank_stopped_while_recording_its_failure_leaves_the_agent_a_whole_error_file_or_none(
    stopped_mid_write, tmp_path
):
    """CI's race (2026-12-06): rank 0 exited 2, the agent SIGTERMed rank 1 while torch's `record` wrote its error
    file in place, and the agent died parsing the empty file (JSONDecodeError): exit 1 and the agent's traceback
    in place of the mistake's one line. The agent reads the file as it does (ProcessFailure) after the rank ends."""
    error_file = tmp_path / "error.json"
    env = {
        **os.environ, "PYTHONPATH": "src", "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_ERROR_FILE": str(error_file),
        "STOPPED_MID_WRITE": str(int(stopped_mid_write)),
    }
    rank = subprocess.run([sys.executable, "-c", RANK_THAT_FAILS], env=env, capture_output=True, text=True)

    assert rank.returncode == (-signal.SIGTERM if stopped_mid_write else 1), rank.stderr
    failure = ProcessFailure(1, 101, rank.returncode, str(error_file))
    if stopped_mid_write:
        assert not error_file.exists()
    else:
        assert failure.message["message"] == "RuntimeError: a crash on every rank"


@pytest.mark.slow
def test_a_stage_says_in_one_line_at_start_what_it_runs_on(digits_records, tmp_path):
    """Device, process-group backend, precision and loader graph, from rank 0 (launch.device auto on a CPU)."""
    project = Project(tmp_path / "project")
    (project.path / "data").mkdir()
    (project.path / "data/records").symlink_to(digits_records)
    pretrained_model(project, DIGITS)
    project.edit_params({"launch": {"nproc_per_node": 2}})

    result = subprocess.run(
        project.stage_command("evaluate@pretrain"), shell=True, cwd=project.path, env=project.env,
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    startup = [line for line in result.stdout.splitlines() if line.startswith("evaluate@pretrain: device ")]
    assert startup == ["evaluate@pretrain: device cpu x2, backend gloo, precision fp32, loader dali (cpu graph)"]


@pytest.mark.slow
def test_an_empty_params_file_is_one_line_and_exit_2(tmp_path):
    """Every key commented out would otherwise run on the schema's defaults: the digits, not what the file meant."""
    project = Project(tmp_path / "project")
    (project.path / "params.yaml").write_text("# every key commented out\n")
    result = subprocess.run(
        project.stage_command("convert"), shell=True, cwd=project.path, env=project.env, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: params.yaml: empty (no params): restore it"), line

