"""Low-resolution pre-training (params pretrain.*): models/pretrain/model.pt, metrics, a resumable checkpoint.

With pretrain.token_label.enabled the objective is token labeling on the store in data/token_labels (MixToken
with pretrain.token_label.mix_token); otherwise label-smoothed cross-entropy on the ground truth (Mixup/CutMix
with pretrain.mixup). Runs as `python stages/pretrain.py` or `torchrun --standalone --nproc_per_node=N
stages/pretrain.py` (DDP); rerun after a crash or kill, it continues from the last checkpoint (at an epoch's end,
or inside one: params `checkpoint`). Training starts from pretrain.init_weights if given; with pretrain.mode import
the model is pretrain.weights instead, evaluated and written without training (docs/fine-tune-only.md).
"""

import argparse
from pathlib import Path

from coarse2fine import cli
from coarse2fine.config import Params
from coarse2fine.training.stage import train_student
from coarse2fine.training.train import StagePaths

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = (
    "seed", "launch.nnodes", "launch.nproc_per_node", "parallel", "model", "pretrain", "loader.backend",
    "loader.dali_graph", "augment",
)


def main(params: Params, args: argparse.Namespace) -> None:
    paths = StagePaths(
        records=Path(args.records), token_labels=Path(args.token_labels), checkpoint_dir=Path(args.checkpoint_dir),
        model_file=Path(args.out) / "model.pt", metrics_dir=Path(args.metrics),
    )
    train_student("pretrain", params, params.pretrain, paths, PARAM_SECTIONS, __file__)


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    cli.add_student_arguments(parser, "pretrain")
    cli.run(main, parser)
