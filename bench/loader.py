"""Training-loader throughput (img/s at 224 px): the coarse2fine loaders against a plain ImageFolder loader and
against decoding alone.

The records are the library's own conversion of an ImageFolder tree (synthetic photo-like 500x375 JPEGs unless
--imagefolder names a real tree). Every loader row applies the same train augment: random-resized-crop (the
project's default scale, ratio and bicubic resize) -> 224 x 224 -> horizontal flip (p 0.5) -> [RandAugment] ->
normalise, with the same number of threads/workers and batch size. Rows:
- dali: build_loader(backend="dali") as it runs without a GPU: DALI decodes the crop, torch finishes the batch
  (see dali_pipeline.HostFinish; bench/loader_profile.py shows why);
- torch: build_loader(backend="torch"), the DataLoader fallback over the same records;
- imagefolder: torchvision ImageFolder + PIL + DataLoader on the source tree (RandomResizedCrop, flip, ToTensor,
  Normalize), the usual baseline;
- decode-only: the same records through DALI's tfrecord reader and CPU JPEG decoder, full images, no augment:
  the practical limit of a JPEG loader on this machine.
One epoch per row per repeat, after one untimed warm-up epoch each, repeats interleaved (see _common.py).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _common import (
    CPU,
    add_common_arguments,
    convert_tree,
    goal,
    header_line,
    interleaved,
    markdown_table,
    photo_tree,
    workspace,
    write_json,
)
from nvidia.dali import Pipeline, fn, pipeline_def, types
from nvidia.dali import tfrecord as tfrec
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision import transforms as T

from coarse2fine.config import parse_params
from coarse2fine.data import records
from coarse2fine.data.loaders import IMAGE_MEAN, IMAGE_STD, build_loader, parse_rand_augment
from coarse2fine.data.torch_pipeline import timm_rand_augment

IMG_SIZE = 224
BATCH_SIZE = 64
# Goals of the loader work: DALI at least 1.5x the ImageFolder loader and 80 % of decode-only.
GOAL_VS_FOLDER = 1.5
GOAL_OF_DECODE = 0.8


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
        "--interpolation",
        choices=["bicubic", "bilinear"],
        default="bicubic",
        help="augment.interpolation of the crop resize, for every loader (default: bicubic, the project's default)",
    )
    add_common_arguments(parser, repeats=5)
    args = parser.parse_args()
    if args.workers < 1:
        parser.error("--workers: at least 1 (DALI needs a thread)")
    return args


class ProjectLoader:
    """One epoch of build_loader's train loader per call; the epoch number advances like training's."""

    def __init__(self, backend: str, records_dir: Path, args: argparse.Namespace):
        params = parse_params(
            {
                "loader": {"backend": backend, "workers": args.workers},
                "augment": {"hflip": 0.5, "rand_augment": args.rand_augment, "interpolation": args.interpolation},
            }
        )
        self.augment = params.augment
        self.loader = build_loader(
            "train",
            records_dir,
            img_size=IMG_SIZE,
            batch_size=BATCH_SIZE,
            runtime=CPU,
            loader_cfg=params.loader,
            augment_cfg=params.augment,
            crop_pct=1.0,
            seed=0,
        )
        self.epoch = 0

    def __call__(self) -> int:
        self.loader.set_epoch(self.epoch)
        self.epoch += 1
        return sum(len(batch["index"]) for batch in self.loader)


class ImageFolderLoader:
    """The usual torchvision baseline on the source tree, with the project loader's augment settings."""

    def __init__(self, root: Path, template: ProjectLoader, args: argparse.Namespace):
        augment = template.augment
        steps = [
            T.RandomResizedCrop(
                IMG_SIZE,
                scale=augment.scale,
                ratio=augment.ratio,
                interpolation=T.InterpolationMode[augment.interpolation.upper()],
            ),
            T.RandomHorizontalFlip(augment.hflip),
        ]
        if args.rand_augment:
            steps.append(timm_rand_augment(parse_rand_augment(args.rand_augment)))
        steps += [T.ToTensor(), T.Normalize(IMAGE_MEAN, IMAGE_STD)]
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


@pipeline_def
def decode_pipeline(files: list[str], index_files: list[str]):
    record = fn.readers.tfrecord(
        path=files,
        index_path=index_files,
        features={"image": tfrec.FixedLenFeature((), tfrec.string, "")},
        pad_last_batch=True,
        name="records",
    )
    image = fn.decoders.image(record["image"], device="cpu", output_type=types.RGB)
    return image.shape()  # the decoder runs in full; only its shape leaves DALI (images may differ in size)


class DecodeOnly:
    """Decoding alone, run like the DALI loader runs: a fresh pipeline per epoch from a graph serialised once, the
    same iterator and last-batch policy."""

    def __init__(self, records_dir: Path, args: argparse.Namespace):
        shards = records.shard_files(records_dir, "train")
        self.graph = decode_pipeline(
            files=[str(tfrecord) for tfrecord, _ in shards],
            index_files=[str(index) for _, index in shards],
            batch_size=BATCH_SIZE,
            num_threads=args.workers,
            device_id=None,
        ).serialize()

    def __call__(self) -> int:
        iterator = DALIGenericIterator(
            Pipeline.deserialize(self.graph), ["shape"], reader_name="records", last_batch_policy=LastBatchPolicy.DROP
        )
        return sum(len(batch["shape"]) for (batch,) in iterator)


def report(rates: dict[str, list[float]], images: int, args: argparse.Namespace) -> tuple[str, dict]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    baseline, limit = medians["imagefolder"], medians["decode-only"]
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
        goal(f"dali >= {GOAL_OF_DECODE:.0%} of decode-only", of_decode >= GOAL_OF_DECODE, f"{of_decode:.0%}"),
    ]
    augment = (
        f"random-resized-crop ({args.interpolation}) + flip"
        + (f" + {args.rand_augment}" if args.rand_augment else "")
        + " + normalise"
    )
    text = "\n".join(
        [
            header_line(),
            "",
            f"Train loaders, {IMG_SIZE} px, batch {BATCH_SIZE}, {args.workers} threads/workers, {augment}; "
            f"{images} images per epoch, median of {args.repeats} interleaved epochs after a warm-up epoch.",
            "",
            markdown_table(["loader", "img/s (median)", "x ImageFolder", "% of decode-only", "img/s range"], rows),
            "",
            "Goals: " + "; ".join(goals) + ".",
        ]
    )
    return text, {"images_per_epoch": images, "img_per_s": rates, "median_img_per_s": medians, "goals": goals}


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
            "decode-only": DecodeOnly(records_dir, args),
        }
        rates = interleaved(variants, args.repeats)
        text, raw = report(rates, dali.loader.num_samples, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
