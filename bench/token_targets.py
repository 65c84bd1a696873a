"""What the student is taught: token-labeling targets built from the same teacher maps three ways, against the
teacher's own prediction on the very crops the student sees.

Needs a project whose convert and teacher stages ran (data/records, models/teacher/model.pt); reads its params.yaml
for the augmentation, the pre-training size, the model's token grid and the label smoothing. For `--samples`
train crops drawn by the real train loader (torch backend, the project's augment), the teacher's dense logits of
each whole image (the token_labels stage's view) are turned into targets by
- reference: TokenLabeling's construction (its get_featuremaps/get_label): the top-k raw logits, the other
  classes' logits set to 0, roi_align, softmax;
- coarse2fine: the store's (labels/targets.py): the top-k log-probabilities, the other classes sharing what the top
  k leave, roi_align, softmax;
- every class: all C logits kept (no top-k): what both approximate;
each then label-smoothed as training does (`pretrain.token_label.label_smoothing`). Columns: the class target's
and the token targets' mean entropy (nats; log C is uniform), how often their top-1 is the label, the class target's KL
divergence from the teacher's prediction on the crop itself (the crop resized to the teacher's input size), the
token top-1 at the grid's edge and inside it, and the class target's mass on the classes outside the top k of the
teacher's prediction on the crop. The last row is the class target as MixToken trains it (mixed with the flipped
batch by lam ~ Beta(1, 1) over the grid).

Run: python bench/token_targets.py [--project DIR] [--samples N] [--top-k K] (see --help)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import CPU, add_tiny_argument, header_line, markdown_table, tiny_sizes, write_json
from coarse2fine import checkpoints
from coarse2fine.config import load_params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD
from coarse2fine.labels import targets
from coarse2fine.labels.generate import TrainRecords, View, dense_head
from coarse2fine.training.losses import mix_token_lam

LOADER_BATCH = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", type=Path, default=Path("."), help="a project after its teacher stage (default: .)")
    parser.add_argument("--samples", type=int, default=512, metavar="N", help="train crops measured (default: 512)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="default: the project's token_labels.top_k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report and numbers here")
    add_tiny_argument(parser, f"--samples {LOADER_BATCH} (one loader batch); --project e.g. the copy bench/startup.py "
                              "--tiny leaves in its --workdir")
    args = parser.parse_args()
    tiny_sizes(parser, args, samples=LOADER_BATCH)
    return args


def reference_maps(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """TokenLabeling's dense map: the top-k logits in place, 0 for every other class."""
    values, classes = logits.topk(top_k, dim=1)
    return torch.zeros_like(logits).scatter_(1, classes, values)


