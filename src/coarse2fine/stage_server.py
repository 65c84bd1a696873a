"""A warm interpreter for the launched stages: their imports paid once, not once per stage.

Most of a short stage's start-up is importing torch, timm, DALI, MLflow, DVCLive and matplotlib (6-7 s on 2 cores,
issue 21), and DVC starts a fresh process for every stage. `python -m coarse2fine.stage_server COMMAND` (e.g. `dvc
repro`) starts a server that imports them once, and runs COMMAND with `COARSE2FINE_STAGE_SERVER` set to the server's
socket (`--serve SOCKET`: be that server). With it in its environment, `python -m coarse2fine.launch` (every
launched stage in dvc.yaml) hands its arguments, environment, working directory and standard streams to the server,
which forks a copy of itself to run the launcher there, and exits with that copy's status. With more than one
process, torchrun's workers are started as `python -m coarse2fine.stage_server --worker SCRIPT ARGS`, which hand
themselves over the same way. A copy is the caller's process as python would have started it: it imports
coarse2fine afresh from the caller's `sys.path` (a queued experiment's copy runs its own code), and reads OpenMP's
thread count and the temporary directory from the caller's environment. The caller forwards SIGINT, SIGTERM and
SIGHUP to it, and the caller's death kills it (as `cli.die_with_the_launcher` does for workers).

Opt-in, for many short stages on one machine (the test suite, a sweep of small experiments): the stage then runs
outside the process tree of `dvc repro` (under the server's), so neither a job's cgroup nor a process-tree
monitor sees it; under Slurm (SLURM_JOB_ID set) the launcher never uses it. A server of another Python
installation, or none at the address, is reported in one line and the launcher runs the stage itself.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import os
import resource
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

SERVER_ENV = "COARSE2FINE_STAGE_SERVER"
# Set in every copy: the program it runs, asking to be handed over (run_there_if_asked takes it out), runs there.
COPY_ENV = "COARSE2FINE_STAGE_SERVER_COPY"
SOURCE_DIR = Path(__file__).resolve().parents[1]  # the `src` directory this package was imported from
# What the launched stages import (a copy imports the rest, and coarse2fine itself, afresh). Only modules whose
# import leaves the process as a fresh one would be: not mlflow.pytorch, whose import configures the root logger
# (logging.basicConfig at ERROR), which a stage's process meets only when it logs its model, at its end.
# mlflow.store.tracking.sqlalchemy_store: SQLAlchemy and Alembic, which mlflow imports only when a stage first opens
# a sqlite store (0.9 s of every tracked stage). sklearn: the digits source's loader and split (1.2 s of convert).
PRELOADED = (
    "torch", "torch.distributed.run", "torchvision", "timm", "timm.models", "nvidia.dali",
    "nvidia.dali.plugin.pytorch", "mlflow", "mlflow.store.tracking.sqlalchemy_store", "dvclive", "matplotlib.figure",
    "pydantic", "yaml", "tfrecord", "tqdm", "PIL.Image", "sklearn.datasets", "sklearn.model_selection",
)
# The caller's resource limits, which a fork of the server would not have (a test's small RLIMIT_FSIZE: a full disk).
LIMITS = ("RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_NPROC")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_MESSAGE = 1 << 20
LISTENING, PRELOADED_LINE = "stage server listening at", "stage server ready"  # what the server prints, in order
PR_SET_PDEATHSIG = 1


# The caller's side: a launcher, or one of torchrun's workers.


def search_path() -> str:
    """PYTHONPATH for a process that runs this package: this checkout's `src` first, then the caller's own entries
    (dependencies installed with `pip --target` and found through PYTHONPATH, as on a GPU node: docs/gpu.md)."""
    return os.pathsep.join(filter(None, (str(SOURCE_DIR), os.environ.get("PYTHONPATH"))))


def address() -> str | None:
    """The stage server to use: COARSE2FINE_STAGE_SERVER's, never under Slurm."""
    return None if "SLURM_JOB_ID" in os.environ else os.environ.get(SERVER_ENV)


