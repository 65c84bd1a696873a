"""The loaders on real TFRecords, both backends: batch contract, sharding across ranks (in-process ranks and a real
2-process torchrun), crop windows and flips against PIL, what RandAugment and random erasing do, EXIF orientation,
determinism and resuming.

Run as a script (`torchrun --nproc_per_node=2 tests/test_loaders.py RECORDS OUT`), this file is the
per-rank program of `test_sharding_under_torchrun`.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import DIGITS_RECORDS_PARAMS, LOADER_GRAPHS, cpu_runtime, make_params, torchrun_command
from PIL import Image

from coarse2fine import distributed
from coarse2fine.data import dali_backend, records
from coarse2fine.data.convert import convert
from coarse2fine.data.loaders import build_loader
from coarse2fine.data.transforms import IDENTITY_AFFINE, IMAGE_MEAN, IMAGE_STD
from coarse2fine.labels.targets import moved_rows
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError

BACKENDS = ("dali", "torch")
GRAPHS = tuple(LOADER_GRAPHS)  # the contract and geometry checks run on each
IMG_SIZE = 32
FULL_AUGMENT = {"rand_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "hflip": 0.5}
# odd_records: 337 train records (odd) over 2 ranks with batch 13: DALI's contiguous shards hold 168 and 169
# records, i.e. 12 and 13 full batches; the common count (12) must win on both ranks.
ODD_TRAIN, ODD_VAL = 337, 113
TRAIN_BATCH, TRAIN_BATCHES_PER_RANK = 13, 12
VAL_BATCH = 8


def make_loader(
    records_dir, split, backend, *, runtime=None, batch_size=16, augment=None, crop_pct=1.0, seed=0, workers=0,
    prefetch=2, mmap="auto",
):
    loader = {**LOADER_GRAPHS[backend], "workers": workers, "prefetch": prefetch, "mmap": mmap}
    params = make_params(loader=loader, augment=augment or {})
    return build_loader(
        split,
        records_dir,
        img_size=IMG_SIZE,
        batch_size=batch_size,
        runtime=runtime or cpu_runtime(),
        loader_cfg=params.loader,
        augment_cfg=params.augment,
        crop_pct=crop_pct,
        seed=seed,
    )


def rank_runtime(rank: int, world_size: int) -> Runtime:
    """A rank of a simulated world: the loaders only read rank/world/device, no process group needed."""
    return Runtime(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))


def epoch(loader, number: int, start_batch: int = 0) -> list[dict[str, torch.Tensor]]:
    loader.set_epoch(number, start_batch)
    return list(loader)


def assert_same_batches(expected: list[dict], actual: list[dict]) -> None:
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def indices(batches) -> list[int]:
    return [int(i) for batch in batches for i in batch["index"]]


def split_records(records_dir: Path, split: str) -> dict[int, dict]:
    """record index -> the record, read with the records module (not the loaders under test)."""
    shards = records.shard_files(records_dir, split)
    return {record["index"]: record for path, _ in shards for record in records.read_shard(path)}


@pytest.fixture(scope="module")
def odd_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Odd record counts in both splits, val in 2 shards."""
    params = copy.deepcopy(DIGITS_RECORDS_PARAMS)
    params["data"].update(subset=0.25, val_shards=2)
    params["data"]["digits"]["val_fraction"] = 0.25
    records_dir = tmp_path_factory.mktemp("odd_records")
    manifest = convert(make_params(**params), cpu_runtime(), records_dir)
    counts = (manifest["splits"]["train"]["images"], manifest["splits"]["val"]["images"])
    assert counts == (ODD_TRAIN, ODD_VAL), f"the converter's split sizes changed to {counts}: choose new params"
    return records_dir


