"""A stage's model from local weights files: `<stage>.mode: import` (the stage's model is the file, evaluated, not
trained) and `<stage>.init_weights` (training starts from the file), in every format users have, with one-line
errors for the files that cannot be used. Every file is made here from a tiny VOLO; nothing is downloaded."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    ListLoader, Project, cpu_runtime, fit_head_by_least_squares, make_params, ran_stages, train_val_loaders,
)
from safetensors.torch import save_file

from coarse2fine import checkpoints, models
from coarse2fine.config import load_params
from coarse2fine.data.listing import weights_state
from coarse2fine.data.loaders import build_loader
from coarse2fine.errors import UserError
from coarse2fine.evaluate import evaluate
from coarse2fine.training import train, weights

CLASSES = 10  # the digits
FORMATS = ("safetensors", "state_dict", "reference_checkpoint", "timm_ema_checkpoint")


def tiny_volo(num_classes: int = CLASSES, img_size: int = 32, seed: int = 0, **model_cfg) -> torch.nn.Module:
    """The student of params.yaml (volo_custom with patch 4: 4 x 4 tokens at 32 px), randomly initialised from
    `seed`."""
    torch.manual_seed(seed)
    return models.build_model(make_params(model={"patch_size": 4, **model_cfg}).model, num_classes, img_size)


def save_weights(model: torch.nn.Module, path: Path, layout: str) -> Path:
    """`model`'s weights as users have them: safetensors; a plain torch state dict; sail-sg/volo's training
    checkpoint (.pth.tar: timm 0.4's CheckpointSaver under DDP, "module." prefixes, the run's argparse args and
    optimizer state beside the weights); timm's train.py checkpoint with EMA weights (`model`'s) beside the raw
    ones (zeros), which only `weights_ema` loads."""
    state = model.state_dict()
    if layout == "safetensors":
        save_file(state, str(path))
    elif layout == "state_dict":
        torch.save(state, path)
    elif layout == "reference_checkpoint":
        optimizer = torch.optim.AdamW(model.parameters())
        torch.save({
            "epoch": 309, "arch": "volo_d1", "state_dict": {f"module.{key}": value for key, value in state.items()},
            "optimizer": optimizer.state_dict(), "version": 2, "args": argparse.Namespace(model="volo_d1", lr=1.6e-3),
            "metric": 84.2,
        }, path)
    else:
        raw = {key: torch.zeros_like(value) for key, value in state.items()}  # the raw weights, not the ones wanted
        torch.save({"epoch": 3, "state_dict": raw, "state_dict_ema": state}, path)
    return path


def file_name(layout: str) -> str:
    return {"safetensors": "w.safetensors", "reference_checkpoint": "d1_224.pth.tar"}.get(layout, "w.pth")


@pytest.mark.parametrize("layout", FORMATS)
def test_every_format_loads_exactly_the_saved_weights(tmp_path, layout):
    source = tiny_volo(seed=1)
    path = save_weights(source, tmp_path / file_name(layout), layout)
    target = tiny_volo(seed=2)
    report = checkpoints.load_weights(target, path, "pretrain.weights", use_ema=layout == "timm_ema_checkpoint")
    assert report.loaded == len(source.state_dict()) and not report.resampled and not report.reset
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key


@pytest.mark.parametrize("stage", ["teacher", "pretrain", "finetune"])
def test_a_checkpoint_with_ema_weights_gives_its_state_dict_unless_weights_ema_asks_for_them(tmp_path, stage):
    """sail-sg/volo's --finetune loads "state_dict" unless --model-ema (and validate.py unless --use-ema): so do
    init_weights and an imported stage's weights, and <stage>.weights_ema takes "state_dict_ema"."""
    path = save_weights(tiny_volo(seed=1), tmp_path / "w.pth", "timm_ema_checkpoint")
    checkpoint = torch.load(path, weights_only=True)
    for ema in (False, True):
        cfg = getattr(make_params(**{stage: {"init_weights": str(path), "weights_ema": ema}}), stage)
        model = tiny_volo(seed=2)
        weights.start_from_weights(stage, cfg, model)
        wanted = checkpoint["state_dict_ema" if ema else "state_dict"]
        assert all(torch.equal(model.state_dict()[key], value) for key, value in wanted.items()), (stage, ema)


