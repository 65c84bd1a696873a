"""Every benchmark of bench/ as users run it, in its --tiny mode (the same code path at the smallest sizes, seconds
to two minutes, no figure asserted): the report's rows, its cells' format and its goal lines' verdicts. Benches
share what they make through a common --workdir: bench/startup.py --tiny's project copy (a real DVC project
running the real stages) serves caching, token_targets, ablation and memory; optimizers' digits copy serves scaling;
loader's photos and records serve loader_profile. peer makes its own, with timm's train.py when a checkout is
given. Also: how a bench stops when a stage's output changes shape.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from coarse2fine.data.records import SPLITS
from coarse2fine.data.sources import list_imagefolder
from coarse2fine.data.transforms import RAND_AUGMENT_OPS

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# A timm source checkout (train.py is not in the wheel, and tests download nothing): CI has none.
TIMM_REPO = os.environ.get("C2F_TIMM_REPO")
# The stage's rows, by the pretrain.token_label.enabled their run logs to MLflow.
PROJECT_ROWS = {"pretrain stage, ground truth": "False", "pretrain stage, token labels": "True"}
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
    """The goals of a report's "Goals: a; b." (or "Goal: a.") line."""
    goals = next(line for line in report.splitlines() if line.startswith(("Goals: ", "Goal: ")))
    return goals.split(": ", 1)[1].removesuffix(".").split("; ")


def verdicts(report: str) -> list[str]:
    """Each goal line's verdict: met, MISSED or not checked, then its measure in parentheses."""
    found = [re.search(r": (met|MISSED|not checked) \(.+\)$", line) for line in goal_lines(report)]
    assert all(found), goal_lines(report)
    return [match.group(1) for match in found]


def run_bench(name: str, *options: str) -> str:
    """bench/NAME.py run as a user runs it, from the project root: its report (stdout)."""
    command = [sys.executable, f"bench/{name}.py", *options]
    result = subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    return result.stdout


def assert_cells(rows: list[list[str]], *formats: str) -> None:
    """Every row's cells after the first match the regular expressions `formats`, column by column."""
    for row in rows:
        assert len(row) == len(formats) + 1, row
        for cell, pattern in zip(row[1:], formats):
            assert re.fullmatch(pattern, cell), f"{cell!r} is not {pattern!r} in {row}"


NUMBER = r"-?\d+(\.\d+)?"
RATIO = r"\d+\.\d+x"
RANGE = r"\d+(\.\d+)?-\d+(\.\d+)?"


