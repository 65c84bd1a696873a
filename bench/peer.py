"""The pretrain stage against timm's train.py: same tiny VOLO, same digits, same epochs, same cores.

Data: scikit-learn's digits written once as an ImageFolder (coarse2fine.data.sources.write_digits, PNG, 32 px).
The pretrain stage reads the project's conversion of that tree (TFRecords; PNGs re-encoded as JPEG, quality 95)
and runs as users run it, in a fresh project copy (bench/_common.ProjectCopy): a normal `dvc repro token_labels`
first (untimed: convert, the default teacher at 32 px for --epochs, its token labels), then per run `dvc repro
--force --single-item pretrain` with the stage's outputs and resume state removed, so it trains from scratch. Two
rows of the stage:
  - ground truth (pretrain.token_label.enabled false): the like-for-like row against timm's train.py;
  - token labels (the default: the teacher's dense targets and MixToken), what the pipeline runs.
timm's train.py reads the same tree (train/ and val/ folders) as one plain process (under torchrun on CPU it
fails: it passes device_ids to DDP).

timm's train.py is not in the timm wheel: --timm-repo names a timm source checkout (e.g. `git clone
https://github.com/huggingface/pytorch-image-models`, or `git --git-dir=MIRROR archive HEAD | tar -x -C DIR`).
train.py runs with that checkout's timm package first on sys.path (the timm its train.py was written for); a tiny
VOLO cannot be named on its command line (volo_d1_224 fixes layers/dims/heads), so this script registers one
(`volo_bench`, a plain timm VOLO built from --model-kwargs) with timm's register_model before calling train.py's
main: nothing of timm is copied.

Matched settings (the project's params.yaml): its model (patch 4), batch 64, AdamW lr 1e-3 (= 1.6e-2 x 64 / 1024)
weight decay 0.05 betas (0.9, 0.999), per-update cosine to 1e-5 with 1 warm-up epoch from 1e-6, label smoothing
0.1, random-resized-crop scale (0.35, 1) ratio (3/4, 4/3) bicubic, no flip, no colour jitter, no RandAugment, no
mixup/cutmix, no random erasing, pretrain.img_size (48 px: the 32 px digits upsampled by the crop), val crop 100 %,
2 loader workers, CPU fp32, seed 0. Epochs: 10 by default, not pretrain.epochs' 60 (sized for the photos; on
digits 60 would take over an hour here).
Reported per row: train img/s (median over epochs; the project's own per-epoch metric, timm's per-epoch average
rate from its last `Train:` log line of the epoch), wall time (the pretrain stage's, from DVC's "Running stage"
line to the end of the repro; timm's whole run), final val top-1 (the stage's last-epoch val_top1, timm's last
eval_top1). A metric the bench reads that a stage or train.py no longer writes stops it with one line naming the
file and the key.
Threads: both tools run as one training process with torch's default intra-op threads (one per core): the stage
runs with launch.nproc_per_node 1, and torchrun sets OMP_NUM_THREADS=1 only for 2 or more processes. Beside
them, DALI's 2 threads (the stage) and 2 loader worker processes (timm) oversubscribe 2 cores alike. timm also
runs with OMP_NUM_THREADS=1 (one intra-op thread), to show what its default threads are worth here.
The runs alternate (forward order, then reversed, ...), never concurrently.

--tiny: a smoke test of the bench itself (tests/test_benches.py), seconds of training, figures that measure
nothing: the first 16 train and 4 val digits of each class, 1 epoch (the teacher's too), 1 run per row. Only
there may --timm-repo be left out: the stage's rows run, timm's are reported as not run.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    PROJECT_ROOT, TINY_TRACKING, ProjectCopy, add_results_argument, digits_tree, goal, header_line, markdown_table,
    read_column, read_metric, workspace, write_json,
)
from coarse2fine.config import load_params

GOAL_VS_TIMM = 1.2
PARAMS = load_params(PROJECT_ROOT / "params.yaml")  # both tools' settings (the stage's copy differs in data, epochs)
EPOCHS = 10
DIGITS_SIZE = PARAMS.data.digits.size  # the written digit images' side
REPEATS = 2
TINY_PER_CLASS = {"train": 16, "val": 4}  # images kept per class folder in --tiny
PROJECT_ROWS = {"pretrain stage, ground truth": False, "pretrain stage, token labels": True}  # token_label.enabled
TIMM_ROWS = {"timm train.py": {}, "timm train.py, OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}}  # extra env
TIMM_RATE = re.compile(r"Train: (\d+) \[.*\(\d+%\)\].*\(\s*[\d.]+s,\s*([\d.]+)/s\)")

# Run as `python -c TIMM_MAIN REPO ARGS...`: register a tiny-VOLO factory, then timm's own train.py main.
TIMM_MAIN = """
import runpy, sys
repo = sys.argv.pop(1)
sys.path.insert(0, repo)
from timm.models import register_model
from timm.models.volo import VOLO

