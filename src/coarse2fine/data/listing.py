"""What the pipeline reads from outside the repository, cheaply enough to check at every `dvc repro` (the
`source` stage): convert's images and the training stages' weights files (mode import, init_weights).

For an ImageFolder: every visible file under the data root with its size and modification time (a stat per
file, nothing read), hashed, as make and rsync judge a file changed. For digits: scikit-learn's version
(the images are generated from its load_digits; the rest is in convert's params); for photos, likewise
scikit-image's version. convert depends on the
result, so an image added, removed or replaced reruns convert and what follows; an unchanged tree gives the
same bytes and leaves every stage cached. A training stage's weights file (<stage>.mode import, or its
init_weights) is judged the same way, by its path, size and modification time, so replacing it reruns that stage
and what follows; and so is
the directory of imported token labels (token_labels.mode import), every file listed like an image folder's, so
a changed label set reruns token_labels and what follows. When no student learns from token labels, their
listing says so (mode "unused") and nothing else: token_labels reruns when that flips, and only then.
Kept free of heavy imports (no torch): it runs on every repro.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coarse2fine.config import Data, Params, Train
from coarse2fine.errors import UserError
from coarse2fine.files import project_path

# Threads that stat an image folder's files, and files a thread stats at a time (see _tree_state).
LISTING_THREADS, STAT_CHUNK = 16, 2048


def source_state(data: Data) -> dict[str, Any]:
    if data.source == "digits":
        return {"kind": "digits", "scikit-learn": importlib.metadata.version("scikit-learn")}
    if data.source == "photos":
        return {"kind": "photos", "scikit-image": importlib.metadata.version("scikit-image")}
    root = project_path(data.root)
    if not root.is_dir():
        raise UserError(f"data.root: {root}: data root not found (expected train/<class>/ and val/<class>/ folders)")
    return {"kind": "imagefolder", "root": data.root, **_tree_state(root)}


def weights_state(stage: str, cfg: Train) -> dict[str, Any]:
    """A training stage's weights file, if it reads one: its model (mode import) or where training starts
    (init_weights)."""
    if cfg.mode == "import":
        return {"mode": "import", **_file_state(f"{stage}.weights", cfg.weights)}
    if cfg.init_weights:
        return {"mode": "train", "init_weights": _file_state(f"{stage}.init_weights", cfg.init_weights)}
    return {"mode": "train"}


def _file_state(key: str, name: str) -> dict[str, Any]:
    path = project_path(name)
    if not path.is_file():
        raise UserError(f"{key}: {path}: weights file not found")
    stat = path.stat()
    return {"path": name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def token_labels_state(params: Params) -> dict[str, Any]:
    token_labels = params.token_labels
    if not params.token_labels_needed:
        return {"mode": "unused"}
    if token_labels.mode == "generate":
        return {"mode": "generate"}
    root = project_path(token_labels.import_dir)
    if not root.is_dir():
        raise UserError(f"token_labels.import_dir: {root}: directory not found (the reference's <class>/<image>.pt files)")
    state = _tree_state(root)
    state["files"] = sum(state["files"].values())  # one count: ImageNet's would list 1000 class folders
    return {"mode": "import", "root": token_labels.import_dir, **state}


def _tree_state(root: Path) -> dict[str, Any]:
    """Files per top-level folder, their total bytes, and a digest of every file's path, size and mtime.

    The names come from one directory read per folder (2,000 for ImageNet); the stats, one per file, from
    LISTING_THREADS threads in chunks: on NFS a stat is a round trip to the server (0.1-1 ms), and threads keep
    many in flight (a stat releases the GIL). Paths stay strings: Path objects per file cost more than the stat.
    """
    names = _visible_files(str(root), "")
    chunks = [names[start : start + STAT_CHUNK] for start in range(0, len(names), STAT_CHUNK)]
    with ThreadPoolExecutor(LISTING_THREADS) as pool:
        stats = [stat for part in pool.map(functools.partial(_stat_all, str(root)), chunks) for stat in part]
    digest = hashlib.sha256()
    counts: dict[str, int] = {}
    for name, (size, mtime_ns) in zip(names, stats):
        digest.update(f"{name}\0{size}\0{mtime_ns}\n".encode("utf-8", "surrogateescape"))
        top = name.partition("/")[0]
        counts[top] = counts.get(top, 0) + 1
    return {"files": counts, "bytes": sum(size for size, _ in stats), "digest": digest.hexdigest()}


def _visible_files(directory: str, prefix: str) -> list[str]:
    """Paths (relative, "/"-separated) of the files under `directory` with no hidden (dot) part, recursively, in
    sorted order: a sort per directory, folders among files by name. A folder is told by the directory entry's
    type, with no stat."""
    names = []
    with os.scandir(directory) as entries:
        visible = sorted((entry for entry in entries if not entry.name.startswith(".")), key=lambda entry: entry.name)
    for entry in visible:
        if entry.is_dir():
            names += _visible_files(entry.path, f"{prefix}{entry.name}/")
        else:
            names.append(prefix + entry.name)
    return names


def _stat_all(root: str, names: list[str]) -> list[tuple[int, int]]:
    stats = []
    for name in names:
        stat = os.stat(f"{root}/{name}")
        stats.append((stat.st_size, stat.st_mtime_ns))
    return stats
