"""DVC's cache at ImageNet's size: no second copy of an output on disk (.dvc/config: cache.type hardlink,symlink),
in the workspace and in an experiment's copy (`dvc exp run --temp`, as `--queue` runs them), and a relative
`data.root` that only the project holds (git- and DVC-ignored) is found from that copy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import Project


def image_tree(root: Path) -> None:
    from PIL import Image

    for split, count in (("train", 6), ("val", 2)):
        for name, colour in (("cat", "white"), ("dog", "black")):
            (root / split / name).mkdir(parents=True)
            for k in range(count):
                Image.new("RGB", (16, 16), colour).save(root / split / name / f"{k}.jpg")


@pytest.mark.slow
def test_outputs_have_one_copy_on_disk_in_the_workspace_and_in_an_experiment_s_copy(tmp_path: Path) -> None:
    project = Project(tmp_path / "project")
    image_tree(project.path / "data" / "images")
    for ignore in (".gitignore", ".dvcignore"):
        with open(project.path / ignore, "a", encoding="utf-8") as file:
            file.write("/data/images/\n")
    project.edit_params({"data": {"source": "imagefolder", "root": "data/images", "subset": 1.0}})
    project.commit("an image folder inside the project, relative")
    project.repro("convert")
    project.commit("converted")

    records = project.path / "data" / "records"
    shard = next(records.glob("train-*.tfrecord"))
    # The workspace's file is the cache's (3 links where two outputs have the same bytes: the two train indices).
    assert all(path.stat().st_nlink >= 2 for path in records.iterdir())
    cache = project.path / ".dvc" / "cache"
    outputs = {path.stat().st_ino for path in records.iterdir()}
    cached = [path for path in cache.rglob("*") if path.is_file()]
    assert outputs <= {path.stat().st_ino for path in cached}
    # Besides the outputs' own inodes, only DVC's metadata: the directory's listing, the run cache's entry and its
    # copy of the uncached metrics file (a few hundred bytes).
    metrics = (project.path / "metrics" / "convert" / "metrics.json").read_bytes()
    extra = [path for path in cached if path.stat().st_ino not in outputs]
    assert all(
        path.suffix == ".dir" or path.relative_to(cache).parts[0] == "runs" or path.read_bytes() == metrics
        for path in extra
    ), extra

    links = []  # the shard's link count while the experiment runs: 3 once its copy links the shard too
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            links.append(shard.stat().st_nlink)
            done.wait(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # A temporary copy under .dvc/tmp/exps/ (what --queue's workers run in): it holds no data/images, so the
        # source listing finds it through DVC_ROOT; convert is cached, its records checked out from the cache.
        result = project.run("dvc", "exp", "run", "--temp", "convert")
    finally:
        done.set()
        watcher.join()
    assert "Running stage 'convert'" not in result.stdout
    assert max(links) == shard.stat().st_nlink + 1, sorted(set(links))
    # A change of convert's params in a copy: convert runs there, reading the images through the relative root.
    result = project.run("dvc", "exp", "run", "--temp", "convert", "-S", "data.val_shards=2")
    assert "Running stage 'convert'" in result.stdout
