"""Low-resolution pre-training (params pretrain.*): models/pretrain/model.pt, metrics, a resumable checkpoint.

With pretrain.token_label.enabled the objective is token labeling on the store in data/token_labels (MixToken
with pretrain.token_label.mix_token); otherwise (MixToken off too) label-smoothed cross-entropy on the ground truth. Runs as `python stages/pretrain.py` or `torchrun --standalone --nproc_per_node=N stages/pretrain.py` (DDP);
rerun after a crash or kill, it continues from the last finished epoch.
"""

import argparse
from pathlib import Path

from coarse2fine import cli, distributed, losses, models, provenance, train
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.labels import store

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = ("seed", "model", "pretrain", "loader", "augment")


def main(params: Params, args: argparse.Namespace) -> None:
    cfg = params.pretrain
    classes = records.read_classes(args.records)
    # With the params: what the weights depend on. A checkpoint made from other data or code is not resumed.
    data_digest = records.manifest_digest(args.records)
    inputs = {"data_digest": data_digest, **provenance.fingerprint(__file__)}
    objective = None
    if cfg.token_label.enabled:
        labels = store.TokenLabelStore(
            args.token_labels, records=records.read_manifest(args.records)["splits"]["train"]["images"],
            num_classes=len(classes), records_digest=data_digest,
        )
        objective = losses.TokenLabelObjective.from_params(labels, cfg)
        inputs["token_labels_digest"] = store.header_digest(args.token_labels)  # never resumed under another store
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
        model = models.build_model(
            params.model, num_classes=len(classes), img_size=cfg.img_size, mix_token=cfg.token_label.mixes_tokens
        )
        train.Trainer(
            stage="pretrain", params=params, cfg=cfg, model=model, classes=classes,
            train_loader=loaders["train"], val_loader=loaders["val"], runtime=runtime,
            param_sections=PARAM_SECTIONS, provenance=inputs,
            checkpoint_dir=Path(args.checkpoint_dir), model_file=Path(args.out) / "model.pt",
            metrics_dir=Path(args.metrics), objective=objective,
        ).fit()


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--token-labels", default="data/token_labels", help="token-label store (default: data/token_labels)"
    )
    parser.add_argument(
        "--checkpoint-dir", default="models/pretrain_ckpt", help="resumable checkpoint (default: models/pretrain_ckpt)"
    )
    parser.add_argument("--out", default="models/pretrain", help="final model directory (default: models/pretrain)")
    parser.add_argument("--metrics", default="metrics/pretrain", help="metrics directory (default: metrics/pretrain)")
    cli.run(main, parser)
