"""Leaving one machine on the engines users have: params `launch` as torchrun's arguments (one place, the
launcher), two torchrun agents meeting at a c10d rendezvous, and an elastic restart after a rank is killed.
Real launcher, real torchrun, real gloo ranks; the pretrain stage itself, on the digits' records."""

from __future__ import annotations

import copy
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from mlflow import MlflowClient
import torch
import yaml

from coarse2fine import launch, slurm
from coarse2fine.config import Launch
from coarse2fine.data import records
from coarse2fine.data.loaders import build_loader
from coarse2fine.distributed import Runtime
from coarse2fine.labels.store import write_store
from coarse2fine.training import train
from conftest import TEST_DEFAULTS, PROJECT_ROOT, Project, built_once, free_ports, make_params, merge
from test_train import TIMING_METRICS


def test_a_test_s_changes_leave_the_shared_settings_as_they_were():
    """CI's failure: test_kill_mid_epoch's `token_label.enabled: False`, merged into this module's PRETRAIN in
    place, turned token labels off in every later stage of that worker, whose runs then missed the shared
    reference made with them."""
    before = copy.deepcopy(PRETRAIN)
    merged = merge({"pretrain": PRETRAIN}, {"pretrain": {"token_label": {"enabled": False}, "epochs": 1}})
    assert merged["pretrain"]["token_label"] == {"enabled": False, "mix_token": True}
    assert merged["pretrain"]["epochs"] == 1 and PRETRAIN == before


def test_one_local_node_runs_standalone_as_before():
    assert launch.torchrun_options(Launch(nproc_per_node=2)) == [
        "--nnodes=1", "--nproc_per_node=2", "--max_restarts=0", "--standalone",
    ]


def test_several_nodes_meet_at_the_c10d_endpoint():
    options = launch.torchrun_options(Launch(nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="pipe", max_restarts=3))
    assert options == [
        "--nnodes=2", "--nproc_per_node=1", "--max_restarts=3",
        "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29400", "--rdzv_id=pipe",
    ]


def test_in_a_slurm_allocation_they_meet_on_its_first_node_under_the_job_s_id():
    job = slurm.Allocation(job_id="4242", first_node="gpu-07", first_node_address="10.0.0.7", cpus_per_task="16")
    settings = Launch(scheduler="slurm", nnodes=2, nproc_per_node=8, rdzv_endpoint="ignored:29500")
    options = launch.torchrun_options(settings, job)
    assert options[-2:] == ["--rdzv_endpoint=10.0.0.7:29500", "--rdzv_id=coarse2fine-4242"]
    assert slurm.srun_command(settings, job, ["agent"]) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=16", "agent",
    ]


def test_only_the_agent_on_the_first_node_hosts_the_rendezvous():
    assert slurm.rendezvous_host_option({"SLURMD_NODENAME": "gpu-07"}, first_node="gpu-07") == "--rdzv_conf=is_host=1"
    assert slurm.rendezvous_host_option({"SLURMD_NODENAME": "gpu-08"}, first_node="gpu-07") == "--rdzv_conf=is_host=0"


def test_a_first_node_agent_whose_rendezvous_port_is_taken_says_so_in_one_line(tmp_path):
    """The first node's agent (srun's environment, as the launcher sets it) finds the port busy: exit 2 and a line
    naming the key, not a join of whatever listens there (torch's guess), which would wait until its timeout."""
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"launch": {"scheduler": "slurm", "nnodes": 2}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, launch.SLURM_AGENT_ENV: "n1", "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "7"}
        agent = [sys.executable, "-m", "coarse2fine.launch", *launch.torchrun_options(
            Launch(scheduler="slurm", nnodes=2, rdzv_endpoint=f"ignored:{port}"),
            slurm.Allocation(job_id="7", first_node="n1", first_node_address="127.0.0.1", cpus_per_task=None),
        ), "stages/pretrain.py", "--params", str(params)]
        result = subprocess.run(agent, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: launch.rdzv_endpoint: port {port} is taken on this node ({socket.gethostname()}), by another job's "
        f"rendezvous or another program: set launch.rdzv_endpoint to a free port"
    )


