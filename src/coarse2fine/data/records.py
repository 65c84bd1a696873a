"""The TFRecord layout the convert stage writes and the loaders read (docs/contracts.md, "Records").

`records_dir/` holds `{split}-{i:05d}-of-{n:05d}.tfrecord` + `.idx` (the DALI / tfrecord index) per shard,
`classes.json` and `manifest.json`. The manifest is written last: it is the marker of a finished conversion,
and it lists the shards, so readers never pick up a stale shard of an earlier run. `ShardReader` reads any
record by its position (the torch loader, token-label generation).
"""

from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import json
import os
import resource
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from tfrecord import example_pb2
from tfrecord.reader import extract_feature_dict, tfrecord_loader
from tfrecord.writer import TFRecordWriter

from coarse2fine.errors import UserError
from coarse2fine.files import atomic_path

SPLITS = ("train", "val")
CLASSES_FILE = "classes.json"
MANIFEST_FILE = "manifest.json"
# The tfrecord package's description of one record (one tf.train.Example per image).
FEATURES = {"image": "byte", "label": "int", "index": "int", "height": "int", "width": "int", "path": "byte"}


@dataclass(frozen=True)
class ShardInfo:
    """One written shard, as the manifest lists it."""

    split: str
    file: str
    index_file: str
    first_index: int
    count: int
    bytes: int
    sha256: str


def shard_stem(split: str, shard: int, num_shards: int) -> str:
    return f"{split}-{shard:05d}-of-{num_shards:05d}"


def example(*, image: bytes, label: int, index: int, height: int, width: int, path: str) -> dict[str, tuple[Any, str]]:
    """One record in the form TFRecordWriter takes; `path` is relative to the source root."""
    return {
        "image": (image, "byte"),
        "label": (label, "int"),
        "index": (index, "int"),
        "height": (height, "int"),
        "width": (width, "int"),
        "path": (path.encode("utf-8"), "byte"),
    }


class _ShardWriter(TFRecordWriter):
    """Writes a shard and, in the same pass, its index lines and sha256: the shard is never read back.

    Byte-identical to TFRecordWriter.write + tfrecord's create_index over the file, but deterministic:
    TFRecordWriter.write serialises the Example's feature map in hash order, and upb seeds that hash per
    process, so the same record came out with its features in a different order on every run. Re-serialising
    with deterministic=True sorts the map. The framing is TFRecordWriter.write's (with its masked CRC); an index
    line is create_index's "offset length" of the framed record.
    """

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self.index_lines: list[str] = []
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write_example(self, datum: dict[str, tuple[Any, str]]) -> None:
        unordered = TFRecordWriter.serialize_tf_example(datum)
        record = example_pb2.Example.FromString(unordered).SerializeToString(deterministic=True)
        length = struct.pack("<Q", len(record))
        framed = length + self.masked_crc(length) + record + self.masked_crc(record)
        self.file.write(framed)
        self.sha256.update(framed)
        self.index_lines.append(f"{self.bytes} {len(framed)}\n")
        self.bytes += len(framed)


def write_shard(
    records_dir: Path, split: str, shard: int, num_shards: int, first_index: int, examples: Iterable[dict]
) -> ShardInfo:
    """Write one shard and its index (each atomically); `examples` come from `example()`. The count, size and
    sha256 it returns are taken while writing."""
    stem = shard_stem(split, shard, num_shards)
    tfrecord_path, index_path = records_dir / f"{stem}.tfrecord", records_dir / f"{stem}.idx"
    # One file after the other, so that a failed write names its own file; the manifest, written last, is what
    # makes a shard and its index part of the records.
    with atomic_path(tfrecord_path) as temporary_tfrecord:
        writer = _ShardWriter(temporary_tfrecord)
        try:
            for datum in examples:
                writer.write_example(datum)
        finally:
            writer.close()
    with atomic_path(index_path) as temporary_index:
        temporary_index.write_text("".join(writer.index_lines), encoding="ascii")
    return ShardInfo(
        split, tfrecord_path.name, index_path.name, first_index, len(writer.index_lines), writer.bytes,
        writer.sha256.hexdigest(),
    )


