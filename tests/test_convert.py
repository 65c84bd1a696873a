"""The convert stage on real files: what passes through, what is re-encoded, what is skipped, and why."""

from __future__ import annotations

import builtins
import collections
import io
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import PROJECT_ROOT, cpu_runtime, launch_command, make_params
from PIL import Image
from tfrecord.tools.tfrecord2idx import create_index

from coarse2fine.config import PhotosSource
from coarse2fine.data import records, sources
from coarse2fine.data.convert import convert
from coarse2fine.errors import UserError
from coarse2fine.files import file_sha256, walked_by

STAGE = PROJECT_ROOT / "stages" / "convert.py"
ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}

# Good images of the test tree: path -> "copy" (stored byte for byte) or "convert" (re-encoded RGB JPEG).
GOOD = {
    "train/cat/baseline.jpg": "copy",
    "train/cat/progressive.jpg": "copy",
    "train/cat/grey.jpg": "copy",
    "train/cat/decoy_marker.jpg": "copy",  # a lossless-JPEG marker inside a comment must not fool the check
    "train/cat/cmyk.jpg": "convert",
    "train/big dog/ñandú_猫.jpg": "copy",
    "train/big dog/rgba.png": "convert",
    "train/big dog/palette.png": "convert",
    "val/cat/baseline.jpg": "copy",
    "val/big dog/rgb.png": "convert",
}
# Bad files: path -> the start of the reason the manifest must give.
BAD = {
    "train/cat/truncated.jpg": "cannot decode: OSError: image file is truncated",
    "train/cat/empty.jpg": "empty file",
    "train/cat/notes.txt": "not an image file (extension '.txt')",
    "train/big dog/garbage.jpg": "not an image PIL can read",
    "val/big dog/truncated.png": "cannot decode",
}


def _noise(width: int, height: int, mode: str, seed: int) -> Image.Image:
    channels = Image.getmodebands(mode)
    return Image.frombytes(mode, (width, height), np.random.default_rng(seed).bytes(width * height * channels))


def _half_transparent(image: Image.Image) -> Image.Image:
    """`image` with its left 8 columns (one JPEG block wide) fully transparent."""
    alpha = np.full((image.height, image.width), 255, np.uint8)
    alpha[:, :8] = 0
    image.putalpha(Image.fromarray(alpha))
    return image


def _jpeg_bytes(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **options)
    return buffer.getvalue()


def build_image_folder(root: Path) -> Path:
    """Every kind of file the converter meets, under two classes ("big dog" has a space in its name)."""
    for folder in ("train/cat", "train/big dog", "val/cat", "val/big dog"):
        (root / folder).mkdir(parents=True)
    files = {
        "train/cat/baseline.jpg": _jpeg_bytes(_noise(40, 30, "RGB", 1)),
        "train/cat/progressive.jpg": _jpeg_bytes(_noise(36, 28, "RGB", 2), progressive=True),
        "train/cat/grey.jpg": _jpeg_bytes(_noise(24, 20, "L", 3)),
        "train/cat/decoy_marker.jpg": _jpeg_bytes(_noise(16, 16, "RGB", 13), comment=b"\xff\xc3\x00\x0b\x08"),
        "train/cat/cmyk.jpg": _jpeg_bytes(_noise(30, 30, "CMYK", 4)),
        "train/cat/truncated.jpg": _jpeg_bytes(_noise(64, 64, "RGB", 5))[:1500],
        "train/cat/empty.jpg": b"",
        "train/cat/notes.txt": b"not an image\n",
        "train/cat/.DS_Store": b"\0hidden",
        "train/big dog/ñandú_猫.jpg": _jpeg_bytes(_noise(33, 21, "RGB", 6)),
        "train/big dog/garbage.jpg": np.random.default_rng(7).bytes(2000),
        "val/cat/baseline.jpg": _jpeg_bytes(_noise(25, 35, "RGB", 8)),
    }
    for path, data in files.items():
        (root / path).write_bytes(data)
    _half_transparent(_noise(20, 20, "RGB", 9)).save(root / "train/big dog/rgba.png")
    palette = _noise(16, 12, "RGB", 10).quantize(8)
    indices = np.asarray(palette).copy()
    indices[:, :8] = 7  # palette entry 7 is declared transparent below
    palette.frombytes(indices.tobytes())
    palette.save(root / "train/big dog/palette.png", transparency=7)
    _noise(18, 22, "RGB", 11).save(root / "val/big dog/rgb.png")
    png = io.BytesIO()
    _noise(64, 64, "RGB", 12).save(png, "PNG")
    (root / "val/big dog/truncated.png").write_bytes(png.getvalue()[:3000])
    return root


