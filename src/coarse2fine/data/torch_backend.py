"""The torch backend (fallback without DALI): the same shards read with the `tfrecord` package, the same recipe
with torchvision v2 and timm (timm's own RandAugment and RandomErasing), a torch DataLoader.

Random access: `records.ShardReader` loads every shard's index (offset, length per record) once, keeps up to
MAX_OPEN_SHARDS files open in each process that reads (every DataLoader worker, or the main process with workers=0),
and reads record k with a single pread at its offset; the `tfrecord` package parses the Example. So any sampler
order works and sharding is exact. (The package's own reader, called per record with `shard=(k, count)`,
reloads the index text, reopens the file and allocates a 1 MB buffer every time: 0.27 ms a record against
0.06 ms, on 640-record shards.) The sampler yields (epoch, position) keys, so workers know the epoch without
state, and every sample's augmentation is seeded by (seed, epoch, record index): identical whatever the
worker count.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image
from timm.data.auto_augment import rand_augment_transform
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms import v2

from coarse2fine.config import RandAugmentSpec
from coarse2fine.data import records
from coarse2fine.data.sampling import (
    LoaderSettings,
    derive_seed,
    epoch_permutation,
    seeded_global_rngs,
    shard_range,
    train_batches_per_rank,
)
from coarse2fine.data.transforms import (
    IDENTITY_AFFINE,
    RAND_AUGMENT_OPS,
    homogeneous,
    normalised_affine,
    normalise_pixels,
    random_erasing,
    resized_short_side,
)

# timm's names for transforms.RAND_AUGMENT_OPS; with inc1 the ops that have one take their "...Increasing" form.
TIMM_OPS = {
    "auto_contrast": "AutoContrast",
    "equalize": "Equalize",
    "invert": "Invert",
    "solarize": "Solarize",
    "solarize_add": "SolarizeAdd",
    "color": "Color",
    "contrast": "Contrast",
    "brightness": "Brightness",
    "sharpness": "Sharpness",
    "rotate": "Rotate",
    "shear_x": "ShearX",
    "shear_y": "ShearY",
    "translate_x": "TranslateXRel",
    "translate_y": "TranslateYRel",
}
TIMM_INCREASING = frozenset({"solarize", "color", "contrast", "brightness", "sharpness"})


def rotate_map(width: int, height: int, degrees: float) -> list[list[float]]:
    """PIL's Image.rotate(degrees) (counter-clockwise about the centre) as its output -> input pixel map."""
    angle = -math.radians(degrees)
    cos, sin = math.cos(angle), math.sin(angle)
    centre_x, centre_y = width / 2, height / 2
    return [
        [cos, sin, centre_x - cos * centre_x - sin * centre_y],
        [-sin, cos, centre_y + sin * centre_x - cos * centre_y],
    ]


# timm's geometric ops as output -> input pixel maps: (width, height, the op's level argument) -> 2 x 3, the
# coefficients its PIL transform uses (timm.data.auto_augment.shear_x and the others).
PIXEL_MAPS = {
    "Rotate": rotate_map,
    "ShearX": lambda width, height, factor: [[1, factor, 0], [0, 1, 0]],
    "ShearY": lambda width, height, factor: [[1, 0, 0], [factor, 1, 0]],
    "TranslateXRel": lambda width, height, share: [[1, 0, share * width], [0, 1, 0]],
    "TranslateYRel": lambda width, height, share: [[1, 0, 0], [0, 1, share * height]],
}


def timm_rand_augment(spec: RandAugmentSpec):
    names = [
        TIMM_OPS[op] + ("Increasing" if spec.increasing and op in TIMM_INCREASING else "") for op in RAND_AUGMENT_OPS
    ]
    return rand_augment_transform(spec.text, transforms=names)


class GeometricRandAugment:
    """timm's RandAugment over transforms.RAND_AUGMENT_OPS, which also returns the affine (normalised output ->
    input, loaders.py) its geometric ops composed to: each geometric op's function is wrapped to record its
    pixel map, from the very arguments timm drew for it."""

    def __init__(self, spec: RandAugmentSpec):
        self.rand_augment = timm_rand_augment(spec)
        for op in self.rand_augment.ops:
            if op.name in PIXEL_MAPS:
                op.aug_fn = self._recording(op.aug_fn, PIXEL_MAPS[op.name])
        self._pixel_map = torch.eye(3, dtype=torch.float64)

    def _recording(self, apply_op, pixel_map):
        def apply_and_record(image: Image.Image, level_argument: float, **kwargs) -> Image.Image:
            step = torch.tensor(pixel_map(*image.size, level_argument), dtype=torch.float64)
            # The ops applied so far map the output back after this op's map: compose on the right.
            self._pixel_map = self._pixel_map @ homogeneous(step)
            return apply_op(image, level_argument, **kwargs)

        return apply_and_record

    def __call__(self, image: Image.Image) -> tuple[Image.Image, torch.Tensor]:
        self._pixel_map = torch.eye(3, dtype=torch.float64)
        image = self.rand_augment(image)
        size_hw = torch.tensor([[image.height, image.width]])
        return image, normalised_affine(self._pixel_map[None, :2], size_hw)[0]


