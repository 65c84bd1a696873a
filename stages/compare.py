"""Coarse vs fine: metrics/compare.json and a Markdown table from the evaluations of both models.

Plain python (no launcher): it only reads two metrics files. `python stages/compare.py` prints the table the
README shows.
"""

import argparse
from pathlib import Path

from coarse2fine import cli, report
from coarse2fine.config import EVALUATED_MODELS, Params
from coarse2fine.errors import UserError
from coarse2fine.files import write_json


def main(params: Params, args: argparse.Namespace) -> None:
    files = {name: Path(args.evaluations) / name / "metrics.json" for name in EVALUATED_MODELS}
    missing = [str(path) for path in files.values() if not path.is_file()]
    if missing:
        raise UserError(f"no evaluation in {', '.join(missing)}: run the evaluate stages first (dvc repro)")
    evaluations = report.read_evaluations(files)
    # Each model's training stage, where one trained it (an imported model's stage has no epochs to choose from).
    trainings = {name: path for name in EVALUATED_MODELS if (path := Path(args.trainings) / name / "metrics.json").is_file()}
    kept = {name: getattr(params, name).keep for name in EVALUATED_MODELS}
    write_json(args.out, report.compare(evaluations, report.read_evaluations(trainings), kept))
    print(report.markdown_table(evaluations))


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--evaluations", default="metrics/evaluate", help="the evaluations' parent dir (default: metrics/evaluate)"
    )
    parser.add_argument("--trainings", default="metrics", help="the training stages' metrics' parent dir (default: metrics)")
    parser.add_argument("--out", default="metrics/compare.json", help="default: metrics/compare.json")
    cli.run(main, parser, check_model_names=False)