def test_slurm_outside_an_allocation_or_too_small_a_one_is_one_line(tmp_path):
    with pytest.raises(Exception, match="SLURM_JOB_ID is not set"):
        slurm.allocation(Launch(scheduler="slurm"), {})
    with pytest.raises(Exception, match=r"launch.nnodes: 4 but Slurm job 7 has 2 node\(s\).*--nodes=4"):
        slurm.allocation(Launch(scheduler="slurm", nnodes=4), {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"})


def test_the_dry_run_prints_the_command_given_options_override_params(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"launch": {"nnodes": 2, "rdzv_endpoint": "node0:29400"}}))
    env = {**os.environ, slurm.DRY_RUN_ENV: "1"}
    command = [sys.executable, "-m", "coarse2fine.launch", "--max_restarts=2", "stages/pretrain.py", "--params", str(params)]
    printed = subprocess.run(command, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout
    assert "--nnodes=2 --nproc_per_node=1 --max_restarts=0 --rdzv_backend=c10d --rdzv_endpoint=node0:29400" in printed
    assert printed.rstrip().endswith(f"--max_restarts=2 stages/pretrain.py --params {params}")


WHERE_AM_I = """import json, os, sys
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "path0": sys.path[0], "name": __name__,
                  "rank": os.environ.get("RANK"), "elastic": "TORCHELASTIC_RUN_ID" in os.environ}))
sys.exit(3)
"""


@pytest.mark.parametrize("restarts", [0, 1])
@pytest.mark.own_processes
def test_a_world_of_one_runs_in_the_launchers_own_process_unless_torchrun_may_restart_it(tmp_path, restarts):
    """One node, one process: the stage is the launcher's main program, as `python script` would run it (no agent,
    no second import of torch); with restarts to make, torchrun's agent runs it as a worker. Either way its exit
    code is the launcher's."""
    script = tmp_path / "where.py"
    script.write_text(WHERE_AM_I)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"launch": {"max_restarts": restarts}}))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "coarse2fine.launch", str(script), "--params", str(params), "x y"],
        cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stdout, stderr = launcher.communicate(timeout=120)
    seen = json.loads(stdout.splitlines()[-1])
    assert (seen["argv"], seen["path0"], seen["name"]) == ([str(script), "--params", str(params), "x y"],
                                                          str(tmp_path), "__main__")
    if restarts == 0:
        assert (seen["pid"], seen["rank"], seen["elastic"]) == (launcher.pid, None, False)
        assert launcher.returncode == 3
    else:
        assert (seen["pid"] != launcher.pid, seen["rank"], seen["elastic"]) == (True, "0", True)
        assert launcher.returncode == 1  # torchrun's failure after its restart, reported with the worker's exit code
        assert "exitcode  : 3" in stderr


# ------------------------------------------------------------------------------------------ real runs (slow)

# The recipe's objective: token labels (`teacher_labels`) with MixToken.
PRETRAIN = {"epochs": 2, "batch_size": 16, "token_label": {"enabled": True, "mix_token": True}}


def teacher_labels(records_dir: Path, directory: Path) -> Path:
    """Token labels of a teacher that knows each train image's class: 0.9 for it in every cell of a 2 x 2 map,
    0.08 for the next class, as the token_labels stage writes them for these records."""
    examples = sorted((example for shard, _ in records.shard_files(records_dir, "train")
                       for example in records.read_shard(shard)), key=lambda example: example["index"])
    labels = np.array([example["label"] for example in examples])
    classes = np.stack([labels, (labels + 1) % 10], axis=1)[:, :, None, None].repeat(2, 2).repeat(2, 3)
    log_probs = np.broadcast_to(np.log([0.9, 0.08])[None, :, None, None], classes.shape)
    write_store(directory, log_probs, classes, num_classes=10, records_digest=records.manifest_digest(records_dir))
    return directory