@register_model
def volo_bench(pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None, **kwargs):
    return VOLO(**kwargs)  # random init: the pretrained* arguments create_model passes are unused

sys.argv[0] = repo + '/train.py'
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-repo", type=Path, metavar="PATH",
                        help="a timm source checkout (the directory holding train.py and timm/); required unless --tiny")
    parser.add_argument("--tiny", action="store_true",
                        help="a smoke test: 16 + 4 digits per class, 1 epoch, 1 run per row (figures measure nothing)")
    add_results_argument(parser)
    parser.add_argument("--epochs", type=int, metavar="N", help=f"epochs for both tools (default: {EPOCHS}; --tiny: 1)")
    parser.add_argument("--repeats", type=int, metavar="N",
                        help=f"runs per row, alternating (default: {REPEATS}; --tiny: 1)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every run) as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR", help="keep the data and outputs here (default: a temp dir)")
    args = parser.parse_args()
    if args.timm_repo is None and not args.tiny:
        parser.error("--timm-repo is required: the bench compares against timm's train.py (only --tiny runs without)")
    if args.timm_repo is not None and not (args.timm_repo / "train.py").is_file():
        parser.error(f"--timm-repo: no train.py in {args.timm_repo}")
    if args.epochs is None:
        args.epochs = 1 if args.tiny else EPOCHS
    if args.repeats is None:
        args.repeats = 1 if args.tiny else REPEATS
    return args


def timm_command(
    timm_repo: Path, tree: Path, output: Path, *, num_classes: int, img_size: int, epochs: int
) -> list[str]:
    """timm's train.py on the ImageFolder `tree` with the project's default pre-training settings (above)."""
    cfg, model, augment = PARAMS.pretrain, PARAMS.model, PARAMS.augment
    lr = cfg.optimizer.lr_base * cfg.batch_size / 1024
    kwargs = {
        "layers": model.layers, "embed_dims": model.embed_dims, "num_heads": model.num_heads,
        "mlp_ratio": model.mlp_ratio, "patch_size": model.patch_size, "img_size": img_size,
    }
    return [
        sys.executable, "-c", TIMM_MAIN, str(timm_repo.resolve()),
        "--data-dir", str(tree), "--train-split", "train", "--val-split", "val",
        "--model", "volo_bench", "--model-kwargs", *(f"{key}={value!r}".replace(" ", "") for key, value in kwargs.items()),
        "--num-classes", str(num_classes), "--img-size", str(img_size), "--crop-pct", str(cfg.val_crop_pct),
        "--epochs", str(epochs), "-b", str(cfg.batch_size),
        "--opt", cfg.optimizer.name, "--lr", f"{lr:g}", "--weight-decay", str(cfg.optimizer.weight_decay),
        "--opt-betas", *map(str, cfg.optimizer.betas),
        "--sched", "cosine", "--sched-on-updates", "--warmup-epochs", str(int(cfg.schedule.warmup_epochs)),
        "--warmup-lr", str(cfg.schedule.warmup_lr), "--min-lr", str(cfg.schedule.min_lr), "--cooldown-epochs", "0",
        "--smoothing", str(cfg.label_smoothing), "--mixup", "0", "--cutmix", "0", "--reprob", "0",
        "--color-jitter", "0", "--hflip", str(augment.hflip), "--scale", *map(str, augment.scale),
        "--ratio", *map(str, augment.ratio), "--train-interpolation", augment.interpolation,
        "--interpolation", augment.interpolation, "--drop-path", str(model.drop_path),
        "-j", str(PARAMS.loader.workers), "--device", "cpu", "--seed", str(PARAMS.seed),
        "--checkpoint-hist", "1", "--output", str(output), "--experiment", "run",
    ]


