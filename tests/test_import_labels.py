"""token_labels.mode: import: the reference's per-image label files (TokenLabeling's generate_label.py layout,
[2, k, s, s] float16: top-k logits, then their class indices as floats) read into the label store."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import DIGITS_PIPELINE, cpu_runtime, launch_command, make_params, merge
from torchvision.ops import roi_align

from coarse2fine.config import ParamsError
from coarse2fine.data import records
from coarse2fine.data.listing import token_labels_state
from coarse2fine.errors import UserError
from coarse2fine.labels import store, targets
from coarse2fine.labels.imported import import_labels, label_file

ROOT = Path(__file__).resolve().parents[1]
CLASSES, TOP_K, GRID = 10, 5, 4  # digits_records: 434 train records of 10 classes


def train_records(records_dir: Path) -> list[dict]:
    """Every train record, in index order (shards hold consecutive indices)."""
    shards = records.shard_files(records_dir, "train")
    return [record for tfrecord, _ in shards for record in records.read_shard(tfrecord)]


def teacher_logits(index: int, *, others: float | None = None) -> torch.Tensor:
    """A fixed [C, s, s] logit map per record. `others`: the value of every class outside each cell's top k (0 is
    what the reference's zero fill assumes); None keeps them as drawn."""
    logits = torch.randn(CLASSES, GRID, GRID, generator=torch.Generator().manual_seed(index)) * 3
    if others is not None:
        top = logits.topk(TOP_K, dim=0)
        logits = torch.full_like(logits, others).scatter(0, top.indices, top.values - top.values[-1:] + 1)
    return logits


