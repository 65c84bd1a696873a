"""Which records a rank reads, in what order, and with which seeds: the shard arithmetic, the per-epoch
permutation and seeds both loader backends share, the settings a backend is given and what it yields
(docs/contracts.md, "Loaders")."""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from coarse2fine.config import Augment
from coarse2fine.config import Loader as LoaderConfig
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError


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