def run_there_if_asked(program: dict) -> None:
    """Run `program` in the stage server (address()) and exit with its status; return if there is none to use,
    after saying why. `program`: {"module": name, "argv": [...]} (`python -m name argv`) or {"script": path,
    "argv": [...]} (`python -u path argv`, as torchrun runs a worker)."""
    if os.environ.pop(COPY_ENV, None) or not address():  # a copy runs its program itself
        return
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        connection.connect(address())
        socket.send_fds(connection, [json.dumps(_request(program)).encode()], [0, 1, 2])
        reply = _receive(connection)
    except OSError as error:
        reply = {"refused": f"no stage server answers at {address()} ({error.strerror or error})"}
    if "refused" in reply:
        connection.close()
        print(f"coarse2fine: {reply['refused']}: running the stage in this process", file=sys.stderr, flush=True)
        return
    _exit_as(_wait_for(connection, reply["pid"]))


def run_script_as_main(script: str, argv: list[str]) -> None:
    """`script` as this process's main program, as `python -u script argv` runs it: its own directory first on
    sys.path, its arguments in sys.argv, output unbuffered (dvc repro shows progress as it comes)."""
    sys.argv = [script, *argv]
    sys.path[0] = str(Path(script).resolve().parent)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)
    runpy.run_path(script, run_name="__main__")


def _request(program: dict) -> dict:
    umask = os.umask(0)
    os.umask(umask)
    return {
        "python": _installation(), "program": program, "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path,
        "umask": umask, "limits": {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS},
    }


def _installation() -> list[str]:
    """The same interpreter and packages: the server's imports must be the ones this process would make."""
    return [sys.executable, sys.prefix, sys.version]


def _wait_for(connection: socket.socket, pid: int) -> dict:
    """The copy's exit status, passing it the signals a terminal or DVC sends the launcher meanwhile."""

    def forward(signum: int, _frame: object) -> None:  # to its process group, as a terminal's Ctrl-C reaches all
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    try:
        return _receive(connection)
    except OSError:
        return {}


def _exit_as(status: dict) -> NoReturn:
    """End as the copy ended: its exit code, or killed by the same signal."""
    if "signal" in status:
        signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    if "exit" not in status:
        print("coarse2fine: the stage server ended before the stage did", file=sys.stderr, flush=True)
    sys.exit(status.get("exit", 1))


def _receive(connection: socket.socket) -> dict:
    message = connection.recv(MAX_MESSAGE)
    if not message:
        raise ConnectionError("the stage server closed the connection")
    return json.loads(message)


# The server's side.


def serve(address: Path) -> NoReturn:
    """Listen at `address`, import PRELOADED, then fork a supervised copy of this process for each launcher that
    connects. A launcher that connects during the imports waits for them (its request queues at the socket), so
    whoever started the server need not. A preloaded package that is not installed is left to the stage that
    imports it, which says so itself: a GPU node may hold only what its checks need (no MLflow for `pytest -m gpu`)."""
    _die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with contextlib.suppress(FileNotFoundError):
        address.unlink()
    listener.bind(str(address))
    listener.listen(64)

    def stop(*_: object) -> NoReturn:  # without the interpreter's teardown of torch and the rest (2-3 s)
        address.unlink(missing_ok=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"{LISTENING} {address}", flush=True)
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if not f"{name}.".startswith(f"{error.name}."):  # one of its own imports failed: a broken install
                raise
    # MLflow checks a logged model's requirements against a map of every installed distribution's modules, which
    # it builds once per process (1.4-1.6 s of every training stage's log_model): built here, every copy has it.
    if "mlflow" in sys.modules:
        from mlflow.utils import requirements_utils

        requirements_utils._init_modules_to_packages_map()
    # Out of the collector's reach: a copy's full collections would otherwise walk every object of these imports
    # (0.5-0.7 s each time) and write to their pages, which the copies share with the server until written.
    gc.freeze()
    import torch

    if torch.cuda.is_initialized():  # a fork of a process with CUDA initialised cannot use the GPU
        raise SystemExit("stage server: importing the stages' libraries initialised CUDA: a fork could not use it")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the supervisors reap themselves
    print(PRELOADED_LINE, flush=True)
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            _supervise(connection)
        connection.close()


