"""Token-label generation: the teacher's dense head, the whole-image view aligned with the loaders' crop windows
(through both real loaders), resuming after a crash, and 2 ranks writing the same bytes as 1."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import mlflow
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import DIGITS_PIPELINE, LOADER_GRAPHS, cpu_runtime, launch_command, make_params, merge
from PIL import Image

from coarse2fine import checkpoints, forward, models
from coarse2fine.config import CustomVolo, TimmModel
from coarse2fine.data import records
from coarse2fine.data.convert import convert
from coarse2fine.data.loaders import build_loader
from coarse2fine.data.transforms import IDENTITY_AFFINE, IMAGE_MEAN, IMAGE_STD, RAND_AUGMENT_GEOMETRIC_OPS
from coarse2fine.distributed import Runtime
from coarse2fine.labels import store, targets
from coarse2fine.labels.generate import (
    DONE_DIR, IMAGENET_TRAIN_IMAGES, RELIABLE_DENSE_TOP1, TrainRecords, View, WARNING_WIDTH, dense_head, generate,
    unreliable_teacher_warning,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ dense head


@pytest.mark.parametrize("name", ["resnet10t", "efficientnet_b0", "regnetx_002", "rexnet_100", "dm_nfnet_f0"])
def test_a_cnn_dense_map_averages_to_the_models_own_logits(name):
    """Global average pooling + a linear classifier: the classifier at every position, averaged, is the model."""
    torch.manual_seed(0)
    model = models.build_model(TimmModel(name=name), num_classes=7, img_size=64).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        dense, logits = dense_head(model)(images), model(images)
    assert dense.shape[:2] == (2, 7) and dense.shape[2] == dense.shape[3] == 2  # stride 32
    torch.testing.assert_close(dense.mean(dim=(2, 3)), logits, atol=1e-5, rtol=1e-4)


def test_token_models_lay_their_patch_tokens_back_on_the_grid():
    torch.manual_seed(0)
    volo = models.build_model(CustomVolo(patch_size=4), num_classes=5, img_size=32)
    train_forward = forward.TrainForward(volo).train()
    volo.patch_embed.eval()  # the training forward only runs in train mode: freeze BatchNorm to compare
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        aux_logits = train_forward(images).aux_logits  # [B, 16, C], row-major: VOLO's own per-token predictions
        dense = dense_head(volo.eval())(images)
    torch.testing.assert_close(dense, aux_logits.transpose(1, 2).reshape(2, 5, 4, 4))

    vit = models.build_model(TimmModel(name="vit_tiny_patch16_224"), num_classes=5, img_size=64).eval()
    with torch.no_grad():
        tokens = vit.forward_features(images.repeat(1, 1, 2, 2))[:, vit.num_prefix_tokens :]  # class token dropped
        dense = dense_head(vit)(images.repeat(1, 1, 2, 2))
    torch.testing.assert_close(dense[:, :, 1, 2], vit.head(vit.fc_norm(tokens))[:, 1 * 4 + 2])


# ------------------------------------------------------------------------- alignment through the real loaders

RED, BLUE = (255, 0, 0), (0, 0, 255)
TEACHER_GRID = 8


def red_left_quarter(image: Image.Image) -> None:
    """Off-centre, so that a centre crop of a wide image loses the red part."""
    width, height = image.size
    image.paste(BLUE, (width // 4, 0, width, height))


def red_and_blue_quadrants(image: Image.Image) -> None:
    """Red top-left and bottom-right, blue elsewhere: a rotation or a shift moves colour into many tokens."""
    width, height = image.size
    image.paste(BLUE, (width // 2, 0, width, height // 2))
    image.paste(BLUE, (0, height // 2, width // 2, height))


def two_colour_folder(root: Path, paint=red_left_quarter) -> Path:
    """Non-square red images with blue painted on by `paint`, in two classes (labels do not matter)."""
    sizes = [(64, 32), (40, 96), (96, 48), (48, 80), (72, 24), (32, 64)]  # (width, height), widths divisible by 4
    for split, count in (("train", 12), ("val", 1)):
        for name in ("red", "blue"):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                width, height = sizes[i % len(sizes)]
                image = Image.new("RGB", (width, height), RED)
                paint(image)
                image.save(root / split / name / f"{i}.png")
    return root


def colour_teacher(images: torch.Tensor) -> torch.Tensor:
    """A fixed 1 x 1 conv on an 8 x 8 pooling: class 0 ("blue", sorted first) scores blue - red, class 1 red - blue."""
    pooled = F.adaptive_avg_pool2d(images, TEACHER_GRID)
    blue_minus_red = pooled[:, 2] - pooled[:, 0]
    return torch.stack([blue_minus_red, -blue_minus_red], dim=1) * 5


def converted(root: Path) -> Path:
    records_dir = root / "records"
    convert(make_params(data={"source": "imagefolder", "root": str(root), "convert_workers": 1}), cpu_runtime(), records_dir)
    assert records.read_classes(records_dir) == ["blue", "red"]
    return records_dir


@pytest.fixture(scope="module")
def two_colour_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted(two_colour_folder(tmp_path_factory.mktemp("two_colour")))


@pytest.fixture(scope="module")
def quadrant_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted(two_colour_folder(tmp_path_factory.mktemp("quadrants"), red_and_blue_quadrants))


def generate_store(
    records_dir: Path, out: Path, *, view: str = "whole", head=colour_teacher, batch_size: int = 8, workers: int = 0,
    runtime: Runtime | None = None, **options,
):
    return generate(
        head, records_dir, out_dir=out, work_dir=out.with_name(out.name + "_partial"),
        view=View(view, 32, "bicubic"), top_k=2, batch_size=batch_size, workers=workers,
        runtime=runtime or cpu_runtime(), autocast_dtype=None, inputs={"batch_size": batch_size}, header={}, **options,
    )


CROP_AND_FLIP = {"scale": [0.08, 1.0], "ratio": [0.5, 2.0], "hflip": 0.5}
# Large crops, which keep both colours, and RandAugment at a high magnitude, geometric ops only (see below).
GEOMETRIC_RAND_AUGMENT = {**CROP_AND_FLIP, "scale": [0.5, 1.0], "rand_augment": "rand-m9-n2"}


def token_colour_agreement(
    records_dir: Path, store_dir: Path, backend: str, augment: dict = CROP_AND_FLIP, *, follow_geometry: bool = True
) -> tuple[int, int, int]:
    """(tokens whose target is the colour of their pixels, tokens checked, tokens checked in moved images):
    random crops and flips (and whatever else `augment` asks for) through the real loader, targets from the store
    for each crop window; only tokens over pixels of a single colour are checked (not the grey RandAugment fills
    in with). `follow_geometry=False` gives the targets the identity in place of the batch's affine."""
    params = make_params(loader={**LOADER_GRAPHS[backend], "workers": 1}, augment=augment)
    loader = build_loader(
        "train", records_dir, img_size=32, batch_size=8, runtime=cpu_runtime(), loader_cfg=params.loader,
        augment_cfg=params.augment, crop_pct=1.0, seed=0,
    )
    labels = store.TokenLabelStore(store_dir, records=24, num_classes=2)
    agree = checked = moved_checked = 0
    for epoch in range(4):
        loader.set_epoch(epoch)
        for batch in loader:
            logits, classes = labels.lookup(batch["index"])
            affine = batch["affine"] if follow_geometry else IDENTITY_AFFINE.expand(len(logits), 2, 3)
            target = targets.token_targets(
                logits, classes, batch["window"], batch["flip"], affine, num_classes=2, token_grid=4, smoothing=0.0
            ).tokens.argmax(-1)  # [B, 16]: 0 blue, 1 red
            # Each token covers an 8 x 8 patch: red or blue where that channel beats the other by far (normalised
            # units; grey and the blends at the edges of a warp are neither).
            image = batch["image"]
            red, blue = ((image[:, 0] - image[:, 2]) > 1).float(), ((image[:, 2] - image[:, 0]) > 1).float()
            red_share, blue_share = (F.avg_pool2d(colour[:, None], 8).flatten(1) for colour in (red, blue))
            single = (red_share == 1) | (blue_share == 1)  # [B, 16]
            agree += int(((target == red_share.long()) & single).sum())
            checked += int(single.sum())
            moved = (batch["affine"] != IDENTITY_AFFINE).flatten(1).any(dim=1)
            moved_checked += int(single[moved].sum())
    return agree, checked, moved_checked


