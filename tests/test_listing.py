"""The source listing (`coarse2fine.data.listing`), what every `dvc repro` pays for first: an image added, removed
or replaced changes it, an unchanged tree gives the same bytes, the same images at another path copied with new
times give the same bytes too (reading each file once: its content hash is kept), and its digest is the documented
stream (a change of the stream would reconvert every user's records once, for nothing); params paths resolve
against the DVC project (`files.project_path`), so a relative `data.root` is found from an experiment's copy too."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from coarse2fine.data import listing
from coarse2fine.files import project_path
from conftest import make_params


def write_tree(root: Path, per_class: int = 3) -> Path:
    for split in ("train", "val"):
        for name in ("cat", "dog", "owl"):
            (root / split / name).mkdir(parents=True)
            for k in range(per_class):
                (root / split / name / f"{k:02d}.jpg").write_bytes(bytes(k + 1))
    return root


@pytest.fixture(autouse=True)
def hash_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own cache of content hashes (as another machine's or user's)."""
    cache = tmp_path / "cache" / "file_hashes.sqlite"
    monkeypatch.setenv(listing.HASH_CACHE_ENV, str(cache))
    return cache


def reference_digest(root: Path) -> str:
    """The digest as the listing documents it, written the plain way: sorted relative paths, size, content md5."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*"), key=lambda path: path.relative_to(root).parts):
        relative = path.relative_to(root)
        if path.is_dir() or any(part.startswith(".") for part in relative.parts):
            continue
        content = hashlib.md5(path.read_bytes()).hexdigest()
        digest.update(f"{relative.as_posix()}\0{path.stat().st_size}\0{content}\n".encode())
    return digest.hexdigest()


def state(root: Path) -> dict:
    return listing.source_state(make_params(data={"source": "imagefolder", "root": str(root)}).data)


def test_the_digest_is_the_documented_stream_over_many_chunks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(listing, "STAT_CHUNK", 4)  # 18 files in 5 chunks, over 16 threads: the order must hold
    root = write_tree(tmp_path / "tree")
    (root / "train" / "cat" / "sub").mkdir()
    (root / "train" / "cat" / "sub" / "deep.jpg").write_bytes(b"deep")
    (root / "train" / "cat" / "a-file-before-sub.jpg").write_bytes(b"x")
    listed = state(root)
    assert listed["digest"] == reference_digest(root)
    assert listed["files"] == {"train": 11, "val": 9}
    assert listed["bytes"] == 2 * 3 * (1 + 2 + 3) + 4 + 1


@pytest.mark.parametrize("change", ["add", "remove", "replace", "hidden"])
def test_a_changed_tree_changes_the_listing_and_a_hidden_file_does_not(tmp_path: Path, change: str) -> None:
    root = write_tree(tmp_path / "tree")
    before = state(root)
    assert state(root) == before  # unchanged: the same bytes, every later stage stays cached
    image = root / "val" / "owl" / "01.jpg"
    if change == "add":
        (root / "val" / "owl" / "new.jpg").write_bytes(b"new")
    elif change == "remove":
        image.unlink()
    elif change == "replace":  # the same size, another content and time (a re-download)
        image.write_bytes(b"\x07\x07")
        os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 1_000_000))
    else:
        (root / "val" / "owl" / ".DS_Store").write_bytes(b"finder")
    assert (state(root) == before) == (change == "hidden")


def test_the_same_images_elsewhere_with_new_times_list_the_same_and_each_file_is_read_once(
    tmp_path: Path, monkeypatch
) -> None:
    """A colleague's copy (another path, copied without its modification times) lists as the original does, so
    convert's input, and DVC's run cache of it, are the same; a listing with nothing new reads no file."""
    monkeypatch.setattr(listing, "HASH_CHUNK", 4)  # the cache read in range scans of 4 paths: none missed
    root = write_tree(tmp_path / "tree")
    reads = []
    md5 = listing._md5
    monkeypatch.setattr(listing, "_md5", lambda path: reads.append(path) or md5(path))
    before = state(root)
    assert len(reads) == 18
    assert state(root) == before and len(reads) == 18  # the cached hashes: nothing read again
    copy = shutil.copytree(root, tmp_path / "elsewhere" / "copy", copy_function=shutil.copyfile)
    assert (copy / "val/owl/01.jpg").stat().st_mtime_ns != (root / "val/owl/01.jpg").stat().st_mtime_ns
    assert state(copy) == before and len(reads) == 36  # the copy's files read once each
    (copy / "val/owl/01.jpg").write_bytes(b"\x09\x09")  # its bytes changed: detected
    assert state(copy) != before


def test_a_relative_data_root_is_the_dvc_project_s(tmp_path: Path, monkeypatch) -> None:
    project = tmp_path / "project"
    write_tree(project / "data" / "images")
    elsewhere = tmp_path / "project" / ".dvc" / "tmp" / "exps" / "tmp123"  # where a temporary experiment runs
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("DVC_ROOT", str(project))  # as DVC sets it for an experiment's stages: the queuing project
    listed = listing.source_state(make_params(data={"source": "imagefolder", "root": "data/images"}).data)
    assert listed["files"] == {"train": 9, "val": 9} and "root" not in listed  # where is not what
    assert project_path("/abs/weights.pt") == Path("/abs/weights.pt")
    monkeypatch.delenv("DVC_ROOT")
    assert project_path("data/images") == Path("data/images")  # outside DVC: the working directory


def test_an_unusable_hash_cache_is_one_warning_and_the_same_listing(tmp_path: Path, monkeypatch, capsys) -> None:
    root = write_tree(tmp_path / "tree")
    before = state(root)
    unusable = tmp_path / "not-a-database"
    unusable.write_bytes(b"garbage" * 100)
    monkeypatch.setenv(listing.HASH_CACHE_ENV, str(unusable))
    assert state(root) == before
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"source: WARNING: the content hash cache {unusable} is not usable (")
