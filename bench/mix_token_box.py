"""MixToken's box on a small token grid: how much of a crop the swapped box covers at the students' sizes, against
sail-sg/volo's VOLO-D1 at 224 and 384 px (issue 56, point 2: "how its box scales on a small token grid").

timm's VOLO draws the box as TokenLabeling does (`timm.models.volo.VOLO.forward_train`): lam ~ Beta(1, 1), then
`rand_bbox` on the patch-embedding grid divided by the pooling scale (2), the box's sides int(side x sqrt(1 - lam))
around a uniform centre, clipped at the grid's edges. This bench builds each model (the project's students from
params.yaml at pretrain.img_size and finetune.img_size, timm's volo_d1_224 and volo_d1_384 at theirs), reads the
box grid off its own patch embedding, and draws `--samples` boxes with timm's `rand_bbox` and the Beta draw
forward_train makes: the share of the crop the box swaps (1 - lam as the loss mixes the class target by it), its
mean, median and 90th percentile, and how often no token is swapped.

Run: python bench/mix_token_box.py [--samples N] [--seed S]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from timm.models.volo import rand_bbox

from _common import add_tiny_argument, header_line, markdown_table, tiny_sizes, write_json
from coarse2fine.config import TimmModel, load_params
from coarse2fine.models import build_model
from coarse2fine.training.losses import mix_token_lam

# sail-sg/volo's VOLO-D1 at ImageNet's pre-training and fine-tuning sizes (its README's volo_d1 224 and 384 rows).
REFERENCE_MODELS = (("volo_d1_224", 224), ("volo_d1_384", 384))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000, metavar="N", help="boxes drawn per model (default: 100000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="the students' params (default: params.yaml)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report and numbers here")
    add_tiny_argument(parser, "--samples 200")
    args = parser.parse_args()
    tiny_sizes(parser, args, samples=200)
    return args


def box_grid(model: torch.nn.Module, img_size: int) -> tuple[int, int]:
    """(the patch embedding's side, the side of the grid MixToken's box is drawn on) for `img_size` inputs."""
    with torch.no_grad():
        tokens = model.patch_embed(torch.zeros(1, 3, img_size, img_size))
    side = tokens.shape[-1]
    return side, side // model.pooling_scale


def box_shares(model: torch.nn.Module, side: int, grid: int, samples: int) -> list[float]:
    """The share of the crop each of `samples` MixToken boxes swaps on a `side` x `side` patch embedding (the box on
    its `grid` x `grid` pooled grid), drawn as timm's forward_train draws them."""
    beta = torch.distributions.Beta(model.beta, model.beta)
    size = (1, side, side, 1)  # forward_train's x: [B, H, W, C] after the patch embedding
    return [1.0 - mix_token_lam(rand_bbox(size, beta.sample(), scale=model.pooling_scale), grid)
            for _ in range(samples)]


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    params = load_params(args.params)
    models = [(f"this project's student ({params.model.name}, patch_size {params.model.patch_size})", params.model, size)
              for size in (params.pretrain.img_size, params.finetune.img_size)]
    models += [(f"sail-sg/volo's {name}", TimmModel(name=name), size) for name, size in REFERENCE_MODELS]
    rows, raw = [], []
    for label, model_cfg, img_size in models:
        model = build_model(model_cfg, num_classes=10, img_size=img_size, mix_token=True)
        side, grid = box_grid(model, img_size)
        shares = box_shares(model, side, grid, args.samples)
        quantiles = statistics.quantiles(shares, n=10)
        numbers = {"model": label, "img_size": img_size, "tokens": side, "box_grid": grid,
                   "mean": statistics.fmean(shares), "median": statistics.median(shares), "p90": quantiles[-1],
                   "no_box": sum(share == 0 for share in shares) / len(shares)}
        raw.append(numbers)
        rows.append([label, str(img_size), f"{side} x {side}", f"{grid} x {grid}", f"{numbers['mean']:.3f}",
                     f"{numbers['median']:.3f}", f"{numbers['p90']:.3f}", f"{100 * numbers['no_box']:.1f}"])
    text = "\n".join([
        header_line(), "",
        f"{args.samples} boxes per model (seed {args.seed}), lam ~ Beta(1, 1) and timm's rand_bbox as VOLO.forward_train "
        "draws them; share: the part of the crop the box swaps",
        "",
        markdown_table(["model", "px", "tokens after the stem", "box grid", "mean share", "median share",
                        "90th percentile", "no box %"], rows),
    ])
    print(text)
    write_json(args, text, {"models": raw})


if __name__ == "__main__":
    main()
