"""The recipe's two halves, ablated as DVC experiments on real photographs: ground truth vs token labels, with
and without MixToken, coarse-to-fine (pre-train at 48 px, fine-tune at 64) vs direct (train at 64 px only).

The data set is `data.source: photos` (patches of the 18 photographs scikit-image ships, 1080 train / 270 val:
see coarse2fine.data.sources.write_photos), where the digits' 99 % ceiling cannot hide an effect. A project copy
in a fresh git repository gets the photos settings below, then one `dvc exp run` per row in its workspace, each
naming every ablated key, so the stages a row does not change (convert, teacher) are reused from the first row;
token_labels runs the teacher once, for the first row with token labels (a ground-truth row empties the store,
and DVC's run cache restores the teacher's store for the next token-label row). Both students get the same epochs:
coarse-to-fine 60 + 10, direct 70.
Each row: the evaluate stage's top-1 of the model the row ends with, the training compute (images x pixels seen
by the students: epochs x train images x side^2, in Gpx) and the students' training wall time.
With --timm-repo (a timm source checkout, as bench/peer.py takes it) one more row: timm's train.py training the
same tiny VOLO directly at 64 px for the direct rows' epochs with the project's default settings (bench/peer.py
lists them), on the same patches written as PNG files (the project reads them re-encoded as JPEG); its wall time
is the whole train.py run, validation included, as the stages' is.

`--set KEY=VALUE ...` adds params to every DVC row, to measure one more knob; a kept `--workdir` run again at the
same seed reuses its project copy, so such a run costs only the students.

Run: python bench/ablation.py [--rows NAME ...] [--seed N] [--set KEY=VALUE ...] [--timm-repo DIR]
[--workdir DIR [--refresh-params]] (see --help); make ablation runs every DVC row (ABLATION_ARGS="--timm-repo DIR"
adds timm's).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from _common import (
    TINY_NEAR_EMPTY, ProjectCopy, add_tiny_argument, add_workdir_arguments, header_line, markdown_table, merge_params,
    project_copy, workspace, write_json,
)
from coarse2fine.config import Params, load_params
from coarse2fine.data import sources
from peer import run_timm

PHOTOS = {
    "data": {"source": "photos"},
    "teacher": {"img_size": 64},
    "pretrain": {"img_size": 48},
    "finetune": {"img_size": 64},
    "evaluate": {"pretrain": {"extra_sizes": [64]}, "finetune": {"extra_sizes": [48]}},
}
EPOCHS = {"coarse": 60, "fine": 10, "direct": 70}
# --tiny: bench/startup.py's near-empty copy (a tenth of the patches, a 1-epoch teacher: reused from a --workdir
# where startup.py --tiny ran, as the photos are the shipped data) and 1 + 1 student epochs, direct their sum.
TINY_EPOCHS = {"coarse": 1, "fine": 1, "direct": 2}


def row(token_labels: bool, mix_token: bool, coarse_to_fine: bool, epochs: dict[str, int]) -> list[str]:
    """`dvc exp run` arguments of one row: every ablated key set, and the last stage it needs."""
    settings = {
        "pretrain.img_size": 48 if coarse_to_fine else 64,
        "pretrain.epochs": epochs["coarse"] if coarse_to_fine else epochs["direct"],
        "finetune.epochs": epochs["fine"],
    }
    for stage in ("pretrain", "finetune"):
        settings[f"{stage}.token_label.enabled"] = token_labels
        settings[f"{stage}.token_label.mix_token"] = mix_token
    arguments = [f"-S={key}={str(value).lower()}" for key, value in settings.items()]
    return arguments + ["evaluate@finetune" if coarse_to_fine else "evaluate@pretrain"]


ROWS = {  # name -> row()'s token_labels, mix_token, coarse_to_fine
    "ground truth, coarse-to-fine": (False, False, True),
    "token labels + MixToken, coarse-to-fine (the recipe)": (True, True, True),
    "token labels, no MixToken, coarse-to-fine": (True, False, True),
    "ground truth, direct at 64 px": (False, False, False),
    "token labels + MixToken, direct at 64 px": (True, True, False),
}
TIMM_ROW = "timm train.py, ground truth, direct at 64 px"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=[*ROWS, TIMM_ROW], default=None, metavar="NAME",
                        help=f"rows to run, of: {'; '.join([*ROWS, TIMM_ROW])} (default: all; timm's with --timm-repo)")
    parser.add_argument("--timm-repo", type=Path, default=None, metavar="PATH",
                        help="a timm source checkout (the directory holding train.py): adds timm's row")
    add_workdir_arguments(parser, "the project copy")
    parser.add_argument("--seed", type=int, default=0,
                        help="params.yaml's seed for every row: it draws the photo patches, the split and the training")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", dest="extra_settings",
                        help="more params for every DVC row (dvc exp run -S), e.g. pretrain.token_label.mix_token=false: "
                             "a knob's effect is this run's rows against a run without it, at the same seed")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report and numbers here")
    add_tiny_argument(parser, "bench/startup.py's near-empty copy of the photos (data.subset 0.1, a 1-epoch teacher, "
                              "no extra evaluation sizes, no MLflow models; reused from a --workdir where startup.py --tiny ran), student "
                              f"epochs coarse-to-fine {TINY_EPOCHS['coarse']} + {TINY_EPOCHS['fine']}, direct "
                              f"{TINY_EPOCHS['direct']}")
    args = parser.parse_args()
    args.epochs = TINY_EPOCHS if args.tiny else EPOCHS
    if args.rows is None:
        args.rows = [*ROWS, TIMM_ROW] if args.timm_repo is not None else list(ROWS)
    if TIMM_ROW in args.rows and (args.timm_repo is None or not (args.timm_repo / "train.py").is_file()):
        parser.error(f"--timm-repo: the row {TIMM_ROW!r} needs a timm checkout with train.py")
    return args


def main() -> None:
    args = parse_args()
    results = {}
    with workspace(args.workdir) as work:
        copy_params = {**copy.deepcopy(PHOTOS), "seed": args.seed}
        project = project_copy(work, merge_params(copy_params, TINY_NEAR_EMPTY) if args.tiny else copy_params,
                               args.refresh_params)
        params = load_params(project.path / "params.yaml")
        train_images = params.data.photos.train_per_class * len(sources.PHOTOS)
        for name in args.rows:
            if name == TIMM_ROW:
                results[name] = run_timm_row(args.timm_repo, work, params, args.epochs)
            else:
                results[name] = run_row(project, name, args.extra_settings, args.epochs)
            print(f"{name}: top-1 {results[name]['top1']:.2f} %", flush=True)
    rows = [
        [name, f"{value['top1']:.2f}", f"{value['loss']:.3f}" if "loss" in value else "-", f"{value['gpx']:.2f}",
         f"{value['student_seconds']:.0f}"]
        for name, value in results.items()
    ]
    text = "\n".join([
        header_line(),
        f"photos ({train_images} train images"
        + (f" x data.subset {params.data.subset:g}" if params.data.subset < 1 else "")
        + f", seed {args.seed}), tiny VOLO student, epochs: coarse-to-fine "
        f"{args.epochs['coarse']} @ 48 px + {args.epochs['fine']} @ 64 px, direct {args.epochs['direct']} @ 64 px"
        + (f"; every DVC row with {' '.join(args.extra_settings)}" if args.extra_settings else ""),
        "",
        markdown_table(["run", "top-1 %", "val loss", "student compute (Gpx)", "student wall time (s)"], rows),
    ])
    print(text)
    write_json(args, text, {"results": results})


def run_row(project: ProjectCopy, name: str, extra_settings: list[str], epochs: dict[str, int]) -> dict:
    """One `dvc exp run` (the row's keys, then `extra_settings`): the evaluate stage's top-1 and loss, the students'
    compute and their stages' wall time."""
    arguments = row(*ROWS[name], epochs)
    extra = [f"-S={setting}" for setting in extra_settings]
    run = project.timed_dvc("exp", "run", "-n", _experiment_name(name), *arguments[:-1], *extra, arguments[-1])
    last = arguments[-1].split("@")[1]
    evaluation = json.loads((project.path / "metrics" / "evaluate" / last / "metrics.json").read_text())
    train_images = json.loads((project.path / "metrics" / "convert" / "metrics.json").read_text())["images_train"]
    settings = dict(argument[3:].split("=", 1) for argument in [*arguments[:-1], *extra])  # --set wins
    sides = [(int(settings["pretrain.img_size"]), int(settings["pretrain.epochs"]))]
    if last == "finetune":
        fine_side = int(settings.get("finetune.img_size", PHOTOS["finetune"]["img_size"]))
        sides.append((fine_side, int(settings["finetune.epochs"])))
    print(f"{name}: stages run: {', '.join(sorted(run.stage_seconds))}", flush=True)
    return {
        "top1": evaluation["top1"],
        "loss": evaluation["loss"],
        "gpx": sum(epochs * side**2 for side, epochs in sides) * train_images / 1e9,
        "student_seconds": sum(run.stage_seconds.get(stage, 0.0) for stage in ("pretrain", "finetune")),
        "stages_run": sorted(run.stage_seconds),
    }


def run_timm_row(timm_repo: Path, work: Path, params: Params, epochs: dict[str, int]) -> dict:
    """timm's train.py on the same patches (PNG files), the same student directly at 64 px."""
    tree = work / "photos"
    if not tree.is_dir():
        sources.write_photos(tree, params.data.photos, params.seed)
    side, direct_epochs = PHOTOS["finetune"]["img_size"], epochs["direct"]
    run = run_timm(timm_repo, tree, work, {}, num_classes=len(sources.PHOTOS), img_size=side, epochs=direct_epochs)
    train_images = sum(1 for _ in (tree / "train").rglob("*.png"))
    return {"top1": run["top1"], "gpx": direct_epochs * side**2 * train_images / 1e9, "student_seconds": run["seconds"]}


def _experiment_name(name: str) -> str:
    return "".join(char if char.isalnum() else "-" for char in name.split(" (")[0]).strip("-")[:40]


if __name__ == "__main__":
    main()
