"""High-resolution fine-tuning (params finetune.*): models/finetune/model.pt, metrics, a resumable checkpoint.

Builds model.* at finetune.img_size and starts it from the pre-trained model file, its position embedding
resampled to the new token grid (every tensor that does not load as it is is printed). With
finetune.token_label.enabled it trains on the same token-label store, whose maps are resampled to the new grid,
with the ground truth mixed into the class target (finetune.token_label.ground_truth_mix). Resumable like
pre-training. finetune.init_weights starts it from that file instead of the pre-trained model; with finetune.mode
import the model is finetune.weights, evaluated and written without training.
"""

import argparse
from pathlib import Path

from coarse2fine import cli
from coarse2fine.config import Params
from coarse2fine.training.stage import train_student
from coarse2fine.training.train import StagePaths

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = (
    "seed", "launch.nnodes", "launch.nproc_per_node", "parallel", "model", "finetune", "loader.backend",
    "loader.dali_graph", "augment",
)


def main(params: Params, args: argparse.Namespace) -> None:
    paths = StagePaths(
        records=Path(args.records), token_labels=Path(args.token_labels), checkpoint_dir=Path(args.checkpoint_dir),
        model_file=Path(args.out) / "model.pt", metrics_dir=Path(args.metrics), init_from=Path(args.init_from),
    )
    train_student("finetune", params, params.finetune, paths, PARAM_SECTIONS, __file__)


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    cli.add_student_arguments(parser, "finetune")
    parser.add_argument(
        "--init-from", default="models/pretrain/model.pt", help="the pre-trained model (default: models/pretrain/model.pt)"
    )
    cli.run(main, parser)