def run_stage(
    params: dict, params_path: Path, out: Path, nproc: int = 1, file_size_limit: int | None = None
) -> subprocess.Popen:
    """Start stages/convert.py with `nproc` ranks through the launcher, as dvc.yaml does, on `params` written to
    `params_path`; `file_size_limit`: the process's RLIMIT_FSIZE in bytes (a disk that fills up, for real)."""
    params_path.write_text(yaml.safe_dump(params, allow_unicode=True), encoding="utf-8")
    metrics = out.parent / f"{out.name}-metrics"
    command = launch_command(STAGE, "--params", params_path, "--out", out, "--metrics", metrics, nproc=nproc)
    # Runs may go concurrently: each gets its own MLflow store (two processes creating one sqlite store at
    # once race in its schema migration), beside its outputs rather than in the project.
    env = {**ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{out.parent / f'{out.name}-mlflow.db'}"}
    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen(
        command, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=None if file_size_limit is None else limit_file_size,
    )


def read_split(records_dir: Path, split: str) -> list[dict]:
    return [record for tfrecord, _ in records.shard_files(records_dir, split) for record in records.read_shard(tfrecord)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The test tree converted by the real stage twice, at the same time: 2 ranks x 2 workers and 1 rank x 1 worker."""
    tmp = tmp_path_factory.mktemp("convert")
    make_project(tmp)  # the stages run in it (out.parent), the images inside it, ignored by neither git nor DVC
    root = build_image_folder(tmp / "images")
    data = {"source": "imagefolder", "root": str(root), "train_shards": 2, "val_shards": 1}
    runs = {
        "two_ranks": run_stage({"data": {**data, "convert_workers": 2}}, tmp / "two.yaml", tmp / "two", nproc=2),
        "one_rank": run_stage({"data": {**data, "convert_workers": 1}}, tmp / "one.yaml", tmp / "one"),
    }
    results = {name: (*process.communicate(timeout=300), process.returncode) for name, process in runs.items()}
    return {"root": root, "two_ranks": tmp / "two", "one_rank": tmp / "one", "results": results}


@pytest.mark.slow
def test_stage_exits_0_and_summarises(converted):
    for name, (stdout, stderr, code) in converted["results"].items():
        assert code == 0, f"{name}: {stderr}"
        assert "convert: 8 train + 2 val images" in stdout
        assert "5 files skipped" in stdout
        # The images sit inside the project, where git and DVC walk them at every command: said once (rank 0).
        (warning,) = [line for line in stdout.splitlines() if "WARNING" in line]
        assert warning.startswith(f"convert: WARNING: data.root {converted['root']} is inside the project and git "
                                  "and DVC walk its 10 images at every command: add it to .gitignore and .dvcignore")


def make_project(directory: Path) -> None:
    """A git repository with DVC initialised in it, as `dvc init` makes one."""
    subprocess.run(["git", "init", "-q"], cwd=directory, check=True)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q"], cwd=directory, check=True, env=ENV)


def test_a_data_root_inside_the_project_is_walked_by_what_does_not_ignore_it(tmp_path, monkeypatch):
    make_project(tmp_path)
    (tmp_path / "images" / "train").mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert walked_by(tmp_path / "images") == ["git", "DVC"]
    (tmp_path / ".gitignore").write_text("/images/\n")
    assert walked_by(tmp_path / "images") == ["DVC"]
    (tmp_path / ".dvcignore").write_text("/images/\n")
    assert walked_by(tmp_path / "images") == []
    assert walked_by(tmp_path.parent) == walked_by(tmp_path) == []  # outside the project, or the project itself
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "images"))  # not a DVC project
    assert walked_by(tmp_path / "images" / "train") == []


@pytest.mark.slow
def test_manifest_counts_and_skipped_reasons(converted):
    manifest = records.read_manifest(converted["two_ranks"])
    assert manifest["classes"] == records.read_classes(converted["two_ranks"]) == ["big dog", "cat"]
    assert manifest["source"] == {"kind": "imagefolder", "root": str(converted["root"])}
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    assert (train["images"], train["passed_through"], train["converted"]) == (8, 5, 3)
    assert (val["images"], val["passed_through"], val["converted"]) == (2, 1, 1)
    assert train["per_class"] == {"big dog": 3, "cat": 5}
    assert val["per_class"] == {"big dog": 1, "cat": 1}
    assert [shard["count"] for shard in train["shards"]] == [4, 4]
    assert [shard["first_index"] for shard in train["shards"]] == [0, 4]
    skipped = {item["path"]: item["reason"] for split in ("train", "val") for item in manifest["splits"][split]["skipped"]}
    assert skipped.keys() == BAD.keys()  # the hidden .DS_Store is ignored, not listed
    for path, reason in BAD.items():
        assert skipped[path].startswith(reason), (path, skipped[path])


@pytest.mark.slow
def test_records_hold_the_images(converted):
    root, records_dir = converted["root"], converted["two_ranks"]
    classes = records.read_classes(records_dir)
    seen = {}
    for split in records.SPLITS:
        split_records = read_split(records_dir, split)
        assert [record["index"] for record in split_records] == list(range(len(split_records)))
        for record in split_records:
            seen[record["path"]] = record
            assert record["label"] == classes.index(record["path"].split("/")[1])
            with Image.open(io.BytesIO(record["image"])) as image:
                image.load()
                assert image.format == "JPEG"
                assert (record["width"], record["height"]) == image.size == Image.open(root / record["path"]).size
                if GOOD[record["path"]] == "convert":
                    assert image.mode == "RGB"
            if GOOD[record["path"]] == "copy":
                assert record["image"] == (root / record["path"]).read_bytes()
    assert seen.keys() == GOOD.keys()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rgba.png", "palette.png"])
def test_transparent_pixels_become_white(converted, name):
    record = next(record for record in read_split(converted["two_ranks"], "train") if record["path"].endswith(name))
    pixels = np.asarray(Image.open(io.BytesIO(record["image"])), dtype=np.float64)
    assert pixels[:, :8].mean() > 230  # composited on black it would be near 0
    assert pixels[:, 8:].mean() < 200  # the opaque noise is kept


@pytest.mark.slow
def test_index_and_digest_taken_while_writing_are_what_reading_the_shard_gives(converted, digits_records, tmp_path):
    """write_shard never reads a shard back: its index must be byte for byte tfrecord's create_index of the file
    (what DALI reads), and the manifest's count, size and sha256 those of the file."""
    reference = tmp_path / "reference.idx"
    for records_dir in (converted["two_ranks"], digits_records):
        manifest = records.read_manifest(records_dir)
        for split in records.SPLITS:
            listed = manifest["splits"][split]["shards"]
            for shard, (tfrecord, index) in zip(listed, records.shard_files(records_dir, split), strict=True):
                create_index(str(tfrecord), str(reference))
                assert index.read_bytes() == reference.read_bytes(), index
                assert shard["count"] == sum(1 for _ in records.read_shard(tfrecord))
                assert (shard["bytes"], shard["sha256"]) == (tfrecord.stat().st_size, file_sha256(tfrecord))


def test_an_index_without_a_line_per_record_is_refused(digits_records, tmp_path):
    """DALI reads only the records an index lists: a short one would drop records silently."""
    copy = shutil.copytree(digits_records, tmp_path / "records")
    (_, index), *_ = records.shard_files(copy, "train")
    index.write_text("".join(index.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(UserError, match=f"{index.name}: 216 entries for the 217 records"):
        records.shard_files(copy, "train")


def test_a_shard_cut_short_or_replaced_after_conversion_is_refused(digits_records, tmp_path):
    copy = shutil.copytree(digits_records, tmp_path / "records")
    (tfrecord, _), *_ = records.shard_files(copy, "train")
    written = tfrecord.stat().st_size
    tfrecord.write_bytes(tfrecord.read_bytes()[: written // 2])  # a copy stopped half-way
    with pytest.raises(UserError, match=rf"{tfrecord.name}: {written // 2} bytes, but written with {written} .*dvc repro -f convert"):
        records.shard_files(copy, "train")


@pytest.mark.slow
def test_output_is_independent_of_ranks_and_workers(converted):
    two, one = converted["two_ranks"], converted["one_rank"]
    assert records.read_manifest(two) == records.read_manifest(one)  # includes every shard's sha256
    names = sorted(path.name for path in two.iterdir())
    assert names == sorted(path.name for path in one.iterdir())
    for name in names:
        assert (two / name).read_bytes() == (one / name).read_bytes(), name


@pytest.mark.slow
def test_converting_again_in_process_is_byte_identical(converted, tmp_path):
    params = make_params(data={"source": "imagefolder", "root": str(converted["root"]), "convert_workers": 2})
    manifest = convert(params, cpu_runtime(), tmp_path)
    assert manifest == records.read_manifest(converted["one_rank"])


def test_train_records_are_class_mixed_and_val_ordered(digits_records):
    manifest = records.read_manifest(digits_records)
    assert manifest["splits"]["train"]["images"] == 434 and manifest["splits"]["val"]["images"] == 108
    for tfrecord, _ in records.shard_files(digits_records, "train"):
        labels = [record["label"] for record in records.read_shard(tfrecord)]
        assert set(labels) == set(range(10))
        assert labels != sorted(labels)
    val = read_split(digits_records, "val")
    listing_order = [(record["label"], record["path"]) for record in val]
    assert listing_order == sorted(listing_order)
    assert {(record["width"], record["height"]) for record in val} == {(32, 32)}


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    sources.write_digits(root, make_params().data.digits, seed=0)
    return root


def test_digits_split_is_stratified(digits_root):
    full = sources.list_imagefolder(digits_root, subset=1.0, seed=0)
    assert len(full.files["train"]) + len(full.files["val"]) == 1797
    for label in range(10):
        train = sum(file.label == label for file in full.files["train"])
        val = sum(file.label == label for file in full.files["val"])
        assert 0.18 < val / (train + val) < 0.22


def test_subset_is_stratified_seeded_and_keeps_one_per_class(digits_root):
    full = sources.list_imagefolder(digits_root, subset=1.0, seed=0)
    part = sources.list_imagefolder(digits_root, subset=0.3, seed=0)
    for split in records.SPLITS:
        assert set(part.files[split]) <= set(full.files[split])
        assert part.files[split] == sorted(part.files[split], key=lambda file: (file.label, file.path))
        for label in range(10):
            total = sum(file.label == label for file in full.files[split])
            assert sum(file.label == label for file in part.files[split]) == max(1, round(total * 0.3))
    assert sources.list_imagefolder(digits_root, subset=0.3, seed=0).files == part.files
    assert sources.list_imagefolder(digits_root, subset=0.3, seed=1).files != part.files
    tiny = sources.list_imagefolder(digits_root, subset=0.001, seed=0)
    assert [file.label for file in tiny.files["train"]] == list(range(10))


def test_photos_are_non_square_patches_of_18_photos_with_val_from_unseen_parts(tmp_path):
    """data.source photos through the real conversion: 18 classes (one per photo), the counts asked for, the
    shorter side `size`, colour and grey photos as they are; and no train patch overlaps the block val comes from."""
    params = make_params(data={"source": "photos", "photos": {"size": 24, "train_per_class": 3, "val_per_class": 2}})
    manifest = convert(params, cpu_runtime(), tmp_path / "records")
    classes = records.read_classes(tmp_path / "records")
    assert len(classes) == 18 and {"astronaut", "camera", "coffee", "text"} <= set(classes)
    assert manifest["source"]["kind"] == "photos"
    assert [manifest["splits"][split]["images"] for split in records.SPLITS] == [54, 36]
    train = read_split(tmp_path / "records", "train")
    assert {min(record["width"], record["height"]) for record in train} == {24}
    assert len({(record["width"], record["height"]) for record in train}) > 1  # not all square
    # PNG patches are stored as RGB JPEG: a grey photo's patch has (up to JPEG rounding) equal channels
    greyness = {
        int(np.ptp(np.asarray(Image.open(io.BytesIO(record["image"])).convert("RGB"), dtype=np.int16), axis=2).max())
        <= 4
        for record in train
    }
    assert greyness == {True, False}

    rng = np.random.default_rng(0)
    block = sources._held_out_block(300, 400, rng)
    top, left, bottom, right = block
    for _ in range(200):
        y, x, h, w = sources._photo_patch(300, 400, block, False, rng)
        assert y + h <= top or bottom <= y or x + w <= left or right <= x
        y, x, h, w = sources._photo_patch(300, 400, block, True, rng)
        assert top <= y and y + h <= bottom and left <= x and x + w <= right


def test_patches_written_grey_are_a_seeded_share_and_the_others_are_the_patches_written_without(tmp_path):
    """write_patches' grey_share (bench/photo_sets.py's held-out sets) draws from a stream of its own: the same
    patches as without it, some of them single-channel grey, the same ones at the same seed."""
    rng = np.random.default_rng(0)
    photos = [(name, rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)) for name in ("a", "b")]
    settings = PhotosSource(size=24, train_per_class=20, val_per_class=5)
    for folder, share in (("colour", 0.0), ("grey", 0.5), ("grey_again", 0.5)):
        sources.write_patches(tmp_path / folder, photos, settings, seed=3, grey_share=share)
    written = sorted(path.relative_to(tmp_path / "colour") for path in (tmp_path / "colour").rglob("*.png"))
    assert len(written) == 50 and written == sorted(
        path.relative_to(tmp_path / "grey") for path in (tmp_path / "grey").rglob("*.png"))
    grey = 0
    for path in written:
        colour, mixed = Image.open(tmp_path / "colour" / path), Image.open(tmp_path / "grey" / path)
        assert colour.mode == "RGB" and (tmp_path / "grey" / path).read_bytes() == (
            tmp_path / "grey_again" / path).read_bytes()
        if mixed.mode == "L":
            grey += 1
            assert np.array_equal(np.asarray(mixed), np.asarray(colour.convert("L")))
        else:
            assert (tmp_path / "grey" / path).read_bytes() == (tmp_path / "colour" / path).read_bytes()
    assert 15 <= grey <= 35  # about half of 50


@pytest.mark.slow
def test_bad_root_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "no such dir"
    process = run_stage({"data": {"source": "imagefolder", "root": str(missing)}}, tmp_path / "params.yaml", tmp_path / "out")
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 2
    assert stderr.strip().count("\n") == 0 and str(missing) in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_a_disk_that_fills_up_while_writing_a_shard_is_one_line_and_the_rerun_succeeds(tmp_path):
    """RLIMIT_FSIZE below a shard's size fails its write as a full disk does (EFBIG for ENOSPC)."""
    data = {"source": "imagefolder", "root": str(build_image_folder(tmp_path / "images")), "train_shards": 1, "convert_workers": 1}
    out = tmp_path / "out"
    full = run_stage({"data": data}, tmp_path / "params.yaml", out, file_size_limit=4 * 1024)
    stderr = full.communicate(timeout=300)[1]
    assert full.returncode == 2 and "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert re.fullmatch(rf"error: {out}/train-\S+\.tfrecord: file too large while writing it .*and rerun", line)
    assert not (out / records.MANIFEST_FILE).exists() and not list(out.glob(".*.tmp-*"))  # nothing taken as done
    rerun = run_stage({"data": data}, tmp_path / "params.yaml", out)
    assert rerun.communicate(timeout=300)[1] is not None and rerun.returncode == 0
    assert sum(shard["count"] for shard in records.read_manifest(out)["splits"]["train"]["shards"]) == len(
        read_split(out, "train")
    )


@pytest.mark.parametrize(
    ("breakage", "named"),
    [
        ("no val", "val"),
        ("empty class", "train/cat"),
        ("extra val class", "val"),
        ("only broken images", "val/cat"),
    ],
)
def test_bad_trees_are_user_errors_naming_the_folder(tmp_path, breakage, named):
    root = tmp_path / "images"
    for folder in ("train/cat", "train/dog", "val/cat", "val/dog"):
        (root / folder).mkdir(parents=True)
        _noise(8, 8, "RGB", 0).save(root / folder / "a.png")
    if breakage == "no val":
        shutil.rmtree(root / "val")
    elif breakage == "empty class":
        (root / "train/cat/a.png").unlink()
    elif breakage == "extra val class":
        (root / "val/bird").mkdir()
    elif breakage == "only broken images":
        (root / "val/cat/a.png").write_bytes(b"")
    params = make_params(data={"source": "imagefolder", "root": str(root), "train_shards": 1, "convert_workers": 1})
    with pytest.raises(UserError, match=re.escape(str(root / named))):
        convert(params, cpu_runtime(), tmp_path / "out")


@pytest.mark.parametrize("unusable", [False, True], ids=["all usable", "some unusable"])
def test_each_source_file_is_read_once_unless_some_are_unusable(tmp_path, monkeypatch, unusable):
    """At ImageNet's size (~140 GB on NFS) a second read of the source is hours of I/O. Counted: every open of a
    file under the source root, in the pool's forked workers too (they inherit the patched `open`, and append to
    one log). An unusable file moves the index of every file after it, so a source with some is written twice:
    the usable files are read again, the unusable ones not."""
    root = build_image_folder(tmp_path / "images")
    if not unusable:
        for path in BAD:
            (root / path).unlink()
    listing = sources.list_imagefolder(root, subset=1.0, seed=0)
    listed = [file.path for split in records.SPLITS for file in listing.files[split]]
    log_path = tmp_path / "opens.log"
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).is_relative_to(root):
            os.write(log, f"{Path(file).relative_to(root).as_posix()}\n".encode())
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)  # PIL's Image.open(path)
    monkeypatch.setattr(io, "open", counting_open)  # pathlib's read_bytes, open
    params = make_params(data={"source": "imagefolder", "root": str(root), "train_shards": 2, "convert_workers": 2})
    try:
        convert(params, cpu_runtime(), tmp_path / "out")
    finally:
        os.close(log)
    opens = collections.Counter(log_path.read_text(encoding="utf-8").splitlines())
    assert opens == {path: 2 if unusable and path in GOOD else 1 for path in listed}


def test_unusable_files_change_no_record(tmp_path):
    """The records written after a pass met unusable files are those of the source without them: nothing of the
    first pass's order (every file taken as usable) is left in any shard or index."""
    written = {}
    for name in ("with", "without"):
        root = build_image_folder(tmp_path / name / "images")
        if name == "without":
            for path in BAD:
                (root / path).unlink()
        data = {"source": "imagefolder", "root": str(root), "train_shards": 3, "val_shards": 2, "convert_workers": 2}
        convert(make_params(data=data), cpu_runtime(), tmp_path / name / "out")
        shards = sorted((tmp_path / name / "out").glob("*-of-*"))
        written[name] = {path.name: path.read_bytes() for path in shards}
    assert len(written["with"]) == 2 * (3 + 2)
    assert written["with"] == written["without"]


def test_more_shards_than_images_is_a_user_error(tmp_path):
    root = build_image_folder(tmp_path / "images")
    params = make_params(data={"source": "imagefolder", "root": str(root), "val_shards": 3, "convert_workers": 1})
    with pytest.raises(UserError, match="data.val_shards"):
        convert(params, cpu_runtime(), tmp_path / "out")


def test_a_failure_that_is_not_the_images_fault_stops_the_run(tmp_path, monkeypatch):
    """Only decoder errors make a file a "cannot decode" skip; a bug or running out of memory is not a verdict
    on the image and must not quietly drop it from the data set."""
    root = build_image_folder(tmp_path / "images")

    def out_of_memory(*args):
        raise MemoryError

    monkeypatch.setattr("coarse2fine.data.convert._passes_through", out_of_memory)
    params = make_params(data={"source": "imagefolder", "root": str(root), "convert_workers": 1})
    with pytest.raises(MemoryError):
        convert(params, cpu_runtime(), tmp_path / "out")


def test_reading_unconverted_records_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="run the convert stage first"):
        records.shard_files(tmp_path / "records", "train")
