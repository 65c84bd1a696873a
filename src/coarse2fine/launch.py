"""`python -m coarse2fine.launch [torchrun options] stages/<stage>.py [stage options]`: how dvc.yaml runs stages.

It is torchrun (the same argument parser and elastic launch, in this process), plus what a pipeline stage needs:

- the params file (the stage's `--params`, default params.yaml) is validated before any worker starts (the
  model names against timm's registry by the workers);
- the workers import the code of the tree the launcher was imported from (dvc.yaml runs it with
  `PYTHONPATH=src`), not the main workspace the editable install points at: a `dvc exp run --queue/--temp`
  copy runs its own code, the code whose hash DVC recorded;
- a user mistake found inside a worker (a `UserError`: a missing data root, a batch larger than a rank's
  share, `launch.device: cuda` where torch finds too few GPUs, ...) ends the stage with that one line and exit
  code 2, instead of torchrun's ChildFailedError report. Workers hand their message over in a file
  (`cli.report_user_error`); any other failure keeps torchrun's full report and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from coarse2fine import cli
from coarse2fine.config import load_params
from coarse2fine.errors import UserError

SOURCE_DIR = Path(__file__).resolve().parents[1]  # the `src` directory this package was imported from


def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(argv)
    try:
        # Everything but the model names, which need timm imported (2 s, paid again by every worker): the workers
        # check those, and a mistake there still ends the stage with its one line (below).
        load_params(_params_file(args.training_script_args), check_model_names=False)
    except UserError as error:
        cli.print_user_error(error)
        sys.exit(cli.USER_ERROR_EXIT)
    _quiet_elastic_agent()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(SOURCE_DIR), os.environ.get("PYTHONPATH"))))
    with tempfile.TemporaryDirectory(prefix="coarse2fine-errors-") as error_dir:
        os.environ[cli.ERROR_DIR_ENV] = error_dir
        try:
            torchrun.run(args)
        except ChildFailedError as failure:
            messages = _user_errors(failure, Path(error_dir))
            if not messages:
                raise
            for message in messages:
                cli.print_user_error(message)
            sys.exit(cli.USER_ERROR_EXIT)


def _params_file(stage_args: list[str]) -> str:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--params", default="params.yaml")
    return parser.parse_known_args(stage_args)[0].params


def _quiet_elastic_agent() -> None:
    """The agent logs every worker's exit (and the OMP_NUM_THREADS default) at WARNING/ERROR: what matters of
    a failure is in the ChildFailedError. torch gives its loggers levels of their own, so set each one."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _user_errors(failure: ChildFailedError, error_dir: Path) -> list[str]:
    """The distinct user-error messages, if the first worker to fail failed with one (the agent then stops
    the others: their SIGTERM is a consequence, not a second failure)."""
    _, first = failure.get_first_failure()
    if first.exitcode != cli.USER_ERROR_EXIT:
        return []
    messages = [path.read_text(encoding="utf-8") for path in sorted(error_dir.glob("*.txt"))]
    return list(dict.fromkeys(messages))


if __name__ == "__main__":
    main()