@pytest.mark.parametrize("split", ["train", "val"])
def test_both_backends_yield_the_contract_batch(digits_records, split):
    augment = FULL_AUGMENT if split == "train" else {}
    structures = {}
    for backend in GRAPHS:
        loader = make_loader(digits_records, split, backend, batch_size=16, augment=augment)
        assert loader.backend == LOADER_GRAPHS[backend]["backend"]
        batch = next(iter(loader))
        if split == "train":  # the rows that a geometric op moved: their number varies from batch to batch
            moved = batch.pop("moved")
            assert moved.dtype == torch.int64 and torch.equal(moved, moved_rows(batch["affine"]))
        structures[backend] = {
            key: (tensor.dtype, tuple(tensor.shape), tensor.device.type) for key, tensor in batch.items()
        }
        assert 0 <= batch["window"].min() and batch["window"][:, :2].max() < 1 and batch["window"][:, 2:].max() <= 1
        assert set(batch["label"].tolist()) <= set(range(10))
        assert batch["image"].abs().max() < 5  # normalised, not 0..255
        assert batch["image"].is_contiguous()  # NCHW on a CPU (Runtime.image_memory_format)
    assert structures["dali"] == structures["dali_all"] == structures["torch"] == {
        "image": (torch.float32, (16, 3, IMG_SIZE, IMG_SIZE), "cpu"),
        "label": (torch.int64, (16,), "cpu"),
        "index": (torch.int64, (16,), "cpu"),
        "window": (torch.float32, (16, 4), "cpu"),
        "flip": (torch.bool, (16,), "cpu"),
        "affine": (torch.float32, (16, 2, 3), "cpu"),
    }


def test_both_backends_see_the_same_records_per_epoch(digits_records, odd_records):
    """Over one epoch on 2 ranks, every record once, with the label it holds, on both backends: val with an odd
    count (113), train where full batches take every record (434 records = 2 ranks x 31 batches x 7)."""
    cases = {"train": (digits_records, 7), "val": (odd_records, VAL_BATCH)}
    for split, (records_dir, batch_size) in cases.items():
        expected = {index: record["label"] for index, record in split_records(records_dir, split).items()}
        if split == "train":
            assert len(expected) % (2 * batch_size) == 0, "premise: no partial batch to drop"
        for backend in BACKENDS:
            seen: dict[int, int] = {}
            for rank in range(2):
                loader = make_loader(records_dir, split, backend, runtime=rank_runtime(rank, 2), batch_size=batch_size)
                batches = epoch(loader, 3)
                assert len(batches) == len(loader)
                assert sum(len(batch["index"]) for batch in batches) == loader.num_samples
                for batch in batches:
                    for index, label in zip(batch["index"].tolist(), batch["label"].tolist()):
                        assert index not in seen, f"{backend} {split}: record {index} twice"
                        seen[index] = label
            assert seen == expected, f"{backend} {split}"


def _unnormalised(image: torch.Tensor) -> np.ndarray:
    """[3, S, S] normalised -> [S, S, 3] in 0..255."""
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    return ((image * std + mean) * 255).permute(1, 2, 0).numpy()


def _crop_with_pil(jpeg: bytes, window, flip: bool) -> np.ndarray:
    """The record's JPEG cropped to `window` (fractions of H, W), resized to S x S bicubic, flipped."""
    image = Image.open(io.BytesIO(jpeg)).convert("RGB")
    top, left, height, width = (float(v) for v in window * torch.tensor([image.height, image.width] * 2))
    crop = image.resize((IMG_SIZE, IMG_SIZE), Image.Resampling.BICUBIC, box=(left, top, left + width, top + height))
    if flip:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(crop, dtype=np.float32)


def _reproduction_errors(batch: dict[str, torch.Tensor], jpegs: dict[int, bytes]) -> np.ndarray:
    """Per image, the mean |loader image - its record's JPEG cropped by PIL to the window, flipped by the flag|
    on 0..255: about 0-1 for an image that is its window's crop (decoder and resampler differences)."""
    return np.array([
        np.abs(_crop_with_pil(jpegs[int(index)], window, bool(flip)) - _unnormalised(image)).mean()
        for image, index, window, flip in zip(batch["image"], batch["index"], batch["window"], batch["flip"])
    ])


def _jpegs(records_dir: Path, split: str) -> dict[int, bytes]:
    return {index: record["image"] for index, record in split_records(records_dir, split).items()}


