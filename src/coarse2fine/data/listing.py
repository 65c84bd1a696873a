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

import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any, Iterator

from coarse2fine.config import Data, Params, Train
from coarse2fine.errors import UserError


def source_state(data: Data) -> dict[str, Any]:
    if data.source == "digits":
        return {"kind": "digits", "scikit-learn": importlib.metadata.version("scikit-learn")}
    if data.source == "photos":
        return {"kind": "photos", "scikit-image": importlib.metadata.version("scikit-image")}
    root = Path(data.root)
    if not root.is_dir():
        raise UserError(f"data.root: {root}: data root not found (expected train/<class>/ and val/<class>/ folders)")
    return {"kind": "imagefolder", "root": str(root), **_tree_state(root)}


def weights_state(stage: str, cfg: Train) -> dict[str, Any]:
    """A training stage's weights file, if it reads one: its model (mode import) or where training starts
    (init_weights)."""
    if cfg.mode == "import":
        return {"mode": "import", **_file_state(f"{stage}.weights", cfg.weights)}
    if cfg.init_weights:
        return {"mode": "train", "init_weights": _file_state(f"{stage}.init_weights", cfg.init_weights)}
    return {"mode": "train"}


def _file_state(key: str, name: str) -> dict[str, Any]:
    path = Path(name)
    if not path.is_file():
        raise UserError(f"{key}: {path}: weights file not found")
    stat = path.stat()
    return {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def token_labels_state(params: Params) -> dict[str, Any]:
    token_labels = params.token_labels
    if not params.token_labels_needed:
        return {"mode": "unused"}
    if token_labels.mode == "generate":
        return {"mode": "generate"}
    root = Path(token_labels.import_dir)
    if not root.is_dir():
        raise UserError(f"token_labels.import_dir: {root}: directory not found (the reference's <class>/<image>.pt files)")
    state = _tree_state(root)
    state["files"] = sum(state["files"].values())  # one count: ImageNet's would list 1000 class folders
    return {"mode": "import", "root": str(root), **state}


def _tree_state(root: Path) -> dict[str, Any]:
    """Files per top-level folder, their total bytes, and a digest of every file's path, size and mtime."""
    digest = hashlib.sha256()
    counts: dict[str, int] = {}
    total_bytes = 0
    for path, stat in _visible_files(root):
        relative = path.relative_to(root)
        digest.update(f"{relative.as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        counts[relative.parts[0]] = counts.get(relative.parts[0], 0) + 1
        total_bytes += stat.st_size
    return {"files": counts, "bytes": total_bytes, "digest": digest.hexdigest()}


def _visible_files(directory: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Files under `directory` whose path has no hidden (dot) part, recursively, in sorted order."""
    for entry in sorted(os.scandir(directory), key=lambda entry: entry.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            yield from _visible_files(Path(entry.path))
        else:
            yield Path(entry.path), entry.stat()
