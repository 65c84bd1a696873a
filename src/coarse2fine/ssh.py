"""`launch.scheduler: ssh`: several nodes without a scheduler, driven from one. `dvc repro` runs on one machine (the
driver); each stage's launcher starts one torchrun agent per node of `launch.hosts` over SSH, as DeepSpeed's and
torchrun's users start them from a host list, and waits for all of them. Node i is `launch.hosts[i]`; they meet at
the c10d rendezvous on the first host (at `launch.rdzv_endpoint`'s port), whose agent hosts it.

Every node runs the same command in the same folder with the same Python (the project and its environment on a
shared file system, as on a cluster), with the environment a stage's result or its tracking depends on forwarded
(FORWARDED_ENV). SSH must log in without a prompt (keys; BatchMode): `COARSE2FINE_SSH` replaces the `ssh` command, as
GIT_SSH_COMMAND does for git (e.g. `ssh -F cluster_ssh_config`). Each host is reached once before any agent
starts: an unreachable one fails the stage in one line naming it. An agent whose driver goes away (the stage killed,
the driver node lost) sees its standard input close and stops its workers: no orphaned ranks wait at a rendezvous.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from coarse2fine.errors import UserError

SSH_ENV = "COARSE2FINE_SSH"
AGENT_ENV = "COARSE2FINE_SSH_AGENT"  # set on each agent the driver starts
# What a remote agent gets of the driver's environment: the code's search path, MLflow's store and DVC's experiment
# (the run's tags), thread counts. Not the stage server's address: a socket of the driver's machine.
FORWARDED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
FORWARDED_PREFIXES = ("MLFLOW_", "DVC_")
CONNECT_SECONDS = 10


def ssh_command() -> list[str]:
    command = shlex.split(os.environ.get(SSH_ENV) or "ssh")
    return [*command, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_SECONDS}"]


def check_reachable(hosts: Sequence[str]) -> None:
    """Log in to every host at once (`true`); a UserError naming the first that fails, with ssh's reason."""
    probes = {host: subprocess.Popen([*ssh_command(), host, "true"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for host in hosts}
    for host, probe in probes.items():
        _, error = probe.communicate()
        if probe.returncode != 0:
            reason = error.strip().splitlines()[-1] if error.strip() else f"ssh exited {probe.returncode}"
            raise UserError(f"launch.hosts: {host} cannot be reached over SSH ({reason})")


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environ.items()
            if name in FORWARDED_ENV or name.startswith(FORWARDED_PREFIXES)}


def agent_commands(hosts: Sequence[str], options: Sequence[str], argv: Sequence[str],
                   environ: Mapping[str, str]) -> list[list[str]]:
    """One ssh command per host: this folder, the forwarded environment and this Python's launcher with torchrun's
    `options`, the first host's agent hosting the rendezvous."""
    assignments = [f"{name}={value}" for name, value in {**forwarded_env(environ), AGENT_ENV: "1"}.items()]
    commands = []
    for rank, host in enumerate(hosts):
        remote = ["cd", os.getcwd(), "&&", "exec", "env", *assignments, sys.executable, "-m", "coarse2fine.launch",
                  *options, f"--rdzv_conf=is_host={int(rank == 0)}", *argv]
        commands.append([*ssh_command(), host, " ".join(part if part == "&&" else shlex.quote(part)
                                                        for part in remote)])
    return commands


def run_agents(commands: Sequence[Sequence[str]]) -> int:
    """Start every agent, wait for all; when one fails, the others are stopped (their standard input closed). The
    exit code of the first that failed (a user mistake is 2 on every node), else 0."""
    agents = [subprocess.Popen(command, stdin=subprocess.PIPE) for command in commands]
    failed = 0
    try:
        while any(agent.poll() is None for agent in agents):
            codes = [agent.returncode for agent in agents if agent.returncode not in (None, 0)]
            if codes and not failed:
                failed = codes[0]
                _hang_up(agents)
            time.sleep(0.2)
    finally:
        _hang_up(agents)
        for agent in agents:
            agent.wait()
    return failed or next((agent.returncode for agent in agents if agent.returncode), 0)


def _hang_up(agents: Sequence[subprocess.Popen]) -> None:
    for agent in agents:
        if agent.stdin is not None and not agent.stdin.closed:
            agent.stdin.close()


def stop_when_the_driver_goes() -> None:
    """On an agent: SIGTERM to itself (torchrun's agent then stops its workers) once its standard input closes,
    which ssh does when the driver's end of the connection goes."""
    def watch() -> None:
        # The raw descriptor, not sys.stdin: a daemon thread blocked in a buffered read holds its lock, which the
        # interpreter's shutdown then waits for and aborts on.
        while os.read(0, 4096):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="driver-watch", daemon=True).start()
