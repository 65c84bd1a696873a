"""A team's set-up (docs/team.md) with real servers on 127.0.0.1: the pipeline and queued experiments writing to an
MLflow tracking server whose backend store is PostgreSQL (both started by the tests, as `make server` starts them);
`dvc repro` on one node driving two over SSH (Debian's sshd)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from mlflow import MlflowClient
from test_pipeline import EVERY_STAGE, FAST, SMOKE, TRACKED_STAGES, queued_names
from test_slurm import SMALL

from conftest import PROJECT_ROOT, Project, S3Server, free_ports, ran_stages
from coarse2fine.queue_stop import queue_workers, stop_queue_workers
from coarse2fine.server import mlflow_server
from coarse2fine.slurm import DRY_RUN_ENV
from coarse2fine.ssh import SSH_ENV

# Two points of the fine-tuning learning rate: each queued experiment reruns finetune and what follows.
QUEUED_LR = ("0.001", "0.002")


@pytest.mark.slow
def test_a_pipeline_and_two_queued_experiments_write_through_a_tracking_server(team_server, tmp_path, request):
    """`dvc repro` with MLFLOW_TRACKING_URI=http://...: the pipeline run, its nested stage runs and the registered
    model go through HTTP into PostgreSQL; then two queued experiments run at once (`dvc exp run --run-all --jobs 2`,
    i.e. `dvc queue start -j 2`), each a pipeline run of its own with its reruns and its links to the cached stages."""
    name = request.node.name
    project = Project(tmp_path / "project")
    project.edit_params(FAST)
    project.edit_params(SMOKE)
    project.edit_params({"tracking": {"experiment": name, "registered_model": name, "log_models": True}})
    project.commit("params")
    project.env["MLFLOW_TRACKING_URI"] = team_server.uri
    assert project.repro() == EVERY_STAGE
    assert not (project.path / "mlflow.db").exists()  # everything went to the server

    server = MlflowClient(team_server.uri)
    experiment = server.get_experiment_by_name(name).experiment_id

    def pipelines() -> dict[str, dict[str, bool]]:
        """pipeline run name -> {stage: whether its run there links to a cached one}, every run FINISHED."""
        found = {}
        for pipeline in server.search_runs([experiment], "tags.stage = 'pipeline'"):
            children = server.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{pipeline.info.run_id}'")
            assert {run.info.status for run in [pipeline, *children]} == {"FINISHED"}
            found[pipeline.info.run_name] = {run.data.tags["stage"]: "cached_from" in run.data.tags for run in children}
        return found

    (first,) = pipelines().values()
    assert first == {stage: False for stage in TRACKED_STAGES}
    version = server.get_model_version_by_alias(name, "candidate")
    assert str(version.version) == "1"
    assert server.get_run(version.run_id).data.tags["stage"] == "finetune"

    project.run("dvc", "exp", "run", "--queue", "-S", f"finetune.optimizer.lr_base={','.join(QUEUED_LR)}")
    assert len(queued_names(project)) == 2
    project.run("dvc", "exp", "run", "--run-all", "--jobs", "2")
    stop_queue_workers(project.path)  # as make sweep does: a worker may outlive the run (kombu's race)
    assert not queue_workers(project.path)

    runs = pipelines()
    assert len(runs) == 3
    queued = [stages for stages in runs.values() if any(stages.values())]
    rerun = {"finetune": False, "evaluate@finetune": False}
    cached = {stage: True for stage in TRACKED_STAGES - set(rerun)}
    assert queued == [cached | rerun, cached | rerun]
    versions = server.search_model_versions(f"name = '{name}'")
    assert len(versions) == 3  # one per fine-tuned model, each registered through the server


def convert_tracked_to(uri: str, tmp_path: Path, launch: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The digits' convert stage, launched as dvc.yaml launches it, writing to `uri`; its outputs in tmp_path."""
    tmp_path.mkdir()
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"launch": launch, "data": {"source": "digits", "subset": 0.1},
                                      "tracking": {"experiment": tmp_path.name}}))
    return subprocess.run(
        [sys.executable, "-m", "coarse2fine.launch", "stages/convert.py", "--params", str(params),
         "--out", str(tmp_path / "records"), "--metrics", str(tmp_path / "metrics")],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src"), "MLFLOW_TRACKING_URI": uri, **env},
    )


