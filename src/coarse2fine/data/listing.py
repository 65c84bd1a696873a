"""What the pipeline reads from outside the repository, cheaply enough to check at every `dvc repro` (the
`source` stage): convert's images and the training stages' weights files (mode import, init_weights).

For an ImageFolder: every visible file under the data root by its path relative to the root, its size and a hash
of its content, all hashed: not the root's own path, nor the files' modification times, so the same images at
another path, or copied with new times (another clone, another machine, a colleague's copy), give the same listing
and DVC's run cache can match across them. The content hashes are kept per machine (`file_hashes`, as DVC's own
state database keeps its hashes) by path, size, modification time and inode: a repro with nothing changed stats
every file and reads none, a new or changed file is read once. For digits: scikit-learn's version
(the images are generated from its load_digits; the rest is in convert's params); for photos, likewise
scikit-image's version. convert depends on the
result, so an image added, removed or replaced reruns convert and what follows; an unchanged tree gives the
same bytes and leaves every stage cached. A training stage's weights file (<stage>.mode import, or its
init_weights) is judged the same way, by its path as the params give it, its size and its content hash, so
replacing it reruns that stage and what follows, and a copy of it with new times does not; and so is
the directory of imported token labels (token_labels.mode import), every file listed like an image folder's, so
a changed label set reruns token_labels and what follows. When no student learns from token labels, their
listing says so (mode "unused") and nothing else: token_labels reruns when that flips, and only then.
Kept free of heavy imports (no torch): it runs on every repro.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import sqlite3
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from coarse2fine.config import Data, Params, Train
from coarse2fine.errors import UserError
from coarse2fine.files import project_path

# Threads that stat an image folder's files, and files a thread stats at a time (see _tree_state).
LISTING_THREADS, STAT_CHUNK = 16, 2048
# Cached content hashes read at a time (see _cached_hashes).
HASH_CHUNK = 65536
# Where the content hashes are kept: this path, else $XDG_CACHE_HOME (~/.cache)/coarse2fine/file_hashes.sqlite.
HASH_CACHE_ENV = "COARSE2FINE_HASH_CACHE"


def source_state(data: Data) -> dict[str, Any]:
    if data.source == "digits":
        return {"kind": "digits", "scikit-learn": importlib.metadata.version("scikit-learn")}
    if data.source == "photos":
        return {"kind": "photos", "scikit-image": importlib.metadata.version("scikit-image")}
    root = project_path(data.root)
    if not root.is_dir():
        raise UserError(f"data.root: {root}: data root not found (expected train/<class>/ and val/<class>/ folders)")
    return {"kind": "imagefolder", **_tree_state(root)}


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
    (content,) = content_hashes(
        os.path.realpath(path.parent), [path.name], [(stat.st_size, stat.st_mtime_ns, stat.st_ino)]
    )
    return {"path": name, "bytes": stat.st_size, "md5": content}


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
    """Files per top-level folder, their total bytes, and a digest of every file's relative path, size and content
    hash.

    The names come from one directory read per folder (2,000 for ImageNet); the stats, one per file, from
    LISTING_THREADS threads in chunks: on NFS a stat is a round trip to the server (0.1-1 ms), and threads keep
    many in flight (a stat releases the GIL). Paths stay strings: Path objects per file cost more than the stat.
    """
    names = _visible_files(str(root), "")
    chunks = [names[start : start + STAT_CHUNK] for start in range(0, len(names), STAT_CHUNK)]
    with ThreadPoolExecutor(LISTING_THREADS) as pool:
        stats = [stat for part in pool.map(functools.partial(_stat_all, str(root)), chunks) for stat in part]
    hashes = content_hashes(os.path.realpath(root), names, stats)
    digest = hashlib.sha256()
    counts: dict[str, int] = {}
    for name, (size, _, _), content in zip(names, stats, hashes):
        digest.update(f"{name}\0{size}\0{content}\n".encode("utf-8", "surrogateescape"))
        top = name.partition("/")[0]
        counts[top] = counts.get(top, 0) + 1
    return {"files": counts, "bytes": sum(size for size, _, _ in stats), "digest": digest.hexdigest()}


def hash_cache() -> Path:
    if os.environ.get(HASH_CACHE_ENV):
        return Path(os.environ[HASH_CACHE_ENV])
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home, "coarse2fine", "file_hashes.sqlite")


def content_hashes(root: str, names: Sequence[str], stats: Sequence[tuple[int, int, int]]) -> list[str]:
    """The md5 of each file `root`/name, from the hash cache where its size, modification time and inode are the
    ones cached, else read (LISTING_THREADS threads) and cached."""
    paths = [f"{root}/{name}" for name in names]
    cache = hash_cache()
    try:
        return _cached_hashes(cache, root, paths, stats)
    except (sqlite3.Error, OSError) as error:  # a read-only or full home, a damaged file: read all, keep none
        print(f"source: WARNING: the content hash cache {cache} is not usable ({error}): every image is read at "
              f"every repro; set {HASH_CACHE_ENV} to a writable file", flush=True)
        with ThreadPoolExecutor(LISTING_THREADS) as pool:
            return list(pool.map(_md5, paths))


def _cached_hashes(cache: Path, root: str, paths: list[str], stats: Sequence[tuple[int, int, int]]) -> list[str]:
    cache.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(cache, timeout=300)) as db:
        db.execute("CREATE TABLE IF NOT EXISTS hashes "
                   "(path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, inode INTEGER, md5 TEXT)")
        hashes: list[str | None] = [None] * len(paths)
        # The cached rows in range scans of the primary key, HASH_CHUNK paths (in sorted order) at a time: a tenth
        # of the time of looking the paths up one by one, and a bounded dict where ImageNet's would hold 1.33 M.
        order = sorted(range(len(paths)), key=paths.__getitem__)
        for start in range(0, len(order), HASH_CHUNK):
            chunk = order[start : start + HASH_CHUNK]
            rows = db.execute("SELECT path, size, mtime_ns, inode, md5 FROM hashes WHERE path >= ? AND path <= ?",
                              (paths[chunk[0]], paths[chunk[-1]]))
            known = {path: (size, mtime_ns, inode, md5) for path, size, mtime_ns, inode, md5 in rows}
            for k in chunk:
                cached = known.get(paths[k])
                if cached is not None and cached[:3] == tuple(stats[k]):
                    hashes[k] = cached[3]
        missing = [k for k, found in enumerate(hashes) if found is None]
        with ThreadPoolExecutor(LISTING_THREADS) as pool:
            for k, content in zip(missing, pool.map(_md5, (paths[k] for k in missing))):
                hashes[k] = content
        with db:
            db.executemany("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?)",
                           [(paths[k], *stats[k], hashes[k]) for k in missing])
    return hashes


def _md5(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "md5").hexdigest()


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


def _stat_all(root: str, names: list[str]) -> list[tuple[int, int, int]]:
    stats = []
    for name in names:
        stat = os.stat(f"{root}/{name}")
        stats.append((stat.st_size, stat.st_mtime_ns, stat.st_ino))
    return stats
