"""`python -m coarse2fine.launch [torchrun options] stages/<stage>.py [stage options]`: how dvc.yaml runs stages.

It is torchrun (the same argument parser and elastic launch, in this process), plus what a pipeline stage needs:

- torchrun's options come from the params file's `launch` section (`torchrun_options`; options given before the
  script override them): one node is `--standalone`, more meet at a c10d rendezvous (run the same command on
  each node); under `launch.scheduler: slurm` the launcher runs itself once per node with `srun`, all meeting
  on the allocation's first node, so DVC decides what runs and Slurm and torchrun run it. `max_restarts`
  restarts the whole group after a failure, and the stage resumes from its checkpoint. Under `launch.scheduler:
  ssh` it starts one agent per node of `launch.hosts` over SSH instead (coarse2fine.ssh). With
  COARSE2FINE_LAUNCH_DRY_RUN=1 in the environment it prints the command it would run instead;
- the params file (the stage's `--params`, default params.yaml) is validated before any worker starts (the
  model names against timm's registry by the workers);
- the workers import the code of the tree the launcher was imported from (dvc.yaml runs it with
  `PYTHONPATH=src`), not the main workspace the editable install points at: a `dvc exp run --queue/--temp`
  copy runs its own code, the code whose hash DVC recorded;
- a user mistake found inside a worker (a `UserError`: a missing data root, a batch larger than a rank's
  share, `launch.device: cuda` where torch finds too few GPUs, ...) ends the stage with that one line and exit
  code 2, instead of torchrun's ChildFailedError report. Workers hand their message over in a file
  (`cli.report_user_error`); any other failure keeps torchrun's full report and exits 1;
- a world of one (one node, one process, no restarts: the default on a laptop or one GPU) runs the stage in this
  process, as `torchrun --standalone --nproc_per_node=1` would run it in a worker: an agent that will never
  restart its only worker adds nothing but a second process and a second import of torch (about 2 s of every
  stage's start-up, issue 21). The stage finds no RANK or WORLD_SIZE set, and `distributed.init` makes a world of one;
- with COARSE2FINE_STAGE_SERVER set, all of the above runs in a fork of that stage server, which has imported
  torch and the rest once (`coarse2fine.stage_server`), and so do torchrun's workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from coarse2fine import cli, ssh, stage_server
from coarse2fine.errors import UserError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from coarse2fine import slurm
    from coarse2fine.config import Launch

# Set on the srun step to the name of the allocation's first node: this process is one node's torchrun agent, its
# options already resolved, and hosts the rendezvous if it runs on that node.
SLURM_AGENT_ENV = "COARSE2FINE_SLURM_AGENT"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    stage_server.run_there_if_asked({"module": "coarse2fine.launch", "argv": argv})
    # Imported after: a launcher that hands its stage to the stage server never imports torch, nor pydantic and
    # the params schema (0.2 s).
    from torch.distributed import run as torchrun

    from coarse2fine import slurm
    from coarse2fine.config import load_params

    dry_run = os.environ.get(slurm.DRY_RUN_ENV) == "1"
    try:
        # Everything but the model names, which need timm imported (2 s, paid again by every worker): the workers
        # check those, and a mistake there still ends the stage with its one line (below).
        params_file = _params_file(torchrun.parse_args(argv).training_script_args)
        launch = load_params(params_file, check_model_names=False).launch
        srun = agents = None
        if launch.scheduler == "slurm" and SLURM_AGENT_ENV not in os.environ:
            job = slurm.allocation(launch, dry_run=dry_run)
            agent = [sys.executable, "-m", "coarse2fine.launch", *torchrun_options(launch, job), *argv]
            srun = slurm.srun_command(launch, job, agent)
        elif SLURM_AGENT_ENV in os.environ:
            argv = [slurm.rendezvous_host_option(os.environ, first_node=os.environ[SLURM_AGENT_ENV]), *argv]
        elif ssh.AGENT_ENV in os.environ:  # one node's agent under an SSH driver: its options resolved there
            ssh.stop_when_the_driver_goes()
        elif launch.scheduler == "ssh":
            if not dry_run:
                ssh.check_reachable(launch.hosts)
            agents = launch.hosts
        else:
            argv = [*torchrun_options(launch), *argv]
    except UserError as error:
        cli.print_user_error(error)
        sys.exit(cli.USER_ERROR_EXIT)
    os.environ["PYTHONPATH"] = stage_server.search_path()
    if agents:  # each agent prints its own user errors; the stage exits with the first failure's code
        commands = ssh.agent_commands(agents, torchrun_options(launch), argv, os.environ)
        if dry_run:
            print("\n".join(map(shlex.join, commands)), flush=True)
            return
        sys.exit(ssh.run_agents(commands))
    if dry_run:
        print(shlex.join(srun or [sys.executable, "-m", "coarse2fine.launch", *argv]), flush=True)
        return
    if srun:  # each agent prints its own user errors; srun exits with the highest task's code
        sys.exit(subprocess.run(srun, env={**os.environ, SLURM_AGENT_ENV: job.first_node}).returncode)
    args = torchrun.parse_args(argv)
    if is_world_of_one(args):
        _run_here(args)
    else:
        _launch_here(args)


def torchrun_options(launch: Launch, job: slurm.Allocation | None = None) -> list[str]:
    """torchrun's arguments for `launch`, in the Slurm allocation `job` if given: one node runs standalone (a free
    local port); more meet at the c10d rendezvous, hosted by the agent on the endpoint's host."""
    options = [f"--nnodes={launch.nnodes}", f"--nproc_per_node={launch.nproc_per_node}",
               f"--max_restarts={launch.max_restarts}"]
    host, port = launch.rdzv_endpoint.rsplit(":", 1)
    rdzv_id = launch.rdzv_id
    if job is not None:
        host, rdzv_id = job.first_node_address, f"{launch.rdzv_id}-{job.job_id}"
    elif launch.nnodes == 1:
        return [*options, "--standalone"]
    elif launch.scheduler == "ssh":
        host = launch.hosts[0]
    return [*options, "--rdzv_backend=c10d", f"--rdzv_endpoint={host}:{port}", f"--rdzv_id={rdzv_id}"]


