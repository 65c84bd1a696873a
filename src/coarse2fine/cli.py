"""What every stage script shares: `--params`, validation before heavy work, and exit codes."""

from __future__ import annotations

import argparse
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
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
