"""`coarse2fine.predict` on real val images: the val loader's preprocessing, every image format, unreadable files,
the command line, and a model logged and registered in MLflow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow.pytorch
import pytest
import torch
from conftest import cpu_runtime, fit_head_by_least_squares, make_params
from mlflow import MlflowClient
from PIL import Image
from torch import nn

from coarse2fine import checkpoints, models, predict
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.data.transforms import eval_transform
from coarse2fine.tracking.identity import MODEL_ID_TAG
from coarse2fine.tracking.runs import Tracker

# A size and crop that make the eval transform do something to the 32 px digits: shorter side to 27, crop 24.
IMG_SIZE, CROP_PCT, INTERPOLATION = 24, 0.875, "bilinear"
NUM_IMAGES = 12  # the first val records, as files


def val_loader(records_dir: Path, backend: str, *, crop_pct: float = CROP_PCT, interpolation: str = INTERPOLATION):
    """The val loader the evaluate stage builds, over the first NUM_IMAGES records in one batch."""
    params = make_params(loader={"backend": backend, "workers": 1}, augment={"interpolation": interpolation})
    return build_loader(
        "val", records_dir, img_size=IMG_SIZE, batch_size=NUM_IMAGES, runtime=cpu_runtime(),
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=crop_pct, seed=0,
    )


def loader_images(records_dir: Path, backend: str, **transform) -> torch.Tensor:
    return next(iter(val_loader(records_dir, backend, **transform)))["image"]


def file_images(model: str | Path, directory: Path, spec: dict) -> torch.Tensor:
    """`<position>.jpg` in `directory` as predict prepares them for the model."""
    transform = predict.EvalTransform(spec, str(model))
    return torch.stack([transform(predict.open_rgb(directory / f"{position}.jpg")) for position in range(NUM_IMAGES)])


def probabilities_of(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(images).softmax(dim=1)


@pytest.fixture(scope="module")
def model_file(digits_records, tmp_path_factory) -> Path:
    """A tiny VOLO whose head is a least-squares fit of the labels on its random features of the train images: an
    untrained one predicts one class for everything, this one several (as in test_evaluate.py)."""
    torch.manual_seed(0)
    classes = records.read_classes(digits_records)
    params = make_params(loader={"backend": "torch", "workers": 0})
    model = models.build_model(params.model, len(classes), IMG_SIZE).eval()
    train_loader = build_loader(
        "train", digits_records, img_size=IMG_SIZE, batch_size=64, runtime=cpu_runtime(),
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=CROP_PCT, seed=0,
    )
    fit_head_by_least_squares(model, list(train_loader))
    path = tmp_path_factory.mktemp("model") / "model.pt"
    checkpoints.save_model_file(
        path, model, model_cfg=params.model, img_size=IMG_SIZE, classes=classes, stage="finetune",
        eval_transform=eval_transform(IMG_SIZE, CROP_PCT, INTERPOLATION),
    )
    return path


@pytest.fixture(scope="module")
def val_images(digits_records, tmp_path_factory) -> Path:
    """The first NUM_IMAGES val records as they are stored (RGB JPEGs): `<position>.jpg`."""
    directory = tmp_path_factory.mktemp("val_images")
    (shard, _), *_ = records.shard_files(digits_records, "val")
    for position, record in zip(range(NUM_IMAGES), records.read_shard(shard)):
        (directory / f"{position}.jpg").write_bytes(record["image"])
    return directory


def predicted(model: str | Path, *inputs: Path, batch_size: int = 5) -> tuple[dict, dict]:
    """In process: ({image: Prediction}, {image: reason}). Batches of 5: NUM_IMAGES makes two full ones and a
    partial one."""
    results = list(predict.Predictor(str(model), torch.device("cpu")).predict(predict.image_files(inputs), batch_size))
    return (
        {result.image: result for result in results if isinstance(result, predict.Prediction)},
        {result.image: result.reason for result in results if isinstance(result, predict.Unreadable)},
    )


def top1_by_position(predictions: dict) -> list[str]:
    return [predictions[image].top5[0][0] for image in sorted(predictions, key=lambda image: int(Path(image).stem))]


def test_predictions_are_the_models_on_the_val_loaders_images(model_file, val_images, digits_records):
    model, card = checkpoints.load_model_file(model_file)
    classes = card["classes"]
    predictions, unreadable = predicted(model_file, val_images)

    assert unreadable == {} and len(predictions) == NUM_IMAGES
    # The torch val loader decodes with PIL too: bit for bit the same input, so the same preprocessing.
    images = loader_images(digits_records, "torch")
    assert torch.equal(file_images(model_file, val_images, card["eval_transform"]), images)
    for position, probabilities in enumerate(probabilities_of(model, images)):
        top5 = predictions[str(val_images / f"{position}.jpg")].top5
        # Sorted, and each the class's probability (other batches: the last bits of the float sums differ).
        assert [p for _, p in top5] == pytest.approx(probabilities.topk(5).values.tolist(), rel=1e-4)
        by_class = dict(zip(classes, probabilities.tolist()))
        assert [p for _, p in top5] == pytest.approx([by_class[name] for name, _ in top5], rel=1e-4)
    # The evaluate stage's loader (DALI where it imports, as here; its JPEG decoder differs in the last bits of
    # a few pixels) gives the same top-1.
    default_top1 = probabilities_of(model, loader_images(digits_records, "auto")).argmax(dim=1)
    assert top1_by_position(predictions) == [classes[label] for label in default_top1.tolist()]
    assert len(set(top1_by_position(predictions))) >= 4  # a real comparison, not one class everywhere


def test_every_pil_format_is_predicted_and_unreadable_files_are_listed(model_file, val_images, tmp_path):
    digit = Image.open(val_images / "3.jpg").convert("RGB")
    folder = tmp_path / "mixed"
    (folder / "nested").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    digit.save(folder / "a_rgb.png")
    digit.convert("CMYK").save(folder / "b_cmyk.jpg")
    digit.convert("P").save(folder / "c_palette.png")
    digit.convert("L").save(folder / "nested" / "d_grey.webp")
    transparent = digit.convert("RGBA")
    transparent.paste((0, 0, 0, 0), (0, 0, 32, 8))  # the top rows: black, fully transparent
    transparent.save(folder / "e_transparent.png")
    on_white = digit.copy()
    on_white.paste((255, 255, 255), (0, 0, 32, 8))
    on_white.save(folder / "f_on_white.png")
    (folder / "g_truncated.jpg").write_bytes((val_images / "3.jpg").read_bytes()[:300])
    (folder / "h_notes.txt").write_text("not an image")
    (folder / "i_empty.png").write_bytes(b"")
    digit.save(folder / ".j_hidden.png")
    digit.save(folder / ".hidden" / "k.png")
    missing = tmp_path / "missing.jpg"

    # One image a forward: equal pixels give equal probabilities to the last bit, whatever else is in the folder.
    predictions, unreadable = predicted(model_file, folder, missing, batch_size=1)

    names = ["a_rgb.png", "b_cmyk.jpg", "c_palette.png", "e_transparent.png", "f_on_white.png", "nested/d_grey.webp"]
    assert sorted(predictions) == [str(folder / name) for name in names]  # hidden files and folders skipped
    assert unreadable == {
        str(folder / "g_truncated.jpg"): "cannot decode: OSError: Truncated File Read",
        str(folder / "h_notes.txt"): "not an image PIL can read",
        str(folder / "i_empty.png"): "not an image PIL can read",
        str(missing): "No such file or directory",
    }
    expected, _ = predicted(model_file, val_images / "3.jpg", batch_size=1)
    assert predictions[str(folder / "a_rgb.png")].top5 == expected[str(val_images / "3.jpg")].top5  # lossless PNG
    # Transparent pixels count as white, as the convert stage writes them into the records.
    assert predictions[str(folder / "e_transparent.png")].top5 == predictions[str(folder / "f_on_white.png")].top5


def test_an_older_model_file_with_fewer_than_five_classes(digits_records, val_images, tmp_path, capsys):
    """Three classes: three lines, all the probability. No recorded eval transform: the params' defaults (crop_pct
    1.0, bicubic), as the val loader applies them, said once."""
    torch.manual_seed(1)
    model = models.build_model(make_params().model, 3, IMG_SIZE).eval()
    path = tmp_path / "model.pt"
    checkpoints.save_model_file(
        path, model, model_cfg=make_params().model, img_size=IMG_SIZE, classes=["x", "y", "z"], stage="pretrain"
    )

    predictions, _ = predicted(path, val_images)

    assert capsys.readouterr().err.count("does not record its eval transform") == 1
    images = loader_images(digits_records, "torch", crop_pct=1.0, interpolation="bicubic")
    assert torch.equal(file_images(path, val_images, eval_transform(IMG_SIZE, 1.0, "bicubic")), images)
    for position, probabilities in enumerate(probabilities_of(model, images)):
        top5 = predictions[str(val_images / f"{position}.jpg")].top5
        values = [p for _, p in top5]
        assert len(top5) == 3 and sum(values) == pytest.approx(1.0, abs=1e-5)
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(probabilities.sort(descending=True).values.tolist(), rel=1e-4)


@pytest.mark.slow
def test_command_line_json_and_text(model_file, val_images, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    command = [sys.executable, "-m", "coarse2fine.predict", str(model_file), str(val_images), str(notes), "--json"]
    result = subprocess.run([*command, "--batch-size", "5"], capture_output=True, text=True, timeout=300)

    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)  # stdout holds the document and nothing else
    expected, _ = predicted(model_file, val_images)
    assert [entry["image"] for entry in document["predictions"]] == sorted(expected)
    for entry in document["predictions"]:
        assert entry["top5"] == [
            {"class": name, "probability": pytest.approx(p, abs=1e-6)} for name, p in expected[entry["image"]].top5
        ]
    assert document["unreadable"] == [{"image": str(notes), "reason": "not an image PIL can read"}]
    assert result.stderr.splitlines() == [f"unreadable: {notes}: not an image PIL can read"]

    predict.main([str(model_file), str(val_images / "0.jpg"), "--device", "cpu"])
    path_line, *class_lines = capsys.readouterr().out.splitlines()
    assert path_line == str(val_images / "0.jpg")
    name, probability = expected[path_line].top5[0]
    assert class_lines[0] == f"  {name}  {100 * probability:6.2f} %" and len(class_lines) == 5


@pytest.mark.parametrize(
    "model, images, message",
    [
        ("models/nope/model.pt", ["{images}"], "error: models/nope/model.pt: model file not found"),
        ("{notes}", ["{images}"], "error: {notes}: not a readable model file (UnpicklingError: "),
        ("{model}", ["{notes}", "{empty}"], "error: {notes} {empty}: no readable image (1 unreadable, listed above)"),
        ("{model}", ["{empty}"], "error: {empty}: no files"),
    ],
    ids=["missing model", "not a model file", "no readable image", "empty directory"],
)
def test_user_mistakes_are_one_error_line_and_exit_2(model_file, val_images, tmp_path, capsys, model, images, message):
    notes, empty = tmp_path / "notes.txt", tmp_path / "empty"
    notes.write_text("not a model, not an image")
    empty.mkdir()
    fill = {"model": model_file, "images": val_images, "notes": notes, "empty": empty}

    with pytest.raises(SystemExit) as exit_info:
        predict.main([model.format(**fill), *(image.format(**fill) for image in images)])

    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(message.format(**fill))


@pytest.mark.slow
def test_a_registered_mlflow_model_predicts_as_its_model_file(model_file, val_images, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    model, card = checkpoints.load_model_file(model_file)
    params = make_params(tracking={"experiment": "predict", "log_models": True})
    tracker = Tracker("finetune", params, cpu_runtime(), metrics_dir=tmp_path / "metrics", param_sections=("model",))
    with tracker:
        tracker.log_model(model, card)
    client = MlflowClient()
    model_id = client.get_run(tracker.run_id).data.tags[MODEL_ID_TAG]
    client.create_registered_model("digits")
    version = client.create_model_version(
        "digits", source=f"models:/{model_id}", run_id=tracker.run_id, model_id=model_id
    )
    client.set_registered_model_alias("digits", "candidate", version.version)
    uri = "models:/digits@candidate"

    from_file, _ = predicted(model_file, val_images)
    from_mlflow, _ = predicted(uri, val_images)

    assert top1_by_position(from_mlflow) == top1_by_position(from_file)
    for image, prediction in from_file.items():
        assert [p for _, p in from_mlflow[image].top5] == pytest.approx([p for _, p in prediction.top5], abs=1e-5)
    images = file_images(uri, val_images, card["eval_transform"])
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with torch.inference_mode():
        mlflow_top1 = mlflow.pytorch.load_model(uri)(images).argmax(dim=1)
    assert top1_by_position(from_file) == [card["classes"][label] for label in mlflow_top1.tolist()]

    with pytest.raises(SystemExit) as exit_info:
        predict.main(["models:/digits@nope", str(val_images)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: models:/digits@nope: cannot load it from {os.environ['MLFLOW_TRACKING_URI']}: "
        f"Registered model alias nope not found."
    ]
