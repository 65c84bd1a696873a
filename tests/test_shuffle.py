"""How far the train order moves from one epoch to the next, on both backends, on real records in many small shards
with a DALI shuffle buffer much smaller than the split, as at ImageNet scale.

ImageNet on 8 ranks: 128 shards of ~1,251 records a rank, a buffer (`dali_backend.SHUFFLE_BUFFER`) of about a
tenth of a rank's records, 13 shards' worth. Scaled down here: 434 digits in 32 shards, a 48-record buffer (3.5
shards' worth, so batch-mates recur more than there), one rank. Two statistics per pair of consecutive epochs, mean
over the pairs of epochs 0..4:
- displacement: mean over records of |position in epoch e+1 - position in epoch e| / N; a permutation gives 1/3.
- batch-mate recurrence: the share of the pairs of records batched together in epoch e+1 that were batched
  together in epoch e, over the (b - 1) / (N - 1) a permutation gives.
Measured (seed 0; seeds 1-8 alike): torch (a permutation) 0.33 and 0.96; DALI 0.37 and 1.4; DALI with the shards
in their stored order every epoch, as before, and the same buffer: 0.10 and 2.5 (2.5-2.9 over seeds 1-8): a
record stayed within a few buffers of its place.
"""

from __future__ import annotations

import collections
import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
from conftest import DIGITS_RECORDS_PARAMS, cpu_runtime, make_params

from coarse2fine.data import dali_backend
from coarse2fine.data.convert import convert
from coarse2fine.data.loaders import build_loader

SHARDS, BUFFER, BATCH, EPOCHS = 32, 48, 16, 5


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits of DIGITS_RECORDS_PARAMS (434 train records) in 32 train shards of 13-14 records."""
    params = copy.deepcopy(DIGITS_RECORDS_PARAMS)
    params["data"]["train_shards"] = SHARDS
    records_dir = tmp_path_factory.mktemp("many_shards")
    convert(make_params(**params), cpu_runtime(), records_dir)
    return records_dir


def epoch_orders(records_dir: Path, backend: str) -> list[list[int]]:
    """The record indices in the order one rank trains on them, per epoch."""
    params = make_params(loader={"backend": backend, "workers": 1})
    loader = build_loader(
        "train", records_dir, img_size=32, batch_size=BATCH, runtime=cpu_runtime(), loader_cfg=params.loader,
        augment_cfg=params.augment, crop_pct=1.0, seed=0,
    )
    orders = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        orders.append([int(index) for batch in loader for index in batch["index"]])
    return orders


def displacement(before: list[int], after: list[int]) -> float:
    """Mean over the records in both epochs of |position after - position before| / records per epoch."""
    position_before = {index: position for position, index in enumerate(before)}
    moves = [abs(position - position_before[index]) for position, index in enumerate(after) if index in position_before]
    return float(np.mean(moves)) / len(after)


def batch_mate_recurrence(before: list[int], after: list[int]) -> float:
    """The share of pairs batched together in `after` that were batched together in `before`, over a random
    permutation's (b - 1) / (N - 1)."""
    batch_before = {index: position // BATCH for position, index in enumerate(before)}
    again = 0
    for start in range(0, len(after), BATCH):
        batch = after[start : start + BATCH]
        shared = collections.Counter(batch_before[index] for index in batch if index in batch_before)
        again += sum(count * (count - 1) for count in shared.values())
    pairs = len(after) * (BATCH - 1)
    return again / pairs / ((BATCH - 1) / (len(before) - 1))


def mean_statistics(orders: list[list[int]]) -> tuple[float, float]:
    pairs = list(itertools.pairwise(orders))
    return (
        float(np.mean([displacement(*pair) for pair in pairs])),
        float(np.mean([batch_mate_recurrence(*pair) for pair in pairs])),
    )


def test_dali_reorders_the_records_between_epochs_about_as_much_as_a_permutation(many_shards, monkeypatch):
    monkeypatch.setattr(dali_backend, "SHUFFLE_BUFFER", BUFFER)
    statistics = {backend: mean_statistics(epoch_orders(many_shards, backend)) for backend in ("torch", "dali")}
    (torch_displacement, torch_recurrence), (dali_displacement, dali_recurrence) = statistics.values()
    assert abs(torch_displacement - 1 / 3) < 0.02 and 0.7 < torch_recurrence < 1.3, statistics
    assert dali_displacement > 0.8 * torch_displacement, statistics  # the stored shard order: 0.10
    assert dali_recurrence < 2, statistics  # the stored shard order: 2.5
