"""Low-resolution pre-training (params pretrain.*): models/pretrain/model.pt, metrics, a resumable checkpoint.

Runs as `python stages/pretrain.py` or `torchrun --standalone --nproc_per_node=N stages/pretrain.py` (DDP);
rerun after a crash or kill, it continues from the last finished epoch.
"""

import argparse
from pathlib import Path

from coarse2fine import cli, distributed, models, provenance, train
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = ("seed", "model", "pretrain", "loader", "augment")


def main(params: Params, args: argparse.Namespace) -> None:
    cfg = params.pretrain
    classes = records.read_classes(args.records)
    # With the params: what the weights depend on. A checkpoint made from other data or code is not resumed.
    inputs = {"data_digest": records.manifest_digest(args.records), **provenance.fingerprint(__file__)}
    with distributed.session() as runtime:
        loaders = {
            split: build_loader(
                split, args.records, img_size=cfg.img_size, batch_size=cfg.batch_size, runtime=runtime,
                loader_cfg=params.loader, augment_cfg=params.augment,
                crop_pct=cfg.val_crop_pct, seed=params.seed,
            )
            for split in ("train", "val")
        }
        train.seed_everything(params.seed, runtime)
        model = models.build_model(params.model, num_classes=len(classes), img_size=cfg.img_size)
        train.Trainer(
            stage="pretrain", params=params, cfg=cfg, model=model, classes=classes,
            train_loader=loaders["train"], val_loader=loaders["val"], runtime=runtime,
            param_sections=PARAM_SECTIONS, provenance=inputs,
            checkpoint_dir=Path(args.checkpoint_dir), model_file=Path(args.out) / "model.pt",
            metrics_dir=Path(args.metrics),
        ).fit()


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--checkpoint-dir", default="models/pretrain_ckpt", help="resumable checkpoint (default: models/pretrain_ckpt)"
    )
    parser.add_argument("--out", default="models/pretrain", help="final model directory (default: models/pretrain)")
    parser.add_argument("--metrics", default="metrics/pretrain", help="metrics directory (default: metrics/pretrain)")
    cli.run(main, parser)
