"""`build_loader`: one loader interface over two backends, DALI (default when importable) and torch.

Both backends read the same TFRecord shards and apply the same recipe (docs/contracts.md, "Loaders"); what
they share lives here so it cannot drift between them: the shard arithmetic, the per-epoch seeds, the
normalisation constants, the RandAugment op set, random erasing and the crop-window maths (the RandAugment spec
is parsed once, by the params schema: `config.Augment.rand_augment_spec`). A backend yields raw batches (image,
label, index, image_hw, and for training crop_box + flip + affine); `Loader` turns them into the contract's batch
(window, flip, affine) on the runtime's device and stops every rank after the same number of batches.

Determinism and resuming: every epoch's stream is a pure function of (seed, epoch, rank, world), so
`set_epoch(e)` on a fresh loader reproduces epoch e of an uninterrupted run, and `set_epoch(e, k)` the same epoch
from its batch k on (a run resumed from a checkpoint taken inside an epoch). The torch backend starts its sampler
at batch k (nothing is read for the batches before); DALI runs its pipeline through them without finishing them
(it cannot seek: its shuffle buffer and random draws are a stream), which costs their decoding, not their training.
- torch: the train order is `epoch_permutation` of the records, seeded by (seed, epoch); each sample's
  augmentation is seeded by (seed, epoch, record index), independent of workers and ranks.
- DALI: a pipeline cannot be reseeded, and a long-lived one carries its shuffle/augmentation state from
  epoch to epoch (resuming would need its checkpoint). So each epoch defines a fresh pipeline seeded by
  (seed, epoch, rank) whose train reader lists the shards in the epoch's order (`epoch_permutation` of the
  shards). The file list is part of the graph, so one graph serialised once (0.05 s an epoch to deserialise)
  cannot serve: defining costs 0.5 s an epoch with RandAugment, 4 ms without (2 s for a process's first graph),
  measured on 2 CPU cores. On a CPU they run DALI's simple executor, on a GPU its asynchronous one
  (`dali_pipeline.executor`). Same seed -> identical batches, whatever the thread count
  (tests/test_loaders.py).

Shuffling: the train order changes about as much from one epoch to the next on both backends
(tests/test_shuffle.py measures how far records move, on many small shards). torch draws a permutation. DALI
reads whole shards in the epoch's order and draws each batch from a buffer of `dali_pipeline.SHUFFLE_BUFFER`
records (why that size: its comment); with the shards in a fixed order, a record would stay within a few
buffers of its place every epoch.

Training sharding: every rank gets `train_batches_per_rank` full batches (floor(N / world) // batch), a
number every rank computes alike, so DDP never waits on a rank that ran out. torch: rank r takes every
world-th sample of the epoch's permutation, cut to that many batches. DALI: rank r reads the r-th of world
contiguous record ranges of the epoch's shard order (DALI's own split, as `shard_range`), so ranks trade shards
every epoch; ranges differ by at most one record, and DALIGenericIterator with reader_name and DROP already
stops every rank when the smallest range runs out of full batches (measured: 168- and 169-record ranges,
batch 13 -> 12 batches on both).
Validation: rank r reads the contiguous record range `shard_range(N, r, world)` (DALI's own split), every
record exactly once, the last batch partial. DALI's PARTIAL policy pads the smaller shards to the largest
one's batch count with an empty batch (measured); `Loader` stops each rank after its own
ceil(records / batch) batches, which removes it. That cap is the one place batch counts are enforced, for
both backends and both splits.

RandAugment draws from timm's op set (`RAND_AUGMENT_OPS`: colour ops and the geometric rotate, shear, translate).
A geometric op moves pixels away from their label cells, so each train sample also carries the `affine` its
geometric ops composed to (`IDENTITY_AFFINE` when none was drawn), in normalised coordinates: (x, y) of the
output image, in [0, 1] over its width and height, -> (x, y) in the flipped crop before those ops. The token
targets warp the teacher's map of the crop by it (labels/targets.py), so they follow the pixels.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.data.random_erasing import RandomErasing

from coarse2fine.config import Augment
from coarse2fine.config import Loader as LoaderConfig
from coarse2fine.data import records
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.labels.store import TokenLabelStore
from coarse2fine.labels.targets import moved_rows

IMAGE_MEAN = IMAGENET_DEFAULT_MEAN
IMAGE_STD = IMAGENET_DEFAULT_STD
# timm's RandAugment set (its _RAND_TRANSFORMS), which DALI's auto_aug provides too. Left out: Posterize: timm
# 1.0.31 asks Pillow for 0 bits at high magnitudes (m10, or m9 plus mstd noise), which Pillow 13 rejects with a
# ValueError that kills the DataLoader worker.
RAND_AUGMENT_COLOUR_OPS = (
    "auto_contrast",
    "equalize",
    "invert",
    "solarize",
    "solarize_add",
    "color",
    "contrast",
    "brightness",
    "sharpness",
)
RAND_AUGMENT_GEOMETRIC_OPS = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
RAND_AUGMENT_OPS = RAND_AUGMENT_COLOUR_OPS + RAND_AUGMENT_GEOMETRIC_OPS
# timm's strongest geometric ops (level 10; level m is m / 10 of these): degrees, shear factor, and translation as
# a share of the image's width/height (its translate_pct default).
MAX_ROTATE_DEGREES = 30.0
MAX_SHEAR = 0.3
MAX_TRANSLATE = 0.45
IDENTITY_AFFINE = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])


def derive_seed(*parts: int) -> int:
    """A well-mixed 31-bit seed from several integers (any seed API takes it: DALI, numpy, torch)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0] >> 1)


