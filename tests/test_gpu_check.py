"""`python -m coarse2fine.gpu_check` (make gpu-check): on this CPU machine it refuses in one line, and its
`--cpu-dry-run` runs every step's CPU side end to end; a missing dependency and a step past its timeout fail that
step with a reason in the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import PROJECT_ROOT

from coarse2fine import gpu_check


def gpu_check_command(out: Path, *options: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coarse2fine.gpu_check", "--out", str(out), *options], cwd=PROJECT_ROOT,
        capture_output=True, text=True, timeout=900, env=env,
    )


def read_report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    return gpu_check_command(out, "--cpu-dry-run"), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU: the check would run")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    result = gpu_check_command(tmp_path / "out")
    assert result.returncode == gpu_check.NO_GPU_EXIT
    assert result.stderr.startswith("gpu_check: no usable CUDA GPU") and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_dry_run_passes_every_step_and_reports_each_one(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(out)
    assert report["mode"] == "cpu dry run" and report["passed"] is True
    assert report["versions"]["torch"] == torch.__version__ and report["device"].startswith("CPU only")
    assert [step["name"] for step in report["steps"]] == [step.name for step in gpu_check.STEPS]
    for step in report["steps"]:
        assert step["status"] == "passed", step
        assert 0 < step["seconds"] <= step["timeout_s"] and (out / step["log"]).is_file()
        assert step["figures"] and all(value >= 0 for value in step["figures"].values()), step
    assert 0 < sum(step["seconds"] for step in report["steps"]) <= report["seconds"]
    markdown = (out / "report.md").read_text(encoding="utf-8")
    assert markdown.startswith("# GPU check: passed")
    for step in report["steps"]:
        assert f"| {step['name']} | passed |" in markdown and f"## {step['name']}: {step['title']}" in markdown


@pytest.mark.slow
def test_the_dry_runs_figures_are_what_its_steps_measured(dry_run):
    _, out = dry_run
    figures = {step["name"]: step["figures"] for step in read_report(out)["steps"]}

    smoke = figures["pytest"]  # no GPU here: every smoke test is collected and skipped
    assert smoke["tests"] == smoke["skipped"] > 0 and smoke["passed"] == smoke["failed"] == 0

    graph = figures["dali_train_graph"]
    assert graph["batches"] >= 1 and graph["images"] == graph["batches"] * 64  # bench/loader.py's batch
    assert 0 < graph["moved images"] <= graph["images"] and graph["img/s"] > 0

    loaders = figures["loaders"]
    assert loaders["dali img/s"] > 0 and loaders["torch img/s"] > 0
    assert loaders["dali / torch"] == pytest.approx(loaders["dali img/s"] / loaders["torch img/s"])

    dvc = figures["dvc"]
    stages = {"teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune"}
    assert stages <= {name.removesuffix(" s") for name in dvc}
    assert sum(value for name, value in dvc.items() if name.endswith(" s")) <= dvc["seconds"]
    assert 0 <= dvc["pretrain top1"] <= 100 and 0 <= dvc["finetune top1"] <= 100

    assert set(figures["timm_gpu_step"]) == {"eager img/s"}  # --eager-only: no compiling on a CPU
    trainer = figures["gpu_step"]
    assert set(trainer) == {"ground truth img/s", "token labels + MixToken img/s"} and min(trainer.values()) > 0
    assert read_report(out)["comparisons"] == {
        "Trainer ground truth / timm, eager": pytest.approx(
            trainer["ground truth img/s"] / figures["timm_gpu_step"]["eager img/s"]
        )
    }


def test_a_step_whose_modules_are_missing_fails_with_that_reason_without_running(tmp_path):
    # As on a GPU node without DVC and MLflow: a finder that says they are not installed, in every process.
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys

        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("dvc", "mlflow"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NotInstalled())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    result = gpu_check_command(tmp_path / "out", "--cpu-dry-run", "--only", "dvc", env=env)
    assert result.returncode == 1, result.stderr
    [step] = read_report(tmp_path / "out")["steps"]
    assert step["status"] == "failed" and step["reason"].startswith("needs dvc, mlflow, not installed here")
    assert "log" not in step and step["seconds"] == 0
    assert (tmp_path / "out" / "report.md").read_text(encoding="utf-8").startswith("# GPU check: FAILED (1 of 1 steps)")


def test_a_step_past_its_timeout_is_ended_with_what_it_started(tmp_path):
    sleeper = textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    step = gpu_check.Step("sleeps", "a step that never ends", 3, lambda check, results: [sys.executable, "-c", sleeper])
    result = gpu_check.run_step(step, gpu_check.Check(PROJECT_ROOT, tmp_path, dry_run=True), tmp_path / "out")
    assert result["status"] == "failed" and result["reason"] == "timed out after 3 s"
    child = int((tmp_path / "out" / result["log"]).read_text().split()[0])
    # SIGKILL is delivered asynchronously: on a loaded machine the grandchild can still show as running just after.
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child), Path(f"/proc/{child}/status").read_text()


def running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting for its reaper)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
