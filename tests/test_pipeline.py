"""The whole pipeline under real DVC in a temporary git repository: caching, reruns, experiments, sources."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow

# Small but real: enough updates to learn (10 epochs x 13 updates of 32 digits), on few images to keep
# each full run short. The LR follows the linear scaling rule: 0.032 x 32 / 1024 = 1e-3.
FAST = {
    "data": {"subset": 0.3},
    "pretrain": {"epochs": 10, "batch_size": 32, "optimizer": {"lr_base": 0.032}},
}


def merge(base: dict, change: dict) -> dict:
    for key, value in change.items():
        if isinstance(value, dict):
            merge(base.setdefault(key, {}), value)
        else:
            base[key] = value
    return base


class Project:
    def __init__(self, path: Path):
        self.path = path
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "DVC_NO_ANALYTICS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_TRACKING_URI": f"sqlite:///{path / 'mlflow.db'}",
        }

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(args, cwd=self.path, env=self.env, capture_output=True, text=True, timeout=900)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def repro(self) -> set[str]:
        """Run `dvc repro`; return the stages that actually ran."""
        output = self.run("dvc", "repro").stdout
        return set(re.findall(r"Running stage '([\w-]+)'", output))

    def edit_params(self, change: dict) -> None:
        path = self.path / "params.yaml"
        path.write_text(yaml.safe_dump(merge(yaml.safe_load(path.read_text()), change), sort_keys=False))

    def metrics(self, stage: str) -> dict:
        return json.loads((self.path / "metrics" / stage / "metrics.json").read_text())


@pytest.fixture
def project(tmp_path) -> Project:
    """A fresh clone-like copy of the project (git + DVC initialised), with fast params."""
    path = tmp_path / "project"
    path.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(ROOT / name, path / name)
    for name in ("stages", "src"):
        shutil.copytree(ROOT / name, path / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / ".dvc", path / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
    project = Project(path)
    project.edit_params(FAST)
    project.run("git", "init", "-q")
    project.run("git", "add", "-A")
    project.run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return project


def test_repro_caches_and_reruns_only_what_a_change_affects(project):
    assert project.repro() == {"convert", "pretrain", "evaluate"}
    evaluated = project.metrics("evaluate")
    assert evaluated["top1"] >= 90.0, evaluated  # chance is 10 %
    assert evaluated["n"] == json.loads((project.path / "data/records/manifest.json").read_text())["splits"]["val"]["images"]

    assert project.repro() == set()  # a second run is a no-op

    project.edit_params({"evaluate": {"crop_pct": 0.875}})
    assert project.repro() == {"evaluate"}

    project.edit_params({"pretrain": {"label_smoothing": 0.0}})
    assert project.repro() == {"pretrain", "evaluate"}

    shown = json.loads(project.run("dvc", "metrics", "show", "--json").stdout)
    assert shown  # dvc sees the declared metrics files

    # An experiment with one knob changed, as a user runs it; it sees the same cache.
    project.run("git", "add", "-A")
    project.run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "params")
    output = project.run("dvc", "exp", "run", "-S", "evaluate.batch_size=128").stdout
    assert set(re.findall(r"Running stage '([\w-]+)'", output)) == {"evaluate"}


def write_image_tree(root: Path) -> None:
    """A small ImageFolder of digits-like images: 3 classes, JPEG and PNG mixed, one broken file."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    for split, count in (("train", 40), ("val", 12)):
        for label in (0, 1, 7):
            folder = root / split / f"class {label}"
            folder.mkdir(parents=True)
            images = digits.images[digits.target == label]
            for i in rng.choice(len(images), count, replace=False):
                pixels = (images[i] * 255 / 16).astype(np.uint8)
                image = Image.fromarray(pixels).resize((32, 32), Image.Resampling.BICUBIC).convert("RGB")
                suffix = ".png" if i % 3 == 0 else ".jpg"
                image.save(folder / f"{i}{suffix}")
    (root / "train" / "class 0" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")


def test_same_pipeline_on_an_imagefolder(project, tmp_path):
    write_image_tree(tmp_path / "images")
    project.edit_params({
        "data": {"source": "imagefolder", "root": str(tmp_path / "images"), "subset": 1.0},
        "pretrain": {"batch_size": 16, "optimizer": {"lr_base": 0.064}},  # 120 images: 7 updates/epoch
    })
    assert project.repro() == {"convert", "pretrain", "evaluate"}
    manifest = json.loads((project.path / "data/records/manifest.json").read_text())
    assert manifest["splits"]["train"]["images"] == 120
    assert [item["reason"] for item in manifest["splits"]["train"]["skipped"]]  # the broken file, with a reason
    assert json.loads((project.path / "data/records/classes.json").read_text()) == ["class 0", "class 1", "class 7"]
    assert project.metrics("evaluate")["n"] == 36
    assert project.metrics("evaluate")["top1"] > 60.0  # chance is 33 %