@pytest.mark.slow
def test_a_tracking_server_that_refuses_the_credentials_ends_the_stage_in_one_line(team_server, tmp_path):
    """`make server --auth`'s server (MLflow's basic authentication) given a wrong password: one line naming
    MLFLOW_TRACKING_URI and exit 2, nothing converted (tests/faults/test_environment.py: a server that is down); the
    admin's password from the server's folder tracks the stage."""
    (port,) = free_ports(1)
    home = tmp_path / "server"
    with mlflow_server(team_server.db, str(tmp_path / "artifacts"), port=port, auth=home, log=tmp_path / "log"):
        uri = f"http://127.0.0.1:{port}"
        assert oct((home / "admin_password").stat().st_mode & 0o777) == "0o600"
        password = (home / "admin_password").read_text()
        wrong = convert_tracked_to(uri, tmp_path / "wrong", {}, {"MLFLOW_TRACKING_USERNAME": "admin",
                                                                  "MLFLOW_TRACKING_PASSWORD": password + "x"})
        assert wrong.returncode == 2 and wrong.stderr == (
            f"error: MLFLOW_TRACKING_URI {uri}: the tracking server refuses the credentials: set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to a user of the server's\n"), wrong.stderr[-3000:]
        assert not (tmp_path / "wrong" / "records").exists()
        admin = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": password}
        tracked = convert_tracked_to(uri, tmp_path / "admin", {}, admin)
        assert tracked.returncode == 0, tracked.stderr[-3000:]
        os.environ.update(admin)
        try:
            client = MlflowClient(uri)
            (run,) = client.search_runs([client.get_experiment_by_name("admin").experiment_id], "tags.stage = 'convert'")
        finally:
            for key in admin:
                del os.environ[key]
        assert run.info.status == "FINISHED" and run.data.metrics["images"] > 0, run


def launch_pretrain(tmp_path, launch: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"launch": launch, "data": {"source": "digits"}}))
    return subprocess.run(
        [sys.executable, "-m", "coarse2fine.launch", "stages/pretrain.py", "--params", str(params)],
        cwd=PROJECT_ROOT, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src"), **env},
        capture_output=True, text=True, timeout=120,
    )


def test_the_dry_run_prints_one_ssh_agent_per_host_meeting_on_the_first(tmp_path):
    launch = {"scheduler": "ssh", "nnodes": 2, "nproc_per_node": 4, "hosts": ["n1", "n2"],
              "rdzv_endpoint": "127.0.0.1:29400"}
    result = launch_pretrain(tmp_path, launch, {DRY_RUN_ENV: "1", "MLFLOW_TRACKING_URI": "http://tracker:5000"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for rank, (line, host) in enumerate(zip(lines, ("n1", "n2"))):
        assert line.startswith(f"ssh -o BatchMode=yes -o ConnectTimeout=10 {host} 'cd {PROJECT_ROOT} && exec env ")
        assert "MLFLOW_TRACKING_URI=http://tracker:5000" in line and "COARSE2FINE_SSH_AGENT=1" in line
        assert (" -m coarse2fine.launch --nnodes=2 --nproc_per_node=4 --max_restarts=0 --rdzv_backend=c10d "
                f"--rdzv_endpoint=n1:29400 --rdzv_id=coarse2fine --rdzv_conf=is_host={int(rank == 0)} "
                "stages/pretrain.py --params ") in line


@pytest.mark.parametrize(("hosts", "expected"), [
    (["n1"], "launch.hosts: scheduler ssh needs one host per node (nnodes 2), got ['n1']"),
    (["n1", "-oProxyCommand=x"], "launch.hosts: ['n1', '-oProxyCommand=x'] holds an empty name, a space or"),
])
def test_a_host_list_that_does_not_fit_is_one_line(tmp_path, hosts, expected):
    result = launch_pretrain(tmp_path, {"scheduler": "ssh", "nnodes": 2, "hosts": hosts}, {DRY_RUN_ENV: "1"})
    assert result.returncode == 2 and result.stderr.startswith(f"error: {tmp_path / 'params.yaml'}: {expected}")
    assert len(result.stderr.splitlines()) == 1


def test_a_node_that_cannot_be_reached_fails_the_stage_in_one_line_naming_it(ssh_server, tmp_path):
    launch = {"scheduler": "ssh", "nnodes": 2, "hosts": ["localhost", "nowhere.invalid"]}
    result = launch_pretrain(tmp_path, launch, {SSH_ENV: ssh_server.ssh_command})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        "error: launch.hosts: nowhere.invalid cannot be reached over SSH (ssh: Could not resolve hostname nowhere.invalid"
    ) and len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.slow
def test_dvc_repro_driving_two_nodes_over_ssh_gives_a_local_two_process_run_bit_for_bit(ssh_server, tmp_path):
    """One `dvc repro` on the driver; every launched stage starts its two agents over SSH (this machine under two
    names), which meet at the first one's rendezvous: the weights and metrics of one node with two processes."""
    over_ssh, local = Project(tmp_path / "ssh"), Project(tmp_path / "local")
    small = {**SMALL, "finetune": {**SMALL["finetune"], "epochs": 1}}
    launch = {"scheduler": "ssh", "nnodes": 2, "nproc_per_node": 1, "hosts": list(ssh_server.HOSTS),
              "rdzv_endpoint": f"127.0.0.1:{free_ports(1)[0]}"}
    over_ssh.edit_params({**small, "launch": launch})
    local.edit_params({**small, "launch": {"nproc_per_node": 2}})
    for project in (over_ssh, local):
        project.env["OMP_NUM_THREADS"] = "1"  # the same kernels for a rank alone on its node as for two on one
        project.commit("small")
    over_ssh.env[SSH_ENV] = ssh_server.ssh_command
    result = over_ssh.run("dvc", "repro")
    assert "pretrain: device cpu x2" in result.stdout + result.stderr  # one rank on each node
    assert local.repro() == EVERY_STAGE

    for stage in ("teacher", "pretrain", "finetune", "evaluate/pretrain", "evaluate/finetune"):
        ours, theirs = (json.loads((p.path / "metrics" / stage / "metrics.json").read_text()) for p in (over_ssh, local))
        timing = ("per_s", "seconds")
        assert {k: v for k, v in ours.items() if not any(t in k for t in timing)} == {
            k: v for k, v in theirs.items() if not any(t in k for t in timing)
        }
    for stage in ("teacher", "pretrain", "finetune"):
        weights = [torch.load(p.path / f"models/{stage}/model.pt", weights_only=True)["model"] for p in (over_ssh, local)]
        torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)