def write_reference_files(records_dir: Path, import_dir: Path, **logits_options) -> dict[int, torch.Tensor]:
    """What TokenLabeling's generate_label.py saves per train image: its classifier's top-k logits and their
    class indices, float16, [2, k, s, s], in <class>/<name>.pt. Returns the logit maps by record index."""
    maps = {}
    for record in train_records(records_dir):
        maps[record["index"]] = logits = teacher_logits(record["index"], **logits_options)
        top = logits.topk(TOP_K, dim=0)
        path = import_dir / Path(record["path"]).parent.name / (Path(record["path"]).stem + ".pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(torch.stack([top.values.half(), top.indices.half()]), path)
    return maps


def run_import(records_dir: Path, import_dir: Path, out: Path):
    return import_labels(
        records_dir, import_dir, out_dir=out, top_k=TOP_K, batch_size=64, runtime=cpu_runtime(), header={"kind": "test"}
    )


@pytest.fixture(scope="module")
def reference_files(digits_records: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The reference's files for a teacher whose classes outside each cell's top 5 have logit 0."""
    import_dir = tmp_path_factory.mktemp("reference_labels")
    return import_dir, write_reference_files(digits_records, import_dir, others=0.0)


def test_label_files_are_named_as_the_reference_names_them():
    root = Path("/labels")
    assert label_file(root, "train/n01440764/n01440764_10026.JPEG") == root / "n01440764/n01440764_10026.pt"
    assert label_file(root, "train/7/00300.png") == root / "7/00300.pt"
    assert label_file(root, "train/cat/photo.v2.jpg") == root / "cat/photo.pt"  # cut at the first dot, as it does


def test_an_imported_store_answers_the_same_lookups_as_a_generated_one(digits_records, reference_files, tmp_path):
    """Where the reference's zero fill is exact (the teacher gave the other classes logit 0), importing its files
    gives the store generate would write from the same teacher: log_softmax over every class, top 5."""
    import_dir, maps = reference_files
    result = run_import(digits_records, import_dir, tmp_path / "imported")
    logits = torch.stack([maps[index] for index in range(len(maps))])
    generated_log_probs, generated_classes = logits.log_softmax(dim=1).topk(TOP_K, dim=1)
    store.write_store(
        tmp_path / "generated", generated_log_probs.half().numpy(), generated_classes.numpy(), CLASSES, kind="test"
    )

    opened = {
        name: store.TokenLabelStore(tmp_path / name, records=434, num_classes=CLASSES)
        for name in ("imported", "generated")
    }
    header = dict(opened["imported"].header)
    assert len(header.pop("content_sha256")) == 64 and header == opened["generated"].header  # records, k, grid, classes
    rows = torch.tensor([0, 7, 433, 200, 7])
    (imported_log_probs, imported_classes), (log_probs, classes) = (opened[name].lookup(rows) for name in opened)
    assert torch.equal(imported_classes, classes)
    # Both float16 log-probabilities; the import's come from float16 logits (the reference's rounding).
    torch.testing.assert_close(imported_log_probs, log_probs, atol=8e-3, rtol=0)

    metrics = result.metrics()
    assert metrics["images"] == result.generated == 434
    assert metrics["bytes_per_image"] == TOP_K * GRID * GRID * (2 + 2)
    # The whole-image target is the teacher's (every class kept): its top-1 over the mean logits.
    expected_top1 = logits.mean(dim=(2, 3)).argmax(dim=1)
    labels = torch.tensor([record["label"] for record in train_records(digits_records)])
    expected = 100.0 * float((expected_top1 == labels).float().mean())
    assert metrics["target_top1"] == pytest.approx(expected, abs=100 / 434)  # one image: float16 may break a near-tie


def test_imported_targets_are_the_references_own(digits_records, tmp_path):
    """For any teacher (the other classes' logits unknown to the files), the targets built from the imported store
    are the reference's: the softmax of its zero-filled logit map, roi-aligned over the crop window."""
    import_dir = tmp_path / "reference_labels"
    write_reference_files(digits_records, import_dir)
    run_import(digits_records, import_dir, tmp_path / "imported")
    labels = store.TokenLabelStore(tmp_path / "imported", records=434, num_classes=CLASSES)
    rows = torch.arange(0, 434, 29)
    log_probs, classes = labels.lookup(rows)
    generator = torch.Generator().manual_seed(1)
    corner = torch.rand(len(rows), 2, generator=generator) * 0.5
    window = torch.cat([corner, 0.3 + torch.rand(len(rows), 2, generator=generator) * 0.2], dim=1)  # top, left, h, w
    flip = torch.zeros(len(rows), dtype=torch.bool)
    identity = torch.eye(2, 3).expand(len(rows), 2, 3)
    ours = targets.token_targets(
        log_probs, classes, window, flip, identity, num_classes=CLASSES, token_grid=3, smoothing=0.0
    ).tokens

    every_record = train_records(digits_records)
    paths = [every_record[row]["path"] for row in rows]
    files = torch.stack([torch.load(label_file(import_dir, path), weights_only=True) for path in paths])
    zero_filled = torch.zeros(len(rows), CLASSES, GRID, GRID).scatter(1, files[:, 1].long(), files[:, 0].float())
    boxes = targets.window_boxes(window, GRID)
    reference = roi_align(zero_filled, boxes, output_size=3, aligned=True).softmax(dim=1).flatten(2).transpose(1, 2)
    torch.testing.assert_close(ours, reference, atol=5e-3, rtol=0)
    # Not what reading the files' logits as a distribution over the top k alone would give.
    top_k_only = targets.token_targets(
        files[:, 0].float().log_softmax(dim=1), files[:, 1].long(), window, flip, identity,
        num_classes=CLASSES, token_grid=3, smoothing=0.0,
    ).tokens
    assert (top_k_only - reference).abs().max() > 0.05

def replace_file(import_dir: Path, record_path: str, tensor: torch.Tensor | None) -> Path:
    path = label_file(import_dir, record_path)
    path.unlink()
    if tensor is not None:
        torch.save(tensor, path)
    return path


def good_file(classes: list[int] | None = None, grid: int = GRID, top_k: int = TOP_K) -> torch.Tensor:
    scores = torch.linspace(5, 1, top_k).view(top_k, 1, 1).expand(top_k, grid, grid)
    indices = torch.tensor(classes or list(range(top_k)), dtype=torch.float32).view(-1, 1, 1).expand(top_k, grid, grid)
    return torch.stack([scores, indices]).half()


@pytest.mark.parametrize(
    "tensor, message",
    [
        (None, "label file of train image .* not found"),
        (good_file().float(), "a torch.float32 tensor, not the reference's float16"),
        (good_file()[0], r"token labels of shape \[5, 4, 4\], expected \[2, 5, 4, 4\]"),
        (good_file(grid=3), r"token labels of shape \[2, 5, 3, 3\], expected \[2, 5, 4, 4\]"),
        (good_file(top_k=3), "the top 3 classes per cell, token_labels.top_k is 5: set it to 3"),
        (good_file(classes=[0, 1, 2, 3, 10]), "class index 10 is not one of the records' 10 classes"),
        (good_file(classes=[0, 1, 2, 3, 3]), "a class appears twice in one cell's top 5"),
        ({"scores": good_file()}, "a dict, not the reference's float16"),
    ],
    ids=["missing", "float32", "shape", "grid", "top_k", "class range", "repeated class", "not a tensor"],
)
def test_a_bad_or_missing_label_file_is_one_line_naming_it(digits_records, tmp_path, tensor, message):
    import_dir = tmp_path / "labels"
    write_reference_files(digits_records, import_dir)
    path = replace_file(import_dir, train_records(digits_records)[300]["path"], tensor)
    with pytest.raises(UserError, match=message) as error:
        run_import(digits_records, import_dir, tmp_path / "imported")
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)
    assert not (tmp_path / "imported" / store.HEADER_FILE).exists()  # no store: nothing reads half an import


def test_a_corrupt_label_file_is_one_line_naming_it(digits_records, tmp_path):
    import_dir = tmp_path / "labels"
    write_reference_files(digits_records, import_dir)
    path = label_file(import_dir, train_records(digits_records)[5]["path"])
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="not a readable label file of train image") as error:
        run_import(digits_records, import_dir, tmp_path / "imported")
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


# What makes the source stage list the token labels' origin: a student that learns from them.
A_STUDENT_READS = {"finetune": {"token_label": {"enabled": True}}}


def test_import_mode_needs_its_directory():
    with pytest.raises(ParamsError, match="token_labels.*import_dir: required when mode is 'import'"):
        make_params(token_labels={"mode": "import"})
    with pytest.raises(UserError, match="token_labels.import_dir: .*missing: directory not found"):
        token_labels_state(make_params(token_labels={"mode": "import", "import_dir": "/missing"}, **A_STUDENT_READS))


def test_the_source_listing_changes_with_the_label_files(tmp_path):
    """The source stage's listing of the import directory: what reruns token_labels when the label set changes."""
    (tmp_path / "7").mkdir()
    torch.save(good_file(), tmp_path / "7" / "00300.pt")
    cfg = make_params(token_labels={"mode": "import", "import_dir": str(tmp_path)}, **A_STUDENT_READS)
    before = token_labels_state(cfg)
    assert before["files"] == 1 and before["mode"] == "import"
    assert token_labels_state(cfg) == before
    torch.save(good_file(classes=[5, 6, 7, 8, 9]), tmp_path / "7" / "00301.pt")
    assert token_labels_state(cfg)["digest"] != before["digest"]
    on = {"token_label": {"enabled": True}}
    assert token_labels_state(make_params(pretrain=on)) == token_labels_state(make_params(finetune=on)) == {
        "mode": "generate"
    }  # which student reads them does not rerun token_labels
    # No student reads token labels (the schema's default): only that is listed; the directory need not exist.
    assert token_labels_state(make_params(token_labels={"mode": "import", "import_dir": "/missing"})) == {
        "mode": "unused"
    }


@pytest.mark.slow
def test_the_stage_imports_on_two_ranks_without_a_teacher(digits_records, reference_files, tmp_path):
    """stages/token_labels.py in import mode under the launcher: no teacher file (none exists here), two ranks
    split the shards, and the store is byte-identical to an import in one process."""
    import_dir, _ = reference_files
    run_import(digits_records, import_dir, tmp_path / "in_process")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), DIGITS_PIPELINE)
    params["token_labels"].update(mode="import", import_dir=str(import_dir))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    command = launch_command(
        ROOT / "stages/token_labels.py", "--params", tmp_path / "params.yaml", "--records", digits_records,
        "--teacher", tmp_path / "no_teacher.pt", "--out", tmp_path / "labels", "--work-dir", tmp_path / "partial",
        "--metrics", tmp_path / "metrics", nproc=2,
    )
    tracking = {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env = {**os.environ, **tracking}
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in (store.LOG_PROBS_FILE, store.CLASSES_FILE):
        assert (tmp_path / "labels" / name).read_bytes() == (tmp_path / "in_process" / name).read_bytes()
    header = json.loads((tmp_path / "labels" / store.HEADER_FILE).read_text())
    assert header["teacher"] == {"imported_from": str(import_dir), "view": "center"}
    assert header["records_digest"] == records.manifest_digest(digits_records)
    assert (header["records"], header["top_k"], header["grid"], header["num_classes"]) == (434, TOP_K, GRID, CLASSES)
    assert json.loads((tmp_path / "metrics" / "metrics.json").read_text())["images"] == 434
    assert np.load(tmp_path / "labels" / store.CLASSES_FILE).dtype == np.int16
