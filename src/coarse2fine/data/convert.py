"""The convert stage: a source tree -> sharded TFRecords + indices + classes.json + manifest.json.

Shards go round-robin to ranks; a rank's process pool reads each file of a shard once, checks it and makes the
bytes to store, while the rank writes them in record order: a JPEG that decodes and is baseline/progressive RGB
or greyscale passes through byte for byte; other images PIL can decode are re-encoded as RGB JPEG; empty,
truncated or undecodable files are skipped with a reason. (At ImageNet's size, ~140 GB on NFS, a check pass
before the writing pass read everything twice.)

Which file gets which index depends on which files are skipped (train is shuffled among the usable files, and
a skipped file moves every index after it), and only decoding every file tells. So the first pass takes every
listed file as usable; a rank that meets one that is not stops writing (it still checks the rest), and a
second pass writes the shards without the skipped files, reading the others again: only a source with
unusable files pays a second read. Which file gets which index, and every byte written, depend only on the
source and params, never on the number of ranks or workers.
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
    """A listed file and the verdict on it (`action` None until a read has checked it)."""

    split: str
    file: SourceFile
    action: Literal["copy", "convert", "skip"] | None = None
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
        checked = [Checked(split, file) for split in records.SPLITS for file in source.files[split]]
        with _worker_pool(data.convert_workers) as map_:
            while True:  # until a pass meets no unusable file: twice at most, unless files vanish meanwhile
                ordered = _record_order(checked, params.seed)
                _require_usable(ordered, checked, source, params)
                shards, verdicts = _write_shards(ordered, source.root, params, runtime, out_dir, map_)
                verdict_of = {verdict.file: verdict for verdict in verdicts}
                checked = [verdict_of.get(item.file, item) for item in checked]
                unusable = sum(verdict.action == "skip" for verdict in verdicts)
                if not unusable:
                    break
                if runtime.is_main:
                    print(f"convert: {unusable} file(s) cannot be used; writing the shards without them", flush=True)
    manifest = _manifest(source, params, checked, shards)
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


def _stored(root: Path, quality: int, item: Checked) -> tuple[Checked, bytes | None]:
    """From one read of a file, in a pool worker: its verdict and the JPEG bytes to store (None for a skip).

    Reading in the workers keeps that many reads in flight (what NFS, latency-bound, needs); sending the bytes
    back to the writer is a memory copy.
    """
    verdict, data = _read(root, item)
    if verdict.action == "copy":
        return verdict, data
    if verdict.action == "convert":
        return verdict, _reencoded(data, quality)
    return verdict, None


def _check_file(root: Path, item: Checked) -> Checked:
    """A file's verdict, without the bytes to store: an earlier pass's, or from reading it now."""
    return item if item.action else _read(root, item)[0]


def _read(root: Path, item: Checked) -> tuple[Checked, bytes]:
    """A file's bytes and the verdict on them: `item`'s own if an earlier pass checked it, else decided now."""
    try:
        data = (root / item.file.path).read_bytes()
    except OSError as error:
        return dataclasses.replace(item, action="skip", reason=f"unreadable: {error.strerror}"), b""
    return (item if item.action else _checked(item, data)), data


def _checked(item: Checked, data: bytes) -> Checked:
    if not data:
        return dataclasses.replace(item, action="skip", reason="empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            # A JPEG decodes at 1/8 scale (libjpeg DCT scaling): all its entropy-coded data is still decoded, so
            # truncation and decoder errors surface as in a full-size decode, at about 2/3 of the cost. (Other
            # formats ignore the draft.) It does not change the mode; it does shrink image.size, read above.
            image.draft(None, (1, 1))
            image.load()  # decodes all the data: Image.open alone reads only the header and misses truncation
            action = "copy" if _passes_through(image, data) else "convert"
            return dataclasses.replace(item, action=action, width=width, height=height)
    except UnidentifiedImageError:  # its message names a memory address; keep the manifest reproducible
        return dataclasses.replace(item, action="skip", reason="not an image PIL can read")
    except DECODE_ERRORS as error:
        return dataclasses.replace(item, action="skip", reason=f"cannot decode: {type(error).__name__}: {error}")


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
    """Per split, the files not known to be unusable, in record-index order: val as listed (by class, then path),
    train shuffled.

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
) -> tuple[list[records.ShardInfo], list[Checked]]:
    """One pass over this rank's shards (round-robin to ranks); returns every rank's ShardInfo, in split and shard
    order, and the verdicts on every file in `ordered`.

    An unusable file moves every index after it, so the rank writes nothing more in this pass (it is all written
    again) but still checks the rest of its files: the next pass then knows every verdict.
    """
    jobs = [(split, shard) for split in records.SPLITS for shard in range(_num_shards(params, split))]
    mine = jobs[runtime.rank :: runtime.world_size]
    bounds = {split: _shard_bounds(len(ordered[split]), _num_shards(params, split)) for split in records.SPLITS}
    total = sum(bounds[split][shard + 1] - bounds[split][shard] for split, shard in mine)
    store = functools.partial(_stored, root, params.data.jpeg_quality)
    check = functools.partial(_check_file, root)
    written: list[records.ShardInfo] = []
    verdicts: list[Checked] = []
    writing = True
    with progress(total=total, desc="write", unit="img", disable=not runtime.is_main) as bar:
        for split, shard in mine:
            first, end = bounds[split][shard], bounds[split][shard + 1]
            items = ordered[split][first:end]
            if writing:
                stored = map_(store, items)
                examples = (
                    records.example(
                        image=image,
                        label=verdict.file.label,
                        index=index,
                        height=verdict.height,
                        width=verdict.width,
                        path=verdict.file.path,
                    )
                    for index, (verdict, image) in enumerate(_until_unusable(stored, verdicts), first)
                )
                info = records.write_shard(out_dir, split, shard, _num_shards(params, split), first, examples)
                verdicts.extend(verdict for verdict, _ in stored)  # the files after one that ended the shard early
                writing = info.count == len(items)
                written.append(info)
            else:
                verdicts.extend(map_(check, items))
            bar.update(len(items))
    everyone = distributed.all_gather_objects((written, verdicts))
    shards = [info for part, _ in everyone for info in part]
    shards.sort(key=lambda info: (records.SPLITS.index(info.split), info.first_index))
    return shards, [verdict for _, part in everyone for verdict in part]


def _until_unusable(
    stored: Iterator[tuple[Checked, bytes | None]], verdicts: list[Checked]
) -> Iterator[tuple[Checked, bytes]]:
    """`stored` up to its first unusable file; each verdict taken from it (that file's too) goes to `verdicts`."""
    for verdict, image in stored:
        verdicts.append(verdict)
        if image is None:
            return
        yield verdict, image


def _reencoded(data: bytes, quality: int) -> bytes:
    """An RGB JPEG re-encoding of a checked image file's bytes."""
    with Image.open(io.BytesIO(data)) as image:
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
    shards: list[records.ShardInfo],
) -> dict[str, Any]:
    splits = {}
    for split in records.SPLITS:
        listed = [item for item in checked if item.split == split]
        unreadable = [Skipped(item.file.path, item.reason) for item in listed if item.action == "skip"]
        skipped = sorted(source.skipped[split] + unreadable, key=lambda item: item.path)
        actions = collections.Counter(item.action for item in listed)
        per_class = collections.Counter(item.file.label for item in listed if item.action != "skip")
        splits[split] = {
            "images": actions["copy"] + actions["convert"],
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
