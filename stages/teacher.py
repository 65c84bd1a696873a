"""The teacher of token labeling (params teacher.*): trained on the records, or imported from local weights.

`teacher.mode: train` trains `teacher.model` with the shared Trainer (resumable like pretrain);
`teacher.mode: import` loads `teacher.weights` (a local .safetensors or state-dict file of `teacher.model.name`,
loaded strictly, weights_only; never a download) and evaluates it. Either way: models/teacher/model.pt, the
teacher's val top-1 in metrics/teacher, an MLflow run.
"""

import argparse
from pathlib import Path

from coarse2fine import cli, distributed, models, provenance, train
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.data.loaders import IMAGE_MEAN, IMAGE_STD, build_loader, eval_transform
from coarse2fine.evaluate import evaluate
from coarse2fine.mesh import ParallelDims
from coarse2fine.tracking.runs import Tracker

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = (
    "seed", "launch.nnodes", "launch.nproc_per_node", "parallel", "teacher", "loader.backend", "augment",
)


def main(params: Params, args: argparse.Namespace) -> None:
    cfg = params.teacher
    classes = records.read_classes(args.records)
    with distributed.session(params.launch.device) as runtime:
        # The ranks of one tensor or pipeline group train on the same batches, seeded alike (coarse2fine.mesh).
        data_runtime = runtime.data_view(ParallelDims.of_run(params.parallel, runtime.world_size))
        loaders = {
            split: build_loader(
                split, args.records, img_size=cfg.img_size, batch_size=cfg.batch_size,
                runtime=data_runtime if split == "train" else runtime,
                loader_cfg=params.loader, augment_cfg=cfg.train_augment(params.augment), crop_pct=cfg.val_crop_pct,
                seed=params.seed,
            )
            for split in (("train", "val") if cfg.mode == "train" else ("val",))
        }
        runtime.announce("teacher", cfg.precision, loader=loaders["val"].backend)
        train.seed_everything(params.seed, data_runtime)
        model = models.build_model(cfg.model, num_classes=len(classes), img_size=cfg.img_size)
        model_file = Path(args.out) / "model.pt"
        if cfg.mode == "import":
            import_teacher(params, model, classes, args.records, loaders["val"], runtime, model_file, Path(args.metrics))
            return
        train.Trainer(
            stage="teacher", params=params, cfg=cfg, model=model, classes=classes, model_cfg=cfg.model,
            train_loader=loaders["train"], val_loader=loaders["val"], runtime=runtime,
            param_sections=PARAM_SECTIONS,
            provenance={"data_digest": records.manifest_digest(args.records), **provenance.fingerprint(__file__)},
            records_dir=Path(args.records), checkpoint_dir=Path(args.checkpoint_dir), model_file=model_file,
            metrics_dir=Path(args.metrics),
        ).fit()


def import_teacher(params, model, classes, records_dir, val_loader, runtime, model_file: Path, metrics_dir: Path) -> None:
    cfg = params.teacher
    models.load_weights(model, cfg.weights, "teacher.weights")
    expected = getattr(model, "pretrained_cfg", {})
    if runtime.is_main and (expected.get("mean", IMAGE_MEAN), expected.get("std", IMAGE_STD)) != (IMAGE_MEAN, IMAGE_STD):
        print(
            f"teacher: warning: {cfg.model.name}'s weights usually expect mean {expected['mean']} std {expected['std']}; "
            f"the loaders normalise with ImageNet's {IMAGE_MEAN} {IMAGE_STD} (the val top-1 below shows the cost)",
            flush=True,
        )
    model = runtime.place(model).eval()
    with Tracker("teacher", params, runtime, metrics_dir=metrics_dir, param_sections=PARAM_SECTIONS) as tracker:
        tracker.log_records(records_dir, "val")
        result = evaluate(model, val_loader, runtime, len(classes), cfg.precision)
        tracker.set_tag("weights_file", cfg.weights)
        # One point of the curves a trained teacher logs per epoch, so both modes fill the same metrics and plots.
        tracker.log_metrics({"val_top1": result.top1, "val_top5": result.top5, "val_loss": result.loss}, step=0)
        if runtime.is_main:
            card = models.save_model_file(
                model_file, model, model_cfg=cfg.model, img_size=cfg.img_size, classes=classes, stage="teacher",
                eval_transform=eval_transform(cfg.img_size, cfg.val_crop_pct, params.augment.interpolation),
            )
            tracker.tag_written_model(model_file)
            tracker.log_model(model, card)
            print(f"teacher: imported {cfg.weights}: val top-1 {result.top1:.2f} %, top-5 {result.top5:.2f} %", flush=True)


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--checkpoint-dir", default=".resume/teacher", help="resume state (default: .resume/teacher)"
    )
    parser.add_argument("--out", default="models/teacher", help="teacher model directory (default: models/teacher)")
    parser.add_argument("--metrics", default="metrics/teacher", help="metrics directory (default: metrics/teacher)")
    cli.run(main, parser)