def image_folder(root: Path, seed: int = 0) -> Path:
    """3 classes of small JPEGs, each class its own colour plus noise: 12 train and 4 val images a class."""
    generator = np.random.default_rng(seed)
    for label, colour in enumerate(((200, 40, 40), (40, 200, 40), (40, 40, 200))):
        for split, count in (("train", 12), ("val", 4)):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for k in range(count):
                pixels = np.clip(np.array(colour) + generator.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{k:03d}.jpg", quality=90)
    return root


def clone(origin: Path, path: Path, home: Path) -> Project:
    """A colleague's clone of `origin` (git) with a HOME of their own (DVC's and the listing's caches) and an empty
    DVC cache: a Project, the clone in place of the template's copy."""
    project = Project.__new__(Project)
    project.path, project.env = path, {**Project._environment(path), "HOME": str(home)}
    subprocess.run(["git", "clone", "-q", "--branch", "main", str(origin), str(path)], check=True, capture_output=True)
    return project


@pytest.mark.slow
def test_a_colleague_s_clone_pulls_the_team_s_stages_over_ssh_and_s3_and_runs_none(
    ssh_server, s3_server, team_server, tmp_path, request
):
    """Clone A trains on its image folder and pushes its stages, run cache and an experiment to two real remotes on
    127.0.0.1: SSH (Debian's sshd, dvc-ssh) and S3 (SeaweedFS, dvc-s3). Clones B (over SSH) and C (over S3), each
    with its own HOME, an empty cache and its own copy of the same images at another path, copied without their
    modification times, pull and reproduce: no stage command runs, their models are A's bytes, and `dvc exp show`
    lists A's experiment. All three track to the team's MLflow server: B's and C's pipeline runs link A's stage
    runs, and the registered model predicts from a clone with no store of its own."""
    name = request.node.name
    origin = tmp_path / "origin.git"
    subprocess.run(["git", "init", "-q", "--bare", str(origin)], check=True)
    a = Project(tmp_path / "a")
    a.edit_params(FAST)
    a.edit_params({"data": {"source": "imagefolder", "root": str(image_folder(tmp_path / "images_a")), "subset": 1.0},
                   "teacher": {"epochs": 1}, "pretrain": {"epochs": 1}, "finetune": {"epochs": 1},
                   "token_labels": {"top_k": 3},  # 3 classes
                   "tracking": {"experiment": name, "registered_model": name, "log_models": True}})
    s3 = {"endpointurl": s3_server.endpoint, "access_key_id": S3Server.KEY, "secret_access_key": S3Server.SECRET}
    a.run("dvc", "remote", "add", "ssh-team", f"ssh://127.0.0.1{tmp_path / 'ssh_remote'}")
    a.run("dvc", "remote", "modify", "ssh-team", "port", str(ssh_server.port))
    a.run("dvc", "remote", "add", "-d", "s3-team", f"s3://{S3Server.BUCKET}/coarse2fine")
    a.run("dvc", "remote", "modify", "s3-team", "endpointurl", s3_server.endpoint)
    a.commit("the team's params and remotes")
    a.run("git", "remote", "add", "origin", str(origin))

    def credentials(project: Project) -> None:  # each person's own, in .dvc/config.local (not in git)
        project.run("dvc", "remote", "modify", "--local", "ssh-team", "keyfile", str(ssh_server.client_key))
        for key in ("access_key_id", "secret_access_key"):
            project.run("dvc", "remote", "modify", "--local", "s3-team", key, s3[key])

    def own_home(project: Project, home: Path) -> None:
        project.env |= {"HOME": str(home), "MLFLOW_TRACKING_URI": team_server.uri}
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh" / "known_hosts").write_text(ssh_server.known_hosts_line)  # DVC's SSH checks the server's key
        credentials(project)

    own_home(a, tmp_path / "home_a")
    assert a.repro() == EVERY_STAGE
    a.commit("results")  # dvc.lock and the uncached metrics in git, as DVC's projects keep them
    a.run("git", "push", "-q", "origin", "HEAD:main")
    # A remote that cannot be reached: DVC's error names it, and nothing is lost: the outputs stay in A's cache
    # (the pushes below send them).
    (closed,) = free_ports(1)
    a.run("dvc", "remote", "add", "--local", "away", f"ssh://127.0.0.1:{closed}/nowhere")
    away = a.run("dvc", "push", "--run-cache", "-r", "away", check=False)
    assert away.returncode != 0 and f"ERROR: unexpected error - [Errno 111] Connect call failed ('127.0.0.1', {closed})" \
        in away.stderr, away.stderr
    status = a.run("dvc", "status").stdout  # nothing deleted or modified: only the stages that always run
    assert {line.strip() for line in status.splitlines() if line.startswith("\t")} == {"always changed"}, status
    for remote in ("ssh-team", "s3-team"):
        a.run("dvc", "push", "--run-cache", "-r", remote)
    models = {stage: (a.path / f"models/{stage}/model.pt").read_bytes() for stage in ("teacher", "pretrain", "finetune")}
    a.run("dvc", "exp", "run", "-n", "tighter-crop", "-S", "evaluate.finetune.crop_pct=0.9")
    for remote in ("ssh-team", "s3-team"):
        a.run("dvc", "exp", "push", "-r", remote, "origin", "tighter-crop")

    for who, remote in (("b", "ssh-team"), ("c", "s3-team")):
        colleague = clone(origin, tmp_path / who, tmp_path / f"home_{who}")
        own_home(colleague, tmp_path / f"home_{who}")
        images = shutil.copytree(tmp_path / "images_a", tmp_path / f"images_{who}", copy_function=shutil.copyfile)
        colleague.edit_params({"data": {"root": str(images)}})
        colleague.run("dvc", "pull", "--run-cache", "-r", remote)
        reproduced = colleague.run("dvc", "repro").stdout
        assert ran_stages(reproduced) == {"source", "lineage"}, remote  # what runs at every repro, and nothing else
        for stage in ("convert", "teacher", "pretrain", "finetune"):  # linked to A's runs on the team's server
            assert f"lineage: {stage}: cached, made by run " in reproduced, (remote, reproduced)
        predicted = colleague.run("python", "-m", "coarse2fine.predict", f"models:/{name}@candidate",
                                  str(images / "val"), "--json")
        assert len(json.loads(predicted.stdout)["predictions"]) == 12
        assert not (colleague.path / "mlflow.db").exists()
        for stage, content in models.items():
            assert (colleague.path / f"models/{stage}/model.pt").read_bytes() == content, (remote, stage)
        colleague.run("dvc", "exp", "pull", "-r", remote, "origin", "tighter-crop")
        shown = json.loads(colleague.run("dvc", "exp", "show", "--json").stdout)
        names = {experiment["name"] for baseline in shown for experiment in baseline.get("experiments") or []}
        assert "tighter-crop" in names, (remote, shown)