@contextlib.contextmanager
def seeded_global_rngs(seed: int) -> Iterator[None]:
    """torchvision and timm draw from the global python/numpy/torch RNGs: seed them for one sample and restore
    them after (this may run in the training process, whose RNG streams must not change)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed)
        torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also seeds (lazy) CUDA, slowly
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


_NORMALISE_MEAN = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
_NORMALISE_STD = torch.tensor(IMAGE_STD).view(3, 1, 1)


def normalise_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [3, H, W] (any strides) -> float32 [3, H, W] contiguous, normalised: bit for bit what v2's
    ToDtype(float32, scale=True) -> Normalize give, but in place on one contiguous buffer (that chain allocates
    twice and keeps a channels-last stride, which collate then has to gather): 0.85 instead of 1.6 ms a 224 px
    sample, collate included."""
    scaled = pixels.to(torch.float32, memory_format=torch.contiguous_format).mul_(1 / 255)
    return scaled.sub_(_NORMALISE_MEAN).div_(_NORMALISE_STD)


def random_erasing(augment: Augment) -> RandomErasing | None:
    """timm's RandomErasing in pixel mode (a box of per-pixel N(0, 1) noise, normalised units) for a normalised
    CPU image; None when augment.reprob is 0. The torch backend and the DALI backend's host finish use it."""
    return RandomErasing(augment.reprob, mode="pixel", device="cpu") if augment.reprob > 0 else None


