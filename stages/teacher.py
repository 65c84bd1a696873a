"""The teacher of token labeling (params teacher.*): trained on the records, or imported from local weights.

`teacher.mode: train` trains `teacher.model` with the shared Trainer (resumable like pretrain), from
`teacher.init_weights` if given; `teacher.mode: import` loads `teacher.weights` (a local weights file of
`teacher.model.name`, loaded strictly, weights_only; never a download) and evaluates it (coarse2fine.training.weights).
Either way: models/teacher/model.pt, the teacher's val top-1 in metrics/teacher, an MLflow run.
"""

import argparse
from pathlib import Path

from coarse2fine import cli
from coarse2fine.config import Params
from coarse2fine.training.stage import train_teacher
from coarse2fine.training.train import StagePaths

# What this stage reads (as dvc.yaml lists it); tracked in MLflow, and a checkpoint under others is not resumed.
PARAM_SECTIONS = (
    "seed", "launch.nnodes", "launch.nproc_per_node", "parallel", "teacher", "loader.backend", "loader.dali_graph",
    "augment",
)


def main(params: Params, args: argparse.Namespace) -> None:
    paths = StagePaths(
        records=Path(args.records), checkpoint_dir=Path(args.checkpoint_dir), model_file=Path(args.out) / "model.pt",
        metrics_dir=Path(args.metrics),
    )
    train_teacher(params, paths, PARAM_SECTIONS, __file__)


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--checkpoint-dir", default=".resume/teacher", help="resume state (default: .resume/teacher)"
    )
    parser.add_argument("--out", default="models/teacher", help="teacher model directory (default: models/teacher)")
    parser.add_argument("--metrics", default="metrics/teacher", help="metrics directory (default: metrics/teacher)")
    cli.run(main, parser)
