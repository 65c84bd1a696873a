"""The benchmarks as users run them: bench/peer.py --tiny and bench/optimizers.py --tiny end to end (a real DVC
project copy running the real stages, and timm's train.py when a checkout is given), and how a bench stops when a
stage's output changes shape."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# A timm source checkout (train.py is not in the wheel, and tests download nothing): CI has none.
TIMM_REPO = os.environ.get("C2F_TIMM_REPO")
PROJECT_ROWS = ("pretrain stage, ground truth", "pretrain stage, token labels")
TIMM_ROWS = ("timm train.py", "timm train.py, OMP_NUM_THREADS=1")


def table_rows(report: str) -> dict[str, list[str]]:
    """The markdown table's rows of a report, by their first cell."""
    rows = {}
    for line in report.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = cells[1:]
    return rows


def goal_lines(report: str) -> list[str]:
    goals = next(line for line in report.splitlines() if line.startswith("Goals: "))
    return goals.removeprefix("Goals: ").removesuffix(".").split("; ")


@pytest.fixture(scope="module")
def peer_report(tmp_path_factory: pytest.TempPathFactory) -> str:
    """bench/peer.py --tiny, run once for the tests below (with timm's rows when C2F_TIMM_REPO is set): its report."""
    command = [sys.executable, "bench/peer.py", "--tiny", "--workdir", str(tmp_path_factory.mktemp("peer"))]
    if TIMM_REPO:
        command += ["--timm-repo", TIMM_REPO]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.slow
def test_peer_tiny_trains_both_pretrain_rows_through_dvc(peer_report: str) -> None:
    rows = table_rows(peer_report)
    for name in PROJECT_ROWS:
        img_per_s, _, seconds, top1 = rows[name]
        assert float(img_per_s) > 0 and float(seconds) > 0
        assert 0 <= float(top1) <= 100
    assert [line.split(" >= ")[0] for line in goal_lines(peer_report)] == list(PROJECT_ROWS)


@pytest.mark.slow
def test_peer_tiny_without_timm_reports_its_rows_as_not_run(peer_report: str) -> None:
    if TIMM_REPO:
        pytest.skip("C2F_TIMM_REPO is set: timm's rows ran (the test below checks them)")
    rows = table_rows(peer_report)
    assert [rows[name][0] for name in TIMM_ROWS] == ["not run (no --timm-repo)"] * 2
    assert all(line.endswith("not checked (timm train.py not run: no --timm-repo)") for line in goal_lines(peer_report))


@pytest.mark.slow
def test_peer_tiny_compares_with_timm_train_py(peer_report: str) -> None:
    if not TIMM_REPO:
        pytest.skip("no timm source checkout: set C2F_TIMM_REPO to one (train.py is not in the timm wheel)")
    rows = table_rows(peer_report)
    for name in TIMM_ROWS:
        img_per_s, _, seconds, top1 = rows[name]
        assert float(img_per_s) > 0 and float(seconds) > 0 and 0 <= float(top1) <= 100
    ratios = {name: rows[name][1] for name in [*PROJECT_ROWS, *TIMM_ROWS]}
    assert all(re.fullmatch(r"\d+\.\d\dx", ratio) for ratio in ratios.values()), ratios
    assert "1.00x" in (ratios[name] for name in TIMM_ROWS)  # the faster timm: the reference
    assert all(line.split(": ")[-1].split(" (")[0] in ("met", "MISSED") for line in goal_lines(peer_report))


def first_table(report: str) -> list[list[str]]:
    """The rows of a report's first markdown table, header and rule left out."""
    rows: list[list[str]] = []
    for line in report.splitlines():
        if line.startswith("| "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


@pytest.mark.slow
def test_optimizers_tiny_reports_each_optimizer_without_and_with_mixup(tmp_path: Path) -> None:
    command = [sys.executable, "bench/optimizers.py", "--tiny", "--workdir", str(tmp_path)]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    rows = first_table(result.stdout)
    assert [row[:3] for row in rows] == [
        [name, mixup, "0.016"] for mixup in ("none", "Mixup 0.2") for name in ("AdamW", "LAMB", "PSGD Kron")
    ]
    for _, _, _, epochs_to_95, top1, train_seconds, stage_seconds in rows:
        assert epochs_to_95 == "not reached" or int(epochs_to_95) == 1  # --tiny trains 1 epoch
        assert 0 <= float(top1) <= 100 and 0 < float(train_seconds) <= float(stage_seconds)


def test_a_metric_a_stage_no_longer_writes_stops_the_bench_naming_file_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))  # as the benches import it: from their own folder
    from _common import read_column, read_metric

    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"top1": 98.0}))
    with pytest.raises(SystemExit, match=rf"{metrics}: no 'val_top1' \(found: top1\)"):
        read_metric(metrics, "val_top1")
    history = tmp_path / "train_img_per_s.tsv"
    history.write_text("step\timg_per_s\n0\t300\n")
    with pytest.raises(SystemExit, match=rf"{history}: no 'train_img_per_s' \(found: step, img_per_s\)"):
        read_column(history, "train_img_per_s", delimiter="\t")


@pytest.mark.slow
def test_startup_tiny_times_every_launched_stage(tmp_path: Path) -> None:
    command = [sys.executable, "bench/startup.py", "--tiny", "--workdir", str(tmp_path)]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    rows = first_table(result.stdout)
    assert [row[0] for row in rows] == [
        "convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune",
    ]
    assert all(float(seconds) > 0 for _, seconds in rows)
    assert all(line.split(": ")[-1].split(" (")[0] in ("met", "MISSED") for line in goal_lines(result.stdout))
