"""Evaluation counts: by hand on fixed logits, against scikit-learn on real records, and under torchrun."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import (
    DIGITS_RECORDS_PARAMS, PROJECT_ROOT, cpu_runtime, fit_head_by_least_squares, launch_command, make_params,
)
from mlflow import MlflowClient
from PIL import Image
from sklearn.metrics import confusion_matrix, log_loss, top_k_accuracy_score
from torch import nn

from coarse2fine import checkpoints, models
from coarse2fine.data import records
from coarse2fine.data.convert import convert
from coarse2fine.data.loaders import build_loader
from coarse2fine.errors import UserError
from coarse2fine.evaluate import (
    EvalResult, count_batch, evaluate, write_confusion_matrix_png, write_per_class_json,
)
from coarse2fine.training.stage import stage_loaders

STAGE = PROJECT_ROOT / "stages" / "evaluate.py"
NUM_CLASSES = 10
IMG_SIZE = 32

# ------------------------------------------------------------------------------------- fixed logits, by hand

# 8 samples over 6 classes (class 4 has none). Each sample's logits rank the classes: the listed class gets
# 6, the next 5, ... the last 1, so a label at rank position p has cross-entropy logsumexp(1..6) - (6 - p).
HAND_LABELS = [0, 1, 2, 2, 3, 5, 5, 0]
HAND_RANKINGS = [
    [0, 1, 2, 3, 4, 5],  # label 0 first: top-1 hit
    [0, 1, 2, 3, 4, 5],  # label 1 second: top-1 miss (predicted 0), top-5 hit
    [2, 0, 1, 3, 4, 5],  # hit
    [3, 4, 5, 0, 1, 2],  # label 2 last: top-5 miss, predicted 3
    [3, 0, 1, 2, 4, 5],  # hit
    [1, 5, 0, 2, 3, 4],  # predicted 1, top-5 hit
    [5, 0, 1, 2, 3, 4],  # hit
    [4, 3, 2, 1, 5, 0],  # label 0 last: top-5 miss, predicted 4
]
HAND_CLASSES = ["zero", "one", "two", "three", "four", "five"]


class FixedLogits(nn.Module):
    """`model(x)` = a stored row of logits, picked by the sample number carried in x[:, 0]; only in eval mode
    (dropout, drop-path and BatchNorm statistics must be off in evaluation)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        assert not self.training, "evaluated in training mode"
        return self.logits[images[:, 0].long()]


def hand_logits() -> torch.Tensor:
    logits = torch.zeros(len(HAND_RANKINGS), len(HAND_CLASSES))
    for sample, ranking in enumerate(HAND_RANKINGS):
        for position, label in enumerate(ranking):
            logits[sample, label] = len(ranking) - position
    return logits


def hand_batches(batch_size: int) -> list[dict[str, torch.Tensor]]:
    samples = torch.arange(len(HAND_LABELS))
    return [
        {"image": samples[start : start + batch_size, None].float(), "label": torch.tensor(HAND_LABELS[start : start + batch_size])}
        for start in range(0, len(HAND_LABELS), batch_size)
    ]


@pytest.fixture(scope="module")
def hand_result() -> EvalResult:
    return evaluate(FixedLogits(hand_logits()), hand_batches(3), cpu_runtime(), len(HAND_CLASSES))