@pytest.mark.parametrize("backend", ["dali", "torch"])
def test_token_targets_follow_the_colours_through_both_loaders(two_colour_records, tmp_path, backend):
    generate_store(two_colour_records, tmp_path / "labels")
    agree, checked, _ = token_colour_agreement(two_colour_records, tmp_path / "labels", backend)
    assert checked >= 300  # measured: about 600 of 768 tokens lie over one colour
    assert agree == checked


@pytest.fixture
def geometric_ops_only(monkeypatch):
    """RandAugment without its colour ops, which would recolour red and blue (invert swaps them)."""
    from coarse2fine.data import dali_backend, torch_backend

    for module in (dali_backend, torch_backend):
        monkeypatch.setattr(module, "RAND_AUGMENT_OPS", RAND_AUGMENT_GEOMETRIC_OPS)


@pytest.mark.parametrize("backend", LOADER_GRAPHS)
def test_token_targets_follow_rotations_shears_and_translations(quadrant_records, tmp_path, backend, geometric_ops_only):
    """RandAugment's geometric ops move the pixels after the crop; the targets follow them through the affine each
    sample carries. Control: the same images with the affine ignored (targets of the unmoved crop). Measured:
    every checked token agrees on both backends (about 500, 230-260 of them in moved images); ignored, 77-80 %."""
    generate_store(quadrant_records, tmp_path / "labels")
    agree, checked, moved = token_colour_agreement(quadrant_records, tmp_path / "labels", backend, GEOMETRIC_RAND_AUGMENT)
    assert moved >= 150 and checked >= 300, (moved, checked)
    assert agree >= 0.99 * checked, (agree, checked)
    ignored, _, _ = token_colour_agreement(
        quadrant_records, tmp_path / "labels", backend, GEOMETRIC_RAND_AUGMENT, follow_geometry=False
    )
    assert ignored < 0.9 * checked, (ignored, checked)


