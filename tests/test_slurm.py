"""The pipeline on a real Slurm: munged, slurmctld and two slurmd (nodes n1 and n2 of one host) started here from
Debian's slurm-wlm and munge (make test's set-up installs them when run as root), `sbatch --wait` of
scripts/slurm/pipeline.sbatch, and the dry run that prints each stage's srun line. Skipped, with the reason,
where Slurm is absent or this is not root (slurmd runs jobs as their user)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import PROJECT_ROOT, Project, free_ports

BATCH_SCRIPT = PROJECT_ROOT / "scripts/slurm/pipeline.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")
# A pipeline small enough for two of them in a test: a third of the digits, one teacher epoch, no token labels.
SMALL = {
    "data": {"subset": 0.3},
    "teacher": {"epochs": 1},
    "pretrain": {"epochs": 2, "token_label": {"enabled": False}},
    "finetune": {"token_label": {"enabled": False}},
    "tracking": {"log_models": False},  # the models are compared as files (torch.export would add 3-5 s a stage)
}


def slurm_conf(directory: Path, host: str, ports: list[int]) -> str:
    """Two nodes on this host, n1 and n2 (their own slurmd ports, spool and logs), a default partition."""
    nodes = "\n".join(
        f"NodeName=n{index} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=4000"
        for index, port in enumerate(ports[2:], start=1)
    )
    return f"""ClusterName=coarse2fine-test
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={directory}/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd-%n.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd-%n.log
{nodes}
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory) -> dict[str, str]:
    """What a client of a running two-node Slurm needs in its environment; the daemons are stopped by their pids
    afterwards."""
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    if missing:
        pytest.skip(f"no Slurm here (missing {', '.join(missing)}): apt-get install slurm-wlm munge, as make test does as root")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm's slurmd must run as root")
    host = socket.gethostname().split(".")[0]
    try:
        socket.getaddrinfo(host, None)
    except OSError as error:  # slurmctld looks up SlurmctldHost and would never come up
        pytest.skip(f"this host's name {host!r} does not resolve ({error}): add it to /etc/hosts for a local Slurm")
    directory = tmp_path_factory.mktemp("slurm")
    directory.chmod(0o700)  # munged refuses a key or socket directory others can write
    for sub in ("state", "spool/n1", "spool/n2"):
        (directory / sub).mkdir(parents=True)
    key = directory / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = directory / "slurm.conf"
    conf.write_text(slurm_conf(directory, host, free_ports(4)))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"/usr/sbin:{os.environ['PATH']}"}
    log = (directory / "daemons.out").open("w")
    daemons = [subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={directory}/munge.socket", f"--key-file={key}",
         f"--pid-file={directory}/munged.pid", f"--log-file={directory}/munged.log", f"--seed-file={directory}/munged.seed"],
        env=env, stdout=log, stderr=log,
    )]
    try:
        time.sleep(1)
        daemons.append(subprocess.Popen(["slurmctld", "-D"], env=env, stdout=log, stderr=log))
        time.sleep(1)
        daemons += [subprocess.Popen(["slurmd", "-D", "-N", node], env=env, stdout=log, stderr=log) for node in ("n1", "n2")]
        deadline = time.monotonic() + 60
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, (directory / "daemons.out").read_text()[-3000:]
            time.sleep(0.5)
        yield {"SLURM_CONF": str(conf)}
    finally:
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in daemons:
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        log.close()


def failure_excerpt(log: str, context: int = 30) -> str:
    """The first traceback or error line of a job's log with what led to it, then the log's end: the first failure
    is the cause, what srun's --kill-on-bad-exit stopped next is not, and either can be thousands of lines long."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("Traceback") or "error" in line.lower()), None)
    head = [] if first is None else lines[max(0, first - context):first + context]
    return "\n".join([*head, "[...]", log[-3000:]])


def test_the_dry_run_prints_each_stage_s_srun_line_for_two_nodes(tmp_path):
    project = Project(tmp_path / "project")
    project.edit_params({"launch": {"scheduler": "slurm", "nnodes": 2, "nproc_per_node": 4}})
    result = project.run(str(BATCH_SCRIPT), "--dry-run", "pretrain", env={**project.env, "PYTHONPATH": "src"})
    lines = result.stdout.splitlines()
    assert lines[0].startswith("PYTHONPATH=src python stages/source.py")  # the listing, on the first node
    launched = lines[1:]
    assert [line.split(" stages/")[1].split(".py")[0] for line in launched] == ["convert", "teacher", "token_labels", "pretrain"]
    for line in launched:
        assert line.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 ")
        assert (" -m coarse2fine.launch --nnodes=2 --nproc_per_node=4 --max_restarts=0 --rdzv_backend=c10d "
                "--rdzv_endpoint=FIRST_NODE:29500 --rdzv_id=coarse2fine-JOB_ID stages/") in line
    assert not (project.path / "data").exists()  # nothing ran


def test_the_batch_script_refuses_a_local_scheduler(tmp_path):
    project = Project(tmp_path / "project")
    result = project.run(str(BATCH_SCRIPT), check=False)
    assert result.returncode == 2 and "launch.scheduler is 'local'" in result.stderr


@pytest.mark.slow
def test_sbatch_on_two_nodes_reaches_the_metrics_of_a_local_two_process_repro(slurm_cluster, tmp_path):
    on_slurm, local = Project(tmp_path / "slurm"), Project(tmp_path / "local")
    on_slurm.edit_params({**SMALL, "launch": {"scheduler": "slurm", "nnodes": 2, "nproc_per_node": 1}})
    local.edit_params({**SMALL, "launch": {"nproc_per_node": 2}})
    for project in (on_slurm, local):
        project.env["OMP_NUM_THREADS"] = "1"  # the same kernels for a rank alone on its node as for two on one
        project.commit("small")

    job = on_slurm.run("sbatch", "--wait", "--nodes=2", str(BATCH_SCRIPT), "evaluate@pretrain",
                       env={**on_slurm.env, **slurm_cluster}, timeout=900, check=False)
    (log,) = on_slurm.path.glob("slurm-*.out")
    assert job.returncode == 0, failure_excerpt(log.read_text())
    assert "on 2 node(s): n[1-2]" in log.read_text()
    assert "pretrain: device cpu x2" in log.read_text()  # one rank on each node
    assert local.repro("evaluate@pretrain") >= {"convert", "teacher", "pretrain", "evaluate@pretrain"}

    for stage in ("teacher", "evaluate/pretrain"):
        ours, theirs = (json.loads((p.path / "metrics" / stage / "metrics.json").read_text()) for p in (on_slurm, local))
        assert {k: v for k, v in ours.items() if "per_s" not in k and "seconds" not in k} == {
            k: v for k, v in theirs.items() if "per_s" not in k and "seconds" not in k
        }
    weights = [torch.load(p.path / "models/pretrain/model.pt", weights_only=True)["model"] for p in (on_slurm, local)]
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