@pytest.mark.parametrize("backend", GRAPHS)
@pytest.mark.parametrize("split", ["train", "val"])
def test_window_and_flip_reproduce_the_crop(digits_records, backend, split):
    """Cropping the original JPEG with the returned window (and flipping by the flag) gives the loader's image;
    the un-flipped or whole-image alternatives do not. RandAugment and erasing off: they are not geometric."""
    jpegs = _jpegs(digits_records, split)
    augment = {"scale": (0.2, 0.6), "hflip": 0.5}
    # crop_pct 0.875: resize to 36, centre crop 32, so the val window is a real sub-window (1.78 px margins).
    loader = make_loader(digits_records, split, backend, batch_size=32, augment=augment, crop_pct=0.875)
    batch = next(iter(loader))
    errors = {"reported": [], "flip inverted": [], "whole image": []}
    for image, index, window, flip in zip(batch["image"], batch["index"], batch["window"], batch["flip"]):
        jpeg, ours = jpegs[int(index)], _unnormalised(image)
        for name, (crop_window, crop_flip) in {
            "reported": (window, bool(flip)),
            "flip inverted": (window, not flip),
            "whole image": (torch.tensor([0.0, 0.0, 1.0, 1.0]), bool(flip)),
        }.items():
            errors[name].append(np.abs(_crop_with_pil(jpeg, crop_window, crop_flip) - ours).mean())
    mean_error = {name: float(np.mean(values)) for name, values in errors.items()}
    assert mean_error["reported"] < 2.0, mean_error  # on 0..255: decoder and resampler differences only
    assert mean_error["flip inverted"] > 10 * mean_error["reported"], mean_error
    assert mean_error["whole image"] > 10 * mean_error["reported"], mean_error
    if split == "train":
        assert 0 < batch["flip"].sum() < len(batch["flip"])
    else:
        assert not batch["flip"].any()
        assert torch.allclose(batch["window"], torch.tensor([2 / 36, 2 / 36, 32 / 36, 32 / 36]).expand(32, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stage_crop_scale_bounds_that_stage_s_train_crops(digits_records, backend):
    """finetune.crop_scale replaces augment.scale in fine-tuning's train loader only; pre-training keeps
    augment.scale. Areas are of the whole image (window height x width), whole pixels off the drawn area."""
    params = make_params(loader={"backend": backend, "workers": 0}, finetune={"crop_scale": [0.8, 1.0]})
    areas = {}
    for stage in ("pretrain", "finetune"):
        cfg = getattr(params, stage)
        loader = build_loader(
            "train", digits_records, img_size=IMG_SIZE, batch_size=64, runtime=cpu_runtime(), loader_cfg=params.loader,
            augment_cfg=cfg.train_augment(params.augment), crop_pct=1.0, seed=0,
        )
        window = next(iter(loader))["window"]
        areas[stage] = window[:, 2] * window[:, 3]
    assert areas["finetune"].min() >= 0.8 - 2 / IMG_SIZE, areas["finetune"]
    assert areas["pretrain"].min() < 0.6, areas["pretrain"]  # augment.scale's default: [0.35, 1]


def test_both_backends_give_the_same_val_images(digits_records):
    """Same pixels up to decoder/resampler differences; with crop_pct > 1 both pad black around the image."""
    crops = {
        (backend, crop_pct): next(iter(make_loader(digits_records, "val", backend, batch_size=32, crop_pct=crop_pct)))
        for backend in BACKENDS
        for crop_pct in (0.875, 1.15)
    }
    for crop_pct in (0.875, 1.15):
        dali, torch_ = crops["dali", crop_pct], crops["torch", crop_pct]
        assert torch.equal(dali["index"], torch_["index"]) and torch.equal(dali["window"], torch_["window"])
    difference = (crops["dali", 0.875]["image"] - crops["torch", 0.875]["image"]).abs().mean()
    assert difference < 0.02  # normalised units: about 1/255 of a pixel value
    # 1.15: the 27-pixel resize sits in 32 x 32 with 2-3 pixels of padding per side (which side gets 3 differs
    # by half a pixel between the backends; the window is the exact centre).
    black = -torch.tensor(IMAGE_MEAN) / torch.tensor(IMAGE_STD)
    for backend in BACKENDS:
        image = crops[backend, 1.15]["image"]
        for border in (image[..., :2, :], image[..., -2:, :], image[..., :, :2], image[..., :, -2:]):
            assert torch.allclose(border, black.view(1, 3, 1, 1).expand_as(border), atol=1e-5), backend


@pytest.mark.parametrize("backend", GRAPHS)
def test_same_seed_and_epoch_give_identical_batches_and_resume(digits_records, backend):
    """Two fresh loaders agree bit for bit; epoch 1 of an uninterrupted run equals a fresh loader started at
    epoch 1 (resume); epochs differ in order. Every random augmentation on."""
    runtime = rank_runtime(1, 2)
    # Another worker/thread count, prefetch depth and way of reading the files too: the stream must not depend on
    # these speed knobs.
    uninterrupted = make_loader(digits_records, "train", backend, runtime=runtime, augment=FULL_AUGMENT, mmap=True)
    first, second = epoch(uninterrupted, 0), epoch(uninterrupted, 1)
    resumed = make_loader(
        digits_records, "train", backend, runtime=runtime, augment=FULL_AUGMENT, workers=2, prefetch=3, mmap=False
    )
    for expected, actual in ((second, epoch(resumed, 1)), (first, epoch(resumed, 0))):
        assert_same_batches(expected, actual)
    # A new order, and a new share of the records for this rank (torch: a fresh permutation; DALI: the next shard).
    assert indices(first) != indices(second) and set(indices(first)) != set(indices(second))
    # Resumed inside an epoch (a checkpoint taken there): the rest of that epoch's stream, batch for batch.
    assert_same_batches(second[5:], epoch(resumed, 1, start_batch=5))
    assert len(resumed) == len(uninterrupted)  # still the whole epoch's count: the Trainer's update arithmetic


@pytest.mark.parametrize("backend", BACKENDS)
def test_val_batches_are_the_same_whatever_the_workers_prefetch_and_mmap(digits_records, backend):
    """What evaluate and every stage's validation read: the speed knobs, which no stage lists, change no batch."""
    expected = make_loader(digits_records, "val", backend, batch_size=32, mmap=True)
    actual = make_loader(digits_records, "val", backend, batch_size=32, workers=2, prefetch=3, mmap=False)
    assert_same_batches(list(expected), list(actual))


# /proc/self/mountinfo as a cluster node may show it: the root on local disk, shared storage over NFS with a local
# scratch disk mounted inside it, Lustre at a mount point with a space (written \040), a FUSE object store, a
# FUSE driver of a local disk, and an NFS export over-mounted by a local file system at the same point.
MOUNT_TABLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
31 22 0:45 / /shared rw,relatime shared:20 - nfs4 filer:/export/shared rw,vers=4.2
32 31 8:17 / /shared/scratch rw,relatime shared:21 - xfs /dev/sdb1 rw
33 22 0:46 / /mnt/lustre\\040data rw,relatime - lustre 10.0.0.1@o2ib:/fs rw,flock
34 22 0:47 / /buckets rw,nosuid,nodev shared:30 master:2 - fuse.gcsfuse imagenet rw,user_id=0
35 22 8:33 / /windows rw,relatime - fuseblk /dev/sdc1 rw
36 22 0:48 / /data rw,relatime - nfs filer:/data rw
37 22 8:49 / /data rw,relatime - ext4 /dev/sdd1 rw
"""


@pytest.mark.parametrize(
    ("path", "fs_type", "network"),
    [
        ("/", "ext4", False),
        ("/home/user/records/train-00000.tfrecord", "ext4", False),
        ("/shared/imagenet/train-00000.tfrecord", "nfs4", True),
        ("/shared", "nfs4", True),
        ("/sharedx/train-00000.tfrecord", "ext4", False),  # a prefix of the name is not a mount point above it
        ("/shared/scratch/train-00000.tfrecord", "xfs", False),  # the longest mount point above the path wins
        ("/mnt/lustre data/train-00000.tfrecord", "lustre", True),
        ("/mnt/lustre/train-00000.tfrecord", "ext4", False),
        ("/buckets/train-00000.tfrecord", "fuse.gcsfuse", True),
        ("/windows/train-00000.tfrecord", "fuseblk", False),
        ("/data/train-00000.tfrecord", "ext4", False),  # the later mount at a point hides the earlier
    ],
)
def test_the_file_system_of_a_path_is_read_from_the_mount_table(path, fs_type, network):
    assert dali_backend.file_system_type(path, MOUNT_TABLE) == fs_type
    assert dali_backend.is_network_file_system(fs_type) is network


def reader_arguments(loader) -> dict:
    """The arguments DALI's tfrecord reader is given in `loader`'s pipeline (its epoch 0's; defined, not built)."""
    backend = loader._impl
    pipeline = backend._define(backend._shards, seed=0)
    with dali_backend._without_dali_alias_warnings():
        pipeline._build_graph()  # DALI's graph definition only (private, pinned DALI)
    (reader,) = [op._op for op in pipeline._ops if op._op.schema.Name() == "readers___TFRecord"]
    return reader._init_args


@pytest.mark.parametrize("split", ["train", "val"])
def test_records_on_a_network_file_system_are_read_without_mmap(digits_records, split, tmp_path, monkeypatch):
    """loader.mmap auto: DALI's reader gets dont_use_mmap where the records lie on NFS (its documentation's advice),
    maps them on a local disk; true and false are obeyed whatever the file system."""
    records_dir = os.path.realpath(digits_records)  # as the mount table names it: links resolved
    table = tmp_path / "mountinfo"
    monkeypatch.setattr(dali_backend, "MOUNT_TABLE", table)
    for records_fs, mmap, mapped in [
        ("nfs4", "auto", False), ("ext4", "auto", True), ("nfs4", True, True), ("ext4", False, False),
    ]:
        escaped = records_dir.replace("\\", "\\134").replace(" ", "\\040")
        table.write_text(
            "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
            f"31 22 0:45 / {escaped} rw,relatime shared:20 - {records_fs} filer:/records rw\n"
        )
        loader = make_loader(digits_records, split, "dali", mmap=mmap)
        assert loader._impl.maps_records is mapped, (records_fs, mmap)
        assert reader_arguments(loader)["dont_use_mmap"] is not mapped, (records_fs, mmap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loading_in_process_leaves_the_global_rngs_alone(digits_records, backend):
    """Per-sample seeding (random erasing) runs in the training process with torch's workers=0 and on DALI's
    CPU path (which finishes batches on the host): the process's RNG streams must not move."""
    loader = make_loader(digits_records, "train", backend, augment=FULL_AUGMENT, batch_size=64)
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    next(iter(loader))
    actual = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(actual[0], expected[0]) and np.array_equal(actual[1], expected[1]) and actual[2] == expected[2]


@pytest.mark.parametrize("backend", GRAPHS)
def test_rand_augment_changes_a_clear_share_of_the_crops(digits_records, backend):
    """Without RandAugment every train image is its window's crop (test_window_and_flip_reproduce_the_crop). With
    it, each of the n=2 draws is one of 14 ops (9 colour, 5 geometric) or one of as many identities: about a
    quarter of the images draw two identities and stay their window's crop, most of the others change far beyond
    decoder noise (measured: about 60 % above 10 on 0..255, on both backends), and the samples that drew a
    geometric op, 1 - (23/28)^2 = 33 % expected, carry its affine."""
    augment = {"hflip": 0.5, "rand_augment": "rand-m9-mstd0.5-inc1"}
    batch = next(iter(make_loader(digits_records, "train", backend, batch_size=64, augment=augment)))
    errors = _reproduction_errors(batch, _jpegs(digits_records, "train"))
    assert (errors > 10).mean() > 1 / 3, np.round(errors, 1)
    assert (errors < 2).mean() > 1 / 10, np.round(errors, 1)  # untouched draws: the crop itself is unchanged
    moved = (batch["affine"] != IDENTITY_AFFINE).flatten(1).any(dim=1)
    assert 0.15 < moved.float().mean() < 0.5, moved.float().mean()
    assert (errors[moved.numpy()] > 2).all()  # a moved image is not its crop


@pytest.mark.parametrize("backend", GRAPHS)
def test_random_erasing_fills_one_rectangle_with_noise(digits_records, backend):
    """reprob=1 against reprob=0, same records and seed: every image differs in exactly one rectangle of
    2 %..1/3 of its area (timm's range, up to rounding), filled with N(0, 1) noise in normalised units (timm's
    pixel mode); windows, flips and every other pixel are unchanged."""
    kept, erased = (
        next(iter(make_loader(digits_records, "train", backend, batch_size=64, augment={"hflip": 0.5, "reprob": p})))
        for p in (0.0, 1.0)
    )
    for key in ("index", "window", "flip"):
        assert torch.equal(kept[key], erased[key]), key
    assert_one_noise_rectangle_each(kept["image"], erased["image"])


def assert_one_noise_rectangle_each(kept: torch.Tensor, erased: torch.Tensor) -> None:
    """Each erased image [C, H, W] differs from its kept twin in one rectangle of 2 %..1/3 of its area (timm's
    range, up to rounding), together filled with N(0, 1) noise."""
    noise = []
    for image, changed in zip(erased, (kept != erased).any(dim=1)):
        rows, cols = changed.any(dim=1).nonzero()[:, 0], changed.any(dim=0).nonzero()[:, 0]
        assert len(rows) > 0, "an image without an erased rectangle"
        box = (slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1))
        assert changed[box].all() and changed.sum() == changed[box].sum(), "the changed pixels are not one rectangle"
        assert 0.015 < changed.float().mean() < 0.4
        noise.append(image[:, box[0], box[1]].flatten())
    noise = torch.cat(noise)
    assert abs(noise.mean()) < 0.1 and 0.9 < noise.std() < 1.1, (noise.mean(), noise.std())


def dali_graph(records_dir, split: str, device: str, augment: dict, **pipeline):
    """The loaders' DALI graph for `split`, as `DaliLoader` defines it, on `device` ("cpu", or "mixed": the GPU's)."""
    params = make_params(augment=augment)
    shards = records.shard_files(records_dir, split)
    common = dict(
        files=[str(tfrecord) for tfrecord, _ in shards], index_files=[str(index) for _, index in shards],
        shard_id=0, num_shards=1, img_size=IMG_SIZE, device=device, num_threads=1, **pipeline,
    )
    if split == "train":
        return dali_backend.train_pipeline(
            augment=params.augment, rand_spec=params.augment.rand_augment_spec, finish_on_host=False, **common
        )
    return dali_backend.val_pipeline(crop_pct=0.875, interpolation=params.augment.interpolation, **common)


GPU_AUGMENTS = [
    {"hflip": hflip, "reprob": reprob, "rand_augment": rand_augment, "interpolation": interpolation}
    for hflip in (0.0, 0.5) for reprob in (0.0, 0.25) for rand_augment in ("", "rand-m9-n2", FULL_AUGMENT["rand_augment"])
    for interpolation in ("bilinear", "bicubic")
]


@pytest.mark.parametrize("augment", GPU_AUGMENTS, ids=lambda augment: "-".join(map(str, augment.values())))
def test_the_gpu_graphs_use_only_operators_dali_registers_where_they_are_placed(digits_records, augment):
    """No GPU needed: the GPU graphs (decoding `mixed`, everything after it on the GPU) are defined with device 0
    but never built, and every operator's placement is looked up in DALI's own registries, which is where a GPU
    build would fail (as fn.ones_like did: DALI registers it for the CPU only)."""
    from nvidia.dali import backend

    registered = {
        "cpu": set(backend.RegisteredCPUOps(True)), "gpu": set(backend.RegisteredGPUOps(True)),
        "mixed": set(backend.RegisteredMixedOps(True)),
    }
    for split in ("train", "val"):
        with dali_backend._without_dali_alias_warnings():  # DALI's own RandAugment calls deprecated aliases
            graph = dali_graph(digits_records, split, "mixed", augment, batch_size=4, device_id=0)
            graph._build_graph()  # DALI's graph definition only: no device is touched (private, pinned DALI)
        placed = {(op._op.schema.Name(), op._op.device) for op in graph._ops}  # the backend's names
        assert ("Erase", "gpu") in placed or augment["reprob"] == 0 or split == "val"
        unregistered = sorted((name, device) for name, device in placed if name not in registered[device])
        assert not unregistered, f"{split}: DALI has no such operator where the graph places it: {unregistered}"


def published_augments() -> list[dict]:
    """Every distinct `augment` section of params.yaml and the profiles (timm's plain rand-m9 too, the other spec
    the GPU crash was seen with), in both interpolations."""
    root = Path(__file__).resolve().parents[1]
    files = [root / "params.yaml", *sorted(root.glob("profiles/*.yaml"))]
    sections = [yaml.safe_load(path.read_text())["augment"] for path in files]
    sections.append({**sections[-1], "rand_augment": "rand-m9"})
    combos = {
        json.dumps({**section, "interpolation": interpolation}, sort_keys=True)
        for section in sections for interpolation in ("bilinear", "bicubic")
    }
    return [json.loads(combo) for combo in sorted(combos)]


@pytest.mark.parametrize(
    "augment", published_augments(),
    ids=lambda augment: "-".join(str(augment[key]) for key in ("rand_augment", "hflip", "reprob", "interpolation")),
)
def test_the_gpu_train_graph_runs_every_published_augment_on_the_cpu(digits_records, augment):
    """The all-DALI train graph (what a GPU runs) over several batches of every augment a profile or params.yaml
    sets: the host-finished graph's batch contract (the same keys, dtypes, shapes, layout), and the same share of
    images a geometric op moved (its affine) as that graph. Its RandAugment crashed on a GPU's first batch
    (2026-11-27), and on this CPU too once the graph ran here."""
    batches = {
        graph: list(itertools.islice(make_loader(digits_records, "train", graph, batch_size=16, augment=augment), 4))
        for graph in ("dali", "dali_all")
    }
    for host, device in zip(*batches.values()):
        assert {k: (v.dtype, v.shape) for k, v in device.items()} == {k: (v.dtype, v.shape) for k, v in host.items()}
        assert device["image"].is_contiguous() and torch.isfinite(device["image"]).all()
        assert torch.equal(device["moved"], moved_rows(device["affine"]))
    moved = {
        graph: np.mean([bool((b["affine"] != IDENTITY_AFFINE).flatten(1).any(1)[i]) for b in got for i in range(16)])
        for graph, got in batches.items()
    }
    if augment["rand_augment"]:  # 1 - (23/28)^2 = 33 % of the samples draw a geometric op, on both graphs
        assert 0.15 < moved["dali_all"] < 0.55 and 0.15 < moved["dali"] < 0.55, moved
    else:
        assert moved == {"dali": 0.0, "dali_all": 0.0}


EXIF_ORIENTATION_TAG = 0x0112
EXIF_HEIGHT, EXIF_WIDTH = 32, 48


@pytest.fixture(scope="module")
def exif_rotated_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Records of 48 x 32 (W x H) JPEGs tagged EXIF Orientation 6 ("rotate 90 degrees clockwise to display"),
    passed through byte for byte by convert. Red marks the left half, green grows downwards and blue rightwards,
    so every window has its own content and the rotated reading differs everywhere."""
    pixels = np.zeros((EXIF_HEIGHT, EXIF_WIDTH, 3), np.uint8)
    pixels[:, : EXIF_WIDTH // 2, 0] = 230
    pixels[..., 1] = np.linspace(0, 255, EXIF_HEIGHT)[:, None]
    pixels[..., 2] = np.linspace(0, 255, EXIF_WIDTH)[None, :]
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = 6
    root = tmp_path_factory.mktemp("exif_images")
    for split, count in (("train", 8), ("val", 4)):
        (root / split / "a").mkdir(parents=True)
        for number in range(count):
            Image.fromarray(pixels).save(root / split / "a" / f"{number}.jpg", quality=95, exif=exif)
    records_dir = tmp_path_factory.mktemp("exif_records")
    data = {"source": "imagefolder", "root": str(root), "train_shards": 1, "val_shards": 1, "convert_workers": 1}
    manifest = convert(make_params(data=data), cpu_runtime(), records_dir)
    assert [manifest["splits"][split]["passed_through"] for split in records.SPLITS] == [8, 4]
    return records_dir


def test_both_backends_ignore_exif_orientation(exif_rotated_records):
    """The ImageNet convention (PIL, torchvision, timm, the TF reference): pixels as stored, EXIF orientation
    ignored, in the records' width/height, in val images and windows, and in the train crop windows, on both
    backends (DALI's decoders would rotate by default)."""
    stored = split_records(exif_rotated_records, "val")
    assert {(record["height"], record["width"]) for record in stored.values()} == {(EXIF_HEIGHT, EXIF_WIDTH)}
    val = {backend: next(iter(make_loader(exif_rotated_records, "val", backend, batch_size=4))) for backend in BACKENDS}
    # crop_pct 1: the shorter side stays 32, the centre 32 columns of 48 are kept.
    centre = torch.tensor([0.0, 8 / EXIF_WIDTH, 1.0, 32 / EXIF_WIDTH])
    for backend, batch in val.items():
        assert torch.allclose(batch["window"], centre.expand(4, 4)), backend
        assert _reproduction_errors(batch, _jpegs(exif_rotated_records, "val")).max() < 2, backend
    assert (val["dali"]["image"] - val["torch"]["image"]).abs().mean() < 0.02
    train_jpegs = _jpegs(exif_rotated_records, "train")
    for backend in BACKENDS:
        loader = make_loader(
            exif_rotated_records, "train", backend, batch_size=4, augment={"scale": (0.2, 0.6), "hflip": 0.5}
        )
        batches = [batch for number in range(2) for batch in epoch(loader, number)]
        errors = np.concatenate([_reproduction_errors(batch, train_jpegs) for batch in batches])
        assert errors.max() < 2, (backend, np.round(errors, 1))


def test_a_batch_larger_than_a_ranks_share_is_a_user_error(odd_records):
    with pytest.raises(UserError, match="batch_size 200"):
        make_loader(odd_records, "train", "torch", runtime=rank_runtime(0, 2), batch_size=200)


@pytest.mark.slow
def test_sharding_under_torchrun(odd_records, tmp_path):
    """Two real processes: val records exactly once across ranks (113, odd); train batches equal in number on both
    ranks (12 each, although DALI's shards hold 168 and 169 records) and disjoint; for both backends."""
    command = torchrun_command(2, __file__, odd_records, tmp_path)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    subprocess.run(command, check=True, timeout=300, env=env, cwd=Path(__file__).parent)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for backend in BACKENDS:
        val = [rank[backend]["val"] for rank in ranks]
        assert sorted(val[0]["indices"] + val[1]["indices"]) == list(range(ODD_VAL)), backend
        assert [len(v["indices"]) for v in val] == [56, 57] and [v["batches"] for v in val] == [v["len"] for v in val]
        for number in ("0", "1"):
            train = [rank[backend]["train"][number] for rank in ranks]
            assert [t["batch_sizes"] for t in train] == [[TRAIN_BATCH] * TRAIN_BATCHES_PER_RANK] * 2, backend
            assert [t["len"] for t in train] == [TRAIN_BATCHES_PER_RANK] * 2
            assert not set(train[0]["indices"]) & set(train[1]["indices"]), backend
            assert all(len(set(t["indices"])) == TRAIN_BATCHES_PER_RANK * TRAIN_BATCH for t in train)
        assert ranks[0][backend]["train"]["0"]["indices"] != ranks[0][backend]["train"]["1"]["indices"]


def _rank_main(odd_records_dir: str, out_dir: str) -> None:
    """One rank of test_sharding_under_torchrun: record what each loader gives this rank (val and train both
    from the odd records)."""
    with distributed.session() as runtime:
        report = {}
        for backend in BACKENDS:
            val = make_loader(odd_records_dir, "val", backend, runtime=runtime, batch_size=VAL_BATCH, workers=1)
            val_batches = epoch(val, 0)
            train = make_loader(odd_records_dir, "train", backend, runtime=runtime, batch_size=TRAIN_BATCH, workers=1)
            report[backend] = {
                "val": {"indices": indices(val_batches), "batches": len(val_batches), "len": len(val)},
                "train": {
                    str(number): {
                        "indices": indices(batches),
                        "batch_sizes": [len(batch["index"]) for batch in batches],
                        "len": len(train),
                    }
                    for number, batches in ((number, epoch(train, number)) for number in (0, 1))
                },
            }
        Path(out_dir, f"rank{runtime.rank}.json").write_text(json.dumps(report))
        distributed.barrier()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:3])


def test_under_the_gpus_executor_no_host_tensor_of_a_batch_is_a_view_of_dalis_buffers(digits_records, monkeypatch):
    """On a GPU, DALI's default executor gives DALIGenericIterator zero-copy views of its output buffers
    (torch.from_dlpack); `Loader` copies host tensors to the GPU with non_blocking, so each must be torch's own
    memory, not a buffer DALI may reuse for the next batch. That executor run on the CPU, over the GPU's graph."""
    monkeypatch.setattr(dali_backend, "executor", lambda settings: {})
    views = []
    from_dlpack = torch.from_dlpack

    def recorded_view(*args, **kwargs):
        views.append(from_dlpack(*args, **kwargs))
        return views[-1]

    monkeypatch.setattr(torch, "from_dlpack", recorded_view)
    for split in ("train", "val"):
        loader = make_loader(digits_records, split, "dali_all", batch_size=16, augment=FULL_AUGMENT)
        for raw in itertools.islice(loader._impl.batches(0), 3):
            assert views, "premise: the iterator hands out DALI's buffers as views"
            dali_memory = {view.data_ptr() for view in views}
            assert not [key for key, value in raw.items() if value.data_ptr() in dali_memory], split
            views.clear()
