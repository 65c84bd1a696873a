"""The TFRecord layout the convert stage writes and the loaders read (docs/contracts.md, "Records").

`records_dir/` holds `{split}-{i:05d}-of-{n:05d}.tfrecord` + `.idx` (the DALI / tfrecord index) per shard,
`classes.json` and `manifest.json`. The manifest is written last: it is the marker of a finished conversion,
and it lists the shards, so readers never pick up a stale shard of an earlier run.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from tfrecord import example_pb2
from tfrecord.reader import tfrecord_loader
from tfrecord.tools.tfrecord2idx import create_index
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


class _DeterministicWriter(TFRecordWriter):
    # TFRecordWriter.write serialises the Example's feature map in hash order, and upb seeds that hash per
    # process: the same record came out with its features in a different order on every run. Re-serialising
    # with deterministic=True sorts the map, so equal inputs give byte-identical shards. The framing below is
    # TFRecordWriter.write's, with its masked CRC.
    def write_example(self, datum: dict[str, tuple[Any, str]]) -> None:
        unordered = TFRecordWriter.serialize_tf_example(datum)
        record = example_pb2.Example.FromString(unordered).SerializeToString(deterministic=True)
        length = struct.pack("<Q", len(record))
        self.file.write(length + self.masked_crc(length) + record + self.masked_crc(record))


def write_shard(
    records_dir: Path, split: str, shard: int, num_shards: int, first_index: int, examples: Iterable[dict]
) -> ShardInfo:
    """Write one shard and its index (each atomically); `examples` come from `example()`."""
    stem = shard_stem(split, shard, num_shards)
    tfrecord_path, index_path = records_dir / f"{stem}.tfrecord", records_dir / f"{stem}.idx"
    count = 0
    with atomic_path(tfrecord_path) as temporary_tfrecord, atomic_path(index_path) as temporary_index:
        writer = _DeterministicWriter(str(temporary_tfrecord))
        try:
            for datum in examples:
                writer.write_example(datum)
                count += 1
        finally:
            writer.close()
        create_index(str(temporary_tfrecord), str(temporary_index))
        with open(temporary_tfrecord, "rb") as file:
            sha256 = hashlib.file_digest(file, "sha256").hexdigest()
        size = temporary_tfrecord.stat().st_size
    return ShardInfo(split, tfrecord_path.name, index_path.name, first_index, count, size, sha256)


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
    """(tfrecord, index) per shard of `split`, in index order, as the manifest lists them."""
    records_dir = Path(records_dir)
    shards = read_manifest(records_dir)["splits"][split]["shards"]
    pairs = [(records_dir / shard["file"], records_dir / shard["index_file"]) for shard in shards]
    for path in (path for pair in pairs for path in pair):
        if not path.is_file():
            raise UserError(f"{path}: listed in {records_dir / MANIFEST_FILE} but missing; run the convert stage again")
    return pairs


def read_shard(tfrecord_path: str | Path) -> Iterator[dict[str, Any]]:
    """The records of one shard in file order, as plain Python values (path decoded to str).

    Reads without the index on purpose: tfrecord_loader given an index but no `shard` starts at a random record.
    """
    for record in tfrecord_loader(str(tfrecord_path), None, FEATURES):
        numbers = {key: int(record[key][0]) for key, kind in FEATURES.items() if kind == "int"}
        yield {"image": record["image"], "path": record["path"].decode("utf-8"), **numbers}