def _supervise(connection: socket.socket) -> NoReturn:
    """One launcher's supervisor: fork the copy that runs it, report the copy's pid and then its exit status, and
    kill it if the launcher dies first."""
    for signum in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the server's terminal is for the stages it runs
    try:
        message, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 3)
        request = json.loads(message)
    except (OSError, ValueError):
        os._exit(1)
    if request["python"] != _installation():
        connection.send(json.dumps({"refused": f"the stage server runs {sys.executable} ({sys.prefix})"}).encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run_program(request, fds)
    with contextlib.suppress(OSError):  # here too (the copy may not have run yet): its pid names its group now
        os.setpgid(pid, pid)
    for fd in fds:
        os.close(fd)
    with contextlib.suppress(OSError):
        connection.send(json.dumps({"pid": pid}).encode())
    copy = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([connection, copy], [], [])
        if copy in ready:
            break
        if not connection.recv(MAX_MESSAGE):  # the caller is gone: so is its stage, loader workers and all
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            break
    _, status = os.waitpid(pid, 0)
    reply = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.waitstatus_to_exitcode(status)}
    with contextlib.suppress(OSError):
        connection.send(json.dumps(reply).encode())
    os._exit(0)


def _run_program(request: dict, fds: list[int]) -> NoReturn:
    """Become the caller's process as python would have started it, then run its program."""
    _die_with_parent()
    os.setpgid(0, 0)  # a group of its own with the processes it starts, killed together as the caller's would be
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name, limits in request["limits"].items():
        try:
            resource.setrlimit(getattr(resource, name), tuple(limits))
        except (OSError, ValueError):  # above the server's hard limit: the stage runs with the server's
            print(f"coarse2fine: the stage server could not raise {name} to the caller's {limits}", file=sys.stderr)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    for name in [name for name in sys.modules if name == "coarse2fine" or name.startswith("coarse2fine.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    tempfile.tempdir = None
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python starts
    sys.stdout.reconfigure(line_buffering=sys.stdout.isatty())
    import torch

    if threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))
    program = request["program"]
    code = 0
    os.environ[COPY_ENV] = "1"
    try:
        if "module" in program:
            sys.argv = ["-m", *program["argv"]]
            runpy.run_module(program["module"], run_name="__main__", alter_sys=True)
        else:
            run_script_as_main(program["script"], program["argv"])
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def running(preloaded: bool = True) -> Iterator[Path]:
    """A stage server in a process of its own while the block runs: its socket, once the server listens there and,
    if `preloaded`, has imported what the stages import (a launcher that comes earlier waits for that itself)."""
    with tempfile.TemporaryDirectory(prefix="coarse2fine-stage-server-") as directory:
        address = Path(directory) / "socket"
        server = subprocess.Popen(
            [sys.executable, "-m", "coarse2fine.stage_server", "--serve", str(address)],
            env={**os.environ, "PYTHONPATH": search_path()}, stdout=subprocess.PIPE, text=True,
            start_new_session=True,  # a Ctrl-C reaches each stage once, forwarded by its launcher
        )
        try:
            expected = [LISTENING, PRELOADED_LINE] if preloaded else [LISTENING]
            for line in expected:
                if not server.stdout.readline().startswith(line):
                    raise RuntimeError(f"the stage server did not start (exit code {server.wait()})")
            yield address
        finally:
            server.terminate()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Run COMMAND (e.g. dvc repro, dvc exp run) with a stage server: its launched stages share one "
                    "import of torch, timm, DALI, MLflow and the rest.",
        epilog="The stages run as the server's processes, outside COMMAND's process tree (see the module's doc).",
    )
    parser.add_argument("--serve", type=Path, metavar="SOCKET", help="be the server, listening at SOCKET")
    parser.add_argument(
        "--worker", action="store_true",
        help="COMMAND is torchrun's worker (SCRIPT ARGS): run it in the server if there is one (coarse2fine.launch)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, with its arguments")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
    if args.worker:
        _die_with_parent()  # as cli.die_with_the_launcher: torchrun starts its workers in sessions of their own
        script, *script_args = args.command
        run_there_if_asked({"script": script, "argv": script_args})
        run_script_as_main(script, script_args)
        return
    if not args.command:
        parser.error("give a COMMAND to run, or --serve SOCKET")
    with running(preloaded=False) as address:  # COMMAND's start-up (dvc's: seconds) overlaps the server's imports
        # As a shell waits for its command: a Ctrl-C is COMMAND's to handle (a handler, not SIG_IGN, which COMMAND
        # would inherit), and this process stops the server once COMMAND has ended.
        signal.signal(signal.SIGINT, lambda *_: None)
        sys.exit(subprocess.run(args.command, env={**os.environ, SERVER_ENV: str(address)}).returncode)


if __name__ == "__main__":
    main()