def test_the_references_swapped_box_order_misplaces_the_targets(two_colour_records, tmp_path, monkeypatch):
    """Control: (top, left, bottom, right) given to roi_align as (x1, y1, x2, y2), as the reference did."""
    generate_store(two_colour_records, tmp_path / "labels")
    proper_boxes = targets.window_boxes

    def swapped_boxes(window: torch.Tensor, grid: int) -> torch.Tensor:
        boxes = proper_boxes(window, grid)
        return boxes[:, [0, 2, 1, 4, 3]]

    monkeypatch.setattr(targets, "window_boxes", swapped_boxes)
    agree, checked, _ = token_colour_agreement(two_colour_records, tmp_path / "labels", "torch")
    assert agree < 0.9 * checked


def test_the_references_centre_view_misplaces_the_targets_of_non_square_images(two_colour_records, tmp_path):
    generate_store(two_colour_records, tmp_path / "labels", view="center")
    agree, checked, _ = token_colour_agreement(two_colour_records, tmp_path / "labels", "torch")
    assert agree < 0.95 * checked


# ------------------------------------------------------------------------------------- resume, ranks, metrics


class Crash(Exception):
    pass


def crashing_after(calls: int, head):
    counter = itertools.count()

    def run(images: torch.Tensor) -> torch.Tensor:
        if next(counter) == calls:
            raise Crash
        return head(images)

    return run


def store_bytes(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in (store.LOG_PROBS_FILE, store.CLASSES_FILE, store.HEADER_FILE)}


