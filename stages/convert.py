"""Convert the source images (params data.*) into TFRecord shards, DALI indices, classes.json and manifest.json.

Runs as `python stages/convert.py` or under `torchrun --nproc_per_node=N` (files and shards split across ranks).
"""

import argparse
from pathlib import Path

from coarse2fine import cli, distributed
from coarse2fine.config import Params
from coarse2fine.data.convert import convert


def main(params: Params, args: argparse.Namespace) -> None:
    with distributed.session() as runtime:
        convert(params, runtime, Path(args.out))


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/records", help="records directory (default: data/records)")
    cli.run(main, parser)