def project_maps(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """This project's: the store's float16 top-k log-probabilities, rebuilt as labels/targets.py does."""
    log_probs, classes = logits.log_softmax(dim=1).topk(top_k, dim=1)
    return targets.dense_maps(log_probs.half().float(), classes, logits.shape[1])


def crop_targets(maps: torch.Tensor, batch: dict, token_grid: int, smoothing: float) -> targets.TokenTargets:
    every_class = torch.arange(maps.shape[1]).view(1, -1, 1, 1).expand_as(maps)
    # dense_maps of all C classes with their log-probabilities is the map itself (nothing is left to share).
    return targets.token_targets(
        maps.log_softmax(dim=1), every_class, batch["window"], batch["flip"], batch["affine"],
        num_classes=maps.shape[1], token_grid=token_grid, smoothing=smoothing,
    )


def edge_mask(token_grid: int) -> torch.Tensor:
    """[S*S] True for the tokens on the grid's border (row-major)."""
    index = torch.arange(token_grid)
    border = (index == 0) | (index == token_grid - 1)
    return (border.view(-1, 1) | border.view(1, -1)).flatten()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    project = args.project
    params = load_params(project / "params.yaml")
    records_dir = project / "data" / "records"
    teacher, info = checkpoints.load_model_file(project / "models" / "teacher" / "model.pt", "cpu")
    teacher.eval()
    head = dense_head(teacher)
    num_classes = len(records.read_classes(records_dir))
    top_k = args.top_k or params.token_labels.top_k
    cfg = params.pretrain
    token_grid = params.model.token_grid(cfg.img_size)
    loader = build_loader(
        "train", records_dir, img_size=cfg.img_size, batch_size=LOADER_BATCH, runtime=CPU,
        loader_cfg=params.loader.model_copy(update={"backend": "torch"}), augment_cfg=params.augment,
        crop_pct=1.0, seed=args.seed,
    )
    loader.set_epoch(0)
    whole = TrainRecords(records_dir, View("whole", info["img_size"], params.augment.interpolation))
    mean, std = (torch.tensor(value).view(1, 3, 1, 1) * 255 for value in (IMAGE_MEAN, IMAGE_STD))
    sums: dict[str, dict[str, float]] = {}
    counted = 0
    edges = edge_mask(token_grid)
    with torch.inference_mode():
        for batch in loader:
            if counted >= args.samples:
                break
            images = torch.stack([whole[int(index)][0] for index in batch["index"]]).float()
            logits = head((images - mean) / std)
            crops = F.interpolate(batch["image"], size=info["img_size"], mode="bicubic", align_corners=False)
            on_crop = teacher(crops).softmax(dim=-1)
            labels = batch["label"]
            outside = torch.ones_like(on_crop, dtype=torch.bool).scatter_(1, on_crop.topk(top_k, dim=1).indices, False)
            for name, maps in (
                ("reference: top-k logits, zero fill", reference_maps(logits, top_k)),
                ("coarse2fine: top-k log-probs, residual fill", project_maps(logits, top_k)),
                ("every class (no top-k)", logits),
            ):
                result = crop_targets(maps, batch, token_grid, cfg.token_label.label_smoothing)
                row = sums.setdefault(name, {})
                _add(row, "cls entropy", targets.entropy(result.cls).sum())
                _add(row, "cls top-1 %", 100 * (result.cls.argmax(-1) == labels).sum())
                _add(row, "KL(teacher on crop || cls)", _kl(on_crop, result.cls).sum())
                _add(row, "token entropy", targets.entropy(result.tokens).mean(1).sum())
                token_hits = (result.tokens.argmax(-1) == labels.view(-1, 1)).float()
                _add(row, "token top-1 %", 100 * token_hits.mean(1).sum())
                _add(row, "edge token top-1 %", 100 * token_hits[:, edges].mean(1).sum())
                _add(row, "inner token top-1 %", 100 * token_hits[:, ~edges].mean(1).sum() if (~edges).any() else 0)
                _add(row, "mass outside top-k", (result.cls * outside).sum())
                if name.startswith("coarse2fine"):
                    mixed = sums.setdefault("coarse2fine, class target under MixToken", {})
                    lam = _mix_token_lam(token_grid)
                    cls = lam * result.cls + (1 - lam) * result.cls.flip(0)
                    _add(mixed, "cls entropy", targets.entropy(cls).sum())
                    _add(mixed, "cls top-1 %", 100 * (cls.argmax(-1) == labels).sum())
                    _add(mixed, "KL(teacher on crop || cls)", _kl(on_crop, cls).sum())
            teacher_row = sums.setdefault("teacher's prediction on the crop", {})
            _add(teacher_row, "cls entropy", targets.entropy(on_crop).sum())
            _add(teacher_row, "cls top-1 %", 100 * (on_crop.argmax(-1) == labels).sum())
            counted += len(labels)
    columns = [
        "cls entropy", "cls top-1 %", "KL(teacher on crop || cls)", "token entropy", "token top-1 %",
        "edge token top-1 %", "inner token top-1 %", "mass outside top-k",
    ]
    rows = [[name] + [f"{values[column] / counted:.3f}" if column in values else "-" for column in columns]
            for name, values in sums.items()]
    text = "\n".join([
        header_line(),
        f"{project}: {counted} train crops at {cfg.img_size} px ({token_grid}x{token_grid} tokens), teacher "
        f"{info['model_cfg']['name']} at {info['img_size']} px, {num_classes} classes (uniform entropy "
        f"{math.log(num_classes):.3f}), top-k {top_k}, label smoothing {cfg.token_label.label_smoothing}",
        "",
        markdown_table(["targets", *columns], rows),
    ])
    print(text)
    write_json(args, text, {"rows": {name: {k: v / counted for k, v in values.items()} for name, values in sums.items()}})


def _add(row: dict[str, float], key: str, value: torch.Tensor | float) -> None:
    row[key] = row.get(key, 0.0) + float(value)


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p.clamp_min(1e-12).log() - q.clamp_min(1e-12).log())).sum(-1)


def _mix_token_lam(token_grid: int) -> float:
    """lam of a MixToken box drawn as timm's VOLO draws it (side grid x sqrt(1 - lam'), lam' ~ Beta(1, 1))."""
    cut = math.sqrt(1 - float(torch.distributions.Beta(1.0, 1.0).sample()))
    side = int(token_grid * cut)
    return mix_token_lam((0, 0, side, side), token_grid)


if __name__ == "__main__":
    main()