def random_teacher(num_classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model(TimmModel(name="resnet10t", output_stride=8), num_classes=num_classes, img_size=32).eval()


@pytest.mark.slow
def test_a_crashed_generation_resumes_to_the_same_bytes(digits_records, tmp_path, capsys):
    head = dense_head(random_teacher(10))
    whole = generate_store(digits_records, tmp_path / "whole" / "labels", head=head)
    assert whole.generated == whole.metrics()["images"] == 434
    # 434 records in chunks of 16 batches x 8 = 128: 4 chunks. Crash in the middle of the second one
    # (call 0 measures the grid).
    with pytest.raises(Crash):
        generate_store(digits_records, tmp_path / "crashed" / "labels", head=crashing_after(1 + 20, head))
    assert not (tmp_path / "crashed" / "labels").exists()
    resumed = generate_store(digits_records, tmp_path / "crashed" / "labels", head=head)
    assert "resuming, 1 of 4 chunks done" in capsys.readouterr().out
    assert resumed.generated == 434 - 128 and resumed.metrics()["images"] == 434
    assert resumed.sums == pytest.approx(whole.sums)  # every statistic, the killed run's chunks included
    assert store_bytes(tmp_path / "crashed" / "labels") == store_bytes(tmp_path / "whole" / "labels")
    # The finished store is DVC's to keep: the work dir is gone, the store's arrays are whole without it.
    assert not (tmp_path / "crashed" / "labels_partial").exists()
    assert (tmp_path / "crashed" / "labels" / store.LOG_PROBS_FILE).stat().st_nlink == 1

    # Other inputs (here: another batch size, which regroups the batches) never resume a partial run.
    with pytest.raises(Crash):
        generate_store(digits_records, tmp_path / "other" / "labels", head=crashing_after(1 + 20, head))
    generate_store(digits_records, tmp_path / "other" / "labels", head=head, batch_size=4)
    assert "resuming" not in capsys.readouterr().out


def test_the_store_is_the_same_whatever_the_worker_count(digits_records, tmp_path):
    """loader.workers only spreads the decoding over processes (the batches are fixed lists of records, in
    order): the token_labels stage leaves it out of what it depends on, so a changed count keeps the chunks."""
    head = dense_head(random_teacher(10))
    for workers in (0, 2):
        generate_store(digits_records, tmp_path / f"workers{workers}" / "labels", head=head, workers=workers)
    assert store_bytes(tmp_path / "workers0" / "labels") == store_bytes(tmp_path / "workers2" / "labels")


def whole_train_split(records_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The train images as generate_store's teacher sees them (whole, 32 px, normalised) and their labels."""
    images, labels, _ = zip(*TrainRecords(records_dir, View("whole", 32, "bicubic")))
    mean, std = (torch.tensor(value).view(1, 3, 1, 1) * 255 for value in (IMAGE_MEAN, IMAGE_STD))
    return (torch.stack(images).float() - mean) / std, torch.tensor(labels)


PATCH_WEIGHTS = torch.randn(10, 3 * 8 * 8, generator=torch.Generator().manual_seed(0))


def patch_teacher(images: torch.Tensor) -> torch.Tensor:
    """A fixed random linear classifier of each 8 x 8 patch (a 4 x 4 map at 32 px): unlike an untrained CNN, which
    gives every digit the same class, its predictions differ between images and between cells."""
    patches = F.unfold(images, kernel_size=8, stride=8)  # [B, 3 x 8 x 8, 16]
    return (PATCH_WEIGHTS @ patches).unflatten(-1, (4, 4))


def test_ranks_never_write_a_shared_file_while_making_their_chunks(digits_records, tmp_path):
    """Two nodes writing neighbouring rows of one file through NFS each write back whole pages (of a mapping: 4 KiB
    to a 2 MiB folio) and lose the other's rows where a page holds both: each chunk's rows go to a file of its own,
    and rank 0 alone copies them into the store's arrays once every chunk is done. The ranks of a 2-rank run take
    turns in one process here, each stopping where it would wait for the other: the arrays are still as allocated
    after each; the store finished by a world of one has the bytes of an uninterrupted one-rank run."""
    one_rank = generate_store(digits_records, tmp_path / "one" / "labels", head=patch_teacher)
    out = tmp_path / "ranks" / "labels"
    work_dir = out.with_name("labels_partial")
    for rank in (0, 1):
        with pytest.raises(RuntimeError, match="chunks without a marker"):
            generate_store(
                digits_records, out, head=patch_teacher,
                runtime=Runtime(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu")),
            )
        arrays = store.open_arrays(work_dir, mode="r")
        assert not arrays.log_probs.any() and not arrays.classes.any(), f"rank {rank} wrote into the shared arrays"
    # 434 records, 4 chunks of 128: rank 0 of 2 made chunks 0 and 2, then rank 1 of 2 every other one left (3).
    assert sorted(path.name for path in (work_dir / DONE_DIR).glob("chunk-*.npz")) == [
        "chunk-000000.npz", "chunk-000002.npz", "chunk-000003.npz"
    ]
    resumed = generate_store(digits_records, out, head=patch_teacher)
    assert resumed.generated == 128 and resumed.sums == pytest.approx(one_rank.sums)
    assert store_bytes(out) == store_bytes(tmp_path / "one" / "labels")


def test_a_run_killed_while_publishing_resumes_from_the_chunk_files(digits_records, tmp_path, monkeypatch):
    """Every chunk done, the arrays assembled (or half): the rerun makes no label and assembles them again."""
    whole = generate_store(digits_records, tmp_path / "whole" / "labels", head=patch_teacher)

    def killed(*args) -> None:
        raise Crash

    monkeypatch.setattr("coarse2fine.labels.generate._publish", killed)
    with pytest.raises(Crash):
        generate_store(digits_records, tmp_path / "killed" / "labels", head=patch_teacher)
    monkeypatch.undo()
    resumed = generate_store(digits_records, tmp_path / "killed" / "labels", head=patch_teacher)
    assert resumed.generated == 0 and resumed.sums == pytest.approx(whole.sums)
    assert store_bytes(tmp_path / "killed" / "labels") == store_bytes(tmp_path / "whole" / "labels")


def test_the_store_is_the_same_whatever_the_chunk_size(digits_records, tmp_path, monkeypatch):
    """Rows are rows: chunks of 3 batches (the last one short) assemble into the bytes chunks of 16 do."""
    generate_store(digits_records, tmp_path / "chunks16" / "labels", head=patch_teacher)
    monkeypatch.setattr("coarse2fine.labels.generate.CHUNK_BATCHES", 3)
    generate_store(digits_records, tmp_path / "chunks3" / "labels", head=patch_teacher)
    assert store_bytes(tmp_path / "chunks3" / "labels") == store_bytes(tmp_path / "chunks16" / "labels")


def test_store_metrics_and_header(digits_records, tmp_path):
    metrics = generate_store(digits_records, tmp_path / "labels", head=patch_teacher).metrics()
    assert metrics["bytes_per_image"] == 2 * 4 * 4 * (2 + 2)  # top-2 x 4 x 4 cells x (fp16 log-probability + int16 class)
    assert metrics["imagenet_gb"] == pytest.approx(metrics["bytes_per_image"] * IMAGENET_TRAIN_IMAGES / 1e9)
    # The teacher's prediction for the whole image: the argmax of its mean logits, against the label.
    images, labels = whole_train_split(digits_records)
    with torch.inference_mode():
        predicted = patch_teacher(images).mean(dim=(2, 3)).argmax(dim=1)
    assert metrics["dense_top1"] == pytest.approx(100 * (predicted == labels).double().mean().item())
    assert metrics["img_per_s"] > 0
    header = json.loads((tmp_path / "labels" / store.HEADER_FILE).read_text())
    assert header == {"records": 434, "top_k": 2, "grid": 4, "num_classes": 10}


def test_store_metrics_say_what_the_student_is_taught_against_what_the_teacher_said(digits_records, tmp_path):
    """One fixed score map for every image: the teacher's prediction, its entropy and what the top 2 leave are
    known; the class target built from the store keeps the teacher's top-1 and (nearly) its entropy."""
    scores = torch.randn(1, 10, 4, 4, generator=torch.Generator().manual_seed(0)) * 2
    metrics = generate_store(
        digits_records, tmp_path / "labels", head=lambda images: scores.expand(len(images), -1, -1, -1)
    ).metrics()
    teacher = scores.mean(dim=(2, 3)).softmax(-1)[0]
    assert metrics["teacher_entropy"] == pytest.approx(float(targets.entropy(teacher)), rel=1e-4)
    left = 1 - scores.softmax(1).topk(2, dim=1).values.sum(1)
    assert metrics["outside_top_k"] == pytest.approx(float(left.mean()), rel=1e-4)
    assert abs(metrics["target_entropy"] - metrics["teacher_entropy"]) < 0.1
    assert metrics["target_top1"] == metrics["dense_top1"]  # one prediction, so each is 0 or 100 per class share
    _, labels = whole_train_split(digits_records)
    assert metrics["dense_top1"] == pytest.approx(100 * (labels == teacher.argmax()).double().mean().item())
    # Each cell predicts its own argmax: an image scores the share of the 16 cells that name its label.
    cells_right = (scores.argmax(dim=1) == labels.view(-1, 1, 1)).double().mean(dim=(1, 2))
    assert metrics["cell_top1"] == pytest.approx(100 * cells_right.mean().item())


def run_token_labels_stage(tmp_path: Path, records_dir: Path, teacher_file: Path, nproc: int) -> tuple[Path, str]:
    """The real stage under the launcher: its output directory and what it printed."""
    out = tmp_path / f"ranks{nproc}"
    out.mkdir()
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), DIGITS_PIPELINE)
    params["token_labels"]["batch_size"] = 16
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    command = launch_command(
        ROOT / "stages/token_labels.py", "--params", out / "params.yaml", "--records", records_dir,
        "--teacher", teacher_file, "--out", out / "labels", "--work-dir", out / "partial", "--metrics", out / "metrics",
        nproc=nproc,
    )
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "MLFLOW_DISABLE_TELEMETRY": "true"}
    run = subprocess.run(command, cwd=out, env=env, check=True, capture_output=True, text=True, timeout=300)
    return out, run.stdout + run.stderr


