"""The convert stage: a source tree -> sharded TFRecords + indices + classes.json + manifest.json.

Phase 1 checks every file, split across ranks and, within a rank, across a process pool: a JPEG that
decodes and is baseline/progressive RGB or greyscale passes through byte for byte; other images PIL can
decode are re-encoded as RGB JPEG; empty, truncated or undecodable files are skipped with a reason.
Phase 2 writes the shards, split across ranks. Which file gets which index, and every byte written,
depend only on the source and params, never on the number of ranks or workers.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import multiprocessing
import random
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from PIL import Image, UnidentifiedImageError

from coarse2fine import distributed
from coarse2fine.config import Params
from coarse2fine.data import records, sources
from coarse2fine.data.sources import Skipped, Source, SourceFile
from coarse2fine.distributed import Runtime
from coarse2fine.errors import UserError
from coarse2fine.files import write_json
from coarse2fine.progress import progress

PASS_THROUGH_MODES = frozenset({"RGB", "L"})
# JPEG frame types (SOFn marker byte) every decoder takes: baseline, extended sequential, progressive.
# Lossless, hierarchical and arithmetic-coded JPEGs are re-encoded even when PIL reads them.
PASS_THROUGH_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
NOT_FRAME_MARKERS = frozenset({0xC4, 0xC8, 0xCC})  # DHT, JPG, DAC share the 0xC0-0xCF range with the SOFn
CHUNK_SIZE = 16  # files per task sent to a pool worker: fewer round trips, still a smooth progress bar
# What PIL raises for bad image data: OSError (truncated data, decoder errors), SyntaxError (broken headers and
# chunks), ValueError and EOFError (some format plugins), DecompressionBombError. A file that raises one is
# skipped; anything else (a bug, MemoryError) stops the run.
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


@dataclass(frozen=True)
class Checked:
    """Phase 1's verdict on one file."""

    split: str
    file: SourceFile
    action: Literal["copy", "convert", "skip"]
    width: int = 0
    height: int = 0
    reason: str = ""


def convert(params: Params, runtime: Runtime, out_dir: Path) -> dict[str, Any]:
    """Convert the images params.data describes into `out_dir`; every rank calls this. Returns the manifest."""
    started = time.perf_counter()
    data = params.data
    # The scratch dir holds the written-out digits (each rank its own copy: cheap, and no shared disk needed).
    with tempfile.TemporaryDirectory(prefix="coarse2fine-source-") as scratch:
        source = sources.open_source(data, params.seed, Path(scratch))
        if runtime.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            records.clear(out_dir)  # a stale shard of an earlier run must not survive next to the new ones
        distributed.barrier()
        with _worker_pool(data.convert_workers) as map_:
            checked = _check_all(source, runtime, map_)
            ordered = _record_order(checked, params.seed)
            _require_usable(ordered, checked, source, params)
            shards = _write_shards(ordered, source.root, params, runtime, out_dir, map_)
    manifest = _manifest(source, params, checked, ordered, shards)
    if runtime.is_main:
        write_json(out_dir / records.CLASSES_FILE, list(source.classes))
        write_json(out_dir / records.MANIFEST_FILE, manifest)  # last: it marks the conversion complete
        print(_summary(manifest, time.perf_counter() - started, runtime, data.convert_workers, out_dir), flush=True)
    return manifest


@contextlib.contextmanager
def _worker_pool(workers: int) -> Iterator[Callable[[Callable, Iterable], Iterator]]:
    """An ordered, lazy `map` over `workers` processes (plain `map` for one worker)."""
    if workers == 1:
        yield map
        return
    # fork: the workers only run PIL, and forking spares each of them re-importing torch.
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        yield functools.partial(_imap, pool)


def _imap(pool: Pool, function: Callable, items: Iterable) -> Iterator:
    return pool.imap(function, items, chunksize=CHUNK_SIZE)


