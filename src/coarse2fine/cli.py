"""What every stage script shares: `--params`, validation before heavy work, and exit codes."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

from coarse2fine.errors import UserError
from coarse2fine.files import atomic_path, sole_writer

if TYPE_CHECKING:
    from coarse2fine.config import Params

USER_ERROR_EXIT = 2
# Set by coarse2fine.launch: the directory where a worker leaves its user-error message for the launcher.
ERROR_DIR_ENV = "COARSE2FINE_ERROR_DIR"


def stage_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    return parser


def add_student_arguments(parser: argparse.ArgumentParser, stage: str) -> None:
    """The paths of a student-training stage (pretrain, finetune), defaulting to dvc.yaml's."""
    parser.add_argument("--records", default="data/records", help="records directory (default: data/records)")
    parser.add_argument(
        "--token-labels", default="data/token_labels", help="token-label store (default: data/token_labels)"
    )
    parser.add_argument(
        "--checkpoint-dir", default=f".resume/{stage}", help=f"resume state (default: .resume/{stage})"
    )
    parser.add_argument("--out", default=f"models/{stage}", help=f"final model directory (default: models/{stage})")
    parser.add_argument("--metrics", default=f"metrics/{stage}", help=f"metrics directory (default: metrics/{stage})")


def run(
    main: Callable[[Params, argparse.Namespace], None],
    parser: argparse.ArgumentParser,
    *,
    check_model_names: bool = True,
) -> None:
    """Parse args, validate the whole params file, run `main`, end the process (exit_now); a UserError exits 2 with
    one clear line. `check_model_names=False` skips the model names' check against timm's registry (see
    config.CHECK_MODEL_NAMES). Only a stage script's main program calls it: it never returns."""
    from coarse2fine.config import load_params  # here, not at the top: the launcher imports cli without pydantic

    args = parser.parse_args()
    die_with_the_launcher()
    try:
        with _sole_writer_of_the_outputs(args):
            params = load_params(args.params, check_model_names=check_model_names)
            _recorded(main)(params, args)
    except UserError as error:
        report_user_error(error)
        exit_now(USER_ERROR_EXIT)
    exit_now(0)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` as the interpreter would, less the teardown of every module's objects (torch,
    timm, MLflow and DALI freed one by one: 1.4 s of each stage, issue 21): other threads finished, atexit handlers
    run (logging's flush, multiprocessing's loader workers, temporary directories), the standard streams flushed.
    multiprocessing ends its forked processes the same way (process.py's _bootstrap, then os._exit)."""
    threading._shutdown()  # what the interpreter does first at exit: threading's own atexit hooks, then the joins
    gc.freeze()  # DALI's atexit hook collects garbage (0.3-0.7 s) only to free what the process's end frees
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _sole_writer_of_the_outputs(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """Rank 0 of a stage with an `--out` holds its lock (`files.sole_writer`) while the stage runs: a second run
    of the stage on the same outputs stops before touching anything (its other ranks stop with it)."""
    if getattr(args, "out", None) is None or os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext()
    return sole_writer(args.out, Path(sys.argv[0]).stem)


def _recorded(main: Callable[[Params, argparse.Namespace], None]) -> Callable[[Params, argparse.Namespace], None]:
    """Under torchrun, torch's `record`: a worker's uncaught exception goes to the agent's error file, so a failure
    that outlasts launch.max_restarts is reported with the failing rank's own traceback (not "error_file: <N/A>").
    Imported here: the listing stage runs without torch."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return main
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

    class WholeErrorFile(ErrorHandler):
        """torch writes the error file in place. Once one rank fails the agent SIGTERMs the others, and a rank
        stopped mid-write left an empty file: the agent died parsing it (JSONDecodeError) and the stage's report,
        a user mistake's one line included, became the agent's traceback (CI, 2026-12-06). Written beside, renamed."""

        def __init__(self) -> None:
            self.writing_to: Path | None = None

        def _get_error_file_path(self) -> str | None:
            return str(self.writing_to) if self.writing_to else super()._get_error_file_path()

        def record_exception(self, e: BaseException) -> None:
            error_file = super()._get_error_file_path()
            if not error_file:
                return super().record_exception(e)
            with atomic_path(error_file) as self.writing_to:
                super().record_exception(e)
            self.writing_to = None

    return record(main, error_handler=WholeErrorFile())


def die_with_the_launcher() -> None:
    """torchrun starts each worker in a session of its own, so a SIGKILL of torchrun (of `dvc repro`, of a job's
    process group) would leave the workers training, and writing the checkpoint beside the rerun that resumes
    from it. On Linux, have the kernel kill this worker when its launcher dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the line above: nobody will collect this worker
        os._exit(1)


def print_user_error(error: UserError | str) -> None:
    print(f"error: {error}", file=sys.stderr)


def report_user_error(error: UserError) -> None:
    """Under coarse2fine.launch, leave the message for the launcher, which prints each distinct one once;
    otherwise print it (under a bare torchrun every rank hits the same mistake: rank 0 speaks for all)."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    if error_dir:
        try:
            # Whole or not at all: the agent may SIGTERM this rank mid-write once another has exited 2, and an
            # empty message file became a second, empty "error:" line (make test, 2026-11-26).
            with atomic_path(Path(error_dir) / f"rank{rank}.txt") as partial:
                partial.write_text(str(error), encoding="utf-8")
            return
        except (OSError, UserError):  # the disk that stopped the stage may be the one it goes to: print it
            pass
    elif rank != "0":
        return
    print_user_error(error)


def check_params() -> None:
    """`python -m coarse2fine.cli [params.yaml]`: validate a params file (one line per mistake, exit 2)."""
    parser = argparse.ArgumentParser(description=check_params.__doc__.splitlines()[0])
    parser.add_argument("params", nargs="?", default="params.yaml")
    run(lambda params, args: None, parser)


if __name__ == "__main__":
    check_params()
