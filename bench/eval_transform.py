"""The evaluation transform against timm's: the same val JPEGs of a records dir through the DALI val loader (DALI's
JPEG decoder and resize: how the evaluate stage and the profiles see them) and through
`timm.data.create_transform(size, crop_pct=..., interpolation="bicubic")` on PIL images (the reference's
validate.py), pixel by pixel; and one model's top-1 both ways.

Per image: the largest difference of any pixel channel, in 8-bit levels (0-255, after undoing the normalisation),
and the mean one. For the model: top-1 % each way and the share of images whose predicted class differs.

Run: python bench/eval_transform.py --records data/records --model models/finetune/model.pt
[--size N] [--crop-pct F] (the size defaults to the model's; crop_pct to evaluate.finetune's default, 1.0).
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch
from PIL import Image
from timm.data import create_transform

from coarse2fine import checkpoints
from coarse2fine.data import records
from coarse2fine.config import Augment, Loader
from coarse2fine.data.loaders import build_loader
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD
from coarse2fine.distributed import Runtime

from _common import add_tiny_argument, header_line, markdown_table, write_json

LEVELS = 255.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=Path, required=True, help="a converted records dir (its val split)")
    parser.add_argument("--model", type=Path, help="a model file to evaluate both ways (default: pixels only)")
    parser.add_argument("--size", type=int, help="the evaluated size (default: the model's, else 64)")
    parser.add_argument("--crop-pct", type=float, default=1.0, help="as evaluate.<model>.crop_pct (default: 1.0)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the raw numbers to FILE")
    add_tiny_argument(parser, "the first 16 val images, pixels only unless --model")
    return parser.parse_args()


def timm_images(records_dir: Path, size: int, crop_pct: float, limit: int | None) -> dict[int, tuple[torch.Tensor, int]]:
    """record index -> (timm's eval tensor of its JPEG, label), PIL decoding as timm's ImageFolder does."""
    transform = create_transform(input_size=size, is_training=False, crop_pct=crop_pct, interpolation="bicubic",
                                 mean=IMAGE_MEAN, std=IMAGE_STD)
    reader = records.ShardReader(records.shard_files(records_dir, "val"))
    out = {}
    for position in range(len(reader) if limit is None else min(limit, len(reader))):
        record = reader.read_position(position)
        image = Image.open(io.BytesIO(record["image"])).convert("RGB")
        out[int(record["index"][0])] = (transform(image), int(record["label"][0]))
    return out


def dali_images(records_dir: Path, size: int, crop_pct: float, wanted: set[int]) -> dict[int, torch.Tensor]:
    """record index -> the DALI val loader's tensor (the evaluate stage's loader on this machine's CPU)."""
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    loader = build_loader("val", records_dir, img_size=size, batch_size=32, runtime=runtime,
                          loader_cfg=Loader(backend="dali"), augment_cfg=Augment(), crop_pct=crop_pct, seed=0)
    out = {}
    for batch in loader:
        for image, index in zip(batch["image"], batch["index"].tolist()):
            if index in wanted:
                out[index] = image.float()
    return out


def levels(image: torch.Tensor) -> torch.Tensor:
    """A normalised [3, S, S] tensor back in 8-bit levels."""
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    return (image * std + mean) * LEVELS


def main() -> None:
    args = parse_args()
    payload = checkpoints.read_model_file(args.model, torch.device("cpu")) if args.model else None
    size = args.size or (payload["img_size"] if payload else 64)
    reference = timm_images(args.records, size, args.crop_pct, 16 if args.tiny else None)
    ours = dali_images(args.records, size, args.crop_pct, set(reference))
    indices = sorted(reference)
    largest = torch.stack([(levels(ours[i]) - levels(reference[i][0])).abs().amax() for i in indices])
    mean = torch.stack([(levels(ours[i]) - levels(reference[i][0])).abs().mean() for i in indices])
    quantiles = torch.quantile(largest, torch.tensor([0.5, 0.9, 1.0])).tolist()
    rows = [[str(len(indices)), f"{size} px, crop_pct {args.crop_pct:g}", f"{mean.mean():.2f}",
             f"{quantiles[0]:.0f} / {quantiles[1]:.0f} / {quantiles[2]:.0f}"]]
    raw: dict = {"images": len(indices), "size": size, "largest_levels": largest.tolist(), "mean_levels": mean.tolist()}
    lines = [header_line(), "", f"val images of {args.records}, DALI's val loader (CPU) against timm's eval transform "
             "(PIL, bicubic), in 8-bit levels", "",
             markdown_table(["images", "view", "mean |diff| per pixel", "largest |diff| per image: median / 90 % / max"],
                            rows)]
    if payload is not None:
        model = checkpoints.model_from_payload(payload, str(args.model), torch.device("cpu")).eval()
        labels = torch.tensor([reference[i][1] for i in indices])
        with torch.inference_mode():
            predicted = {name: torch.cat([model(torch.stack(chunk)).argmax(1) for chunk in _chunks(images, 64)])
                         for name, images in (("dali", [ours[i] for i in indices]),
                                              ("timm", [reference[i][0] for i in indices]))}
        top1 = {name: 100.0 * (found == labels).float().mean().item() for name, found in predicted.items()}
        differ = 100.0 * (predicted["dali"] != predicted["timm"]).float().mean().item()
        raw |= {"top1_dali": top1["dali"], "top1_timm": top1["timm"], "predictions_differ_percent": differ}
        lines += ["", f"{args.model}:", "", markdown_table(
            ["top-1 % DALI", "top-1 % timm (PIL)", "difference (points)", "images predicted differently"],
            [[f"{top1['dali']:.2f}", f"{top1['timm']:.2f}", f"{top1['dali'] - top1['timm']:+.2f}", f"{differ:.2f} %"]],
        )]
    text = "\n".join(lines)
    print(text)
    write_json(args, text, raw, "eval_transform")


def _chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


if __name__ == "__main__":
    sys.exit(main())