def _check_all(source: Source, runtime: Runtime, map_: Callable) -> list[Checked]:
    """Phase 1 on this rank's contiguous slice of all files; returns every rank's verdicts in file order."""
    items = [(split, file) for split in records.SPLITS for file in source.files[split]]
    start, end = (len(items) * rank // runtime.world_size for rank in (runtime.rank, runtime.rank + 1))
    mine = items[start:end]
    check = functools.partial(_check_file, source.root)
    checked = progress(map_(check, mine), total=len(mine), desc="check", unit="img", disable=not runtime.is_main)
    return [verdict for part in distributed.all_gather_objects(list(checked)) for verdict in part]


def _check_file(root: Path, item: tuple[str, SourceFile]) -> Checked:
    split, file = item
    try:
        data = (root / file.path).read_bytes()
    except OSError as error:
        return Checked(split, file, "skip", reason=f"unreadable: {error.strerror}")
    if not data:
        return Checked(split, file, "skip", reason="empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            # A JPEG decodes at 1/8 scale (libjpeg DCT scaling): all its entropy-coded data is still decoded, so
            # truncation and decoder errors surface as in a full-size decode, at about 2/3 of the cost. (Other
            # formats ignore the draft.) It does not change the mode; it does shrink image.size, read above.
            image.draft(None, (1, 1))
            image.load()  # decodes all the data: Image.open alone reads only the header and misses truncation
            action = "copy" if _passes_through(image, data) else "convert"
            return Checked(split, file, action, width, height)
    except UnidentifiedImageError:  # its message names a memory address; keep the manifest reproducible
        return Checked(split, file, "skip", reason="not an image PIL can read")
    except DECODE_ERRORS as error:
        return Checked(split, file, "skip", reason=f"cannot decode: {type(error).__name__}: {error}")


def _passes_through(image: Image.Image, data: bytes) -> bool:
    return (
        image.format == "JPEG"
        and image.mode in PASS_THROUGH_MODES
        and _jpeg_frame_marker(data) in PASS_THROUGH_FRAMES
    )


def _jpeg_frame_marker(data: bytes) -> int | None:
    """The SOFn marker byte of a JPEG (0xC0 baseline, 0xC2 progressive, ...): PIL parses it but does not keep it.

    Walks the marker segments after SOI (FF D8) so an EXIF thumbnail's own SOF inside APP1 is not mistaken.
    """
    position = 2
    while position + 4 <= len(data) and data[position] == 0xFF:
        marker = data[position + 1]
        if marker == 0xFF:  # fill byte before a marker
            position += 1
        elif 0xC0 <= marker <= 0xCF and marker not in NOT_FRAME_MARKERS:
            return marker
        else:
            position += 2 + int.from_bytes(data[position + 2 : position + 4], "big")
    return None


def _record_order(checked: list[Checked], seed: int) -> dict[str, list[Checked]]:
    """Per split, the good files in record-index order: val as listed (by class, then path), train shuffled.

    Shuffling train once here (seeded) makes every shard, and every reader's shuffle buffer, class-mixed.
    """
    good = [item for item in checked if item.action != "skip"]
    ordered = {split: [item for item in good if item.split == split] for split in records.SPLITS}
    random.Random(seed).shuffle(ordered["train"])
    return ordered


def _require_usable(ordered: dict[str, list[Checked]], checked: list[Checked], source: Source, params: Params) -> None:
    """Every class needs a readable image in each split, and each shard at least one record."""
    for split, items in ordered.items():
        for label in sorted(set(range(len(source.classes))) - {item.file.label for item in items}):
            example = next(item for item in checked if item.split == split and item.file.label == label)
            folder = source.root / split / source.classes[label]
            raise UserError(f"{folder}: no readable images (e.g. {example.file.path}: {example.reason})")
        num_shards = _num_shards(params, split)
        if len(items) < num_shards:
            raise UserError(
                f"data.{split}_shards: {num_shards} shards for only {len(items)} {split} images; use at most {len(items)}"
            )


def _num_shards(params: Params, split: str) -> int:
    return {"train": params.data.train_shards, "val": params.data.val_shards}[split]


def _shard_bounds(count: int, num_shards: int) -> list[int]:
    """Shard i holds record indices [bounds[i], bounds[i + 1]): contiguous, sizes differ by at most one."""
    return [count * shard // num_shards for shard in range(num_shards + 1)]


def _write_shards(
    ordered: dict[str, list[Checked]], root: Path, params: Params, runtime: Runtime, out_dir: Path, map_: Callable
) -> list[records.ShardInfo]:
    """Phase 2: shards go round-robin to ranks; returns every rank's ShardInfo, in split and shard order."""
    jobs = [(split, shard) for split in records.SPLITS for shard in range(_num_shards(params, split))]
    mine = jobs[runtime.rank :: runtime.world_size]
    bounds = {split: _shard_bounds(len(ordered[split]), _num_shards(params, split)) for split in records.SPLITS}
    total = sum(bounds[split][shard + 1] - bounds[split][shard] for split, shard in mine)
    written = []
    with progress(total=total, desc="write", unit="img", disable=not runtime.is_main) as bar:
        for split, shard in mine:
            first, end = bounds[split][shard], bounds[split][shard + 1]
            items = ordered[split][first:end]
            examples = (
                records.example(
                    image=image,
                    label=item.file.label,
                    index=index,
                    height=item.height,
                    width=item.width,
                    path=item.file.path,
                )
                for index, item, image in zip(range(first, end), items, _stored_images(items, root, params, map_))
            )
            info = records.write_shard(out_dir, split, shard, _num_shards(params, split), first, examples)
            bar.update(info.count)
            written.append(info)
    everyone = [info for part in distributed.all_gather_objects(written) for info in part]
    return sorted(everyone, key=lambda info: (records.SPLITS.index(info.split), info.first_index))


def _stored_images(items: list[Checked], root: Path, params: Params, map_: Callable) -> Iterator[bytes]:
    """The JPEG bytes stored for each checked file, in order: the file itself, read here (sending it through a
    pool worker costs more than reading it), or its RGB re-encoding from the pool."""
    reencode = functools.partial(_reencoded, root, params.data.jpeg_quality)
    reencoded = map_(reencode, [item for item in items if item.action == "convert"])
    for item in items:
        yield (root / item.file.path).read_bytes() if item.action == "copy" else next(reencoded)


def _reencoded(root: Path, quality: int, item: Checked) -> bytes:
    """An RGB JPEG re-encoding of a checked file."""
    with Image.open(root / item.file.path) as image:
        encoded = io.BytesIO()
        on_white_rgb(image).save(encoded, "JPEG", quality=quality)  # libjpeg output is deterministic
        return encoded.getvalue()


def on_white_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels (alpha, or a palette's transparent entry) composited on white, not black."""
    if not image.has_transparency_data:
        return image.convert("RGB")
    canvas = Image.new("RGBA", image.size, "white")
    canvas.alpha_composite(image.convert("RGBA"))
    return canvas.convert("RGB")


def _manifest(
    source: Source,
    params: Params,
    checked: list[Checked],
    ordered: dict[str, list[Checked]],
    shards: list[records.ShardInfo],
) -> dict[str, Any]:
    splits = {}
    for split in records.SPLITS:
        unreadable = [
            Skipped(item.file.path, item.reason) for item in checked if item.split == split and item.action == "skip"
        ]
        skipped = sorted(source.skipped[split] + unreadable, key=lambda item: item.path)
        actions = collections.Counter(item.action for item in ordered[split])
        per_class = collections.Counter(item.file.label for item in ordered[split])
        splits[split] = {
            "images": len(ordered[split]),
            "passed_through": actions["copy"],
            "converted": actions["convert"],
            "per_class": {name: per_class[label] for label, name in enumerate(source.classes)},
            "shards": [
                {key: value for key, value in dataclasses.asdict(info).items() if key != "split"}
                for info in shards
                if info.split == split
            ],
            "skipped": [dataclasses.asdict(item) for item in skipped],
        }
    return {
        "source": source.description,
        "settings": {"seed": params.seed, "subset": params.data.subset, "jpeg_quality": params.data.jpeg_quality},
        "classes": list(source.classes),
        "splits": splits,
    }


def totals(manifest: dict[str, Any]) -> dict[str, float]:
    """Counts over both splits, as logged to MLflow and printed in the summary line."""
    splits = manifest["splits"]
    counts = {f"images_{split}": splits[split]["images"] for split in records.SPLITS}
    return {
        **counts,
        "images": sum(counts.values()),
        "skipped": sum(len(split["skipped"]) for split in splits.values()),
        "megabytes": sum(shard["bytes"] for split in splits.values() for shard in split["shards"]) / 1e6,
    }


def _summary(manifest: dict[str, Any], seconds: float, runtime: Runtime, workers: int, out_dir: Path) -> str:
    total = totals(manifest)
    counts = " + ".join(f"{total[f'images_{split}']} {split}" for split in records.SPLITS)
    return (
        f"convert: {counts} images -> {out_dir}, {total['skipped']} files skipped (see {records.MANIFEST_FILE}), "
        f"{total['megabytes']:.1f} MB written, {total['images'] / seconds:.0f} img/s "
        f"({runtime.world_size} rank(s) x {workers} worker(s))"
    )