# ------------------------------------------------------------------------------------------------ init_weights


def first_step_loss(model: torch.nn.Module, batch: dict, tmp_path: Path) -> float:
    """The loss of the first training step of the pretrain stage's Trainer (ground-truth objective) on `batch`."""
    params = make_params(pretrain={"img_size": 32, "token_label": {"enabled": False}})
    trainer = train.Trainer(
        stage="pretrain", params=params, cfg=params.pretrain, model=model, classes=[str(c) for c in range(CLASSES)],
        train_loader=ListLoader([batch]), val_loader=ListLoader([batch]), runtime=cpu_runtime(),
        param_sections=("model", "pretrain"), provenance={}, paths=train.StagePaths.under(tmp_path),
    )
    return float(trainer.backward({key: value.clone() for key, value in batch.items()}, micro_steps=1, sync=True))


def test_init_weights_start_training_from_the_file(tmp_path):
    original = tiny_volo(seed=1)
    path = save_weights(original, tmp_path / "w.safetensors", "safetensors")
    cfg = make_params(pretrain={"init_weights": str(path)}).pretrain
    started = tiny_volo(seed=2)
    notes = weights.start_from_weights("pretrain", cfg, started)
    assert notes == [f"pretrain.init_weights: loaded {len(original.state_dict())} tensors from {path}"]

    generator = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(8, 3, 32, 32, generator=generator), "label": torch.arange(8) % CLASSES}
    losses = [first_step_loss(model, batch, tmp_path / name) for name, model in
              (("original", original), ("started", started), ("random", tiny_volo(seed=2)))]
    assert losses[1] == losses[0] and losses[2] != losses[0], losses


def test_init_weights_of_another_class_count_get_a_new_head(tmp_path):
    source = tiny_volo(num_classes=1000, seed=1)
    path = save_weights(source, tmp_path / "imagenet.pth", "state_dict")
    model = tiny_volo(seed=2)
    fresh_head = model.head.weight.clone()
    notes = weights.start_from_weights("teacher", make_params(teacher={"init_weights": str(path)}).teacher, model)
    assert notes[-1] == (
        "teacher.init_weights: not loaded (another class count; freshly initialised): aux_head.weight, "
        "aux_head.bias, head.weight, head.bias"
    )
    assert torch.equal(model.head.weight, fresh_head) and model.head.out_features == CLASSES
    body = [key for key in source.state_dict() if not key.startswith(("head.", "aux_head."))]
    assert all(torch.equal(model.state_dict()[key], source.state_dict()[key]) for key in body)


def test_init_weights_of_another_size_resample_the_position_embedding(tmp_path):
    source = tiny_volo(img_size=32, seed=1)  # a 4 x 4 position embedding
    path = save_weights(source, tmp_path / "w.safetensors", "safetensors")
    model = tiny_volo(img_size=48, seed=2)  # 6 x 6
    notes = weights.start_from_weights("finetune", make_params(finetune={"init_weights": str(path)}).finetune, model)
    assert "finetune.init_weights: resampled pos_embed 4x4 -> 6x6" in notes
    assert model.pos_embed.shape == (1, 6, 6, 128)
    assert torch.equal(model.head.weight, source.head.weight)


# ------------------------------------------------------------------------------------------------ bad files


