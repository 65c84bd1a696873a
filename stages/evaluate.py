"""Evaluate a model file on the val records: metrics.json, per_class.json and confusion_matrix.png (+ MLflow).

Runs as `python stages/evaluate.py` or under `torchrun --nproc_per_node=N` (every rank evaluates its share of
the records, rank 0 writes the files).
"""

import argparse
from pathlib import Path

from coarse2fine import cli, distributed, models
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.errors import UserError
from coarse2fine.evaluate import evaluate, write_confusion_matrix_png, write_per_class_json
from coarse2fine.tracking import Tracker

# What this stage reads: evaluate.*, loader.*, and augment.interpolation (the val resize).
# Exactly the keys dvc.yaml lists for this stage (the val loader takes the seed and the interpolation).
PARAM_SECTIONS = ("seed", "evaluate", "loader", "augment.interpolation")


def main(params: Params, args: argparse.Namespace) -> None:
    cfg = params.evaluate
    out = Path(args.out)
    classes_file = Path(args.records) / records.CLASSES_FILE
    classes = records.read_classes(args.records)
    with distributed.session() as runtime:
        model, info = models.load_model_file(args.model, runtime.device)
        if info["classes"] != classes:
            raise UserError(_class_mismatch(args.model, info["classes"], classes_file, classes))
        if info["img_size"] != cfg.img_size:
            # VOLO's position embedding fixes the input size: the model cannot run at another resolution.
            raise UserError(f"evaluate.img_size: {cfg.img_size}, but {args.model} takes {info['img_size']} px images")
        loader = build_loader(
            "val", args.records, img_size=cfg.img_size, batch_size=cfg.batch_size, runtime=runtime,
            loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=cfg.crop_pct, seed=params.seed,
        )
        with Tracker("evaluate", params, runtime, metrics_dir=out, param_sections=PARAM_SECTIONS) as tracker:
            tracker.set_tag("model_file", args.model)
            tracker.set_tag("model_stage", info["stage"])
            result = evaluate(model, loader, runtime, len(classes))
            tracker.log_summary(result.summary())
            if runtime.is_main:
                write_per_class_json(out / "per_class.json", result, classes)
                write_confusion_matrix_png(out / "confusion_matrix.png", result, classes)
                print(f"evaluate: top-1 {result.top1:.2f} %, top-5 {result.top5:.2f} %, loss {result.loss:.4f}, n = {result.n}")
            for path in (out / "per_class.json", out / "confusion_matrix.png", classes_file):
                tracker.log_artifact(path)


def _class_mismatch(model_file: str, model_classes: list[str], classes_file: Path, classes: list[str]) -> str:
    """One line naming both files and the first label where they disagree (ImageNet has 1000 names)."""
    label = next(
        (i for i, (ours, theirs) in enumerate(zip(model_classes, classes)) if ours != theirs),
        min(len(model_classes), len(classes)),
    )
    model_name, records_name = (names[label] if label < len(names) else "(none)" for names in (model_classes, classes))
    return (
        f"{model_file} has {len(model_classes)} classes, {classes_file} {len(classes)}; they differ at label {label} "
        f"({model_name!r} vs {records_name!r}): evaluate on the records the model was trained on"
    )


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/pretrain/model.pt", help="model file (default: models/pretrain/model.pt)")
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument("--out", default="metrics/evaluate", help="metrics directory (default: metrics/evaluate)")
    cli.run(main, parser)
