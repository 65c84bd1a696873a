"""Faults of the environment around a stage: DVC's lock held by another `dvc repro`, and a stage started while
another process writes its outputs. Each is one clear message, nothing is touched, and the rerun succeeds."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, Project
from test_kill_anywhere import Repro
from test_scale_out import finish, start_stage

HOLD_THE_LOCK = """
import sys, time
from coarse2fine.files import sole_writer
with sole_writer(sys.argv[1], "source"):
    print("holding", flush=True)
    time.sleep(600)
"""


def run_source_stage(out, env) -> subprocess.CompletedProcess:
    listings = {option: str(out.with_name(f"{option}.json")) for option in ("teacher", "pretrain", "finetune", "labels")}
    command = [sys.executable, "stages/source.py", "--out", str(out),
               *(word for option, path in listings.items() for word in (f"--{option}-out", path))]
    return subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_stage_started_while_another_process_writes_its_outputs_stops_untouched(tmp_path):
    out = tmp_path / "source.json"
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src")}
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        refused = run_source_stage(out, env)
    finally:
        holder.send_signal(signal.SIGKILL)  # as a killed run ends: the kernel releases its lock
        holder.wait(timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"error: {out}: source (pid {holder.pid}) is writing it already; source did not start (nothing was "
        f"touched): wait for that run to end, or stop it, and rerun"
    )
    assert not out.exists()
    rerun = run_source_stage(out, env)
    assert rerun.returncode == 0, rerun.stderr
    assert out.is_file()


@pytest.mark.slow
def test_dvc_repro_beside_a_running_one_is_refused_by_dvc_and_the_rerun_has_nothing_to_do(tmp_path):
    project = Project(tmp_path / "project")
    running = Repro(project, "convert")
    assert running.wait_for("convert"), running.output
    beside = project.run("dvc", "repro", "convert", check=False)
    # DVC locks what each stage reads and writes while it runs: the second repro's first stage writes what the
    # running convert reads.
    assert beside.returncode != 0 and "is busy, it is being blocked by" in beside.stderr, beside.stderr
    assert "dvc repro convert" in beside.stderr  # the blocker, by its PID and command
    running.finish()
    assert project.repro("convert") == {"source"}  # convert's result stands: only the always-run listing ran


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "written", "kept"),
    [("ddp", r"last\.pt: file too large", "nothing half-written is kept"),
     ("fsdp", r"shards-\d+\.partial: a shard written short \(a full disk or quota\)",
      "the temporary shards are removed, the last checkpoint kept")],
)
def test_a_disk_that_fills_up_while_a_checkpoint_is_written_is_one_line_and_the_rerun_succeeds(
    digits_records, tmp_path, strategy, written, kept
):
    """Two ranks write epoch 1's checkpoint (DDP: one file of about 13 MB; FSDP: DCP shards of about 6 MB a rank)
    under a 2 MB file-size limit, as a full disk refuses them: one line naming what was being written, nothing
    half-written left, and the rerun with room trains to the end."""
    changes = {"parallel": {"strategy": strategy}, "pretrain": {"epochs": 1}}
    full = start_stage(tmp_path, digits_records, {"nproc_per_node": 2}, changes, file_size_limit=2 * 1024 * 1024)
    stderr = full.communicate(timeout=600)[1]
    assert full.returncode == 2 and "Traceback" not in stderr, stderr
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert re.fullmatch(
        rf"error: {re.escape(str(tmp_path / 'ckpt'))}/{written} while writing it \({kept}\): free "
        r"space, or raise the file-size limit, and rerun",
        line,
    ), line
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == []
    finish(start_stage(tmp_path, digits_records, {"nproc_per_node": 2}, changes))
    assert (tmp_path / "model" / "model.pt").is_file()


HOLD_AN_SQLITE_LOCK = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(600)
"""


# Stores a stage cannot use, each a fault of its own: name -> the tracking URI (STORE: the test's own sqlite file).
UNUSABLE_STORES = {
    "corrupt": "sqlite:///STORE",  # overwritten with garbage below (a bad copy, a disk error)
    "locked": "sqlite:///STORE",  # held in an exclusive transaction past sqlite's wait by another process
    "bad URI": "bogus://nowhere",
    "cannot be written": "sqlite:////proc/coarse2fine/mlflow.db",
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", UNUSABLE_STORES)
def test_an_unusable_mlflow_store_is_one_warning_and_the_stage_writes_its_outputs(tmp_path, fault):
    """The convert stage, launched as dvc.yaml does, warns once and converts; its metrics are in its DVCLive files.
    A stage of days must not die for its tracking (docs/guide.md, tracking)."""
    store = tmp_path / "mlflow.db"
    uri = UNUSABLE_STORES[fault].replace("STORE", str(store))
    holder = None
    if fault == "corrupt":
        store.write_bytes(b"this is not an sqlite database" * 100)
    elif fault == "locked":
        holder = subprocess.Popen([sys.executable, "-c", HOLD_AN_SQLITE_LOCK, str(store)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
    params = tmp_path / "params.yaml"
    params.write_text("data: {source: digits, subset: 0.1}\n")
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src"), "MLFLOW_TRACKING_URI": uri}
    command = [sys.executable, "-m", "coarse2fine.launch", "stages/convert.py", "--params", str(params),
               "--out", str(tmp_path / "records"), "--metrics", str(tmp_path / "metrics")]
    try:
        result = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "MLflow" in line]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: MLflow at {uri} is not usable ("), result.stderr
    assert "convert goes on without it; its metrics are in" in warnings[0] and "Traceback" not in result.stderr
    assert (tmp_path / "records" / "manifest.json").is_file()
    images = json.loads((tmp_path / "records" / "manifest.json").read_text())["splits"]["train"]["images"]
    assert json.loads((tmp_path / "metrics" / "metrics.json").read_text())["images_train"] == images


@pytest.mark.slow
def test_a_tracking_server_that_is_down_when_a_stage_starts_ends_it_in_one_line(tmp_path):
    """A server MLFLOW_TRACKING_URI names is what the user asked for: down at the start, the stage stops before it
    does anything, every rank of a 2-process launch on rank 0's one line (tests/test_team.py: wrong credentials)."""
    uri = "http://127.0.0.1:9"  # the discard port: connection refused
    params = tmp_path / "params.yaml"
    params.write_text("data: {source: digits, subset: 0.1}\nlaunch: {nproc_per_node: 2}\n")
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT / "src"), "MLFLOW_TRACKING_URI": uri}
    command = [sys.executable, "-m", "coarse2fine.launch", "stages/convert.py", "--params", str(params),
               "--out", str(tmp_path / "records"), "--metrics", str(tmp_path / "metrics")]
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr[-3000:]
    assert result.stderr.startswith(f"error: MLFLOW_TRACKING_URI {uri}: the tracking server cannot be reached "
                                    "(Connection refused): start it (make server)"), result.stderr
    assert not (tmp_path / "records").exists() and not (tmp_path / "metrics").exists()  # nothing ran untracked