def to_normalised_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 [3, H, W] normalised (np.array: a writable copy for torch)."""
    return normalise_pixels(torch.from_numpy(np.array(image)).permute(2, 0, 1))


class TrainTransform:
    """random-resized-crop -> resize S x S -> hflip -> RandAugment -> normalise -> random erasing; returns the
    crop box (top, left, height, width) in pixels, the flip and RandAugment's affine with the image."""

    def __init__(self, settings: LoaderSettings):
        augment = settings.augment_cfg
        self.size = [settings.img_size, settings.img_size]
        self.augment = augment
        self.interpolation = InterpolationMode[augment.interpolation.upper()]
        spec = augment.rand_augment_spec
        self.rand_augment = GeometricRandAugment(spec) if spec is not None else None
        self.erase = random_erasing(augment)

    def __call__(self, image: Image.Image) -> dict[str, torch.Tensor]:
        scale, ratio = list(self.augment.scale), list(self.augment.ratio)
        top, left, height, width = RandomResizedCrop.get_params(image, scale, ratio)
        image = v2.functional.resized_crop(
            image, top, left, height, width, self.size, interpolation=self.interpolation, antialias=True
        )
        flip = bool(torch.rand(()) < self.augment.hflip)
        if flip:
            image = v2.functional.horizontal_flip(image)
        affine = IDENTITY_AFFINE
        if self.rand_augment is not None:
            image, affine = self.rand_augment(image)
        image = to_normalised_tensor(image)
        if self.erase is not None:
            image = self.erase(image)
        return {
            "image": image, "crop_box": torch.tensor([top, left, height, width]), "flip": torch.tensor(flip),
            "affine": affine,
        }


def val_resize_and_crop(img_size: int, crop_pct: float, interpolation: str) -> v2.Compose:
    """Resize the shorter side to floor(S / crop_pct) -> centre crop S (padded if larger): the val loader's and
    `coarse2fine.predict`'s geometry (a model's recorded eval transform)."""
    return v2.Compose(
        [
            v2.Resize(
                resized_short_side(img_size, crop_pct),
                interpolation=InterpolationMode[interpolation.upper()],
                antialias=True,
            ),
            v2.CenterCrop(img_size),
        ]
    )


class ValTransform:
    """Resize the shorter side to floor(S / crop_pct) -> centre crop S (padded if larger) -> normalise."""

    def __init__(self, settings: LoaderSettings):
        self.resize_and_crop = val_resize_and_crop(
            settings.img_size, settings.crop_pct, settings.augment_cfg.interpolation
        )

    def __call__(self, image: Image.Image) -> dict[str, torch.Tensor]:
        return {"image": to_normalised_tensor(self.resize_and_crop(image))}


class RecordDataset(Dataset):
    """The records of one split, addressed by position in shard order; items are keyed (epoch, position)."""

    def __init__(self, shards: list[tuple[Path, Path]], settings: LoaderSettings):
        self.reader = records.ShardReader(shards)
        self.seed = settings.seed
        self.transform = TrainTransform(settings) if settings.split == "train" else ValTransform(settings)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        epoch, position = key
        record = self.reader.read_position(position)
        record_index, label = int(record["index"][0]), int(record["label"][0])
        image = Image.open(io.BytesIO(record["image"]))
        if image.mode != "RGB":  # greyscale JPEGs pass through convert; converting an RGB image would only copy it
            image = image.convert("RGB")
        with seeded_global_rngs(derive_seed(self.seed, epoch, record_index)):
            sample = self.transform(image)
        return {
            **sample,
            "label": torch.tensor(label),
            "index": torch.tensor(record_index),
            "image_hw": torch.tensor([image.height, image.width]),
        }


class EpochSampler(Sampler):
    """This rank's positions for the current epoch, as (epoch, position) keys."""

    def __init__(self, settings: LoaderSettings):
        self.settings = settings
        self.epoch = self.start = 0  # start: the positions of the epoch's batches already trained on, skipped

    def positions(self) -> list[int]:
        settings, runtime = self.settings, self.settings.runtime
        if settings.split == "val":
            return list(shard_range(settings.num_records, runtime.rank, runtime.world_size))
        order = epoch_permutation(settings.num_records, settings.seed, self.epoch)
        batches = train_batches_per_rank(settings.num_records, runtime.world_size, settings.batch_size)
        return order[runtime.rank :: runtime.world_size][self.start : batches * settings.batch_size].tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(self.epoch, position) for position in self.positions()])

    def __len__(self) -> int:
        return len(self.positions())


class TorchBackend:
    """One DataLoader for the loader's life (persistent workers); each epoch re-reads the sampler."""

    def __init__(self, shards: list[tuple[Path, Path]], settings: LoaderSettings):
        workers = settings.loader_cfg.workers
        records.require_open_file_limit(workers, "loader.workers")
        self._sampler = EpochSampler(settings)
        self._loader = DataLoader(
            RecordDataset(shards, settings),
            batch_size=settings.batch_size,
            sampler=self._sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=settings.loader_cfg.prefetch if workers > 0 else None,
            pin_memory=settings.runtime.is_cuda,
            # Its own generator: the DataLoader draws a base seed per epoch (unused here: samples are seeded
            # by key), which would otherwise come from, and advance, the training process's torch RNG.
            generator=torch.Generator(),
        )

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        self._sampler.epoch, self._sampler.start = epoch, start_batch * self._loader.batch_size
        return iter(self._loader)