def run_timm(timm_repo: Path, tree: Path, work: Path, env: dict[str, str], **settings: int) -> dict:
    """One train.py run (`settings`: timm_command's num_classes, img_size, epochs): its img/s, wall time, top-1."""
    output = work / "timm-out"
    shutil.rmtree(output, ignore_errors=True)
    started = time.perf_counter()
    result = subprocess.run(
        timm_command(timm_repo, tree, output, **settings), capture_output=True, text=True, cwd=work,
        env={**os.environ, **env},
    )
    seconds = time.perf_counter() - started
    if result.returncode:
        raise RuntimeError(f"timm train.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
    rates: dict[int, float] = {}
    for epoch, rate in TIMM_RATE.findall(result.stdout + result.stderr):
        rates[int(epoch)] = float(rate)  # the epoch's last line holds its average over the epoch
    if not rates:
        raise SystemExit(f"timm train.py's log has no `Train:` line with a rate (TIMM_RATE): its format changed; "
                         f"update the bench:\n{result.stdout[-2000:]}")
    top1 = read_column(output / "run" / "summary.csv", "eval_top1", delimiter=",")[-1]
    return {"img_per_s": [rates[epoch] for epoch in sorted(rates)], "seconds": seconds, "top1": top1}


def prepared_project(work: Path, tree: Path, args: argparse.Namespace) -> ProjectCopy:
    """A fresh project copy on `tree` with everything pretrain reads made by a normal `dvc repro token_labels`:
    the records, the default teacher and its token labels (the token-label row's targets). The teacher trains as
    many epochs as the students, at the digits' own 32 px (params.yaml's 30 epochs at 64 px are sized for the
    photos: on the digits they took 28 minutes here, untimed)."""
    shutil.rmtree(work / "project", ignore_errors=True)
    params = {
        "data": {"source": "imagefolder", "root": str(tree)}, "pretrain": {"epochs": args.epochs},
        "teacher": {"epochs": args.epochs, "img_size": DIGITS_SIZE}, **(TINY_TRACKING if args.tiny else {}),
    }
    project = ProjectCopy(work / "project", params)
    project.repro("token_labels")
    return project


def run_pretrain(project: ProjectCopy, token_labels: bool) -> dict:
    """One pretrain stage run from scratch, learning from token labels or the ground truth: its img/s, wall time,
    top-1."""
    project.edit_params({"pretrain": {"token_label": {"enabled": token_labels}}})
    for name in (".resume/pretrain", "models/pretrain", "metrics/pretrain"):
        shutil.rmtree(project.path / name, ignore_errors=True)  # no resuming, no earlier run's metrics to read
    # Forced: with params and deps as the last run left them, DVC would check its cached outputs out instead.
    run = project.repro("--force", "--single-item", "pretrain")
    if "pretrain" not in run.stage_seconds:
        raise SystemExit(f"`dvc repro pretrain` ran no stage named pretrain (ran: {', '.join(run.stage_seconds)})")
    metrics = project.path / "metrics" / "pretrain"
    rates = read_column(metrics / "plots" / "metrics" / "train_img_per_s.tsv", "train_img_per_s", delimiter="\t")
    top1 = read_metric(metrics / "metrics.json", "val_top1")
    return {"img_per_s": rates, "seconds": run.stage_seconds["pretrain"], "top1": top1}


def table_row(name: str, runs: list[dict], median: float | None, reference: float | None) -> list[str]:
    """A row of the report; `reference`: the faster timm's median img/s, None if timm did not run."""
    if not runs:
        return [name, "not run (no --timm-repo)", "-", "-", "-"]
    return [
        name,
        f"{median:.0f}",
        "-" if reference is None else f"{median / reference:.2f}x",
        " / ".join(f"{run['seconds']:.1f}" for run in runs),
        " / ".join(f"{run['top1']:.2f}" for run in runs),
    ]


def goal_line(name: str, medians: dict[str, float], accuracy: dict[str, float], best_timm: str | None) -> str:
    """The issue's goal for one of the stage's rows: >= GOAL_VS_TIMM x the faster timm's img/s, top-1 no lower."""
    text = f"{name} >= {GOAL_VS_TIMM:g}x the faster timm train.py img/s at equal or better val top-1"
    if best_timm is None:
        return goal(text, None, "timm train.py not run: no --timm-repo")
    ratio = medians[name] / medians[best_timm]
    met = ratio >= GOAL_VS_TIMM and accuracy[name] >= accuracy[best_timm]
    return goal(text, met, f"{ratio:.2f}x, val top-1 {accuracy[name]:.2f} vs {accuracy[best_timm]:.2f} %")


def report(runs: dict[str, list[dict]], args: argparse.Namespace, train_images: int) -> tuple[str, dict]:
    ran = {name: tool_runs for name, tool_runs in runs.items() if tool_runs}
    medians = {name: statistics.median(rate for run in tool_runs for rate in run["img_per_s"]) for name, tool_runs in ran.items()}
    accuracy = {name: statistics.median(run["top1"] for run in tool_runs) for name, tool_runs in ran.items()}
    timm_ran = [name for name in TIMM_ROWS if name in ran]
    best_timm = max(timm_ran, key=medians.get) if timm_ran else None  # the goal's reference
    reference = medians[best_timm] if best_timm else None
    rows = [table_row(name, tool_runs, medians.get(name), reference) for name, tool_runs in runs.items()]
    goals = [goal_line(name, medians, accuracy, best_timm) for name in PROJECT_ROWS]
    cfg = PARAMS.pretrain
    tiny = "Tiny run (--tiny: a smoke test of the bench, its figures measure nothing). " if args.tiny else ""
    text = "\n".join([
        header_line(),
        "",
        f"{tiny}Tiny VOLO on digits ({train_images} train images, {cfg.img_size} px), {args.epochs} epochs, batch "
        f"{cfg.batch_size}, AdamW, 2 loader workers, CPU fp32; {args.repeats} runs per row, alternating. img/s: "
        "median over all epochs of all runs (training with data loading, no validation). Ground truth: "
        "pretrain.token_label.enabled false, like for like with timm; token labels: the default, from the default "
        "teacher's token_labels stage.",
        "",
        markdown_table(["tool", "train img/s (median)", "x faster timm", "wall s per run", "val top-1 % per run"], rows),
        "",
        "Goals: " + "; ".join(goals) + ".",
    ])
    return text, {"runs": runs, "median_img_per_s": medians}


def variants_to_run(args: argparse.Namespace, project: ProjectCopy, tree: Path, work: Path) -> dict:
    """Each row's run, as a call returning its numbers: the stage's rows, and timm's with --timm-repo."""
    variants = {name: functools.partial(run_pretrain, project, enabled) for name, enabled in PROJECT_ROWS.items()}
    if args.timm_repo is not None:
        settings = {"num_classes": 10, "img_size": PARAMS.pretrain.img_size, "epochs": args.epochs}
        for name, env in TIMM_ROWS.items():
            variants[name] = functools.partial(run_timm, args.timm_repo, tree, work, env, **settings)
    return variants


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work:
        tree = digits_tree(work, PARAMS, TINY_PER_CLASS if args.tiny else None)
        variants = variants_to_run(args, prepared_project(work, tree, args), tree, work)
        runs: dict[str, list[dict]] = {name: [] for name in [*PROJECT_ROWS, *TIMM_ROWS]}
        order = list(variants)
        for repeat in range(args.repeats):
            for name in order if repeat % 2 == 0 else order[::-1]:
                runs[name].append(variants[name]())
                print(f"{name}: {runs[name][-1]}", file=sys.stderr)
        train_images = sum(1 for path in (tree / "train").rglob("*.png"))
    text, raw = report(runs, args, train_images)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
