"""What every stage script shares: `--params`, validation before heavy work, and exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from coarse2fine.config import Params, load_params
from coarse2fine.errors import UserError


def stage_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    return parser


def run(main: Callable[[Params, argparse.Namespace], None], parser: argparse.ArgumentParser) -> None:
    """Parse args, validate the whole params file, run `main`; a UserError exits 2 with one clear line."""
    args = parser.parse_args()
    try:
        params = load_params(args.params)
        main(params, args)
    except UserError as error:
        # Under torchrun every rank hits the same mistake; one copy of the message is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


def check_params() -> None:
    """`python -m coarse2fine.cli [params.yaml]`: validate before torchrun starts any worker.

    dvc.yaml runs this ahead of each torchrun command so a bad value stops the stage with one line and
    exit code 2, instead of every worker failing and torchrun reporting a child failure.
    """
    parser = argparse.ArgumentParser(description=check_params.__doc__.splitlines()[0])
    parser.add_argument("params", nargs="?", default="params.yaml")
    run(lambda params, args: None, parser)


if __name__ == "__main__":
    check_params()