@pytest.mark.parametrize("batch_size", [1, 3, 8])  # 3: the last batch is partial
def test_counts_on_fixed_logits_match_the_hand_computed_ones(batch_size):
    model = FixedLogits(hand_logits()).train()
    result = evaluate(model, hand_batches(batch_size), cpu_runtime(), len(HAND_CLASSES))

    assert result.n == 8
    assert result.top1 == 100 * 4 / 8
    assert result.top5 == 100 * 6 / 8
    label_positions = [ranking.index(label) for ranking, label in zip(HAND_RANKINGS, HAND_LABELS)]
    assert label_positions == [0, 1, 0, 5, 0, 1, 0, 5]
    log_sum_exp = math.log(sum(math.exp(value) for value in range(1, 7)))
    assert result.loss == pytest.approx(log_sum_exp - 6 + sum(label_positions) / 8, rel=1e-6)
    expected_confusion = np.zeros((6, 6), dtype=np.int64)
    for true, predicted in [(0, 0), (1, 0), (2, 2), (2, 3), (3, 3), (5, 1), (5, 5), (0, 4)]:
        expected_confusion[true, predicted] += 1
    np.testing.assert_array_equal(result.confusion, expected_confusion)
    np.testing.assert_array_equal(result.per_class_correct, [1, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(result.per_class_total, [2, 1, 2, 1, 0, 2])
    np.testing.assert_array_equal(result.per_class_accuracy, [50.0, 0.0, 50.0, 100.0, np.nan, 50.0])
    assert result.summary() == {"top1": 50.0, "top5": 75.0, "loss": result.loss, "n": 8}
    assert model.training  # handed back in the mode it came in


def test_a_batch_is_counted_without_reading_a_value_back_so_a_gpu_never_waits_per_batch():
    """Tensors on the meta device have shapes and no values: a host read (`.item()`, a length that depends on the
    values, as torch.bincount's does) raises there, as it would stall a GPU at every validation batch."""
    meta = torch.device("meta")
    confusion = torch.zeros(len(HAND_CLASSES) ** 2, dtype=torch.int64, device=meta)
    totals = torch.zeros(2, dtype=torch.float64, device=meta)
    count_batch(hand_logits().to(meta), torch.tensor(HAND_LABELS, device=meta), confusion, totals)
    assert confusion.device == meta and confusion.shape == (36,)


def test_top5_counts_every_class_when_there_are_fewer_than_five():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    batch = {"image": torch.tensor([[0.0], [1.0]]), "label": torch.tensor([2, 1])}
    result = evaluate(FixedLogits(logits), [batch], cpu_runtime(), 3)
    assert (result.top1, result.top5, result.n) == (0.0, 100.0, 2)


def test_per_class_json_lists_every_class_in_label_order(hand_result, tmp_path):
    path = tmp_path / "out" / "per_class.json"
    write_per_class_json(path, hand_result, HAND_CLASSES)
    assert json.loads(path.read_text()) == [
        {"class": "zero", "accuracy": 50.0, "correct": 1, "total": 2},
        {"class": "one", "accuracy": 0.0, "correct": 0, "total": 1},
        {"class": "two", "accuracy": 50.0, "correct": 1, "total": 2},
        {"class": "three", "accuracy": 100.0, "correct": 1, "total": 1},
        {"class": "four", "accuracy": None, "correct": 0, "total": 0},  # no samples: no accuracy
        {"class": "five", "accuracy": 50.0, "correct": 1, "total": 2},
    ]
    assert os.listdir(path.parent) == ["per_class.json"]  # no temporary file left behind


@pytest.mark.parametrize("num_classes", [6, 60])  # 60: past the tick-label limit, the figure grows and caps
def test_confusion_matrix_png_is_written_whole(hand_result, tmp_path, num_classes):
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    confusion[:6, :6] = hand_result.confusion
    result = EvalResult(top1=hand_result.top1, top5=hand_result.top5, loss=hand_result.loss, n=8, confusion=confusion)
    path = tmp_path / "confusion_matrix.png"
    write_confusion_matrix_png(path, result, [f"class {i}" for i in range(num_classes)])
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == ((600, 600) if num_classes == 6 else (1600, 1600))
    assert os.listdir(tmp_path) == ["confusion_matrix.png"]


# ------------------------------------------------------------------------------- real records, real VOLO

# 125 val records: odd, so two ranks get 62 and 63 samples.
ODD_VAL_RECORDS = 125


@pytest.fixture(scope="module")
def odd_records(tmp_path_factory) -> Path:
    params = copy.deepcopy(DIGITS_RECORDS_PARAMS)
    params["data"]["digits"]["val_fraction"] = 0.23
    records_dir = tmp_path_factory.mktemp("odd_records")
    convert(make_params(**params), cpu_runtime(), records_dir)
    return records_dir


def loader(records_dir: Path, split: str, batch_size: int):
    params = make_params(loader={"workers": 1})
    return build_loader(
        split, records_dir, img_size=IMG_SIZE, batch_size=batch_size, runtime=cpu_runtime(),
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=1.0, seed=0,
    )


@pytest.fixture(scope="module")
def model_file(odd_records, tmp_path_factory) -> Path:
    """A tiny VOLO whose head is a least-squares fit of the labels on its random features of the train images.

    An untrained VOLO predicts one class for everything; this one, in a second and deterministically, spreads
    its predictions over the classes, right and wrong, so every count below is exercised.
    """
    torch.manual_seed(0)
    model = models.build_model(make_params().model, NUM_CLASSES, IMG_SIZE).eval()
    fit_head_by_least_squares(model, list(loader(odd_records, "train", 64)))
    path = tmp_path_factory.mktemp("model") / "model.pt"
    checkpoints.save_model_file(
        path, model, model_cfg=make_params().model, img_size=IMG_SIZE, classes=records.read_classes(odd_records), stage="pretrain"
    )
    return path


@pytest.fixture(scope="module")
def reference(odd_records, model_file) -> EvalResult:
    """Single process, one big batch."""
    model, _ = checkpoints.load_model_file(model_file)
    return evaluate(model, loader(odd_records, "val", 256), cpu_runtime(), NUM_CLASSES)


def test_evaluate_agrees_with_scikit_learn_on_real_records(odd_records, model_file, reference):
    model, _ = checkpoints.load_model_file(model_file)
    labels, logits = [], []
    with torch.inference_mode():
        for batch in loader(odd_records, "val", 17):
            labels.append(batch["label"])
            logits.append(model(batch["image"]).double())
    labels, logits = torch.cat(labels).numpy(), torch.cat(logits)
    classes = np.arange(NUM_CLASSES)

    assert reference.n == len(labels) == ODD_VAL_RECORDS
    np.testing.assert_array_equal(reference.confusion, confusion_matrix(labels, logits.argmax(dim=1).numpy(), labels=classes))
    assert reference.top5 == pytest.approx(100 * top_k_accuracy_score(labels, logits.numpy(), k=5, labels=classes))
    assert reference.loss == pytest.approx(log_loss(labels, logits.softmax(dim=1).numpy(), labels=classes), rel=1e-5)
    # The fitted head makes this a real test: several classes predicted, some right, some wrong.
    assert (reference.confusion.sum(axis=0) > 0).sum() >= 5
    assert 20 < reference.top1 < 100 and reference.top1 < reference.top5 < 100


def test_training_stages_validate_at_the_evaluation_batch_not_their_training_one(odd_records):
    """Validation, and the evaluation of an imported model, run at evaluate.batch_size: a stage's training batch can
    be tiny (VOLO-D5 at 512 trains at 4 a GPU), a forward without gradients needs a fraction of its memory."""
    params = make_params(pretrain={"batch_size": 8}, evaluate={"batch_size": 50}, loader={"workers": 1})
    for mode, splits in (("import", ["val"]), ("train", ["train", "val"])):
        cfg = params.pretrain.model_copy(update={"mode": mode})
        loaders = stage_loaders(params, cfg, odd_records, cpu_runtime(), cpu_runtime(), labels=None)
        assert list(loaders) == splits
        assert [len(batch["label"]) for batch in loaders["val"]] == [50, 50, ODD_VAL_RECORDS - 100]
    assert len(next(iter(loaders["train"]))["label"]) == 8


@pytest.mark.slow
def test_stage_under_torchrun_counts_every_sample_exactly_once(odd_records, model_file, reference, tmp_path):
    store = tmp_path / "mlflow.db"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        # 62-sample batches: rank 0 gets 62 records (one batch), rank 1 63 (a full batch and one of 1).
        "evaluate": {"batch_size": 62},
        "loader": {"workers": 1},
        "tracking": {"experiment": "evaluate-test"},
    }))
    out = tmp_path / "metrics" / "evaluate"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{store}", "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    subprocess.run(
        launch_command(STAGE, "--model", model_file, "--settings", "pretrain", "--records", odd_records, "--out", out,
                       nproc=2),
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=600,
    )

    assert sorted(os.listdir(out)) == ["confusion_matrix.png", "metrics.json", "per_class.json"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["n"], metrics["img_size"]) == (ODD_VAL_RECORDS, IMG_SIZE)
    assert (metrics["top1"], metrics["top5"]) == (reference.top1, reference.top5)
    assert metrics["loss"] == pytest.approx(reference.loss, rel=1e-6)
    per_class = json.loads((out / "per_class.json").read_text())
    assert [row["class"] for row in per_class] == records.read_classes(odd_records)
    assert [row["correct"] for row in per_class] == reference.per_class_correct.tolist()
    assert [row["total"] for row in per_class] == reference.per_class_total.tolist()

    client = MlflowClient(f"sqlite:///{store}")
    [run] = client.search_runs([client.get_experiment_by_name("evaluate-test").experiment_id], "tags.stage != 'pipeline'")
    assert run.info.run_name == "evaluate@pretrain" and run.info.status == "FINISHED"
    assert run.data.metrics == {
        "top1": reference.top1, "top5": reference.top5, "loss": pytest.approx(reference.loss, rel=1e-6),
        "n": ODD_VAL_RECORDS, "img_size": IMG_SIZE,
    }
    assert run.data.params["evaluate.batch_size"] == "62"
    assert sorted(item.path for item in client.list_artifacts(run.info.run_id)) == [
        "classes.json", "confusion_matrix.png", "params.yaml", "per_class.json",
    ]
    (dataset,) = run.inputs.dataset_inputs  # the val records it evaluated, as the UI's Dataset column shows them
    assert (dataset.dataset.name, dataset.tags[0].value) == ("digits val (subset 0.3)", "val")


