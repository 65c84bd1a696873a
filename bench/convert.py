"""Convert-stage throughput: the library's conversion of an ImageFolder of JPEGs (one rank, data.convert_workers
processes) against a raw copy of the same tree (shutil.copytree), with and without fsyncs.

All variants read the same tree (synthetic photo-like 500x375 JPEGs unless --imagefolder names a real one) and
write into a fresh directory each repeat; outputs are deleted between runs, untimed. Nothing is dropped from the
page cache: after the warm-up run the source is read from memory. Convert fsyncs every file it writes, renames it
into place and fsyncs its directory (files.atomic_path), so the goal's baseline is a copy as durable: "raw copy +
fsync" fsyncs every file it writes and every directory it makes. The copy without fsync ("raw copy") leaves its
writes in the page cache, for the kernel to write back later, and shows what the disk costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from pathlib import Path

from _common import (
    add_common_arguments,
    add_tiny_argument,
    goal,
    header_line,
    imagefolder_params,
    interleaved,
    markdown_table,
    photo_tree,
    run_convert,
    tiny_sizes,
    tree_stats,
    workspace,
    write_json,
)

GOAL_VS_COPY = 0.5  # conversion at least half the throughput of a raw copy as durable as its output
SAME_WORK_COPY = "raw copy + fsync"
TINY_IMAGES = 20  # the fewest that leave train images: val takes at least 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=int, default=1500, metavar="N", help="synthetic images, train + val (default: 1500)"
    )
    parser.add_argument("--convert-workers", type=int, default=2, metavar="N", help="data.convert_workers (default: 2)")
    add_common_arguments(parser, repeats=5)
    add_tiny_argument(parser, f"--images {TINY_IMAGES} (10 train, 10 val), 1 repeat")
    args = parser.parse_args()
    tiny_sizes(parser, args, images=TINY_IMAGES, repeats=1)
    return args


def copy_and_fsync(source: str, destination: str) -> None:
    """shutil.copy2, then fsync the copy: each file on disk before the next, as atomic_path does for convert."""
    shutil.copy2(source, destination)
    with open(destination, "rb+") as copied:
        os.fsync(copied.fileno())


def durable_copytree(source: Path, destination: Path) -> None:
    """shutil.copytree, every file fsynced as it is copied, then every directory made (their entries durable)."""
    shutil.copytree(source, destination, copy_function=copy_and_fsync)
    for directory in [destination, *(path for path in destination.rglob("*") if path.is_dir())]:
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work:
        val_images = max(10, args.images // 30)
        tree = args.imagefolder or photo_tree(work, train_images=args.images - val_images, val_images=val_images)
        files, size = tree_stats(tree)
        params = imagefolder_params(tree, args.convert_workers)
        out = work / "out"

        def convert() -> int:
            run_convert(params, out / "records")
            return files

        def copy() -> int:
            shutil.copytree(tree, out / "copy")
            return files

        def durable_copy() -> int:
            durable_copytree(tree, out / "copy")
            return files

        variants = {"convert": convert, SAME_WORK_COPY: durable_copy, "raw copy": copy}
        rates = interleaved(variants, args.repeats, before=lambda: shutil.rmtree(out, ignore_errors=True))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    rows = [
        [
            name,
            f"{medians[name]:.0f}",
            f"{medians[name] * size / files / 1e6:.0f}",
            f"{medians[name] / medians[SAME_WORK_COPY]:.2f}x",
            f"{medians[name] / medians['raw copy']:.2f}x",
            f"{min(values):.0f}-{max(values):.0f}",
        ]
        for name, values in rates.items()
    ]
    ratio = medians["convert"] / medians[SAME_WORK_COPY]
    text = "\n".join(
        [
            header_line(),
            "",
            f"{files} files, {size / 1e6:.0f} MB ({tree.name}); convert: 1 rank x {args.convert_workers} workers; "
            f"median of {args.repeats} interleaved runs after a warm-up run each.",
            "",
            markdown_table(
                ["variant", "img/s (median)", "MB/s", f"x {SAME_WORK_COPY}", "x raw copy", "img/s range"], rows
            ),
            "",
            "Goal: "
            + goal(f"convert >= {GOAL_VS_COPY}x {SAME_WORK_COPY}", ratio >= GOAL_VS_COPY, f"{ratio:.2f}x")
            + ".",
            "img/s and MB/s count the source tree's files and bytes. Page cache: nothing is dropped, so after the "
            "warm-up every variant reads the source from memory. Convert and the raw copy + fsync wait until what "
            "they write is on disk: convert fsyncs its few files (large shards, their indices, two JSON files) and "
            "their directory, the copy every image and every directory, a journal commit each. The raw copy does not wait: the kernel writes its data back in "
            "the background while later runs go on (with filesystem journal commits, the likely cause of its wide "
            "range); it is the bound on moving the bytes. The copies only move bytes; the converter also decodes "
            "every image to check it.",
        ]
    )
    print(text)
    raw = {
        "files": files, "bytes": size, "img_per_s": rates, "median_img_per_s": medians, "convert_vs_fsync_copy": ratio
    }
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
