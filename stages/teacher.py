"""The teacher of token labeling (params teacher.*): trained on the records, or imported from local weights.

`teacher.mode: train` trains `teacher.model` with the shared Trainer (resumable like pretrain), from
`teacher.init_weights` if given; `teacher.mode: import` loads `teacher.weights` (a local weights file of
`teacher.model.name`, loaded strictly, weights_only; never a download) and evaluates it (coarse2fine.weights).
Either way: models/teacher/model.pt, the teacher's val top-1 in metrics/teacher, an MLflow run.
"""

import argparse
from pathlib import Path

from coarse2fine import cli, distributed, models, provenance, train, weights
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.mesh import ParallelDims

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = (
    "seed", "launch.nnodes", "launch.nproc_per_node", "parallel", "teacher", "loader.backend", "loader.dali_graph",
    "augment",
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
            weights.import_model(
                "teacher", params, cfg, model, model_cfg=cfg.model, classes=classes, records_dir=Path(args.records),
                val_loader=loaders["val"], runtime=runtime, model_file=model_file, metrics_dir=Path(args.metrics),
                param_sections=PARAM_SECTIONS,
            )
            return
        if cfg.init_weights:
            notes = weights.start_from_weights("teacher", cfg, model)
            if runtime.is_main:
                print("\n".join(f"teacher: {note}" for note in notes), flush=True)
        train.Trainer(
            stage="teacher", params=params, cfg=cfg, model=model, classes=classes, model_cfg=cfg.model,
            train_loader=loaders["train"], val_loader=loaders["val"], runtime=runtime,
            param_sections=PARAM_SECTIONS,
            provenance={
                "data_digest": records.manifest_digest(args.records), **weights.weights_digest(cfg),
                **provenance.fingerprint(__file__),
            },
            records_dir=Path(args.records), checkpoint_dir=Path(args.checkpoint_dir), model_file=model_file,
            metrics_dir=Path(args.metrics),
        ).fit()


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--checkpoint-dir", default=".resume/teacher", help="resume state (default: .resume/teacher)"
    )
    parser.add_argument("--out", default="models/teacher", help="teacher model directory (default: models/teacher)")
    parser.add_argument("--metrics", default="metrics/teacher", help="metrics directory (default: metrics/teacher)")
    cli.run(main, parser)
