"""Where the images come from: an ImageNet-style folder tree, or one written out from images a package ships:
patches of scikit-image's photographs (`photos`, the default: hard enough that recipe features show their
effect, see `write_photos`) or scikit-learn's digits (fast, the tests' set, but saturating near 99 %).

Each becomes a `Source`: per split, the sorted candidate image files with their labels (after `data.subset`),
the files skipped while listing (with the reason, for the manifest), and a description of the origin.
Written sources go through the same folder listing as real data, so the default pipeline exercises that path.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from coarse2fine.config import Data, DigitsSource, PhotosSource
from coarse2fine.data.records import SPLITS
from coarse2fine.errors import UserError
from coarse2fine.files import project_path

# Extensions of the formats PIL can open (not just save); anything else is listed as skipped, not guessed at.
IMAGE_SUFFIXES = frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)
DIGITS_GREY_LEVELS = 16  # load_digits pixels are 0..16

# The 18 photographs scikit-image ships in its wheel (files of its skimage.data package: nothing is downloaded),
# one class each; 8 are colour, 10 grey. Left out: drawings and synthetic images (logo, color, chessboards,
# phantom, horse's silhouette), microaneurysms (102 px) and the second motorcycle view (a near-twin of the first).
PHOTOS = (
    "astronaut.png", "brick.png", "camera.png", "cell.png", "chelsea.png", "clock_motion.png", "coffee.png",
    "coins.png", "grass.png", "gravel.png", "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png",
    "page.png", "retina.jpg", "rocket.jpg", "text.png",
)
PHOTO_PATCH_SIDES = (0.2, 0.45)  # a patch's shorter side, as a fraction of the photo's shorter side
PHOTO_PATCH_RATIOS = (3 / 4, 4 / 3)  # width / height: patches are not square, as real photos are not
PHOTO_VAL_BLOCK = 0.45  # the held-out block's side, as a fraction of each side of the photo


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the source root, POSIX separators: "train/cat/x.jpg"
    label: int


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass(frozen=True)
class Source:
    root: Path
    classes: tuple[str, ...]
    files: dict[str, list[SourceFile]]  # split -> candidate images, sorted by path
    skipped: dict[str, list[Skipped]]  # split -> files that are not images, sorted by path
    description: dict[str, Any]  # for the manifest: where the images came from


def open_source(data: Data, seed: int, scratch: Path) -> Source:
    """The images `data` describes; digits are first written as PNGs under `scratch` (caller's temp dir)."""
    if data.source == "imagefolder":
        source = list_imagefolder(project_path(data.root), subset=data.subset, seed=seed)
        # data.root as written: the same records wherever the project (or an experiment's copy of it) sits
        return dataclasses.replace(source, description={"kind": "imagefolder", "root": data.root})
    if data.source == "photos":
        write_photos(scratch, data.photos, seed)
        description = {"kind": "photos", **data.photos.model_dump()}
    else:
        write_digits(scratch, data.digits, seed)
        description = {"kind": "digits", **data.digits.model_dump()}
    source = list_imagefolder(scratch, subset=data.subset, seed=seed)
    return dataclasses.replace(source, description=description)


def write_digits(directory: Path, digits: DigitsSource, seed: int) -> None:
    """load_digits as `directory/{train,val}/<digit>/<sample id>.png`, upsampled bicubic to digits.size."""
    # Imported here: scikit-learn takes seconds to import and only this source needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    dataset = load_digits()
    images = np.rint(dataset.images * (255 / DIGITS_GREY_LEVELS)).astype(np.uint8)
    sample_ids = np.arange(len(images))
    train_ids, val_ids = train_test_split(
        sample_ids, test_size=digits.val_fraction, stratify=dataset.target, random_state=seed
    )
    for split, split_ids in zip(SPLITS, (train_ids, val_ids)):
        for sample_id in split_ids:
            folder = directory / split / str(dataset.target[sample_id])
            folder.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(images[sample_id]).resize((digits.size, digits.size), Image.Resampling.BICUBIC)
            image.save(folder / f"{sample_id:05d}.png")


def write_photos(directory: Path, photos: PhotosSource, seed: int) -> None:
    """Patches of scikit-image's photographs (`write_patches`); colour photos stay colour, grey ones grey."""
    photo_dir = importlib.resources.files("skimage.data")  # read as files: importing scikit-image takes a second

    def read(file_name: str) -> tuple[str, np.ndarray]:
        with Image.open(photo_dir / file_name) as opened:
            return file_name.rsplit(".", 1)[0], np.asarray(opened)

    write_patches(directory, map(read, PHOTOS), photos, seed)


def write_patches(
    directory: Path, photos: Iterable[tuple[str, np.ndarray]], settings: PhotosSource, seed: int, grey_share: float = 0.0
) -> None:
    """Patches of `photos` ((name, pixels) pairs) as `directory/{train,val}/<name>/<n>.png`: the class is the photo
    a patch was cut from. Each patch is a seeded random rectangle (its shorter side PHOTO_PATCH_SIDES of the photo's,
    its aspect ratio in PHOTO_PATCH_RATIOS) resized so its shorter side is `settings.size`. Val patches come from one
    seeded block of each photo that no train patch overlaps, so val measures recognition of unseen parts of a
    scene, not of pixels seen in training. A share `grey_share` of the patches, drawn apart from the patches, are
    written as single-channel grey images (as ImageNet holds some)."""
    rng = np.random.default_rng(seed)
    grey_rng = np.random.default_rng([seed, 1])  # its own stream: grey_share 0 leaves the patches as they were
    for name, photo in photos:
        height, width = photo.shape[:2]
        block = _held_out_block(height, width, rng)
        for split, count in (("train", settings.train_per_class), ("val", settings.val_per_class)):
            folder = directory / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for number in range(count):
                top, left, patch_height, patch_width = _photo_patch(height, width, block, split == "val", rng)
                patch = Image.fromarray(photo[top : top + patch_height, left : left + patch_width])
                scale = settings.size / min(patch_height, patch_width)
                size = (round(patch_width * scale), round(patch_height * scale))
                patch = patch.resize(size, Image.Resampling.BICUBIC, reducing_gap=3.0)
                if grey_share and grey_rng.random() < grey_share:
                    patch = patch.convert("L")
                patch.save(folder / f"{number:04d}.png")


def _held_out_block(height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the block val patches are cut from, away from no edge in particular."""
    block_height, block_width = round(height * PHOTO_VAL_BLOCK), round(width * PHOTO_VAL_BLOCK)
    top, left = int(rng.integers(0, height - block_height + 1)), int(rng.integers(0, width - block_width + 1))
    return top, left, top + block_height, left + block_width


def _photo_patch(
    height: int, width: int, block: tuple[int, int, int, int], inside: bool, rng: np.random.Generator
) -> tuple[int, int, int, int]:
    """A random (top, left, height, width) patch inside the held-out block (val) or not overlapping it (train)."""
    block_top, block_left, block_bottom, block_right = block
    area_height, area_width = (block_bottom - block_top, block_right - block_left) if inside else (height, width)
    while True:
        side = rng.uniform(*PHOTO_PATCH_SIDES) * min(height, width)
        ratio = np.exp(rng.uniform(*np.log(PHOTO_PATCH_RATIOS)))
        patch_height = min(area_height, round(side if ratio >= 1 else side / ratio))
        patch_width = min(area_width, round(side * ratio if ratio >= 1 else side))
        top = int(rng.integers(0, area_height - patch_height + 1))
        left = int(rng.integers(0, area_width - patch_width + 1))
        if inside:
            return block_top + top, block_left + left, patch_height, patch_width
        rows_overlap = top < block_bottom and block_top < top + patch_height
        if not (rows_overlap and left < block_right and block_left < left + patch_width):
            return top, left, patch_height, patch_width


def list_imagefolder(root: Path, *, subset: float, seed: int) -> Source:
    """root/train/<class>/** and root/val/<class>/**; class = folder name, label = position in sorted names."""
    if not root.is_dir():
        raise UserError(f"{root}: data root not found (expected train/<class>/ and val/<class>/ folders)")
    class_names = {split: _class_folders(root / split) for split in SPLITS}
    classes = class_names["train"]
    if class_names["val"] != classes:
        missing = sorted(set(classes) - set(class_names["val"]))
        extra = sorted(set(class_names["val"]) - set(classes))
        raise UserError(
            f"{root / 'val'}: class folders differ from {root / 'train'} (missing: {missing}, extra: {extra})"
        )
    files: dict[str, list[SourceFile]] = {}
    skipped: dict[str, list[Skipped]] = {}
    for split in SPLITS:
        files[split], skipped[split] = [], _loose_files(root, split)
        for label, name in enumerate(classes):
            images, not_images = _list_class(root, f"{split}/{name}")
            if not images:
                raise UserError(f"{root / split / name}: no image files (empty class folder)")
            kept = _stratified_subset(images, subset, seed, f"{split}/{name}")
            files[split] += [SourceFile(path, label) for path in kept]
            skipped[split] += not_images
        skipped[split].sort(key=lambda item: item.path)
    return Source(root, tuple(classes), files, skipped, {"kind": "imagefolder", "root": str(root)})


def _visible(name: str) -> bool:
    return not name.startswith(".")


def _class_folders(split_dir: Path) -> list[str]:
    if not split_dir.is_dir():
        raise UserError(f"{split_dir}: missing (the data root needs train/ and val/, each with one folder per class)")
    names = sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir() and _visible(entry.name))
    if not names:
        raise UserError(f"{split_dir}: no class folders")
    return names


def _loose_files(root: Path, split: str) -> list[Skipped]:
    """Files directly in train/ or val/ belong to no class."""
    return [
        Skipped(f"{split}/{entry.name}", "not in a class folder")
        for entry in os.scandir(root / split)
        if not entry.is_dir() and _visible(entry.name)
    ]


def _list_class(root: Path, class_dir: str) -> tuple[list[str], list[Skipped]]:
    """Sorted relative paths of the candidate images under root/class_dir (recursively), and the rest."""
    images, skipped = [], []
    for folder, subfolders, names in os.walk(root / class_dir):
        subfolders[:] = [name for name in subfolders if _visible(name)]
        for name in filter(_visible, names):
            path = Path(folder, name).relative_to(root).as_posix()
            try:
                path.encode("utf-8")
            except UnicodeEncodeError:  # a non-UTF-8 name on disk; records store paths as UTF-8
                readable = path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                skipped.append(Skipped(readable, "file name is not valid UTF-8"))
                continue
            suffix = Path(name).suffix.lower()
            if suffix in IMAGE_SUFFIXES:
                images.append(path)
            else:
                skipped.append(Skipped(path, f"not an image file (extension {suffix or 'none'!r})"))
    return sorted(images), skipped


def _stratified_subset(paths: list[str], fraction: float, seed: int, key: str) -> list[str]:
    """`fraction` of one class's files (at least one), chosen by a generator seeded per class, in sorted order."""
    if fraction >= 1:
        return paths
    count = max(1, round(len(paths) * fraction))
    chosen = random.Random(f"{seed}/{key}").sample(range(len(paths)), count)  # str seeds hash stably (sha512)
    return [paths[i] for i in sorted(chosen)]
