"""Where RandAugment's CPU time goes: each op of the DALI backend (dali_backend.rand_augment_ops, as its train graph
applies them) against the same op of timm (its PIL transform, what torchvision ImageFolder + timm's create_transform
runs), and the whole policy both ways, on the same photo-like images.

Why the recipe's augment makes the DALI loader slower than ImageFolder without a GPU (bench/loader.py
--rand-augment). Each variant runs in this process on one thread (DALI: 1 thread, its simple executor, as the CPU
loader runs; timm: a Python loop over PIL images, as in one DataLoader worker), every op applied (probability 1) at
the spec's magnitude; the policy rows apply the spec as training does (n ops, each with probability 0.5). Reported:
CPU milliseconds per image (the process's CPU time: DALI's thread and the loop alike), median of --repeats
interleaved epochs. --size sets the images' side: the CPU graph applies RandAugment to the decoded crop before its
resize (on 500x375 photos at augment.scale's default (0.35, 1), a crop holds 68 % of the photo on average, about
356 px square), timm after its resize to 224.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common as common
import numpy as np
import yaml
from PIL import Image
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.auto_aug.core import signed_bin

from coarse2fine.config import MAX_RAND_AUGMENT_MAGNITUDE, parse_params
from coarse2fine.data.dali_backend import SIMPLE_EXECUTOR, rand_augment_ops, rand_augment_with_geometry
from coarse2fine.data.torch_backend import TIMM_OPS, timm_rand_augment

BATCH_SIZE = 64
POLICY = "the whole policy"
# The recipe's spec, as the VOLO profile sets it from sail-sg/volo (tests/test_profiles.py pins it there).
RECIPE_SPEC = yaml.safe_load((common.PROJECT_ROOT / "profiles" / "volo_d1.yaml").read_text())["augment"]["rand_augment"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rand-augment", default=RECIPE_SPEC, metavar="SPEC",
                        help=f"timm's RandAugment spec (default: the recipe's, {RECIPE_SPEC})")
    parser.add_argument("--size", type=int, default=224, metavar="PX", help="the images' side (default: 224)")
    parser.add_argument("--images", type=int, default=256, metavar="N", help="images per epoch (default: 256)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="timed epochs per variant (default: 3)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    common.add_tiny_argument(parser, "--images 16 at --size 32, 1 repeat")
    args = parser.parse_args()
    common.tiny_sizes(parser, args, images=16, size=32, repeats=1)
    return args


@pipeline_def(batch_size=BATCH_SIZE, num_threads=1, device_id=None, enable_conditionals=True, **SIMPLE_EXECUTOR)
def augment_pipeline(batches: list[list[np.ndarray]], spec, op):
    """`op` of rand_augment_ops at the spec's magnitude on every image of `batches` (None: the whole policy)."""
    image = fn.external_source(source=batches, cycle=True, layout="HWC")
    shape = fn.cast(fn.shapes(image)[0:2], dtype=types.FLOAT)
    if op is None:
        return rand_augment_with_geometry(image, spec, shape)
    identity = fn.transforms.translation(offset=[0.0, 0.0])
    return op(image, identity, magnitude_bin=signed_bin(spec.magnitude),
              num_magnitude_bins=MAX_RAND_AUGMENT_MAGNITUDE + 1, shape=shape)


class DaliEpoch:
    """One epoch of `images` through augment_pipeline."""

    def __init__(self, images: list[np.ndarray], spec, op=None):
        batches = [images[start : start + BATCH_SIZE] for start in range(0, len(images), BATCH_SIZE)]
        self.images, self.runs = len(images), len(batches)
        self.pipeline = augment_pipeline(batches, spec, op)
        self.pipeline.build()

    def __call__(self) -> int:
        for _ in range(self.runs):
            self.pipeline.run()
        return self.images


class TimmEpoch:
    """One epoch of `images` (PIL) through timm's op (probability 1), or its whole RandAugment."""

    def __init__(self, images: list, transform):
        self.images, self.transform = images, transform

    def __call__(self) -> int:
        for image in self.images:
            self.transform(image)
        return len(self.images)


def main() -> None:
    args = parse_args()
    spec = parse_params({"augment": {"rand_augment": args.rand_augment}}).augment.rand_augment_spec
    # Photos resized to the side, as a crop is (the generator draws its shapes for photo sizes).
    photos = [common.photo_like(seed).resize((args.size, args.size), Image.Resampling.BICUBIC)
              for seed in range(min(args.images, BATCH_SIZE))]
    pil_images = [photos[index % len(photos)] for index in range(args.images)]
    arrays = [np.asarray(image, dtype=np.uint8) for image in pil_images]
    dali_ops = rand_augment_ops(spec)
    timm_policy = timm_rand_augment(spec)
    timm_ops = {}
    for name, timm_op in zip(dali_ops, timm_policy.ops):
        assert timm_op.name.removesuffix("Increasing") == TIMM_OPS[name], (name, timm_op.name)
        timm_op.prob = 1.0  # every op applied, at the spec's magnitude (its mstd noise kept)
        timm_ops[name] = timm_op
    variants = {}
    for name, op in [*dali_ops.items(), (POLICY, None)]:
        variants[f"dali {name}"] = common.CpuTimed(DaliEpoch(arrays, spec, op))
        variants[f"timm {name}"] = common.CpuTimed(TimmEpoch(pil_images, timm_ops.get(name, timm_policy)))
    rates = common.interleaved(variants, args.repeats)
    cpu_ms = {name: variant.cpu_ms_per_item() for name, variant in variants.items()}
    rows = []
    for name in [*dali_ops, POLICY]:
        dali, timm = cpu_ms[f"dali {name}"], cpu_ms[f"timm {name}"]
        rows.append([name, f"{dali:.3f}", f"{timm:.3f}", f"{dali / timm:.2f}x"])
    text = "\n".join([
        common.header_line(),
        "",
        f"RandAugment `{spec.text}` on {args.size} x {args.size} photo-like images, one thread each, CPU ms per "
        f"image, median of {args.repeats} interleaved epochs of {args.images} images (ops applied with probability 1; "
        f"the last row as training applies the policy).",
        "",
        common.markdown_table(["op", "DALI CPU ms per image", "timm (PIL) CPU ms per image", "DALI / timm"], rows),
    ])
    print(text)
    common.write_json(args, text, {"img_per_s": rates, "cpu_ms_per_image": cpu_ms})


if __name__ == "__main__":
    main()
