"""Every stage's code deps in dvc.yaml are the files its script imports (transitively, within the package) plus
the launcher, and the code digest that fingerprints a checkpoint covers them."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coarse2fine import provenance

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("stages/", "src/")


def dvc_stages() -> dict[str, dict]:
    """Each stage's definition (a foreach stage's `do`, the same for every item)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: stage.get("do", stage) for name, stage in stages.items()}


def relative(files: list[Path]) -> set[str]:
    return {path.relative_to(ROOT).as_posix() for path in files}


@pytest.mark.parametrize("name", sorted(dvc_stages()))
def test_code_deps_are_exactly_what_the_stage_imports(name):
    stage = dvc_stages()[name]
    listed = {dep for dep in stage["deps"] if dep.startswith(CODE_DIRS)}
    expected = set(provenance.stage_code_deps(stage["cmd"], ROOT))
    assert not expected - listed, f"{name}: dvc.yaml misses code deps {sorted(expected - listed)}"
    assert not listed - expected, f"{name}: dvc.yaml lists code the stage does not import {sorted(listed - expected)}"


def test_make_deps_writes_what_dvc_yaml_holds():
    """`make deps` (scripts/write_code_deps.py) rewrites the code deps from the imports: on this tree, nothing to do."""
    check = subprocess.run(
        [sys.executable, "scripts/write_code_deps.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stderr


def test_same_outputs_tells_a_changed_output_from_a_run_s_timing(tmp_path):
    """scripts/same_outputs.py, the proof that a layout change changed no behaviour: two runs' outputs are the same
    when their hashes are, or when only a metrics file's timing fields differ; a model that differs fails it."""
    def project(name: str, seconds: float, model: str) -> Path:
        path = tmp_path / name
        (path / "metrics/pretrain").mkdir(parents=True)
        metrics = json.dumps({"val_top1": 90.0, "epoch_seconds": seconds})
        (path / "metrics/pretrain/metrics.json").write_text(metrics)
        outs = [{"path": "metrics/pretrain/metrics.json", "md5": hashlib.md5(metrics.encode()).hexdigest()},
                {"path": "models/pretrain", "md5": f"{model}.dir"}]
        (path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"pretrain": {"outs": outs}}}))
        return path

    def compare(before: Path, after: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "scripts/same_outputs.py", before, after], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    same = compare(project("before", 5.0, "a1"), project("after", 6.5, "a1"))
    assert same.returncode == 0, same.stdout
    assert "| pretrain | metrics/pretrain/metrics.json |" in same.stdout and "identical but timing" in same.stdout
    assert "2 of 2 outputs the same" in same.stdout
    changed = compare(tmp_path / "before", project("changed", 5.0, "b2"))
    assert changed.returncode == 1 and "differing: pretrain models/pretrain" in changed.stdout, changed.stdout
    # A folder's differing files are named (here the model folders exist in neither project: the output itself).
    assert "| pretrain | models/pretrain | a1.dir | b2.dir | DIFFERS |" in changed.stdout
    (tmp_path / "before/models/pretrain").mkdir(parents=True)
    (tmp_path / "before/models/pretrain/model.pt").write_bytes(b"one")
    (tmp_path / "changed/models/pretrain").mkdir(parents=True)
    (tmp_path / "changed/models/pretrain/model.pt").write_bytes(b"two")
    named = compare(tmp_path / "before", tmp_path / "changed")
    assert "| a1.dir | b2.dir | DIFFERS: model.pt |" in named.stdout, named.stdout
    missing = compare(tmp_path / "before", tmp_path)
    assert missing.returncode == 1, missing.stderr
    lock = tmp_path / "dvc.lock"
    assert missing.stderr == f"{lock}: no such file: run the pipeline in {tmp_path} first (dvc repro)\n"

    # A token-label store whose header differs in its inputs' digest only (it hashes the stage's code files: a move
    # changes it) holds the same labels; other labels, or another header field, differ.
    def store_project(name: str, inputs_digest: str, labels: bytes, top_k: int = 5) -> Path:
        path = tmp_path / name
        (path / "data/token_labels/enabled").mkdir(parents=True)
        header = json.dumps({"top_k": top_k, "records_digest": "r", "inputs_digest": inputs_digest})
        (path / "data/token_labels/header.json").write_text(header)
        (path / "data/token_labels/enabled/true").write_text(hashlib.sha256(header.encode()).hexdigest())
        (path / "data/token_labels/log_probs.npy").write_bytes(labels)
        outs = [{"path": "data/token_labels", "md5": f"{hashlib.md5(header.encode() + labels).hexdigest()}.dir"}]
        (path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"token_labels": {"outs": outs}}}))
        return path

    labels = store_project("labels", "code-a", b"labels")
    moved = compare(labels, store_project("moved", "code-b", b"labels"))
    assert moved.returncode == 0 and "identical but the code's fingerprint" in moved.stdout, moved.stdout
    relabelled = compare(labels, store_project("relabelled", "code-b", b"other labels"))
    assert relabelled.returncode == 1 and "DIFFERS: enabled/true, header.json, log_probs.npy" in relabelled.stdout
    fewer = compare(labels, store_project("fewer", "code-b", b"labels", top_k=3))
    assert fewer.returncode == 1 and "DIFFERS: enabled/true, header.json |" in fewer.stdout, fewer.stdout


def test_imports_are_followed_through_modules_packages_and_function_bodies():
    files = relative(provenance.code_files(ROOT / "stages/pretrain.py"))
    # Imported by modules the script imports (not by the script), and package __init__ files on the way.
    for module in ("training/losses.py", "config.py", "distributed.py", "data/records.py", "labels/targets.py",
                   "__init__.py", "data/__init__.py", "labels/__init__.py", "training/__init__.py"):
        assert f"src/coarse2fine/{module}" in files
    # loaders.py imports its backends inside a function.
    assert "src/coarse2fine/data/dali_backend.py" in relative(provenance.code_files(ROOT / "stages/evaluate.py"))
    # Nothing the stage cannot run: convert never imports the trainer.
    assert "src/coarse2fine/training/train.py" not in relative(provenance.code_files(ROOT / "stages/convert.py"))


def test_the_fingerprint_changes_with_the_code_the_process_imports(tmp_path):
    """Computed in a copy of the tree, as a `dvc exp run` copy computes it: a change there changes it."""
    def fingerprint(tree: Path) -> dict:
        program = "import json, sys; from coarse2fine import provenance; print(json.dumps(provenance.fingerprint(sys.argv[1])))"
        result = subprocess.run(
            [sys.executable, "-c", program, str(tree / "stages/pretrain.py")],
            env={"PYTHONPATH": str(tree / "src")}, capture_output=True, text=True, check=True, timeout=120,
        )
        return yaml.safe_load(result.stdout)

    tree = tmp_path / "tree"
    for name in ("stages", "src"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    before = fingerprint(tree)
    assert before["code"] == provenance.fingerprint(ROOT / "stages/pretrain.py")["code"]
    assert before["version.torch"] and before["version.timm"]
    with open(tree / "src/coarse2fine/training/losses.py", "a") as losses:
        losses.write("\nSMOOTHING_FLOOR = 0.0\n")
    assert fingerprint(tree)["code"] != before["code"]
