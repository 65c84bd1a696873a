"""Shared test helpers. Import the plain helpers with `from conftest import make_params, cpu_runtime`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coarse2fine.config import Params, parse_params
from coarse2fine.data.convert import convert
from coarse2fine.data.loaders import build_loader
from coarse2fine.distributed import Runtime

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def make_params(**sections: Any) -> Params:
    """Params from the schema defaults plus nested overrides, validated like params.yaml.

    `make_params(seed=1, data={"subset": 0.3, "digits": {"size": 32}})`: keys left out keep their defaults
    at every level.
    """
    return parse_params(sections, "make_params")


def cpu_runtime() -> Runtime:
    """A world of one on the CPU, without touching torch.distributed."""
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def train_val_loaders(records_dir: Path, params: Params, runtime: Runtime, batch_size: int) -> list:
    """build_loader's train and val loaders over `records_dir` at 32 px with `params`' loader and augment."""
    return [
        build_loader(
            split, records_dir, img_size=32, batch_size=batch_size, runtime=runtime, loader_cfg=params.loader,
            augment_cfg=params.augment, crop_pct=1.0, seed=params.seed,
        )
        for split in ("train", "val")
    ]


DIGITS_RECORDS_PARAMS = {
    "seed": 0,
    "data": {
        "source": "digits",
        "digits": {"size": 32, "val_fraction": 0.2},
        "subset": 0.3,
        "train_shards": 2,
        "val_shards": 1,
        "convert_workers": 1,
    },
}


@pytest.fixture(scope="session")
def digits_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A records dir converted once per session from digits (about 1 s).

    Params (DIGITS_RECORDS_PARAMS): seed 0, 32x32 digit images, val_fraction 0.2, subset 0.3 per class,
    2 train shards + 1 val shard, 1 convert worker. That gives 434 train and 108 val records, 10 classes
    ("0".."9"), every image a re-encoded RGB JPEG of 32x32. Read it with coarse2fine.data.records; do not
    write into it (it is shared by the whole session).
    """
    records_dir = tmp_path_factory.mktemp("digits_records")
    convert(make_params(**DIGITS_RECORDS_PARAMS), cpu_runtime(), records_dir)
    return records_dir
