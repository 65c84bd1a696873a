"""What the launcher needs of a Slurm allocation (`launch.scheduler: slurm`): its size, the address of its first
node (where the c10d rendezvous is hosted) and the `srun` step that starts one torchrun agent per node.

Slurm starts the processes and torchrun runs them, as in torchtitan's and Colossal-AI's multi-node scripts: this
module only reads what Slurm says (its environment, `scontrol`) and writes the `srun` command.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from coarse2fine.config import Launch
from coarse2fine.errors import UserError

# Set, the launcher prints the command it would run instead of running it (the batch script's dry run).
DRY_RUN_ENV = "COARSE2FINE_LAUNCH_DRY_RUN"
# Shown in a dry run made outside an allocation, where Slurm has not chosen the nodes yet.
UNKNOWN_NODE, UNKNOWN_JOB = "FIRST_NODE", "JOB_ID"


@dataclass(frozen=True)
class Allocation:
    job_id: str
    first_node: str  # its Slurm name (SLURMD_NODENAME there)
    first_node_address: str
    cpus_per_task: str | None  # sbatch --cpus-per-task, passed on: srun steps do not all inherit it


def allocation(launch: Launch, environ: Mapping[str, str] = os.environ, *, dry_run: bool = False) -> Allocation:
    """The allocation this process runs in, checked against launch.nnodes."""
    if "SLURM_JOB_ID" not in environ:
        if dry_run:
            return Allocation(UNKNOWN_JOB, UNKNOWN_NODE, UNKNOWN_NODE, None)
        raise UserError(
            "launch.scheduler: slurm starts the workers with srun inside an allocation, and SLURM_JOB_ID is not "
            "set: submit scripts/slurm/pipeline.sbatch with sbatch, or set launch.scheduler: local"
        )
    nodes = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES", "1"))
    if nodes < launch.nnodes:
        raise UserError(
            f"launch.nnodes: {launch.nnodes} but Slurm job {environ['SLURM_JOB_ID']} has {nodes} node(s): "
            f"submit with sbatch --nodes={launch.nnodes}, or lower launch.nnodes"
        )
    first_node = _first_node(environ["SLURM_JOB_NODELIST"])
    return Allocation(
        job_id=environ["SLURM_JOB_ID"],
        first_node=first_node,
        first_node_address=_node_address(first_node),
        cpus_per_task=environ.get("SLURM_CPUS_PER_TASK"),
    )


def srun_command(launch: Launch, job: Allocation, command: list[str]) -> list[str]:
    """`command` once per node on launch.nnodes nodes of the allocation; a task that fails ends the step."""
    options = [f"--nodes={launch.nnodes}", f"--ntasks={launch.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if job.cpus_per_task:
        options.append(f"--cpus-per-task={job.cpus_per_task}")
    return ["srun", *options, *command]


def rendezvous_host_option(environ: Mapping[str, str], first_node: str) -> str:
    """torchrun's --rdzv_conf for the agent srun started on this node: the first node's agent hosts the c10d
    store and the others only join it. Said, not left to torch's guess (is the endpoint one of this machine's
    addresses?): two nodes that share a host would both try to host, and a first node whose port is taken
    (another job's torchrun on the default port) would join whatever listens there and wait, where told to host
    it fails at once (coarse2fine.launch says so in one line)."""
    return f"--rdzv_conf=is_host={int(environ.get('SLURMD_NODENAME') == first_node)}"


def dry_run(argv: list[str] | None = None) -> None:
    """`python -m coarse2fine.slurm [TARGETS] [--single-item]` (scripts/slurm/pipeline.sbatch --dry-run): the
    command of each stage `dvc repro` would consider, in run order, each launcher's as the srun step it starts
    here (outside an allocation its first node and job id are placeholders). Nothing is run or written."""
    parser = argparse.ArgumentParser(description=dry_run.__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="*")
    parser.add_argument("-s", "--single-item", action="store_true")
    args = parser.parse_args(argv)
    import networkx
    from dvc.repo import Repo

    with Repo() as repo:
        graph = repo.index.graph  # an edge runs from a stage to a stage it depends on
        wanted = {
            stage for target in args.targets for stage in repo.stage.collect(target, with_deps=not args.single_item)
        }
        commands = [stage.cmd for stage in reversed(list(networkx.topological_sort(graph)))
                    if stage.cmd and (not args.targets or stage in wanted)]
    for command in commands:
        if "coarse2fine.launch" in command:  # the launcher prints its srun line
            subprocess.run(command, shell=True, check=True, env={**os.environ, DRY_RUN_ENV: "1"})
        else:  # the listing stage: plain python, on the first node
            print(command, flush=True)


def _first_node(nodelist: str) -> str:
    return _scontrol("show", "hostnames", nodelist).split()[0]


def _node_address(node: str) -> str:
    """Slurm's NodeAddr of the node (its name unless slurm.conf says otherwise): what the other nodes reach."""
    found = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "--oneliner", node))
    return found.group(1) if found else node


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise UserError(f"launch.scheduler: slurm: `scontrol {' '.join(args)}` failed: {error}") from None


if __name__ == "__main__":
    try:
        dry_run()
    except subprocess.CalledProcessError as failure:
        sys.exit(failure.returncode)