def load_stage_module():
    spec = importlib.util.spec_from_file_location("evaluate_stage", STAGE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_refuses_records_with_other_classes(odd_records, model_file, tmp_path):
    other_records = tmp_path / "records"
    shutil.copytree(odd_records, other_records)
    classes = records.read_classes(odd_records)
    (other_records / records.CLASSES_FILE).write_text(json.dumps([*classes[:3], "cat", *classes[4:]]))
    args = argparse.Namespace(model=str(model_file), settings="pretrain", records=str(other_records), out=str(tmp_path / "out"))
    with pytest.raises(UserError) as error:
        load_stage_module().main(make_params(), args)
    message = str(error.value)
    assert str(model_file) in message and str(other_records / records.CLASSES_FILE) in message
    assert "label 3 ('3' vs 'cat')" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_stage_evaluates_at_extra_resolutions_with_the_position_embedding_resampled(odd_records, model_file, tmp_path, monkeypatch):
    args = argparse.Namespace(model=str(model_file), settings="finetune", records=str(odd_records), out=str(tmp_path / "out"))
    params = make_params(evaluate={"finetune": {"extra_sizes": [IMG_SIZE, 48]}}, tracking={"experiment": "extra"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    load_stage_module().main(params, args)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["img_size"] == IMG_SIZE and "top1_at_32" not in metrics  # its own size is not repeated
    # The same model rebuilt for 48 px inputs: another number, from the same weights, over the same images.
    resized, _ = checkpoints.load_model_file(model_file, img_size=48)
    assert tuple(resized.pos_embed.shape[1:3]) == (3, 3)  # 2 x 2 tokens at 32 px, 3 x 3 at 48
    loader48 = build_loader(
        "val", odd_records, img_size=48, batch_size=64, runtime=cpu_runtime(),
        loader_cfg=make_params().loader, augment_cfg=make_params().augment, crop_pct=1.0, seed=0,
    )
    assert metrics["top1_at_48"] == evaluate(resized, loader48, cpu_runtime(), NUM_CLASSES).top1
