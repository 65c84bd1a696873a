"""`build_loader`: one loader interface over two backends, DALI (default when importable) and torch.

Both backends read the same TFRecord shards and apply the same recipe (docs/contracts.md, "Loaders"); what
they share is defined once, where both import it, so it cannot drift between them: `sampling` (the shard
arithmetic, the per-epoch seeds, the settings a backend gets) and `transforms` (the normalisation constants, the
RandAugment op set, random erasing, the crop-window maths); the RandAugment spec is parsed once, by the params
schema (`config.Augment.rand_augment_spec`). A backend yields raw batches (image,
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
  (`dali_backend.executor`). Same seed -> identical batches, whatever the thread count
  (tests/test_loaders.py).

Shuffling: the train order changes about as much from one epoch to the next on both backends
(tests/test_shuffle.py measures how far records move, on many small shards). torch draws a permutation. DALI
reads whole shards in the epoch's order and draws each batch from a buffer of `dali_backend.SHUFFLE_BUFFER`
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

import itertools
import math
from pathlib import Path
from typing import Iterator, Protocol

import torch

from coarse2fine.config import Augment
from coarse2fine.config import Loader as LoaderConfig
from coarse2fine.data import records
from coarse2fine.data.sampling import Backend, LoaderSettings, count_records, shard_range, train_batches_per_rank
from coarse2fine.data.torch_backend import TorchBackend
from coarse2fine.data.transforms import IDENTITY_AFFINE, center_crop_box, moved_rows, normalised_window
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError


class TokenLabelRows(Protocol):
    """What a loader needs of a token-label store (labels.store.TokenLabelStore): the rows of some records."""

    def lookup(self, record_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities, classes) of the records `record_indices`, in the store's dtypes."""
        ...


class Loader:
    """One split's batches on `runtime.device` (docs/contracts.md, "Loaders")."""

    def __init__(
        self, backend_name: str, backend: Backend, settings: LoaderSettings, token_labels: TokenLabelRows | None = None
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
    batch: dict[str, torch.Tensor], token_labels: TokenLabelRows | None, *, pin: bool = False
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
    token_labels: TokenLabelRows | None = None,
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
    if backend_name == "dali":
        from coarse2fine.data.dali_backend import DaliBackend as backend_class  # here: needs nvidia.dali
    else:
        backend_class = TorchBackend
    return Loader(backend_name, backend_class(shards, settings), settings, token_labels)
