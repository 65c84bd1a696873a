"""Training-loader throughput (img/s at 224 px or --img-size): the coarse2fine loaders against a plain ImageFolder
loader and against the DALI loader's crop decoding alone.

The records are the library's own conversion of an ImageFolder tree (synthetic photo-like 500x375 JPEGs unless
--imagefolder names a real tree). Every loader row applies the same train augment: random-resized-crop (the
project's default scale, ratio and bicubic resize) -> 224 x 224 -> horizontal flip (p 0.5) -> [RandAugment] ->
normalise [-> random erasing], with the same number of threads/workers and batch size (the recipe's augment:
--rand-augment rand-m9-mstd0.5-inc1 --reprob 0.25, as timm's create_transform builds it). Rows:
- dali: build_loader(backend="dali") as it runs without a GPU: DALI decodes the crop, torch finishes the batch
  (see dali_backend.HostFinish; bench/loader_profile.py shows why);
- torch: build_loader(backend="torch"), the DataLoader fallback over the same records;
- imagefolder: torchvision ImageFolder + PIL + DataLoader on the source tree (RandomResizedCrop, flip, ToTensor,
  Normalize), the usual baseline;
- crop decode only: the dali row's own DALI graph (dali_backend.train_pipeline as build_loader defines it
  without a GPU: read, draw the crop window, decode only that window) with the same per-epoch seeds, so it
  decodes the same windows, and nothing after the decode (no RandAugment, no torch finish): the limit of a
  loader that decodes crops like this one on this machine.
One epoch per row per repeat, after one untimed warm-up epoch each, repeats interleaved (see _common.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from _common import (
    CPU,
    add_common_arguments,
    add_tiny_argument,
    convert_tree,
    goal,
    header_line,
    interleaved,
    markdown_table,
    photo_tree,
    tiny_sizes,
    workspace,
    write_json,
)
from nvidia.dali import Pipeline
from timm.data.random_erasing import RandomErasing
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T

from coarse2fine.config import parse_params
from coarse2fine.data import records
from coarse2fine.data.dali_backend import train_pipeline
from coarse2fine.data.loaders import build_loader
from coarse2fine.data.sampling import derive_seed
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD
from coarse2fine.data.torch_backend import timm_rand_augment
from coarse2fine.distributed import Runtime

IMG_SIZE = 224  # the default --img-size
BATCH_SIZE = 64
SEED = 0
CROP_DECODE = "crop decode only"
# Goals of the loader work: DALI at least 1.5x the ImageFolder loader and 80 % of its own crop decoding alone.
GOAL_VS_FOLDER = 1.5
GOAL_OF_DECODE = 0.8
TINY_IMAGES = BATCH_SIZE


def add_img_size_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--img-size", type=int, default=IMG_SIZE, metavar="PX", help=f"the loaders' output side (default: {IMG_SIZE})"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=int, default=1024, metavar="N", help="synthetic train images (default: 1024 = 16 batches)"
    )
    parser.add_argument(
        "--workers", type=int, default=2, metavar="N", help="DALI threads = DataLoader workers (default: 2)"
    )
    parser.add_argument(
        "--rand-augment", default="", metavar="SPEC", help="add RandAugment to the loaders, e.g. rand-m9-mstd0.5-inc1"
    )
    parser.add_argument(
        "--reprob", type=float, default=0.0, metavar="P",
        help="add random erasing (pixel mode) with probability P to the loaders; the recipe's is 0.25 (default: 0)",
    )
    add_img_size_argument(parser)
    parser.add_argument(
        "--interpolation",
        choices=["bicubic", "bilinear"],
        default="bicubic",
        help="augment.interpolation of the crop resize, for every loader (default: bicubic, the project's default)",
    )
    add_common_arguments(parser, repeats=5)
    add_tiny_argument(parser, f"--images {TINY_IMAGES} (one batch), 1 repeat")
    args = parser.parse_args()
    tiny_sizes(parser, args, images=TINY_IMAGES, repeats=1)
    if args.workers < 1:
        parser.error("--workers: at least 1 (DALI needs a thread)")
    return args


class ProjectLoader:
    """One epoch of build_loader's train loader per call; the epoch number advances like training's."""

    def __init__(self, backend: str, records_dir: Path, args: argparse.Namespace, runtime: Runtime = CPU):
        self.params = parse_params(
            {
                "loader": {"backend": backend, "workers": args.workers},
                "augment": {
                    "hflip": 0.5, "rand_augment": args.rand_augment, "reprob": args.reprob,
                    "interpolation": args.interpolation,
                },
            }
        )
        self.img_size = args.img_size
        self.loader = build_loader(
            "train",
            records_dir,
            img_size=args.img_size,
            batch_size=BATCH_SIZE,
            runtime=runtime,
            loader_cfg=self.params.loader,
            augment_cfg=self.params.augment,
            crop_pct=1.0,
            seed=SEED,
        )
        self.epoch = 0

    def __call__(self) -> int:
        return sum(len(batch["index"]) for batch in self._next_epoch())

    def first_batch_and_second_half(self) -> tuple[float, float]:
        """One epoch: seconds to its first batch (a DALI pipeline's build, DataLoader workers' start: paid once an
        epoch) and img/s over its second half, the rate a long epoch approaches once the batches that were loading
        ahead of the first (workers x prefetch) are used up: an epoch of several times that many batches."""
        arrivals, images = [], []
        started = time.perf_counter()
        for batch in self._next_epoch():
            arrivals.append(time.perf_counter() - started)
            images.append(len(batch["index"]))
        half = len(arrivals) // 2
        return arrivals[0], sum(images[half + 1:]) / (arrivals[-1] - arrivals[half])

    def _next_epoch(self) -> Iterator[dict]:
        self.loader.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)


class ImageFolderLoader:
    """The usual torchvision baseline on the source tree, with the project loader's augment settings."""

    def __init__(self, root: Path, template: ProjectLoader, args: argparse.Namespace):
        augment = template.params.augment
        steps = [
            T.RandomResizedCrop(
                args.img_size,
                scale=augment.scale,
                ratio=augment.ratio,
                interpolation=T.InterpolationMode[augment.interpolation.upper()],
            ),
            T.RandomHorizontalFlip(augment.hflip),
        ]
        if args.rand_augment:
            steps.append(timm_rand_augment(augment.rand_augment_spec))
        steps += [T.ToTensor(), T.Normalize(IMAGE_MEAN, IMAGE_STD)]
        if augment.reprob:  # as timm's create_transform adds it, after normalising
            steps.append(RandomErasing(augment.reprob, mode="pixel", device="cpu"))
        self.loader = DataLoader(
            datasets.ImageFolder(str(root / "train"), transform=T.Compose(steps)),
            batch_size=BATCH_SIZE,
            shuffle=True,
            drop_last=True,
            num_workers=args.workers,
            persistent_workers=True,
            prefetch_factor=2,
        )

    def __call__(self) -> int:
        return sum(len(labels) for _, labels in self.loader)