def shard_range(num_records: int, shard: int, num_shards: int) -> range:
    """The contiguous records of one shard, split as DALI's readers split them (sizes differ by at most 1)."""
    return range(num_records * shard // num_shards, num_records * (shard + 1) // num_shards)


def epoch_permutation(count: int, seed: int, epoch: int) -> torch.Tensor:
    """The train order of `epoch`: a permutation of range(count) seeded by (seed, epoch), the same on every rank
    (torch: of the records; DALI: of the shards, read in this order)."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))


def train_batches_per_rank(num_records: int, world_size: int, batch_size: int) -> int:
    """Full batches every rank can fill from its smallest possible share: the same number on every rank."""
    batches = num_records // world_size // batch_size
    if batches == 0:
        raise UserError(
            f"batch_size {batch_size}: larger than the {num_records // world_size} training records each of "
            f"{world_size} rank(s) gets; lower the batch size"
        )
    return batches


def eval_transform(img_size: int, crop_pct: float, interpolation: str) -> dict[str, Any]:
    """The val loaders' preprocessing as plain data, stored with a model so that `coarse2fine.predict` (or anyone
    loading it from MLflow) feeds it images exactly as it was validated: resize the shorter side to
    floor(img_size / crop_pct) with `interpolation`, centre-crop img_size, scale to [0, 1], normalise."""
    return {
        "img_size": img_size, "crop_pct": crop_pct, "interpolation": interpolation,
        "mean": list(IMAGE_MEAN), "std": list(IMAGE_STD),
    }


def resized_short_side(img_size: int, crop_pct: float) -> int:
    """Evaluation resizes the shorter side to this, then centre-crops img_size (timm's crop_pct rule)."""
    return math.floor(img_size / crop_pct)


def center_crop_box(image_hw: torch.Tensor, img_size: int, crop_pct: float) -> torch.Tensor:
    """[B, 4] (top, left, height, width) in original pixels of "resize shorter side to floor(S / crop_pct),
    centre crop S" (larger than the image when crop_pct > 1: the crop is padded)."""
    image_hw = image_hw.to(torch.float64)
    side = img_size * image_hw.min(dim=1, keepdim=True).values / resized_short_side(img_size, crop_pct)
    top_left = (image_hw - side) / 2
    return torch.cat([top_left, side, side], dim=1)


def normalised_window(crop_box: torch.Tensor, image_hw: torch.Tensor) -> torch.Tensor:
    """[B, 4] float32 (top/H, left/W, height/H, width/W) from pixel boxes (top, left, height, width)."""
    image_hw = image_hw.to(torch.float64)
    crop_box = crop_box.to(torch.float64)
    return torch.cat([crop_box[:, :2] / image_hw, crop_box[:, 2:] / image_hw], dim=1).to(torch.float32)


def normalised_affine(pixel_map: torch.Tensor, size_hw: torch.Tensor) -> torch.Tensor:
    """[B, 2, 3] maps output -> input in continuous pixel coordinates (x, y; pixel centres at +0.5) of images of
    `size_hw` [B, 2] (height, width) -> the same maps in coordinates normalised to [0, 1], float32."""
    height, width = size_hw.to(torch.float64).unbind(dim=1)
    scale = torch.stack([width, height], dim=1)[:, :, None]  # [B, 2, 1]
    pixel_map = pixel_map.to(torch.float64)
    linear = pixel_map[:, :, :2] * scale.transpose(1, 2) / scale
    shift = pixel_map[:, :, 2:] / scale
    return torch.cat([linear, shift], dim=2).to(torch.float32)


def homogeneous(affine: torch.Tensor) -> torch.Tensor:
    """[..., 2, 3] -> [..., 3, 3] with the row (0, 0, 1)."""
    last_row = torch.zeros_like(affine[..., :1, :])
    last_row[..., 2] = 1
    return torch.cat([affine, last_row], dim=-2)


def count_records(shards: list[tuple[Path, Path]]) -> list[int]:
    """Records per shard: one line per record in its index."""
    counts = []
    for _, index_path in shards:
        with open(index_path, "rb") as index:
            counts.append(sum(1 for _ in index))
    return counts


class Backend(Protocol):
    """What a backend gives `Loader`: raw batches of one epoch (CPU or device tensors)."""

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Epoch `epoch`'s raw batches from its batch `start_batch` on: those an uninterrupted epoch yields there."""
        ...


@dataclass(frozen=True)
class LoaderSettings:
    """Everything a backend needs besides the shard files, computed once here for both backends."""

    split: str  # train | val
    img_size: int
    batch_size: int
    runtime: Runtime
    loader_cfg: LoaderConfig
    augment_cfg: Augment
    crop_pct: float
    seed: int
    record_counts: tuple[int, ...]

    @property
    def num_records(self) -> int:
        return sum(self.record_counts)


class Loader:
    """One split's batches on `runtime.device` (docs/contracts.md, "Loaders")."""

    def __init__(
        self, backend_name: str, backend: Backend, settings: LoaderSettings, token_labels: TokenLabelStore | None = None
    ):
        self.backend = backend_name
        self._impl = backend
        self._settings = settings
        self._token_labels = token_labels
        self._epoch = self._start_batch = 0
        runtime = settings.runtime
        if settings.split == "train":
            self._batches = train_batches_per_rank(settings.num_records, runtime.world_size, settings.batch_size)
            self.num_samples = self._batches * settings.batch_size
        else:
            self.num_samples = len(shard_range(settings.num_records, runtime.rank, runtime.world_size))
            self._batches = math.ceil(self.num_samples / settings.batch_size)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Iterate epoch `epoch` from its batch `start_batch` on (len() stays the whole epoch's batch count)."""
        if not 0 <= start_batch < self._batches:
            raise ValueError(f"start_batch {start_batch}: an epoch has {self._batches} batches")
        self._epoch, self._start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self._batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        raw_batches = self._impl.batches(self._epoch, self._start_batch)
        for raw in itertools.islice(raw_batches, self._batches - self._start_batch):
            yield self._contract_batch(raw)

    def _contract_batch(self, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        settings = self._settings
        image_hw = raw["image_hw"]
        if settings.split == "train":
            crop_box, flip, affine = raw["crop_box"], raw["flip"].to(torch.bool), raw["affine"]
        else:
            crop_box = center_crop_box(image_hw, settings.img_size, settings.crop_pct)
            flip = torch.zeros(len(image_hw), dtype=torch.bool)
            affine = IDENTITY_AFFINE.expand(len(image_hw), 2, 3)
        batch = {
            "image": raw["image"],
            "label": raw["label"].to(torch.int64),
            "index": raw["index"].to(torch.int64),
            "window": normalised_window(crop_box, image_hw),
            "flip": flip,
            "affine": affine.to(torch.float32),
        }
        runtime = settings.runtime
        if settings.split == "train":
            batch = with_target_inputs(batch, self._token_labels, pin=runtime.is_cuda)
        batch = {key: value.to(runtime.device, non_blocking=runtime.is_cuda) for key, value in batch.items()}
        batch["image"] = batch["image"].contiguous(memory_format=runtime.image_memory_format)
        return batch


def with_target_inputs(
    batch: dict[str, torch.Tensor], token_labels: TokenLabelStore | None, *, pin: bool = False
) -> dict[str, torch.Tensor]:
    """A train batch on the host plus what its token targets need, found here so that the training step never
    waits for the GPU: `moved`, the rows whose affine is not the identity (their count is then host metadata), and
    with `token_labels` the records' rows of the store (`token_log_probs`, `token_classes`), kept in the store's
    float16/int16 until the device and, with `pin` (a GPU), in pinned memory so the copy overlaps the step."""
    extra = {"moved": moved_rows(batch["affine"])}
    if token_labels is not None:
        log_probs, classes = token_labels.lookup(batch["index"])
        extra["token_log_probs"] = log_probs.pin_memory() if pin else log_probs
        extra["token_classes"] = classes.pin_memory() if pin else classes
    return {**batch, **extra}


def resolve_backend(name: str) -> str:
    """`auto` is DALI when nvidia.dali imports, else torch."""
    if name == "torch":
        return name
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as error:
        if name == "dali":
            raise UserError(
                f"loader.backend: 'dali' but nvidia.dali does not import ({error}); use auto or torch"
            ) from None
        return "torch"
    return "dali"


def build_loader(
    split: str,
    records_dir: str | Path,
    *,
    img_size: int,
    batch_size: int,
    runtime: Runtime,
    loader_cfg: LoaderConfig,
    augment_cfg: Augment,
    crop_pct: float,
    seed: int,
    token_labels: TokenLabelStore | None = None,
) -> Loader:
    """A loader for `split` ("train": augmented, sharded, equal batches per rank; "val": centre crop, each
    record once), backend per loader_cfg.backend. With `token_labels` each batch also carries its records' rows of
    that store (`token_log_probs`, `token_classes`)."""
    if split not in records.SPLITS:
        raise ValueError(f"split must be one of {records.SPLITS}, got {split!r}")
    shards = records.shard_files(records_dir, split)
    settings = LoaderSettings(
        split=split,
        img_size=img_size,
        batch_size=batch_size,
        runtime=runtime,
        loader_cfg=loader_cfg,
        augment_cfg=augment_cfg,
        crop_pct=crop_pct,
        seed=seed,
        record_counts=tuple(count_records(shards)),
    )
    backend_name = resolve_backend(loader_cfg.backend)
    # Imported here: the DALI module needs nvidia.dali, and both backends import this module's helpers.
    if backend_name == "dali":
        from coarse2fine.data.dali_pipeline import DaliBackend as backend_class
    else:
        from coarse2fine.data.torch_pipeline import TorchBackend as backend_class
    return Loader(backend_name, backend_class(shards, settings), settings, token_labels)
