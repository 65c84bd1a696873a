"""Complete this pipeline's MLflow run from dvc.lock: each stage DVC skipped gets a "<stage> (cached)" run linked
to the run that made its outputs (coarse2fine.tracking, "Lineage").

dvc.yaml runs it last at every `dvc repro` (always_changed), as plain `python`: it only talks to MLflow, and not
even that when the last record saw this pipeline, these outputs and this store (tracking.identity.LineageMark);
under a stage server (coarse2fine.stage_server) it records in a fork of the server, MLflow already imported.
"""

import argparse
import sys
from pathlib import Path

import yaml

from coarse2fine import cli, stage_server
from coarse2fine.config import Params
from coarse2fine.errors import UserError
from coarse2fine.tracking.identity import LineageMark, tracking_uri


def main(params: Params, args: argparse.Namespace) -> None:
    if not args.lock.is_file():
        raise UserError(f"no {args.lock}: run the pipeline first (dvc repro)")
    lock = yaml.safe_load(args.lock.read_text(encoding="utf-8"))
    mark = LineageMark(params, lock, tracking_uri())
    if mark.is_recorded():
        return
    # MLflow's import and its store's: seconds, paid only to record, and not at all in a stage server's fork.
    stage_server.run_there_if_asked({"script": __file__, "argv": sys.argv[1:]})
    from coarse2fine.tracking.lineage import record_lineage

    lines = record_lineage(params, lock)
    if lines is None:
        return  # MLflow unusable: record_lineage warned
    for line in lines:
        print(f"lineage: {line}")
    mark.save()


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--lock", type=Path, default=Path("dvc.lock"), help="default: dvc.lock")
    cli.run(main, parser, check_model_names=False)  # no model here
