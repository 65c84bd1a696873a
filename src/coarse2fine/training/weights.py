"""A training stage's model from local weights files (params <stage>.mode, .weights, .init_weights).

`import_model` is `<stage>.mode: import`: the stage's model is the weights file, evaluated on the val records and
written as the model file a trained one would be (the same card), without training. `start_from_weights` is
`<stage>.init_weights`: training starts from the file instead of a random init. Both read the file with
`checkpoints.load_weights` (safetensors, a state dict or a training checkpoint, weights_only; never a download).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from torch import nn

from coarse2fine import checkpoints, config
from coarse2fine.data.loaders import Loader
from coarse2fine.data.transforms import IMAGE_MEAN, IMAGE_STD, eval_transform
from coarse2fine.distributed import Runtime
from coarse2fine.evaluate import evaluate
from coarse2fine.files import file_sha256, project_path
from coarse2fine.tracking.runs import Tracker


def start_from_weights(stage: str, cfg: config.Train, model: nn.Module) -> list[str]:
    """Load `cfg.init_weights` into `model` (another class count: a new head; another size: the position embedding
    resampled) and return what was done, as lines to print."""
    what = f"{stage}.init_weights"
    path = project_path(cfg.init_weights)
    report = checkpoints.load_weights(model, path, what, new_classes=True, use_ema=cfg.weights_ema)
    return [f"{what}: {line}" for line in report.lines(path)]


def weights_digest(cfg: config.Train) -> dict[str, str]:
    """The provenance of a stage started from `init_weights` (after `start_from_weights` found the file): a
    checkpoint of a run started from other weights is stale."""
    return {"init_digest": file_sha256(project_path(cfg.init_weights))} if cfg.init_weights else {}


def import_model(
    stage: str, params: config.Params, cfg: config.Train, model: nn.Module, *, model_cfg: config.Model,
    classes: Sequence[str], records_dir: Path, val_loader: Loader, runtime: Runtime, model_file: Path,
    metrics_dir: Path, param_sections: Sequence[str],
) -> None:
    """`<stage>.mode: import`: load `cfg.weights` into `model` strictly (its size may differ: the position
    embedding is resampled), evaluate it, and write the stage's model file, metrics and MLflow run."""
    what = f"{stage}.weights"
    path = project_path(cfg.weights)
    notes = checkpoints.load_weights(model, path, what, use_ema=cfg.weights_ema).lines(path)
    expected = getattr(model, "pretrained_cfg", {})
    if (expected.get("mean", IMAGE_MEAN), expected.get("std", IMAGE_STD)) != (IMAGE_MEAN, IMAGE_STD):
        notes.append(
            f"warning: {model_cfg.name}'s weights usually expect mean {expected['mean']} std {expected['std']}; the "
            f"loaders normalise with ImageNet's {IMAGE_MEAN} {IMAGE_STD} (the val top-1 below shows the cost)"
        )
    if runtime.is_main:
        for note in notes:
            print(f"{stage}: {note}", flush=True)
    model = runtime.place(model).eval()
    with Tracker(stage, params, runtime, metrics_dir=metrics_dir, param_sections=param_sections) as tracker:
        tracker.log_records(records_dir, "val")
        result = evaluate(model, val_loader, runtime, len(classes), cfg.precision)
        tracker.set_tag("weights_file", cfg.weights)
        # One point of the curves a trained model logs per epoch, so both modes fill the same metrics and plots.
        tracker.log_metrics({"val_top1": result.top1, "val_top5": result.top5, "val_loss": result.loss}, step=0)
        if runtime.is_main:
            card = checkpoints.save_model_file(
                model_file, model, model_cfg=model_cfg, img_size=cfg.img_size, classes=classes, stage=stage,
                eval_transform=eval_transform(cfg.img_size, cfg.val_crop_pct, params.augment.interpolation),
            )
            tracker.tag_written_model(model_file)
            tracker.log_model(model, card)
            print(
                f"{stage}: imported {cfg.weights}: val top-1 {result.top1:.2f} %, top-5 {result.top5:.2f} %", flush=True
            )
