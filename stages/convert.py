"""Convert the source images (params data.*) into TFRecord shards, DALI indices, classes.json and manifest.json.

Runs as `python stages/convert.py` or under `torchrun --nproc_per_node=N` (files and shards split across ranks).
"""

import argparse
import time
from pathlib import Path

from coarse2fine import cli, distributed
from coarse2fine.config import Params
from coarse2fine.data import records
from coarse2fine.data.convert import convert, totals
from coarse2fine.files import project_path, walked_by
from coarse2fine.tracking.runs import Tracker

# What this stage reads (as dvc.yaml lists it): data but its speed knob, convert_workers (the same bytes whatever
# the count), and data.root, whose images it reads through their listing (data/source.json: paths relative to the
# root and content hashes), so the same images at another path, a colleague's copy, reuse the converted records.
PARAM_SECTIONS = (
    "seed", "data.source", "data.digits", "data.photos", "data.subset", "data.train_shards", "data.val_shards",
    "data.jpeg_quality",
)


def main(params: Params, args: argparse.Namespace) -> None:
    out = Path(args.out)
    with distributed.session("cpu") as runtime:  # no GPU work: a gloo group (never nccl), even on a GPU node
        runtime.announce("convert")
        with Tracker("convert", params, runtime, metrics_dir=Path(args.metrics), param_sections=PARAM_SECTIONS) as tracker:
            started = time.perf_counter()
            manifest = convert(params, runtime, out)
            seconds = time.perf_counter() - started
            total = totals(manifest)
            tracker.log_summary({**total, "seconds": seconds, "images_per_second": total["images"] / seconds})
            for name in (records.MANIFEST_FILE, records.CLASSES_FILE):
                tracker.log_artifact(out / name)
            if params.data.source == "imagefolder":
                tracker.set_tag("data.root", params.data.root)  # where the images were, not what they are
        if params.data.source == "imagefolder" and runtime.is_main:
            if walking := walked_by(project_path(params.data.root)):
                walk = f"{' and '.join(walking)} walk" if len(walking) > 1 else f"{walking[0]} walks"
                print(f"convert: WARNING: data.root {params.data.root} is inside the project and {walk} its "
                      f"{total['images']:,} images at every command: add it to .gitignore and .dvcignore "
                      "(docs/scaling.md)", flush=True)


if __name__ == "__main__":
    parser = cli.stage_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/records", help="records directory (default: data/records)")
    parser.add_argument("--metrics", default="metrics/convert", help="metrics directory (default: metrics/convert)")
    cli.run(main, parser)