def clear(records_dir: Path) -> None:
    """Remove a previous conversion's outputs (manifest first, so a half-cleared dir reads as unconverted)."""
    (records_dir / MANIFEST_FILE).unlink(missing_ok=True)
    (records_dir / CLASSES_FILE).unlink(missing_ok=True)
    for split in SPLITS:
        for suffix in ("tfrecord", "idx"):
            for path in records_dir.glob(f"{split}-*-of-*.{suffix}"):
                path.unlink()


def read_manifest(records_dir: str | Path) -> dict:
    return _read_json(Path(records_dir), MANIFEST_FILE)


def manifest_digest(records_dir: str | Path) -> str:
    """Identifies the records: the manifest lists every shard's sha256."""
    return hashlib.sha256(json.dumps(read_manifest(records_dir), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class SplitSummary:
    """What a run read, for its MLflow dataset entry: a name, the records' digest and the image count."""

    name: str
    digest: str
    images: int


def split_summary(records_dir: str | Path, split: str) -> SplitSummary:
    """`split` of the records in `records_dir`, named after where the images came from (e.g. "digits train")."""
    manifest = read_manifest(records_dir)
    origin = manifest["source"]
    name = f"{Path(origin['root']).name if 'root' in origin else origin['kind']} {split}"
    if manifest["settings"]["subset"] < 1:
        name += f" (subset {manifest['settings']['subset']:g})"
    digest = hashlib.sha256(json.dumps(manifest["splits"][split]["shards"], sort_keys=True).encode()).hexdigest()
    return SplitSummary(name, digest[:12], manifest["splits"][split]["images"])


def read_classes(records_dir: str | Path) -> list[str]:
    """Class names; position = label."""
    return _read_json(Path(records_dir), CLASSES_FILE)


def _read_json(records_dir: Path, name: str) -> Any:
    path = records_dir / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{records_dir}: no converted records ({name} missing); run the convert stage first") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path}: not valid JSON ({error}); run the convert stage again") from None


def shard_files(records_dir: str | Path, split: str) -> list[tuple[Path, Path]]:
    """(tfrecord, index) per shard of `split`, in index order, as the manifest lists them.

    Each index must have one line per record of its shard: DALI reads exactly the records an index lists, so a
    truncated one would drop records without a word. Each shard must have the size it was written with: a shard cut
    short (a disk filled, a copy stopped) or replaced after conversion would fail deep inside DALI, or read other
    records. (Its sha256 is in the manifest too, but reading every shard at every start costs minutes on ImageNet.)
    """
    records_dir = Path(records_dir)
    pairs = []
    for shard in read_manifest(records_dir)["splits"][split]["shards"]:
        tfrecord, index = records_dir / shard["file"], records_dir / shard["index_file"]
        for path in (tfrecord, index):
            if not path.is_file():
                raise UserError(
                    f"{path}: listed in {records_dir / MANIFEST_FILE} but missing; run the convert stage again"
                )
        if (size := tfrecord.stat().st_size) != shard["bytes"]:
            raise UserError(
                f"{tfrecord}: {size} bytes, but written with {shard['bytes']} ({records_dir / MANIFEST_FILE}): cut "
                f"short or replaced since; run the convert stage again (dvc repro -f convert)"
            )
        entries = index.read_bytes().count(b"\n")
        if entries != shard["count"]:
            raise UserError(
                f"{index}: {entries} entries for the {shard['count']} records of {tfrecord.name}; "
                f"run the convert stage again"
            )
        pairs.append((tfrecord, index))
    return pairs


def read_shard(tfrecord_path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of one shard in file order, as plain Python values (path decoded to str).

    Reads without the index on purpose: tfrecord_loader given an index but no `shard` starts at a random record.
    """
    for record in tfrecord_loader(str(tfrecord_path), None, FEATURES):
        numbers = {key: int(record[key][0]) for key, kind in FEATURES.items() if kind == "int"}
        yield {"image": record["image"], "path": record["path"].decode("utf-8"), **numbers}


# The tfrecord package's own names for the FEATURES kinds (example_loader's mapping).
TFRECORD_KINDS = {"byte": "bytes_list", "float": "float_list", "int": "int64_list"}
# A TFRecord frame: length (uint64 little-endian), its masked CRC (4 bytes), the Example, the Example's CRC.
FRAME_HEADER, FRAME_FOOTER = 12, 4


# At most this many shards open at once in each reading process (every DataLoader worker is one): ImageNet's 1,024
# train shards, all open in each of 8 workers, passed the common soft limit of 1,024 open files ("Too many open
# files"). Reads that stay in a shard (token-label generation's consecutive records) never reopen one; a permutation
# over every record (the torch backend's train order) reopens on most reads: an open + close is ~5 us on a local disk
# (bench/results/scale_*), one round trip to the server on NFS.
MAX_OPEN_SHARDS = 64
# What else a reading process holds open: Python's and the libraries' own files (about 20 seen), and in a DataLoader's
# main process a few pipes per worker (45 in all seen with 4 workers and 16 batches in flight).
OPEN_FILES_BESIDE_SHARDS, OPEN_FILES_PER_WORKER = 32, 4


def require_open_file_limit(workers: int, key: str) -> None:
    """One line naming the limit and `key` (the workers asked for) when the process's soft open-file limit cannot
    hold what a ShardReader process and its DataLoader (`workers` processes) may keep open; raising the soft limit is
    the user's call (ulimit -n), not ours."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = MAX_OPEN_SHARDS + OPEN_FILES_BESIDE_SHARDS + OPEN_FILES_PER_WORKER * workers
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise UserError(
            f"{key}: {workers} workers reading the records need up to {needed} open files a process, but the "
            f"open-file limit is {soft} (ulimit -n); raise it (ulimit -n {max(1024, needed)}) or lower {key}"
        )


class ShardReader:
    """Record k of shard s by position: the indices are read once (here); the files are opened as they are read, at
    most MAX_OPEN_SHARDS at once per process (the least recently read is closed first)."""

    def __init__(self, shards: list[tuple[Path, Path]]):
        self.paths = [str(tfrecord) for tfrecord, _ in shards]
        # Per shard, (offset, length) of each whole frame, as the convert stage's index lists them.
        self.frames = [np.loadtxt(index, dtype=np.int64, ndmin=2) for _, index in shards]
        # Position of each shard's first record in the split (records are numbered across shards in order).
        self.first_positions = list(itertools.accumulate((len(frames) for frames in self.frames), initial=0))
        self._files: OrderedDict[int, io.FileIO] = OrderedDict()  # shard -> its open file, least recently read first
        self._pid = os.getpid()  # the process that opened _files: a forked worker closes its copies, opens its own

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": OrderedDict(), "_pid": -1}  # open files do not pickle (spawned workers)

    def __len__(self) -> int:
        return self.first_positions[-1]

    def read_position(self, position: int) -> dict:
        """The record at `position` of the split (shards in order)."""
        shard = bisect.bisect_right(self.first_positions, position) - 1
        return self.read(shard, position - self.first_positions[shard])

    def read(self, shard: int, k: int) -> dict:
        """The record as the tfrecord package decodes it (ints as 1-element int64 arrays, bytes as bytes)."""
        offset, length = (int(value) for value in self.frames[shard][k])
        frame = os.pread(self._file(shard).fileno(), length, offset)
        (size,) = struct.unpack_from("<Q", frame)
        if len(frame) != length or size != length - FRAME_HEADER - FRAME_FOOTER:
            raise RuntimeError(f"{self.paths[shard]}: record {k} at byte {offset} does not match its index entry")
        example = example_pb2.Example.FromString(frame[FRAME_HEADER:-FRAME_FOOTER])
        return extract_feature_dict(example.features, FEATURES, TFRECORD_KINDS)

    def open_files(self) -> int:
        return len(self._files)

    def _file(self, shard: int) -> io.FileIO:
        if self._pid != os.getpid():  # a forked worker: the parent's files are copies here, and count against its limit
            self.close()
            self._pid = os.getpid()
        file = self._files.get(shard)
        if file is not None:
            self._files.move_to_end(shard)
            return file
        if len(self._files) >= MAX_OPEN_SHARDS:
            self._files.popitem(last=False)[1].close()
        file = self._files[shard] = open(self.paths[shard], "rb", buffering=0)
        return file

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()