def start_stage(
    out: Path, records: Path, launch_settings: dict, changes: dict | None = None, stage: str = "pretrain",
    arguments: tuple[str, ...] = (), env: dict[str, str] | None = None, file_size_limit: int | None = None,
) -> subprocess.Popen:
    """A training stage (pretrain by default) through the launcher, as dvc.yaml runs it, with its own params file
    (`changes` merged in), outputs, extra `arguments` (finetune: --init-from) and `env` variables, in a process
    group of its own; `file_size_limit`: RLIMIT_FSIZE in bytes for it and its ranks (a disk that fills up, for real).
    One thread per rank everywhere, so that every layout computes with the same kernels."""
    out.mkdir(parents=True, exist_ok=True)
    params = out / "params.yaml"
    # The tests' defaults (no MLflow model: the layouts and resumes are the subject; every rank still gathers the
    # final model as with it on).
    settings = merge(TEST_DEFAULTS, {"data": {"source": "digits"}, "launch": launch_settings, "pretrain": PRETRAIN})
    # Written whole, then renamed: the second of two agents sharing `out` must not truncate the file the first reads.
    written = params.with_suffix(".partial")
    written.write_text(yaml.safe_dump(merge(settings, changes or {})))
    written.replace(params)
    labels = out / "token_labels"
    if not labels.exists():  # a resumed stage reads the labels it started with
        teacher_labels(records, labels)
    command = [
        sys.executable, "-m", "coarse2fine.launch", f"stages/{stage}.py", "--params", str(params),
        "--records", str(records), "--token-labels", str(labels), "--checkpoint-dir", str(out / "ckpt"),
        "--out", str(out / "model"), "--metrics", str(out / "metrics"), *arguments,
    ]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{out / 'mlflow.db'}", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(PROJECT_ROOT / "src"), **(env or {})}
    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=limit_file_size if file_size_limit else None)


def finish(process: subprocess.Popen) -> str:
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-3000:]
    return stdout


def outcome(out: Path) -> tuple[dict, dict]:
    weights = torch.load(out / "model" / "model.pt", weights_only=True)["model"]
    metrics = json.loads((out / "metrics" / "metrics.json").read_text())
    return weights, {key: value for key, value in metrics.items() if key not in TIMING_METRICS}


# The reference layout's optimizer: SGD with momentum, two micro-batches an update (each strategy's no-sync
# accumulation is covered too). SGD, so that float noise in the reduction order is not amplified the way Adam's
# first steps amplify near-zero gradients: FSDP's comparison with DDP (test_fsdp.py) holds to 1e-5.
SGD = {"optimizer": {"name": "sgd", "momentum": 0.9, "lr_base": 0.4}, "accum_steps": 2}


@pytest.fixture(scope="session")
def one_node_two_ranks(digits_records, tmp_path_factory) -> Path:
    """pretrain on one node with two DDP ranks (SGD): the result every other layout must reach, here and in
    test_fsdp.py, run once per session (the workers' digits records are the same bytes)."""
    return built_once(tmp_path_factory, "one_node_two_ranks", lambda out: finish(
        start_stage(out, digits_records, {"nproc_per_node": 2}, {"pretrain": SGD})
    ))