def stage_runs(store: Path, stage: str) -> list:
    """The MLflow runs of `stage` that ran (not links to a cached result) in the sqlite store `store`."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.stage = '{stage}'")
    return [run for run in runs if "cached_from" not in run.data.tags]


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """bench/peer.py --tiny, run once for the tests below (with timm's rows when C2F_TIMM_REPO is set): its
    --workdir and its report."""
    workdir = tmp_path_factory.mktemp("peer")
    timm = ["--timm-repo", TIMM_REPO] if TIMM_REPO else []
    return workdir, run_bench("peer", "--tiny", "--workdir", str(workdir), *timm)


@pytest.mark.slow
def test_peer_tiny_trains_both_pretrain_rows_through_dvc(peer_run: tuple[Path, str]) -> None:
    workdir, report = peer_run
    rows = table_rows(report)
    # Each row's top-1 is what its own pretrain run computed (one run per row in --tiny).
    computed = {
        run.data.params["pretrain.token_label.enabled"]: run.data.metrics["val_top1"]
        for run in stage_runs(workdir / "project" / "mlflow.db", "pretrain")
    }
    assert sorted(computed) == sorted(PROJECT_ROWS.values())
    for name, token_labels in PROJECT_ROWS.items():
        img_per_s, _, seconds, top1 = rows[name]
        assert float(img_per_s) > 0 and float(seconds) > 0
        assert top1 == f"{computed[token_labels]:.2f}", (name, computed)
    assert [line.split(" >= ")[0] for line in goal_lines(report)] == list(PROJECT_ROWS)


@pytest.mark.slow
def test_peer_tiny_without_timm_reports_its_rows_as_not_run(peer_run: tuple[Path, str]) -> None:
    if TIMM_REPO:
        pytest.skip("C2F_TIMM_REPO is set: timm's rows ran (the test below checks them)")
    _, peer_report = peer_run
    rows = table_rows(peer_report)
    assert [rows[name][0] for name in TIMM_ROWS] == ["not run (no --timm-repo)"] * 2
    assert all(line.endswith("not checked (timm train.py not run: no --timm-repo)") for line in goal_lines(peer_report))


@pytest.mark.slow
def test_peer_tiny_compares_with_timm_train_py(peer_run: tuple[Path, str]) -> None:
    if not TIMM_REPO:
        pytest.skip("no timm source checkout: set C2F_TIMM_REPO to one (train.py is not in the timm wheel)")
    _, peer_report = peer_run
    rows = table_rows(peer_report)
    for name in TIMM_ROWS:
        img_per_s, _, seconds, top1 = rows[name]
        assert float(img_per_s) > 0 and float(seconds) > 0 and 0 <= float(top1) <= 100
    ratios = {name: rows[name][1] for name in [*PROJECT_ROWS, *TIMM_ROWS]}
    assert all(re.fullmatch(r"\d+\.\d\dx", ratio) for ratio in ratios.values()), ratios
    assert "1.00x" in (ratios[name] for name in TIMM_ROWS)  # the faster timm: the reference
    assert set(verdicts(peer_report)) <= {"met", "MISSED"}


def first_table(report: str) -> list[list[str]]:
    """The rows of a report's first markdown table, header and rule left out."""
    rows: list[list[str]] = []
    for line in report.splitlines():
        if line.startswith("| "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


@pytest.fixture(scope="module")
def digits_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --workdir for optimizers and scaling: the second reuses the first's project copy (digits, converted)."""
    return tmp_path_factory.mktemp("digits")


OPTIMIZER_NAMES = {"AdamW": "adamw", "LAMB": "lamb", "PSGD Kron": "kron"}  # the table's name -> optimizer.name


@pytest.mark.slow
def test_optimizers_tiny_reports_each_optimizer_without_and_with_mixup(digits_workdir: Path) -> None:
    rows = first_table(run_bench("optimizers", "--tiny", "--workdir", str(digits_workdir)))
    assert [row[:3] for row in rows] == [
        [name, mixup, "0.016"] for mixup in ("none", "Mixup 0.2") for name in ("AdamW", "LAMB", "PSGD Kron")
    ]
    for name, mixup, lr_base, epochs_to_95, top1, train_seconds, stage_seconds in rows:
        # What its run computed (bench/optimizers.py's runs/<optimizer.name>-<lr_base>[-mixup]/): in --tiny one
        # epoch, whose top-1 and seconds are the row's (tiny runs' top-1 are near chance, and often equal).
        run = f"{OPTIMIZER_NAMES[name]}-{lr_base}{'-mixup' if mixup != 'none' else ''}"
        ran = json.loads((digits_workdir / "runs" / run / "metrics" / "metrics.json").read_text())
        assert (top1, train_seconds) == (f"{ran['val_top1']:.2f}", f"{ran['epoch_seconds']:.1f}"), (run, ran)
        assert epochs_to_95 == ("1" if ran["val_top1"] >= 95 else "not reached"), (run, ran)
        assert 0 < float(train_seconds) <= float(stage_seconds)


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


def test_a_kept_workdir_is_reused_only_with_today_s_code_and_params_unless_told_to_refresh_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    from _common import COPY_DIR, ProjectCopy, project_copy

    def committed_seed() -> int:
        return yaml.safe_load(copy.run("git", "show", "HEAD:params.yaml"))["seed"]

    copy = ProjectCopy(tmp_path / COPY_DIR, {"seed": 3})
    assert project_copy(tmp_path, {"seed": 3}).path == copy.path  # the same params: reused as it is
    with pytest.raises(SystemExit, match="made with other params: use another --workdir, or --refresh-params"):
        project_copy(tmp_path, {"seed": 4})
    assert committed_seed() == 3
    # Told to, today's params are committed there, so the next bench (and DVC's experiments) start from them.
    project_copy(tmp_path, {"seed": 4}, refresh_params=True)
    assert committed_seed() == 4 and not copy.run("git", "status", "--porcelain")
    project_copy(tmp_path, {"seed": 4})
    # A copy whose pipeline code is not this checkout's is never reused, refresh or not: its figures would not be today's.
    stage = next((copy.path / "stages").glob("*.py"))
    stage.write_text(stage.read_text() + "\n# changed\n")
    with pytest.raises(SystemExit, match=rf"made from other code \(stages/{stage.name} differs\)"):
        project_copy(tmp_path, {"seed": 4}, refresh_params=True)


@pytest.fixture(scope="module")
def pipeline_workdir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """bench/startup.py --tiny, run once: its --workdir, holding the near-empty project copy every stage ran in
    (caching, token_targets, ablation and memory reuse it: one pipeline for the five), and its report."""
    workdir = tmp_path_factory.mktemp("pipeline")
    return workdir, run_bench("startup", "--tiny", "--workdir", str(workdir))


@pytest.mark.slow
def test_startup_tiny_times_every_launched_stage(pipeline_workdir: tuple[Path, str]) -> None:
    _, report = pipeline_workdir
    rows = first_table(report)
    assert [row[0] for row in rows] == [
        "convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune",
    ]
    assert_cells(rows, NUMBER)
    assert set(verdicts(report)) <= {"met", "MISSED"}


@pytest.mark.slow
def test_caching_tiny_times_a_no_op_and_a_last_stage_change_in_the_shared_copy(
    pipeline_workdir: tuple[Path, str],
) -> None:
    workdir, _ = pipeline_workdir
    report = run_bench("caching", "--tiny", "--workdir", str(workdir))
    rows = first_table(report)
    assert [row[0] for row in rows] == ["no change", "evaluate.finetune.crop_pct changed"]
    stage_list = r"[\w@-]+(, [\w@-]+)*"
    assert_cells(rows, NUMBER, RANGE, stage_list, NUMBER, NUMBER, NUMBER, NUMBER)
    assert "evaluate@finetune" in rows[1][3].split(", ")  # the change reached its stage
    assert set(verdicts(report)) <= {"met", "MISSED"}


@pytest.mark.slow
def test_token_targets_tiny_compares_the_targets_in_the_shared_copy(pipeline_workdir: tuple[Path, str]) -> None:
    workdir, _ = pipeline_workdir
    rows = first_table(run_bench("token_targets", "--tiny", "--project", str(workdir / "project")))
    assert [row[0] for row in rows] == [
        "reference: top-k logits, zero fill", "coarse2fine: top-k log-probs, residual fill",
        "coarse2fine, class target under MixToken", "every class (no top-k)", "teacher's prediction on the crop",
    ]
    number_or_none = rf"{NUMBER}|-"
    assert_cells(rows, *[number_or_none] * 8)


# One row of each kind (ending with the fine-tuned model / the pre-trained one): all five take 3.5 min even tiny.
# The recipe's is the shared copy's own pipeline, restored from DVC's cache.
ABLATION_ROWS = ("token labels + MixToken, coarse-to-fine (the recipe)", "token labels + MixToken, direct at 64 px")


@pytest.mark.slow
def test_ablation_tiny_runs_its_rows_as_dvc_experiments_in_the_shared_copy(
    pipeline_workdir: tuple[Path, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    workdir, _ = pipeline_workdir
    rows = first_table(run_bench("ablation", "--tiny", "--workdir", str(workdir), "--rows", *ABLATION_ROWS))
    assert [row[0] for row in rows] == list(ABLATION_ROWS)
    assert_cells(rows, NUMBER, NUMBER, NUMBER, NUMBER)
    # Each row's top-1 and loss are what its experiment's last evaluation wrote, as `dvc exp show` has them.
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    import ablation

    shown = experiment_metrics(workdir / "project")
    for name, top1, loss, *_ in rows:
        last = "finetune" if ablation.ROWS[name][2] else "pretrain"
        evaluation = shown[ablation._experiment_name(name)][f"metrics/evaluate/{last}/metrics.json"]
        assert (top1, loss) == (f"{evaluation['top1']:.2f}", f"{evaluation['loss']:.3f}"), (name, evaluation)


def skip_unless_apt_offers_lomiri_s_photographs() -> None:
    """bench/photo_sets.py's first set comes from this Debian package, at this version."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("no apt-get and dpkg-deb here: bench/photo_sets.py takes its photographs from Debian packages")
    policy = subprocess.run(["apt-cache", "policy", "lomiri-wallpapers-16.04"], capture_output=True, text=True).stdout
    if "Candidate: 20.04.0-2" not in policy:
        pytest.skip("apt's package lists do not offer lomiri-wallpapers-16.04 20.04.0-2 here (apt-get update as root)")


# A held-out set from its Debian package (apt-get download: the registry), cut as the photos are.
@pytest.mark.slow
def test_photo_sets_tiny_builds_an_imagefolder_of_a_debian_package_s_photographs_and_names_them(tmp_path: Path) -> None:
    skip_unless_apt_offers_lomiri_s_photographs()
    report = run_bench("photo_sets", "--tiny", "--out", str(tmp_path))
    (row,) = first_table(report)
    assert row[:4] == ["lomiri", "lomiri-wallpapers-16.04 20.04.0-2", "2", "6 / 2"], row
    built = json.loads((tmp_path / "lomiri.json").read_text())
    assert list(built["photos"]) == ["bridge", "dragonfly"] and built["grey_share"] == 0.2
    assert all(re.fullmatch(r"[0-9a-f]{64}", photo["sha256"]) for photo in built["photos"].values())
    source = list_imagefolder(tmp_path / "lomiri", subset=1.0, seed=0)
    assert source.classes == ("bridge", "dragonfly") and [len(source.files[split]) for split in SPLITS] == [6, 2]
    assert {min(Image.open(tmp_path / "lomiri" / file.path).size) for file in source.files["train"]} == {64}


# teacher_quality.py --photo-set: each seed's copy trains on the set drawn at that seed (its val blocks too), built once.
@pytest.mark.slow
def test_teacher_quality_draws_the_photo_set_at_each_seed_and_reuses_a_kept_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_apt_offers_lomiri_s_photographs()
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    import teacher_quality

    def drawn(seed_work: Path, seed: int) -> Path:
        return teacher_quality.photo_set_tree(seed_work, "lomiri", seed, tiny=True)

    def images(tree: Path, split: str) -> list[bytes]:
        return [path.read_bytes() for path in sorted((tree / split).rglob("*.png"))]

    def written(tree: Path) -> dict[Path, int]:
        return {path: path.stat().st_mtime_ns for path in tree.rglob("*.png")}

    first = drawn(tmp_path / "seed1", 1)
    assert first == (tmp_path / "seed1" / "photo_set" / "lomiri").resolve()
    args = argparse.Namespace(photo_set="lomiri", data_root=None, tiny=True)
    assert teacher_quality.data_params(args, tmp_path / "seed1", 1) == {"source": "imagefolder", "root": str(first)}
    kept = written(first)
    assert drawn(tmp_path / "seed1", 1) == first and written(first) == kept  # reused: convert would rerun on new files
    assert images(drawn(tmp_path / "again", 1), "val") == images(first, "val")  # the seed decides the draw
    other = drawn(tmp_path / "seed2", 2)
    assert images(other, "val") != images(first, "val") and images(other, "train") != images(first, "train")
    (tmp_path / "seed1" / "photo_set" / "lomiri.json").unlink()  # as a build killed before its description
    drawn(tmp_path / "seed1", 1)
    assert written(first).keys() == kept.keys() and all(written(first)[path] > kept[path] for path in kept)


@pytest.fixture(scope="module")
def teacher_quality_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Three DVC experiments (ground truth, the recipe without the dense loss, the recipe) from a one-epoch teacher, in
    the bench's own near-empty copy: (the workdir, the report)."""
    workdir = tmp_path_factory.mktemp("teacher_quality")
    # The no-dense arm sets finetune.token_label.dense_weight: DVC overrides only keys params.yaml writes.
    report = run_bench("teacher_quality", "--tiny", "--workdir", str(workdir), "--json", str(workdir / "runs.json"),
                       "--arms", "ground truth", "recipe, no dense loss", "recipe")
    return workdir, report


@pytest.mark.slow
def test_teacher_quality_tiny_reports_each_arm_and_the_recipe_s_gap_to_ground_truth(
    teacher_quality_tiny: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir, report = teacher_quality_tiny
    rows = {row[2]: row for row in first_table(report)}
    # Each run names its machine, as the result files' names do: a seed's arms pair only on one (next test).
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    from _common import machine_slug
    assert {run["machine"] for run in json.loads((workdir / "runs.json").read_text())["runs"]} == {machine_slug()}
    assert list(rows) == ["recipe, no dense loss", "recipe", "ground truth"]
    assert rows["recipe"][0] == "1"  # the teacher's epochs
    project = workdir / "seed0" / "project"
    metrics = {name: json.loads((project / "metrics" / name / "metrics.json").read_text())
               for name in ("teacher", "token_labels", "evaluate/pretrain", "evaluate/finetune")}

    def students(evaluations: dict[str, dict]) -> list[float]:  # pretrain @48, @64, finetune @64
        pretrain, finetune = evaluations["evaluate/pretrain"], evaluations["evaluate/finetune"]
        return [pretrain["top1"], pretrain["top1_at_64"], finetune["top1"]]

    # The recipe ran last: its row is what the workspace's evaluations and the token_labels stage wrote.
    recipe = students(metrics)
    assert rows["recipe"][3:6] == [f"{value:.2f}" for value in recipe]
    labels = metrics["token_labels"]
    teacher = (metrics["teacher"]["val_top1"], labels["dense_top1"], labels["cell_top1"])
    assert rows["recipe"][1] == " / ".join(f"{value:.2f}" for value in teacher)
    # Ground truth's row is the other experiment's evaluations, and the gap is the recipe's minus it.
    evaluations = ("evaluate/pretrain", "evaluate/finetune")
    shown = [students({name: files[f"metrics/{name}/metrics.json"] for name in evaluations})
             for files in experiment_metrics(project).values()]
    truth = next(values for values in shown if [f"{value:.2f}" for value in values] == rows["ground truth"][3:6])
    assert rows["recipe"][6] == " / ".join(f"{mine - theirs:+.2f}" for mine, theirs in zip(recipe, truth))
    # Each arm's fine-tuned errors per class are the evaluate stage's per_class.json: the recipe's (the workspace's)
    # in the recipe's column of the per-class table.
    per_class = json.loads((project / "metrics" / "evaluate" / "finetune" / "per_class.json").read_text())
    section = report.split("val images wrong per class")[1]
    header = next(line for line in section.splitlines() if line.startswith("| class"))
    column = [cell.strip() for cell in header.strip("|").split("|")].index("recipe")
    classes = {row[0]: row[column] for row in first_table(section)}
    assert classes and all(
        classes[row["class"]] == f"{row['total'] - row['correct']:.1f}" for row in per_class if row["class"] in classes
    )


@pytest.mark.slow
def test_token_votes_reads_each_experiment_s_model_from_dvc_s_cache_as_the_evaluate_stage_scores_it(
    teacher_quality_tiny: tuple[Path, str], tmp_path: Path
) -> None:
    project = teacher_quality_tiny[0] / "seed0" / "project"
    report = run_bench("token_votes", "--projects", str(project), "--results", str(tmp_path))
    rows = first_table(report)
    # Each experiment named by the arm whose settings it ran (the bench's --set common to all left out).
    assert list(dict.fromkeys(row[0] for row in rows)) == ["ground truth", "recipe", "recipe, no dense loss"]
    # The recipe ran last: its per-class top-1 is the evaluate stage's per_class.json in the workspace, so the model
    # came from the right experiment and the val records were read as the stage reads them.
    per_class = json.loads((project / "metrics" / "evaluate" / "finetune" / "per_class.json").read_text())
    recipe = {row[1]: row for row in rows if row[0] == "recipe"}
    assert sorted(recipe) == sorted(row["class"] for row in per_class)
    for row in per_class:
        assert recipe[row["class"]][2:4] == [str(row["total"]), f"{100 * row['correct'] / row['total']:.1f}"]
    assert_cells(rows, r"[\w-]+", r"\d+", *[r"\d+\.\d"] * 3, r"[\w-]+ \(\d+ %\)", "1")
    assert all(0 <= float(cell) <= 100 for row in rows for cell in row[3:6])
    unknown = subprocess.run(
        [sys.executable, "bench/token_votes.py", "--projects", str(project), "--classes", "nosuch"],
        cwd=PROJECT_ROOT, capture_output=True, text=True,
    )
    assert unknown.returncode != 0 and "no val class nosuch" in unknown.stderr


def test_teacher_quality_s_help_names_every_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    # argparse %-formats help: an arm named "... 8-100 %" once made --help itself fail.
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    import teacher_quality

    shown = " ".join(run_bench("teacher_quality", "--help").split()).replace("- ", "-")  # unwrapped
    assert [arm for arm in teacher_quality.ARMS if arm.replace("- ", "-") not in shown] == []


def test_teacher_quality_reports_ground_truth_s_variants_against_it(tmp_path: Path) -> None:
    # An arm the teacher does not reach (ground truth on other crops) has no teacher figures; it once fell out of
    # the table. Its pairs' differences to ground truth are +1, -1, +2: mean +0.67, standard error 1.53 / sqrt(3).
    values = {"ground truth": [70.0, 80.0, 90.0], "recipe": [72.0, 84.0, 93.0],
              "ground truth, pre-training crops 8-100 %": [71.0, 79.0, 92.0]}
    runs = [
        {"seed": seed, "teacher_epochs": 30, "arm": arm, "student_epochs": None,
         "students": dict.fromkeys(("pretrain @48", "pretrain @64", "finetune @64"), by_seed[seed]),
         "finetune_wrong": {"a": seed},
         **({"teacher": {"val_top1": 80.0, "dense_top1": 99.0, "cell_top1": 90.0}} if arm == "recipe" else {})}
        for seed in range(3) for arm, by_seed in values.items()
    ]
    (tmp_path / "runs.json").write_text(json.dumps({"runs": runs}))
    # --json into a folder not made yet: it is made (it once stopped a long bench after its first run).
    report = run_bench("teacher_quality", "--report-from", str(tmp_path / "runs.json"), "--results", str(tmp_path),
                       "--json", str(tmp_path / "new" / "all.json"))
    assert len(json.loads((tmp_path / "new" / "all.json").read_text())["runs"]) == len(runs)
    rows = first_table(report)
    assert [row[2] for row in rows] == ["recipe", "ground truth", "ground truth, pre-training crops 8-100 %"]
    assert rows[2][:4] == ["-", "-", "ground truth, pre-training crops 8-100 %", "80.67 (71.00 / 79.00 / 92.00)"]
    assert rows[2][6] == " / ".join(["+0.67 ± 0.88"] * 3)


def test_teacher_quality_gap_is_the_mean_of_paired_differences_with_their_standard_error(tmp_path: Path) -> None:
    # Three seeds whose arms both swing by seed: the pairs' differences are +2, +4, +3 (mean +3, sd 1, so the
    # standard error 1 / sqrt(3) = 0.58), though either arm's own figures spread by 10 points.
    truth, recipe = [70.0, 80.0, 90.0], [72.0, 84.0, 93.0]
    columns = ("pretrain @48", "pretrain @64", "finetune @64")
    # Val images wrong per class: the recipe misreads class `a` at every seed, ground truth nearly never.
    wrong = {"ground truth": [{"a": 0, "b": 2, "c": 1}, {"a": 1, "b": 2, "c": 1}, {"a": 0, "b": 2, "c": 1}],
             "recipe": [{"a": 5, "b": 2, "c": 1}, {"a": 4, "b": 3, "c": 1}, {"a": 6, "b": 2, "c": 1}]}
    runs = [
        {"seed": seed, "teacher_epochs": 30, "arm": arm, "student_epochs": None,
         "students": dict.fromkeys(columns, values[seed]), "finetune_wrong": wrong[arm][seed],
         **({"teacher": {"val_top1": 80.0, "dense_top1": 99.0, "cell_top1": 90.0}} if arm == "recipe" else {})}
        for seed in range(3) for arm, values in (("ground truth", truth), ("recipe", recipe))
    ]
    (tmp_path / "runs.json").write_text(json.dumps({"runs": runs}))
    report = run_bench("teacher_quality", "--report-from", str(tmp_path / "runs.json"), "--results", str(tmp_path))
    rows = {row[2]: row for row in first_table(report)}
    assert rows["recipe"][3] == "83.00 (72.00 / 84.00 / 93.00)"
    assert rows["recipe"][6] == " / ".join(["+3.00 ± 0.58"] * 3)
    # Then where the gap comes from: the classes ordered by how far the recipe's errors are from ground truth's.
    classes = first_table(report.split("val images wrong per class")[1])
    assert classes == [["a", "0.3 (0.0 / 1.0 / 0.0)", "5.0 (5.0 / 4.0 / 6.0)"],  # ground truth, recipe
                       ["b", "2.0 (2.0 / 2.0 / 2.0)", "2.3 (2.0 / 3.0 / 2.0)"],
                       ["c", "1.0 (1.0 / 1.0 / 1.0)", "1.0 (1.0 / 1.0 / 1.0)"]]
    # The same runs given twice (a report re-made from its own file and the ones it came from) are refused, not
    # counted twice: six 'seeds' would shrink the standard error by a root of two.
    again = subprocess.run([sys.executable, "bench/teacher_quality.py", "--report-from", str(tmp_path / "runs.json"),
                            str(tmp_path / "runs.json"), "--results", str(tmp_path)],
                           cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert again.returncode == 1 and "seed 0, teacher epochs 30, arm 'ground truth' is in both" in again.stderr
    # A seed whose arms ran on two machines is refused too: another CPU's rounding trains other students from the
    # same seed, so the pair would measure the machines as well as the arms.
    runs[-1]["machine"] = "2cpu-amd-epyc"  # seed 2's recipe; the rest name no machine
    (tmp_path / "machines.json").write_text(json.dumps({"runs": runs}))
    mixed = subprocess.run([sys.executable, "bench/teacher_quality.py", "--report-from",
                            str(tmp_path / "machines.json"), "--results", str(tmp_path)],
                           cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert mixed.returncode == 1
    assert "seed 2 ran on an unnamed machine" in mixed.stderr and "2cpu-amd-epyc" in mixed.stderr
    # Runs that name one machine make a report named after it, wherever it is made: re-made here from runs of
    # another machine, it must not replace this machine's result file of the same day.
    for run in runs:
        run["machine"] = "2cpu-far-away"
    (tmp_path / "far.json").write_text(json.dumps({"runs": runs}))
    far = run_bench("teacher_quality", "--report-from", str(tmp_path / "far.json"),
                    "--results", str(tmp_path / "far"))
    assert "seeds 0, 1, 2 (run on 2cpu-far-away);" in far
    assert [path.name.split("_")[2] for path in (tmp_path / "far").glob("*.md")] == ["2cpu-far-away"]
    # Ground truth alone (a seed's arm added to runs of an earlier session) reports its row: it has no teacher.
    (tmp_path / "truth.json").write_text(json.dumps({"runs": [run for run in runs if run["arm"] == "ground truth"]}))
    alone = run_bench("teacher_quality", "--report-from", str(tmp_path / "truth.json"),
                      "--results", str(tmp_path / "truth"))
    assert [row[2:4] for row in first_table(alone)] == [["ground truth", "80.00 (70.00 / 80.00 / 90.00)"]]


def test_mix_token_box_tiny_draws_each_model_s_box_on_its_pooled_token_grid(tmp_path: Path) -> None:
    report = run_bench("mix_token_box", "--tiny", "--results", str(tmp_path))
    rows = first_table(report)
    # The students at params.yaml's 48 and 64 px (stem stride 4), the reference's VOLO-D1 at 224 and 384 (stride 8):
    # the box is drawn on the stem's grid halved (VOLO's pooling scale).
    assert [row[1:4] for row in rows] == [["48", "12 x 12", "6 x 6"], ["64", "16 x 16", "8 x 8"],
                                          ["224", "28 x 28", "14 x 14"], ["384", "48 x 48", "24 x 24"]]
    assert_cells(rows, r"\d+", r"\d+ x \d+", r"\d+ x \d+", *[r"0\.\d{3}"] * 3, r"\d+\.\d")
    for row in rows:  # lam ~ Beta(1, 1) swaps a quarter to a third of the crop on average at every grid
        assert 0.15 < float(row[4]) < 0.4, row


def experiment_metrics(project: Path) -> dict[str, dict[str, dict]]:
    """experiment name -> metrics file -> its values, as `dvc exp show` has them in the DVC project `project`."""
    shown = json.loads(subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=project, capture_output=True, text=True,
                                      check=True, env={**os.environ, "DVC_NO_ANALYTICS": "1"}).stdout)
    return {
        experiment["name"]: {
            path: entry["data"] for path, entry in experiment["revs"][0]["data"]["metrics"].items() if "data" in entry
        }
        for baseline in shown for experiment in baseline.get("experiments") or []
    }


DEFAULT_STAGES = (
    "source", "convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune",
    "compare", "lineage",
)


# 1.3 min alone on 2 cores, 1.6 in the loaded suite, its stages in a stage server of the bench's own (2.5 min when
# each ran in its own process): every stage once more in the shared copy, then 2 x 4 launched stages (convert to
# pretrain) in the 1x/10x copy.
@pytest.mark.slow
def test_memory_tiny_samples_every_stage_pretrain_at_1x_and_10x_the_records_and_the_listing(
    pipeline_workdir: tuple[Path, str],
) -> None:
    workdir, _ = pipeline_workdir
    report = run_bench("memory", "--tiny", "--workdir", str(workdir))
    rows = table_rows(report)
    assert [row[0] for row in first_table(report)] == list(DEFAULT_STAGES)
    for stage in DEFAULT_STAGES:
        seconds, summed, largest, processes, samples = rows[stage]
        assert float(seconds) > 0 and int(samples) > 0 and int(processes) >= 1, (stage, rows[stage])
        assert int(summed) >= int(largest) > 0, (stage, rows[stage])
    one, ten = rows["1x"], rows["10x"]
    assert int(ten[0]) == 10 * int(one[0])  # train images
    assert float(ten[1]) > float(one[1]) > 0  # the token-label store grew with them
    for row in (one, ten):
        assert float(row[2]) > 0 and int(row[3]) >= int(row[4]) > 0 and re.fullmatch(RATIO, row[5]), row
    for files in ("100", "1000"):
        folders, seconds = rows[files]
        assert int(folders) >= 1 and float(seconds) > 0
    assert verdicts(report) and set(verdicts(report)) <= {"met", "MISSED"}


def markdown_tables(report: str) -> list[list[list[str]]]:
    """Every markdown table of a report, in order: its rows, header and rule left out."""
    tables: list[list[list[str]]] = []
    previous = ""
    for line in report.splitlines():
        if line.startswith("| "):
            if not previous.startswith("| "):
                tables.append([])
            tables[-1].append([cell.strip() for cell in line.strip().strip("|").split("|")])
        previous = line
    return [table[2:] for table in tables]


LAUNCHED_STAGES = DEFAULT_STAGES[1:-2]  # the stages a launcher runs: seconds, sampled many times


# Two whole repros (1000 class folders, the VOLO-D1 profile's 1024 + 64 shards) and their no-ops, the stages in
# the bench's own stage server.
@pytest.mark.slow
def test_scale_tiny_measures_every_stage_on_imagenet_shaped_trees_and_projects_them(tmp_path: Path) -> None:
    report = run_bench("scale", "--tiny", "--workdir", str(tmp_path))
    stages, dvc, summary, projection, volo = markdown_tables(report)
    assert [row[0] for row in stages] == list(DEFAULT_STAGES)
    for stage, unit, small, large, fixed, per_unit, fds, records, processes, read, written, own in stages:
        assert float(small) > 0 and float(large) > 0 and float(own) >= 0, stage
        assert re.fullmatch(r"\d+ / \d+", records) and float(read) >= 0 and float(written) >= 0, stage
        assert (unit == "-") is (stage in ("compare", "lineage")) and re.fullmatch(NUMBER, fixed), stage
        if stage in LAUNCHED_STAGES:  # its processes were seen, with their open files
            assert int(processes) >= 1 and int(fds) > 0, (stage, fds, processes)
    opened, mapped = next(row for row in stages if row[0] == "pretrain")[7].split(" / ")
    assert int(opened) + int(mapped) > 0  # a training stage reads the records
    assert [row[0] for row in dvc] == list(DEFAULT_STAGES)
    assert all(float(row[1]) > 0 for row in dvc)  # each stage's command
    rows = {row[0]: row[1:] for row in summary}
    assert re.fullmatch(r"\d+\.\d %", rows["cache overhead"][0])
    for tree in ("small", "large"):
        assert re.fullmatch(NUMBER, rows[f"no-op repro, {tree} tree"][0])
        assert re.fullmatch(RANGE, rows[f"no-op repro, {tree} tree"][1])
        assert float(rows[f"whole repro, {tree} tree"][0]) > 0
    assert rows["open-file limit"][0] == "ulimit -Sn 1024"
    assert rows["open-file limit"][2] == "passed" or rows["open-file limit"][2].startswith("FAILED in ")
    assert [row[0] for row in projection] == [*DEFAULT_STAGES, "whole repro", "no-op repro"]
    for stage, *_, local, nfs in projection:
        assert 0 < float(local) <= float(nfs), (stage, local, nfs)
    assert volo[0][0] == "GPU steps" and volo[-1][0] == "total" and float(volo[0][1]) > 0
    assert all(float(hours) >= 0 and re.fullmatch(r"\d+\.\d %", share) for _, hours, share in volo)
    assert len(verdicts(report)) == 4 and set(verdicts(report)) <= {"met", "MISSED"}


# A stage's process that ends between psutil's reads and /proc/<pid>/maps once stopped the sampling thread for good,
# and every later stage read as if none of its processes had run (CI, stop 75: teacher "0 processes").
def test_scale_s_sampler_passes_over_a_process_that_ended_and_raises_what_stops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(PROJECT_ROOT / "bench"))
    import psutil
    import scale

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    sampler = scale.Sampler((PROJECT_ROOT / "data" / "records",))
    with pytest.raises(psutil.NoSuchProcess):  # what the sampling passes over, as for psutil's own reads
        sampler._mapped_records(ended.pid)

    def planted() -> None:
        raise OSError("planted")

    with pytest.raises(RuntimeError, match="sampling stopped during stage teacher") as raised:
        with scale.Sampler(()) as sampler:
            sampler.start_stage("teacher")
            monkeypatch.setattr(scale, "bench_processes", planted)
            time.sleep(5 * scale.SAMPLE_SECONDS)
    assert str(raised.value.__cause__) == "planted"


@pytest.fixture(scope="module")
def photos_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A --workdir for loader and loader_profile: the second reuses the first's synthetic photos and records."""
    return tmp_path_factory.mktemp("photos")


@pytest.mark.slow
@pytest.mark.parametrize("augment", [[], ["--rand-augment", "rand-m9-mstd0.5-inc1", "--reprob", "0.25"]],
                         ids=["plain", "the recipe's"])
def test_loader_tiny_times_each_loader(augment: list[str], photos_workdir: Path) -> None:
    report = run_bench("loader", "--tiny", "--workdir", str(photos_workdir), *augment)
    rows = first_table(report)
    assert [row[0] for row in rows] == ["dali", "torch", "imagefolder", "crop decode only"]
    assert_cells(rows, NUMBER, RATIO, r"\d+ %", RANGE)
    assert set(verdicts(report)) <= {"met", "MISSED"}
    assert ("rand-m9-mstd0.5-inc1 + normalise + random erasing 0.25;" in report) == bool(augment)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["photos", "digits"])
def test_loader_profile_tiny_times_each_step_of_the_dali_graph(source: str, photos_workdir: Path, tmp_path) -> None:
    options = ["--workdir", str(photos_workdir)] if source == "photos" else ["--digits", "--img-size", "32",
                                                                              "--workdir", str(tmp_path)]
    report = run_bench("loader_profile", "--tiny", *options)
    assert (" 32 px," in report) is (source == "digits")
    rows = first_table(report)
    assert [row[0] for row in rows] == [
        "crop decode", "+ resize bicubic, antialiased (the default)", "+ resize bilinear, antialiased",
        "+ resize bicubic, not antialiased", "+ normalise (the all-DALI train graph)",
        "project CPU loader (torch resize)",
    ]
    assert_cells(rows, NUMBER, RATIO, NUMBER)


@pytest.mark.slow
def test_rand_augment_tiny_times_each_op_both_ways() -> None:
    rows = first_table(run_bench("rand_augment", "--tiny"))
    assert [row[0] for row in rows] == [*RAND_AUGMENT_OPS, "the whole policy"]
    assert_cells(rows, NUMBER, NUMBER, RATIO)


@pytest.fixture(scope="module")
def run_all_tiny(tmp_path_factory) -> tuple[dict[str, str], Path]:
    """`make bench`'s runner on two benches, tiny, writing their result files and its summary to a folder: each
    bench's report (what its `## name` section printed) and the folder."""
    results = tmp_path_factory.mktemp("results")
    output = run_bench("run_all", "--only", "convert", "train_step", "--tiny", "--results", str(results))
    sections = re.split(r"^## (\w+)$", output, flags=re.MULTILINE)[1:]
    return dict(zip(sections[::2], sections[1::2])), results


@pytest.mark.slow
def test_convert_tiny_times_convert_against_copies(run_all_tiny) -> None:
    report = run_all_tiny[0]["convert"]
    rows = first_table(report)
    assert [row[0] for row in rows] == ["convert", "raw copy + fsync", "raw copy"]
    assert_cells(rows, NUMBER, NUMBER, RATIO, RATIO, RANGE)
    assert set(verdicts(report)) <= {"met", "MISSED"}


@pytest.mark.slow
def test_run_all_summarises_every_goal_line_from_the_result_files(run_all_tiny) -> None:
    reports, results = run_all_tiny
    (summary,) = results.glob("bench_goals_*.md")
    rows = first_table(summary.read_text())
    for name, report in reports.items():
        (written,) = results.glob(f"{name}_*.md")
        assert json.loads(written.with_suffix(".json").read_text())["goals"] == goal_lines(report)
        assert [[row[0], f"{row[1]}: {row[2]} ({row[3]})", row[4]] for row in rows if row[0] == name] == [
            [name, line, f"[{written.name}]({written.name})"] for line in goal_lines(report)
        ]
    assert {row[0] for row in rows} == {"convert", "train_step"}
    assert json.loads(summary.with_suffix(".json").read_text())["reports"] == {  # beside it: named, not a path
        name: next(results.glob(f"{name}_*.md")).name for name in ("convert", "train_step")
    }
    # run_all starts each bench by its absolute path: the reports name it from the project root, and below their
    # header line (the command as given) no path of this machine, not even of its temporary files.
    for report in [summary.read_text(), *(path.read_text() for path in results.glob("[ct][or]*_*.md"))]:
        header, body = report.split("\n", 1)
        assert "; command: `python bench/" in header and str(PROJECT_ROOT) not in report, report
        assert tempfile.gettempdir() + "/" not in body, body


@pytest.mark.slow
def test_train_step_tiny_times_the_trainer_against_a_bare_loop(run_all_tiny) -> None:
    report = run_all_tiny[0]["train_step"]
    rows = first_table(report)
    assert [row[0] for row in rows] == [
        "bare loop", "Trainer step", "Trainer epoch", "Trainer step + token labels",
        "Trainer step + token labels + MixToken",
    ]
    assert_cells(rows, NUMBER, RATIO, RANGE, NUMBER, RATIO)
    assert set(verdicts(report)) <= {"met", "MISSED"}


@pytest.mark.slow
def test_layout_tiny_times_channels_last_images_against_nchw() -> None:
    report = run_bench("layout", "--tiny")
    rows = first_table(report)
    works = ["teacher (resnet10t, 32 px) training step", "teacher (resnet10t, 32 px) forward (generation)",
             "student (volo_custom, 32 px) training step"]
    assert [(row[0], row[1]) for row in rows] == [(work, layout) for work in works for layout in ("NCHW", "channels-last")]
    assert_cells(rows, r"NCHW|channels-last", NUMBER, RATIO, RANGE, RATIO)
    assert {row[3] for row in rows if row[1] == "NCHW"} == {"1.000x"}


@pytest.mark.slow
def test_token_labels_tiny_times_generation_against_the_bare_forward() -> None:
    report = run_bench("token_labels", "--tiny")
    rows = first_table(report)
    assert [row[0] for row in rows] == [
        "generation", "generation, loop only", "teacher bare forward", "dense head only",
    ]
    assert_cells(rows, NUMBER, RATIO, RANGE)
    assert set(verdicts(report)) <= {"met", "MISSED"}


@pytest.mark.slow
def test_scaling_tiny_runs_one_process_and_two_agents_at_a_rendezvous(digits_workdir: Path) -> None:
    # The two-agent layout only beside the reference: every layout is the same call, each costs half a minute here.
    two_nodes = "2 nodes x 1 process (c10d)"
    rows = first_table(run_bench("scaling", "--tiny", "--workdir", str(digits_workdir), "--layouts", two_nodes))
    assert [row[0] for row in rows] == ["1 node x 1 process", two_nodes]
    assert_cells(rows, NUMBER, NUMBER, NUMBER)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU: the test below runs bench/gpu_step.py --tiny")
def test_gpu_step_tiny_without_a_gpu_or_the_trackers_parses_its_options_and_stops_with_one_line(tmp_path) -> None:
    """As on a GPU node whose image has torch and timm only (docs/gpu.md): MLflow, DVC, DVCLive and DALI are
    made unimportable, and the Trainer's step still imports."""
    for package in ("mlflow", "dvc", "dvclive", "nvidia/dali"):  # nvidia is a namespace package: block dali only
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('{package} is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "bench/gpu_step.py", "--tiny"], cwd=PROJECT_ROOT, capture_output=True, text=True,
        timeout=600, env=env,
    )
    assert result.returncode == 1 and result.stderr.startswith("bench/gpu_step.py: no usable CUDA GPU"), result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU: bench/timm_gpu_step.py would time real steps")
def test_timm_gpu_step_without_a_gpu_stops_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "bench/timm_gpu_step.py"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1 and result.stderr.startswith("bench/timm_gpu_step.py: no usable CUDA GPU"), (
        result.stderr
    )


def test_timm_gpu_step_writes_its_json_into_a_folder_not_made_yet(tmp_path: Path) -> None:
    # The CPU dry run of the bench with timm's smallest ViT (made for tests): figures that measure nothing.
    path = tmp_path / "new" / "timm.json"
    subprocess.run(
        [sys.executable, "bench/timm_gpu_step.py", "--model", "test_vit", "--device", "cpu", "--eager-only",
         "--batch-size", "2", "--steps", "1", "--repeats", "1", "--json", str(path)],
        cwd=PROJECT_ROOT, check=True, capture_output=True, text=True, timeout=600,
    )
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert list(raw["median_img_per_s"]) == ["eager"] and raw["median_img_per_s"]["eager"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: bench/gpu_step.py --tiny needs one")
def test_gpu_step_tiny_times_both_steps_on_the_gpu() -> None:
    rows = first_table(run_bench("gpu_step", "--tiny"))
    assert [row[0] for row in rows] == ["ground truth", "token labels + MixToken"]
    assert_cells(rows, NUMBER, RATIO, RANGE)


@pytest.mark.slow
def test_model_export_tiny_logs_the_shipped_model_and_sizes_it() -> None:
    """bench/model_export.py --tiny: the shipped params' tiny VOLO logged through tracking.logged_model, timed and
    sized: its artifact holds at least the model's fp32 weights."""
    report = run_bench("model_export", "--tiny")
    (row,) = first_table(report)
    assert row[0] == "params.yaml" and row[1] == "volo_custom @ 64"
    assert float(row[2].removesuffix(" M")) > 0 and float(row[4]) > 0
    assert float(row[5]) >= float(row[3]) > 0  # the archive holds the fp32 weights
    assert "every profile's model exports (torch.export accepts it): met (1 of 1)" in report


def test_eval_transform_tiny_compares_dali_with_timm_pixel_by_pixel_and_by_top1(digits_records, tmp_path) -> None:
    """bench/eval_transform.py --tiny on the digits: square 32 px JPEGs evaluated at their own size need no resize
    and no crop, so DALI's decoder and PIL's give the same pixels (largest difference 0 levels), and a model
    predicts the same classes both ways."""
    from conftest import make_params

    from coarse2fine import checkpoints, models
    from coarse2fine.data.transforms import eval_transform

    params = make_params()
    model = models.build_model(params.model, num_classes=10, img_size=32)
    checkpoints.save_model_file(tmp_path / "model.pt", model, model_cfg=params.model, img_size=32,
                                classes=[str(k) for k in range(10)], stage="finetune",
                                eval_transform=eval_transform(32, 1.0, "bicubic"))
    report = run_bench("eval_transform", "--tiny", "--records", str(digits_records), "--model", str(tmp_path / "model.pt"))
    (pixels,) = first_table(report)
    assert pixels[:2] == ["16", "32 px, crop_pct 1"] and pixels[2:] == ["0.00", "0 / 0 / 0"], pixels
    (top1,) = first_table(report.split("model.pt:")[1])
    assert top1[0] == top1[1] and top1[2:] == ["+0.00", "0.00 %"], top1


@pytest.mark.slow
def test_cpu_dispatch_tiny_trains_the_teacher_under_each_setting_in_a_copy_of_its_own(tmp_path) -> None:
    """bench/cpu_dispatch.py --tiny: the teacher of the digits under the native kernels and under the baseline ones,
    each in a project copy of its own; both convert the same records (the JPEGs do not depend on the kernels)."""
    report = run_bench("cpu_dispatch", "--tiny", "--workdir", str(tmp_path))
    rows = first_table(report)
    assert [row[0] for row in rows] == ["native", "baseline"], rows
    assert rows[0][1] == "(as installed)" and rows[1][1] == "ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE"
    assert rows[0][2].endswith(" (same)") and rows[1][2] == rows[0][2], rows
    assert_cells(rows[:1], r".+", r".+", rf"{NUMBER} / {NUMBER} / 0", r"\d+ \(1\.00x\)")  # the reference
    assert_cells(rows[1:], r".+", r".+", rf"{NUMBER} / {NUMBER} / {NUMBER}(e-\d+)?", rf"\d+ \({RATIO}\)")
    for setting in ("native", "baseline"):
        assert (tmp_path / setting / "models" / "teacher" / "model.pt").is_file()
