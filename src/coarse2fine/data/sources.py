"""Where the images come from: an ImageNet-style folder tree, or scikit-learn's digits written out as one.

Both become a `Source`: per split, the sorted candidate image files with their labels (after `data.subset`),
the files skipped while listing (with the reason, for the manifest), and a description of the origin.
Digits go through the same folder listing as real data, so the default pipeline exercises that path.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from coarse2fine.config import Data, DigitsSource
from coarse2fine.data.records import SPLITS
from coarse2fine.errors import UserError

# Extensions of the formats PIL can open (not just save); anything else is listed as skipped, not guessed at.
IMAGE_SUFFIXES = frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN)
DIGITS_GREY_LEVELS = 16  # load_digits pixels are 0..16


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
        return list_imagefolder(Path(data.root), subset=data.subset, seed=seed)
    write_digits(scratch, data.digits, seed)
    source = list_imagefolder(scratch, subset=data.subset, seed=seed)
    description = {"kind": "digits", "size": data.digits.size, "val_fraction": data.digits.val_fraction}
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