def is_world_of_one(args: argparse.Namespace) -> bool:
    """torchrun's arguments start a single worker on this machine that it would never restart: a python script."""
    return (
        args.standalone and args.nnodes in ("1", "1:1") and args.nproc_per_node == "1" and args.max_restarts == 0
        and not (args.module or args.no_python)
    )


def _run_here(args: argparse.Namespace) -> None:
    """The stage script as this process's main program, as `python -u script args` runs it. A user mistake is its
    one line and exit 2 (cli.run prints it: no launcher waits for a message file)."""
    stage_server.run_script_as_main(args.training_script, args.training_script_args)


def _launch_here(args: argparse.Namespace) -> None:
    """torchrun's elastic launch of this node's workers, their user errors as one line each and exit 2."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    _quiet_elastic_agent()
    # torch 2.14 shares the rendezvous' TCP store with the workers across restarts without a per-attempt prefix
    # (despite its comment in torch/distributed/rendezvous.py), so a restarted group's gloo reads the killed
    # attempt's addresses and fails "Connection refused". Unshared, rank 0 hosts a fresh store each attempt.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if stage_server.address():  # each worker a fork of the stage server too, through its `--worker` entry
        args.module, args.training_script, args.training_script_args = (
            True, "coarse2fine.stage_server", ["--worker", args.training_script, *args.training_script_args],
        )
    with tempfile.TemporaryDirectory(prefix="coarse2fine-errors-") as error_dir:
        os.environ[cli.ERROR_DIR_ENV] = error_dir
        try:
            torchrun.run(args)
        except RendezvousConnectionError as failure:
            if "EADDRINUSE" not in str(failure.__cause__):
                raise
            # Only an agent told to host the store (a Slurm job's first node) fails so; left to guess, it would
            # have joined whatever listens there as a client, and waited.
            cli.print_user_error(
                f"launch.rdzv_endpoint: port {args.rdzv_endpoint.rsplit(':', 1)[-1]} is taken on this node "
                f"({socket.gethostname()}), by another job's rendezvous or another program: set launch.rdzv_endpoint "
                f"to a free port"
            )
            sys.exit(cli.USER_ERROR_EXIT)
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
    """The distinct user-error messages, if a worker stopped on one and every other failed worker was stopped
    by the agent (SIGTERM: a consequence, not a second failure). Which of them torch calls the first failure
    is a race (error-file timestamps in whole seconds; a rank stopped mid-exit may have written one first)."""
    exit_codes = {process.exitcode for process in failure.failures.values()}
    if cli.USER_ERROR_EXIT not in exit_codes or not exit_codes <= {cli.USER_ERROR_EXIT, -signal.SIGTERM}:
        return []
    messages = [path.read_text(encoding="utf-8") for path in sorted(error_dir.glob("*.txt"))]
    return list(dict.fromkeys(messages))


if __name__ == "__main__":
    main()