class CropDecodeOnly:
    """The decoding a DALI loader (`template`, without a GPU) does and nothing after it: the library's train graph
    with the loader's settings, finish_on_host (the graph ends at the decoded crop) and no RandAugment, run like the
    loader runs it (a fresh pipeline per epoch seeded like the loader's epoch, so the same crop windows; the same
    number of batches), its crops dropped as they come."""

    def __init__(self, records_dir: Path, template: ProjectLoader):
        shards = records.shard_files(records_dir, "train")
        loader_cfg = template.params.loader
        self.graph = train_pipeline(
            files=[str(tfrecord) for tfrecord, _ in shards],
            index_files=[str(index) for _, index in shards],
            shard_id=0,
            num_shards=1,
            img_size=template.img_size,
            augment=template.params.augment,
            rand_spec=None,
            device="cpu",
            finish_on_host=True,
            batch_size=BATCH_SIZE,
            num_threads=loader_cfg.workers,
            prefetch_queue_depth=loader_cfg.prefetch,
            device_id=None,
        ).serialize()
        self.batches = len(template.loader)
        self.epoch = 0

    def __call__(self) -> int:
        pipeline = Pipeline.deserialize(self.graph, seed=derive_seed(SEED, self.epoch, CPU.rank))
        self.epoch += 1
        pipeline.build()
        return sum(len(pipeline.run()[0]) for _ in range(self.batches))


def report(rates: dict[str, list[float]], images: int, args: argparse.Namespace) -> tuple[str, dict]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    baseline, limit = medians["imagefolder"], medians[CROP_DECODE]
    rows = [
        [
            name,
            f"{medians[name]:.0f}",
            f"{medians[name] / baseline:.2f}x",
            f"{100 * medians[name] / limit:.0f} %",
            f"{min(values):.0f}-{max(values):.0f}",
        ]
        for name, values in rates.items()
    ]
    vs_imagefolder, of_decode = medians["dali"] / baseline, medians["dali"] / limit
    goals = [
        goal(f"dali >= {GOAL_VS_FOLDER}x imagefolder", vs_imagefolder >= GOAL_VS_FOLDER, f"{vs_imagefolder:.2f}x"),
        goal(f"dali >= {GOAL_OF_DECODE:.0%} of {CROP_DECODE}", of_decode >= GOAL_OF_DECODE, f"{of_decode:.0%}"),
    ]
    augment = (
        f"random-resized-crop ({args.interpolation}) + flip"
        + (f" + {args.rand_augment}" if args.rand_augment else "")
        + " + normalise"
        + (f" + random erasing {args.reprob}" if args.reprob else "")
    )
    text = "\n".join(
        [
            header_line(),
            "",
            f"Train loaders, {args.img_size} px, batch {BATCH_SIZE}, {args.workers} threads/workers, {augment}; "
            f"{images} images per epoch, median of {args.repeats} interleaved epochs after a warm-up epoch.",
            "",
            markdown_table(["loader", "img/s (median)", "x ImageFolder", f"% of {CROP_DECODE}", "img/s range"], rows),
            "",
            "Goals: " + "; ".join(goals) + ".",
        ]
    )
    return text, {"images_per_epoch": images, "img_per_s": rates, "median_img_per_s": medians}


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work:
        tree = args.imagefolder or photo_tree(work, train_images=args.images, val_images=40)
        records_dir = convert_tree(tree, work / "records")
        dali = ProjectLoader("dali", records_dir, args)
        variants = {
            "dali": dali,
            "torch": ProjectLoader("torch", records_dir, args),
            "imagefolder": ImageFolderLoader(tree, dali, args),
            CROP_DECODE: CropDecodeOnly(records_dir, dali),
        }
        rates = interleaved(variants, args.repeats)
        text, raw = report(rates, dali.loader.num_samples, args)
    print(text)
    # The augmented run (make bench's loader_recipe) gets a result file of its own beside the plain one of the day.
    write_json(args, text, raw, topic="loader_augmented" if args.rand_augment or args.reprob else None)


if __name__ == "__main__":
    main()
