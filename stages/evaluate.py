"""Evaluate a trained model on the val records: metrics.json, per_class.json and confusion_matrix.png (+ MLflow).

`--model models/finetune/model.pt --settings finetune` evaluates that model under params evaluate.finetune: at the
resolution it was trained at (from its model file), with that section's crop_pct, and again at each of its
extra_sizes (the model rebuilt at that size, its position embedding resampled): metrics.json holds `top1`,
`top5`, `loss`, `n`, `img_size`, and `top1_at_<size>` / `top5_at_<size>` per extra size. Runs as
`python stages/evaluate.py` or under `torchrun --nproc_per_node=N` (every rank evaluates its share of the
records, rank 0 writes the files).
"""

import argparse
from pathlib import Path

from coarse2fine import checkpoints, cli, distributed
from coarse2fine.config import EVALUATED_MODELS, ModelEvaluation, Params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader, Loader, resolve_backend
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.evaluate import evaluate, write_confusion_matrix_png, write_per_class_json
from coarse2fine.tracking.runs import Tracker


def param_sections(settings: str) -> tuple[str, ...]:
    """What this stage reads, exactly the keys dvc.yaml lists for it (the val loader takes the seed, the backend
    and the interpolation)."""
    return ("seed", "evaluate.batch_size", f"evaluate.{settings}", "loader.backend", "augment.interpolation")


def main(params: Params, args: argparse.Namespace) -> None:
    cfg = getattr(params.evaluate, args.settings)
    out = Path(args.out)
    classes_file = Path(args.records) / records.CLASSES_FILE
    classes = records.read_classes(args.records)
    with distributed.session(params.launch.device) as runtime:
        payload = checkpoints.read_model_file(args.model, runtime.device)  # read once, built at every size
        model = checkpoints.model_from_payload(payload, args.model, runtime.device)
        if payload["classes"] != classes:
            raise UserError(_class_mismatch(args.model, payload["classes"], classes_file, classes))
        own_size = payload["img_size"]
        stage = f"evaluate@{args.settings}"
        runtime.announce(stage, "auto", loader=resolve_backend(params.loader.backend))  # evaluate()'s precision
        with Tracker(stage, params, runtime, metrics_dir=out, param_sections=param_sections(args.settings)) as tracker:
            tracker.set_tag("model_file", args.model)
            tracker.set_tag("model_stage", payload["stage"])
            tracker.tag_evaluated_model(args.model)
            tracker.log_records(args.records, "val")
            result = evaluate(model, _val_loader(params, cfg, args.records, own_size, runtime), runtime, len(classes))
            summary = result.summary() | {"img_size": own_size}
            lines = [f"{stage}: at {own_size} px (its own): top-1 {result.top1:.2f} %, top-5 {result.top5:.2f} %, "
                     f"loss {result.loss:.4f}, n = {result.n}"]
            for size in (size for size in cfg.extra_sizes if size != own_size):
                resized = checkpoints.model_from_payload(payload, args.model, runtime.device, img_size=size)
                extra = evaluate(resized, _val_loader(params, cfg, args.records, size, runtime), runtime, len(classes))
                summary |= {f"top1_at_{size}": extra.top1, f"top5_at_{size}": extra.top5}
                lines.append(f"{stage}: at {size} px: top-1 {extra.top1:.2f} %, top-5 {extra.top5:.2f} %")
            tracker.log_summary(summary)
            if runtime.is_main:
                write_per_class_json(out / "per_class.json", result, classes)
                write_confusion_matrix_png(out / "confusion_matrix.png", result, classes)
                print("\n".join(lines), flush=True)
            for path in (out / "per_class.json", out / "confusion_matrix.png", classes_file):
                tracker.log_artifact(path)


def _val_loader(params: Params, cfg: ModelEvaluation, records_dir: str, img_size: int, runtime: Runtime) -> Loader:
    return build_loader(
        "val", records_dir, img_size=img_size, batch_size=params.evaluate.batch_size, runtime=runtime,
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=cfg.crop_pct, seed=params.seed,
    )


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
    parser.add_argument("--model", default="models/finetune/model.pt", help="model file (default: models/finetune/model.pt)")
    parser.add_argument(
        "--settings", choices=EVALUATED_MODELS, default="finetune", help="the section of evaluate.* (default: finetune)"
    )
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--out", default="metrics/evaluate/finetune", help="metrics directory (default: metrics/evaluate/finetune)"
    )
    cli.run(main, parser)