@pytest.mark.slow
def test_two_ranks_write_the_same_bytes_as_one(digits_records, tmp_path):
    model_cfg = TimmModel(name="resnet10t", output_stride=8)
    teacher_file = tmp_path / "teacher.pt"
    checkpoints.save_model_file(
        teacher_file, random_teacher(10), model_cfg=model_cfg, img_size=32,
        classes=records.read_classes(digits_records), stage="teacher",
    )
    (one, printed), (two, _) = (run_token_labels_stage(tmp_path, digits_records, teacher_file, nproc) for nproc in (1, 2))
    assert store_bytes(one / "labels") == store_bytes(two / "labels")
    # What dvc.yaml's students depend on: the store's identity if they learn from it, else nothing.
    deps = one / "labels" / "enabled"
    assert (deps / "true").read_text() == store.header_digest(one / "labels") + "\n"
    assert (deps / "false").read_bytes() == b""
    header = json.loads((one / "labels" / store.HEADER_FILE).read_text())
    assert header["teacher"] == {"name": "resnet10t", "img_size": 32, "view": "whole"}
    assert header["records_digest"] == records.manifest_digest(digits_records)
    metrics = [json.loads((run / "metrics" / "metrics.json").read_text()) for run in (one, two)]
    assert metrics[0]["images"] == metrics[1]["images"] == 434
    assert metrics[0]["dense_top1"] == metrics[1]["dense_top1"]
    # A random teacher is wrong on most of its training images: the stage says so, on its output and its run.
    warning = unreliable_teacher_warning(metrics[0])
    assert warning is not None and f"token_labels: {warning}" in printed.splitlines()
    client = mlflow.MlflowClient(f"sqlite:///{one / 'mlflow.db'}")
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    assert [run.data.tags.get("teacher_warning") for run in runs if run.info.run_name == "token_labels"] == [warning]
    labels = np.load(one / "labels" / store.CLASSES_FILE)
    assert labels.shape == (434, 5, 4, 4) and labels.dtype == np.int16


def test_the_teacher_warning_names_its_share_of_wrong_training_images_below_the_threshold():
    assert RELIABLE_DENSE_TOP1 == 98.0  # bench/teacher_quality.py's sweep (docs/recipe.md, "A teacher that errs")
    assert unreliable_teacher_warning({"dense_top1": 100.0, "cell_top1": 92.99}) is None  # the photos' teacher
    assert unreliable_teacher_warning({"dense_top1": RELIABLE_DENSE_TOP1, "cell_top1": 80.0}) is None
    warning = unreliable_teacher_warning({"dense_top1": 88.89, "cell_top1": 70.98})
    assert "wrong on 11.1% of its train images (cells 29.0%)" in warning
    assert "<student>.token_label.enabled false" in warning and "teacher.epochs" in warning  # what to do
    assert "docs/recipe.md#a-teacher-that-errs" in warning  # and where the why is
    for worst in ({"dense_top1": 0.0, "cell_top1": 0.0}, {"dense_top1": 97.99, "cell_top1": 90.0}):
        printed = f"token_labels: {unreliable_teacher_warning(worst)}"  # as the stage prints it
        assert "\n" not in printed and len(printed) <= WARNING_WIDTH == 200