@pytest.mark.slow
def test_two_agents_at_a_c10d_rendezvous_train_as_one_node_with_two_ranks(one_node_two_ranks, digits_records, tmp_path):
    settings = {"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"127.0.0.1:{free_ports(1)[0]}", "rdzv_id": "test"}
    sampled = {"MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}  # MLflow's system metrics every second, not 10
    agents = [start_stage(tmp_path, digits_records, settings, {"pretrain": SGD}, env=sampled) for _ in range(2)]
    outputs = [finish(agent) for agent in agents]
    # Each node's first rank samples its machine into rank 0's run, under its node id (torchrun's GROUP_RANK).
    store = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = store.search_runs([store.get_experiment_by_name("coarse2fine").experiment_id], "tags.stage = 'pretrain'")
    system = {key for key in run.data.metrics if key.startswith("system/")}
    assert {key.split("/")[1] for key in system} == {"node0", "node1"}, system
    for node in ("node0", "node1"):
        assert {f"system/{node}/cpu_utilization_percentage", f"system/{node}/system_memory_usage_megabytes"} <= system
    assert sum("global batch 64 = 16 per device x 2 accumulated x 2 ranks" in text for text in outputs) == 1
    weights, metrics = outcome(tmp_path)
    reference_weights, reference_metrics = outcome(one_node_two_ranks)
    torch.testing.assert_close(weights, reference_weights, rtol=0, atol=0)
    assert metrics == reference_metrics
    # An epoch's images: each rank's whole batches of its half of the train split (the loaders drop the rest).
    params = make_params(data={"source": "digits"}, pretrain=PRETRAIN)
    loader = build_loader("train", digits_records, img_size=32, batch_size=16, runtime=Runtime(
        rank=0, world_size=2, local_rank=0, device=torch.device("cpu")), loader_cfg=params.loader,
        augment_cfg=params.augment, crop_pct=1.0, seed=params.seed)
    images = 2 * len(loader) * 16
    for out in (tmp_path, one_node_two_ranks):  # throughput, global and per rank, in both layouts' metrics
        speed = json.loads((out / "metrics" / "metrics.json").read_text())
        assert speed["train_img_per_s"] * speed["epoch_seconds"] == pytest.approx(images)
        assert speed["train_img_per_s_per_rank"] == pytest.approx(speed["train_img_per_s"] / 2)


@pytest.mark.slow
@pytest.mark.own_processes  # the ranks are the launcher's children
def test_a_killed_rank_is_restarted_and_the_stage_ends_as_if_uninterrupted(one_node_two_ranks, digits_records, tmp_path):
    process = start_stage(tmp_path, digits_records, {"nproc_per_node": 2, "max_restarts": 1}, {"pretrain": SGD})
    checkpoint = tmp_path / "ckpt" / train.CHECKPOINT_FILE
    deadline = time.monotonic() + 600
    while not checkpoint.exists():  # epoch 1 is saved: kill a rank while epoch 2 trains
        assert process.poll() is None, process.communicate(timeout=60)[1][-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 600 s"
        time.sleep(0.05)
    killed_at = torch.load(checkpoint, weights_only=True)["epoch"]
    # The launcher is the torchrun agent: its children are the ranks.
    ranks = psutil.Process(process.pid).children()  # psutil: pinned (MLflow's system metrics), no procps needed
    assert len(ranks) == 2
    ranks[-1].kill()
    stdout = finish(process)
    assert killed_at == 1 and "resumed from epoch 1" in stdout
    weights, metrics = outcome(tmp_path)
    reference_weights, reference_metrics = outcome(one_node_two_ranks)
    torch.testing.assert_close(weights, reference_weights, rtol=0, atol=0)
    assert metrics == reference_metrics


@pytest.mark.slow
def test_a_failure_that_repeats_ends_the_stage_with_the_failing_rank_s_own_error(digits_records, tmp_path):
    """Restarted once, failing again: torchrun's report names the rank and holds its traceback (workers record
    their errors), after the second attempt."""
    project = Project(tmp_path / "project")
    (project.path / "data").mkdir()
    (project.path / "data/records").symlink_to(digits_records)
    project.edit_code("stages/pretrain.py", "    paths = StagePaths(", "    if os.environ['RANK'] == '1':\n"
                      "        raise RuntimeError('rank 1 cannot go on')\n    paths = StagePaths(")
    project.edit_code("stages/pretrain.py", "import argparse\n", "import argparse\nimport os\n")
    # Rank 0 must get as far as the process group (no token labels to miss), where it waits for rank 1.
    project.edit_params({
        "launch": {"nproc_per_node": 2, "max_restarts": 1}, "pretrain": {"token_label": {"enabled": False}},
    })
    result = subprocess.run(project.stage_command("pretrain"), shell=True, cwd=project.path, env=project.env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "RuntimeError: rank 1 cannot go on" in result.stderr
    assert "rank      : 1 (local_rank: 1)" in result.stderr and "attempt_1" in result.stderr
