"""Where a DALI train loader's CPU time goes at 224 px (or --img-size): why the CPU loader resizes with torch.

The same records as bench/loader.py (synthetic 500x375 JPEGs unless --imagefolder or --digits), the project's default
random-resized-crop (augment.scale/ratio, bicubic), batch 64, 2 DALI threads. The first rows are one epoch of a
DALI CPU pipeline built from the train pipeline's own pieces, adding one step at a time:
- crop decode: the loader's own graph up to the decoded crop (tfrecord reader -> random crop window ->
  decoders.image_slice; bench/loader.py's "crop decode only" row): crops leave DALI as they are;
- + resize ... : the same steps, then fn.resize to the output size with the named filter (uint8 out);
- + normalise: then crop_mirror_normalize (flip, float CHW): the all-DALI train graph (the one a GPU runs),
  here on the CPU, without RandAugment/erasing;
- project CPU loader: build_loader's DALI backend as it runs without a GPU: the crop decode above, then
  HostFinish resizes with torch's uint8 antialiased kernels, flips and normalises in the loading thread.
Besides img/s, CPU milliseconds per image of the whole process (DALI's threads included) are reported: the
cost of each step is the difference between consecutive rows.
"""

from __future__ import annotations

import argparse
import statistics

import _common as common
from nvidia.dali import Pipeline, fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from coarse2fine.config import parse_params
from coarse2fine.data import records
from coarse2fine.data.dali_backend import READER_NAME, normalise, read_records, stored_shape
from loader import BATCH_SIZE, TINY_IMAGES, CropDecodeOnly, ProjectLoader, add_img_size_argument

RESIZES = {  # row name -> fn.resize filter options
    "+ resize bicubic, antialiased (the default)": dict(interp_type=types.INTERP_CUBIC),
    "+ resize bilinear, antialiased": dict(interp_type=types.INTERP_LINEAR),
    "+ resize bicubic, not antialiased": dict(interp_type=types.INTERP_CUBIC, antialias=False),
}
ALL_DALI = "+ normalise (the all-DALI train graph)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=1024, metavar="N", help="synthetic train images (default: 1024)")
    parser.add_argument("--threads", type=int, default=2, metavar="N", help="DALI threads (default: 2)")
    add_img_size_argument(parser)
    parser.add_argument("--digits", action="store_true",
                        help="scikit-learn's digits (32 px PNGs, as the peer bench trains on), not synthetic photos")
    common.add_common_arguments(parser, repeats=5)
    common.add_tiny_argument(parser, f"--images {TINY_IMAGES} (one batch; bench/loader.py --tiny's, reused from the "
                                     "same --workdir), 1 repeat")
    args = parser.parse_args()
    common.tiny_sizes(parser, args, images=TINY_IMAGES, repeats=1)
    # for loader.ProjectLoader: the plain augment
    args.workers, args.rand_augment, args.reprob, args.interpolation = args.threads, "", 0.0, "bicubic"
    return args


@pipeline_def
def profile_pipeline(files, index_files, scale, ratio, img_size: int, resize: dict, normalised: bool = False):
    """The crop decode, then fn.resize to img_size x img_size with the `resize` options [then
    crop_mirror_normalize]."""
    record = read_records(files, index_files, shard_id=0, num_shards=1, shuffle=True)
    image_hw = stored_shape(record["image"])
    anchor, shape = fn.random_crop_generator(image_hw, random_area=scale, random_aspect_ratio=ratio)
    image = fn.decoders.image_slice(
        record["image"], start=anchor, shape=shape, axis_names="HW", output_type=types.RGB, adjust_orientation=False
    )
    flip = fn.random.coin_flip(probability=0.5)
    image = fn.resize(image, size=(img_size, img_size), **resize)
    return (normalise(image, img_size, mirror=flip) if normalised else image), flip


class DaliEpoch:
    """One epoch of a profile pipeline through the iterator the loader uses (fresh pipeline per epoch)."""

    def __init__(self, graph: bytes):
        self.graph = graph

    def __call__(self) -> int:
        iterator = DALIGenericIterator(
            Pipeline.deserialize(self.graph), ["image", "flip"], reader_name=READER_NAME,
            last_batch_policy=LastBatchPolicy.DROP,
        )
        return sum(len(batch["image"]) for (batch,) in iterator)


def main() -> None:
    args = parse_args()
    augment = parse_params({}).augment
    with common.workspace(args.workdir) as work:
        if args.digits:
            tree = common.digits_tree(work, parse_params({}))
        else:
            tree = args.imagefolder or common.photo_tree(work, train_images=args.images, val_images=40)
        records_dir = common.convert_tree(tree, work / "records")
        shards = records.shard_files(records_dir, "train")
        pipeline_options = dict(
            files=[str(tfrecord) for tfrecord, _ in shards], index_files=[str(index) for _, index in shards],
            scale=augment.scale, ratio=augment.ratio, img_size=args.img_size, batch_size=BATCH_SIZE,
            num_threads=args.threads, device_id=None,
        )
        project_loader = ProjectLoader("dali", records_dir, args)
        variants = {"crop decode": common.CpuTimed(CropDecodeOnly(records_dir, project_loader))}
        variants |= {
            name: common.CpuTimed(DaliEpoch(profile_pipeline(resize=resize, **pipeline_options).serialize()))
            for name, resize in RESIZES.items()
        }
        default_resize = next(iter(RESIZES.values()))
        variants[ALL_DALI] = common.CpuTimed(
            DaliEpoch(profile_pipeline(resize=default_resize, normalised=True, **pipeline_options).serialize())
        )
        variants["project CPU loader (torch resize)"] = common.CpuTimed(project_loader)
        rates = common.interleaved(variants, args.repeats)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    cpu_ms = {name: variant.cpu_ms_per_item() for name, variant in variants.items()}
    rows = [
        [name, f"{medians[name]:.0f}", f"{medians[name] / medians[ALL_DALI]:.2f}x", f"{cpu_ms[name]:.2f}"]
        for name in variants
    ]
    text = "\n".join(
        [
            common.header_line(),
            "",
            f"DALI CPU train pipeline, step by step: {args.img_size} px, batch {BATCH_SIZE}, {args.threads} DALI "
            "threads, "
            f"crop area {augment.scale}, {args.images} images per epoch, median of {args.repeats} interleaved epochs.",
            "",
            common.markdown_table(["pipeline", "img/s (median)", "x all-DALI graph", "CPU ms per image"], rows),
        ]
    )
    print(text)
    common.write_json(args, text, {"img_per_s": rates, "cpu_ms_per_image": cpu_ms})


if __name__ == "__main__":
    main()
