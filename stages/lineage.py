"""Complete this pipeline's MLflow run from dvc.lock: each stage DVC skipped gets a "<stage> (cached)" run linked
to the run that made its outputs (coarse2fine.tracking, "Lineage").

dvc.yaml runs it last at every `dvc repro` (always_changed), as plain `python`: it only talks to MLflow.
"""

import argparse
from pathlib import Path

import yaml

from coarse2fine import cli, tracking
from coarse2fine.config import Params
from coarse2fine.errors import UserError


def main(params: Params, args: argparse.Namespace) -> None:
    if not args.lock.is_file():
        raise UserError(f"no {args.lock}: run the pipeline first (dvc repro)")
    for line in tracking.record_lineage(params, yaml.safe_load(args.lock.read_text(encoding="utf-8"))):
        print(f"lineage: {line}")


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--lock", type=Path, default=Path("dvc.lock"), help="default: dvc.lock")
    cli.run(main, parser, check_model_names=False)  # no model here
