"""Convert-stage throughput: the library's conversion of an ImageFolder of JPEGs (one rank, data.convert_workers
processes) against a raw copy of the same tree (shutil.copytree).

Both variants read the same tree (synthetic photo-like 500x375 JPEGs unless --imagefolder names a real one) and
write into a fresh directory each repeat; outputs are deleted between runs, untimed. Nothing is dropped from the
page cache: after the warm-up run the source is read from memory and writes land in the page cache (no fsync),
so the disk is mostly out of the picture, and the raw copy bounds any converter from above.
"""

from __future__ import annotations

import argparse
import shutil
import statistics

from _common import (
    add_common_arguments,
    goal,
    header_line,
    imagefolder_params,
    interleaved,
    markdown_table,
    photo_tree,
    run_convert,
    tree_stats,
    workspace,
    write_json,
)

GOAL_VS_COPY = 0.5  # conversion at least half the raw copy's throughput


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--images", type=int, default=1500, metavar="N", help="synthetic images, train + val (default: 1500)"
    )
    parser.add_argument("--convert-workers", type=int, default=2, metavar="N", help="data.convert_workers (default: 2)")
    add_common_arguments(parser, repeats=5)
    return parser.parse_args()


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

        variants = {"convert": convert, "raw copy": copy}
        rates = interleaved(variants, args.repeats, before=lambda: shutil.rmtree(out, ignore_errors=True))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    rows = [
        [
            name,
            f"{medians[name]:.0f}",
            f"{medians[name] * size / files / 1e6:.0f}",
            f"{medians[name] / medians['raw copy']:.2f}x",
            f"{min(values):.0f}-{max(values):.0f}",
        ]
        for name, values in rates.items()
    ]
    ratio = medians["convert"] / medians["raw copy"]
    text = "\n".join(
        [
            header_line(),
            "",
            f"{files} files, {size / 1e6:.0f} MB ({tree}); convert: 1 rank x {args.convert_workers} workers; "
            f"median of {args.repeats} interleaved runs after a warm-up run each.",
            "",
            markdown_table(["variant", "img/s (median)", "MB/s", "x raw copy", "img/s range"], rows),
            "",
            "Goal: " + goal(f"convert >= {GOAL_VS_COPY}x raw copy", ratio >= GOAL_VS_COPY, f"{ratio:.2f}x") + ".",
            "img/s and MB/s count the source tree's files and bytes. Page cache: nothing is dropped, so after the "
            "warm-up both variants read the source from memory; neither syncs its writes, which the kernel writes "
            "back in the background while later runs go on (with filesystem journal commits, the likely cause of "
            "the raw copy's wide range). The raw copy is the kernel moving bytes; the converter also decodes every "
            "image to check it.",
        ]
    )
    print(text)
    raw = {"files": files, "bytes": size, "img_per_s": rates, "median_img_per_s": medians, "convert_vs_copy": ratio}
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