def cut_short(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# What makes each file unusable, given a directory -> (the file, words the one line must hold)
BAD_FILES = {
    "missing": lambda tmp: (tmp / "nowhere.pth.tar", ["nowhere.pth.tar: weights file not found"]),
    "another architecture": lambda tmp: (  # a wider last stage than model.*
        save_weights(tiny_volo(embed_dims=[64, 128, 128, 256], num_heads=[2, 4, 4, 8]), tmp / "wide.pth", "state_dict"),
        [
            "wide.pth does not fit VOLO with 10 classes",
            "shape (file vs model) 40: cls_token (1, 1, 256) vs (1, 1, 128), network.4.0.norm1.weight (256,) vs (128,)",
        ],
    ),
    "truncated torch file": lambda tmp: (
        cut_short(save_weights(tiny_volo(), tmp / "cut.pth.tar", "reference_checkpoint")),
        ["cut.pth.tar: not a readable weights file: a truncated or corrupt torch file"],
    ),
    "truncated safetensors": lambda tmp: (
        cut_short(save_weights(tiny_volo(), tmp / "cut.safetensors", "safetensors")),
        ["cut.safetensors: not a readable weights file: a truncated or corrupt safetensors file"],
    ),
    "unknown format": lambda tmp: (
        written(tmp / "page.pth", "<html>404 Not Found</html>"),  # a download's error page
        ["page.pth: not a readable weights file: unknown format (neither safetensors nor a file torch saved"],
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_a_file_that_cannot_be_used_is_one_line_naming_it(tmp_path, bad):
    path, words = BAD_FILES[bad](tmp_path)
    with pytest.raises(UserError) as error:
        checkpoints.load_weights(tiny_volo(), path, "pretrain.weights")
    message = str(error.value)
    assert message.startswith(f"pretrain.weights: {path}") and "\n" not in message
    assert all(word in message for word in words), message


def test_a_whole_pickled_model_is_refused_by_weights_only_loading(tmp_path):
    torch.save(tiny_volo(), tmp_path / "model.pth")
    with pytest.raises(UserError, match="pickles Python objects besides tensors: save the model's state_dict()"):
        checkpoints.load_weights(tiny_volo(), tmp_path / "model.pth", "pretrain.weights")


def test_the_mode_and_its_file_are_checked_with_the_params():
    with pytest.raises(UserError, match="pretrain.weights: required when mode is 'import'"):
        make_params(pretrain={"mode": "import"})
    with pytest.raises(UserError, match="finetune.init_weights: only with mode 'train'"):
        make_params(finetune={"mode": "import", "weights": "a.pth", "init_weights": "b.pth"})


@pytest.mark.parametrize("bad", ["missing", "another architecture", "unknown format"])
def test_the_stage_says_it_in_one_line_and_exits_2(digits_records, tmp_path, bad):
    """As dvc.yaml runs the pretrain stage (under the launcher): the line and exit code 2, no traceback."""
    path, words = BAD_FILES[bad](tmp_path)
    project = Project(tmp_path / "project")
    (project.path / "data").mkdir()
    (project.path / "data/records").symlink_to(digits_records)
    project.edit_params({"pretrain": {"mode": "import", "weights": str(path), "token_label": {"enabled": False}}})
    result = subprocess.run(
        project.stage_command("pretrain"), shell=True, cwd=project.path, env=project.env, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: pretrain.weights: {path}") and "Traceback" not in result.stderr, lines
    assert all(word in lines[-1] for word in words), lines[-1]


# ------------------------------------------------------------------------------------------------ under DVC


def test_the_source_listing_follows_each_stages_weights_file(tmp_path):
    path = save_weights(tiny_volo(), tmp_path / "w.safetensors", "safetensors")
    imported = make_params(pretrain={"mode": "import", "weights": str(path)})
    before = weights_state("pretrain", imported.pretrain)
    assert before["mode"] == "import" and before["path"] == str(path)
    assert weights_state("pretrain", imported.pretrain) == before
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # copied anew: new times, same bytes
    assert weights_state("pretrain", imported.pretrain) == before
    save_weights(tiny_volo(seed=5), path, "state_dict")  # replaced by another file under the same name
    assert weights_state("pretrain", imported.pretrain) != before
    started = make_params(finetune={"init_weights": str(path)}).finetune
    assert weights_state("finetune", started)["init_weights"]["path"] == str(path)
    assert weights_state("finetune", make_params().finetune) == {"mode": "train"}
    with pytest.raises(UserError, match=r"^teacher.init_weights: .*nowhere.pt: weights file not found$"):
        weights_state("teacher", make_params(teacher={"init_weights": str(tmp_path / "nowhere.pt")}).teacher)


# One epoch per trained stage on a tenth of the digits, the students on the ground truth (token_labels then writes
# an empty store without the teacher's forward); the import at the size of the file, fine-tuning at 40 px.
CHEAP = {
    "data": {"subset": 0.1},
    "teacher": {"epochs": 1, "batch_size": 32},
    "pretrain": {"img_size": 32, "epochs": 1, "batch_size": 32, "token_label": {"enabled": False}},
    "finetune": {"img_size": 40, "epochs": 1, "batch_size": 32, "token_label": {"enabled": False}},
    "evaluate": {"pretrain": {"extra_sizes": []}, "finetune": {"extra_sizes": []}},
    "tracking": {"log_models": False},
}
ALWAYS = {"source", "lineage"}  # run at every `dvc repro`
AFTER_PRETRAIN = {"pretrain", "evaluate@pretrain", "finetune", "evaluate@finetune", "compare"}


def classifier(digits_records: Path, seed: int) -> torch.nn.Module:
    """A tiny VOLO at 32 px that classifies digits well above chance: a random body, its head fit by least squares."""
    model = tiny_volo(seed=seed)
    train_loader, _ = train_val_loaders(digits_records, make_params(loader={"backend": "torch"}), cpu_runtime(), 64)
    fit_head_by_least_squares(model.eval(), [batch for _, batch in zip(range(4), train_loader)])
    return model


def top1_of(model: torch.nn.Module, project: Project) -> float:
    """`model`'s val top-1 on the project's records, loaded as evaluate@pretrain loads them."""
    params = load_params(project.path / "params.yaml")
    loader = build_loader(
        "val", project.path / "data/records", img_size=params.pretrain.img_size, batch_size=params.evaluate.batch_size,
        runtime=cpu_runtime(), loader_cfg=params.loader, augment_cfg=params.augment,
        crop_pct=params.evaluate.pretrain.crop_pct, seed=params.seed,
    )
    return evaluate(model.eval(), loader, cpu_runtime(), CLASSES).top1


@pytest.mark.slow
def test_pretrain_imports_its_model_under_dvc(digits_records, tmp_path):
    """pretrain.mode import through real DVC: the model file is the reference checkpoint's weights with the card a
    trained one gets, evaluate@pretrain measures exactly them, finetune starts from it; new bytes in the file rerun
    pretrain and what follows, nothing changed reruns nothing, and mode train trains again."""
    original = classifier(digits_records, seed=1)
    path = save_weights(original, tmp_path / "d1_224.pth.tar", "reference_checkpoint")
    project = Project(tmp_path / "project")
    project.edit_params(CHEAP | {"pretrain": {**CHEAP["pretrain"], "mode": "import", "weights": str(path)}})
    project.commit("import the pre-trained student")

    result = project.run("dvc", "repro")
    assert ran_stages(result.stdout) == {"source", "convert", "teacher", "token_labels", *AFTER_PRETRAIN, "lineage"}
    assert f"pretrain: imported {path}: val top-1" in result.stdout
    assert "finetune: loaded" in result.stdout and "finetune: resampled pos_embed 4x4 -> 5x5" in result.stdout
    payload = torch.load(project.path / "models/pretrain/model.pt", weights_only=True)
    assert all(torch.equal(payload["model"][key], value) for key, value in original.state_dict().items())
    assert (payload["stage"], payload["img_size"], payload["classes"]) == ("pretrain", 32, [str(c) for c in range(10)])
    assert payload["model_cfg"]["name"] == "volo_custom" and payload["eval_transform"]["img_size"] == 32
    expected = top1_of(original, project)
    assert project.metrics("evaluate/pretrain")["top1"] == expected == project.metrics("pretrain")["val_top1"]
    assert expected > 50.0  # chance is 10 %: the weights, not a fresh init, are what was measured

    assert project.repro() == ALWAYS
    save_weights(classifier(digits_records, seed=2), path, "reference_checkpoint")  # the same file, new bytes
    assert project.repro() == ALWAYS | AFTER_PRETRAIN

    project.edit_params({"pretrain": {"mode": "train"}})
    result = project.run("dvc", "repro")
    assert ran_stages(result.stdout) == ALWAYS | AFTER_PRETRAIN and "epoch 1/1: train loss" in result.stdout
    assert "train_loss" in project.metrics("pretrain")
