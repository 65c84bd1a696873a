"""The pretrain stage against timm's train.py: same tiny VOLO, same digits, same epochs, same cores.

Data: scikit-learn's digits written once as an ImageFolder (coarse2fine.data.sources.write_digits, PNG, 32 px).
The pretrain stage reads the project's conversion of that tree (TFRecords; PNGs re-encoded as JPEG, quality 95)
and runs as users run it: `dvc repro -f -s pretrain` in a fresh project copy (checkpoint and metrics removed
first, so it trains from scratch). timm's train.py reads the same tree (train/ and val/ folders) as one plain
process (under torchrun on CPU it fails: it passes device_ids to DDP).

timm's train.py is not in the timm wheel: --timm-repo names a timm source checkout (e.g. `git clone
https://github.com/huggingface/pytorch-image-models`, or `git --git-dir=MIRROR archive HEAD | tar -x -C DIR`).
train.py runs with that checkout's timm package first on sys.path (the timm its train.py was written for); a tiny
VOLO cannot be named on its command line (volo_d1_224 fixes layers/dims/heads), so this script registers one
(`volo_bench`, a plain timm VOLO built from --model-kwargs) with timm's register_model before calling train.py's
main: nothing of timm is copied.

Matched settings (the project's params defaults): batch 64, AdamW lr 1e-3 (= 1.6e-2 x 64 / 1024) weight decay
0.05 betas (0.9, 0.999), per-update cosine to 1e-5 with 1 warm-up epoch from 1e-6, label smoothing 0.1,
random-resized-crop scale (0.35, 1) ratio (3/4, 4/3) bicubic, no flip, no colour jitter, no RandAugment, no
mixup/cutmix, no random erasing, 32 px, val crop 100 %, 2 loader workers, CPU fp32, seed 0.
Reported per tool: train img/s (median over epochs; the project's own per-epoch metric, timm's per-epoch average
rate from its last `Train:` log line of the epoch), wall time of the whole run, final val top-1.
Threads: both tools run as one training process with torch's default intra-op threads (one per core): the stage
runs with launch.nproc_per_node 1, and torchrun sets OMP_NUM_THREADS=1 only for 2 or more processes. Beside
them, DALI's 2 threads (the stage) and 2 loader worker processes (timm) oversubscribe 2 cores alike. timm also
runs with OMP_NUM_THREADS=1 (one intra-op thread), to show what its default threads are worth here.
The runs alternate (forward order, then reversed, ...), never concurrently.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import ProjectCopy, goal, header_line, markdown_table, workspace, write_json
from coarse2fine.config import parse_params
from coarse2fine.data.sources import write_digits

GOAL_VS_TIMM = 1.0
PARAMS = parse_params({})  # the project's defaults: the settings both tools get
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
    parser.add_argument("--timm-repo", type=Path, required=True, metavar="PATH",
                        help="a timm source checkout: the directory holding train.py and timm/ (required)")
    parser.add_argument("--epochs", type=int, default=PARAMS.pretrain.epochs, metavar="N",
                        help=f"epochs for both tools (default: {PARAMS.pretrain.epochs}, pretrain.epochs)")
    parser.add_argument("--repeats", type=int, default=2, metavar="N",
                        help="runs per tool, alternating (default: 2)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every run) as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR", help="keep the data and outputs here (default: a temp dir)")
    args = parser.parse_args()
    if not (args.timm_repo / "train.py").is_file():
        parser.error(f"--timm-repo: no train.py in {args.timm_repo}")
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
    with open(output / "run" / "summary.csv", newline="", encoding="utf-8") as summary:
        top1 = float(list(csv.DictReader(summary))[-1]["eval_top1"])
    return {"img_per_s": [rates[epoch] for epoch in sorted(rates)], "seconds": seconds, "top1": top1}


def run_pretrain(project: ProjectCopy) -> dict:
    for name in (".resume/pretrain", "metrics/pretrain"):
        shutil.rmtree(project.path / name, ignore_errors=True)
    run = project.repro("-f", "-s", "pretrain")
    history = project.path / "metrics/pretrain/plots/metrics/train_img_per_s.tsv"
    with open(history, newline="", encoding="utf-8") as table:
        rates = [float(row["train_img_per_s"]) for row in csv.DictReader(table, delimiter="\t")]
    top1 = json.loads((project.path / "metrics/pretrain/metrics.json").read_text(encoding="utf-8"))["top1"]
    return {"img_per_s": rates, "seconds": run.seconds, "top1": top1}


def report(runs: dict[str, list[dict]], args: argparse.Namespace, train_images: int) -> tuple[str, dict]:
    medians = {name: statistics.median(rate for run in tool_runs for rate in run["img_per_s"]) for name, tool_runs in runs.items()}
    accuracy = {name: statistics.median(run["top1"] for run in tool_runs) for name, tool_runs in runs.items()}
    best_timm = max((name for name in runs if name.startswith("timm")), key=medians.get)  # the goal's reference
    rows = [
        [
            name,
            f"{medians[name]:.0f}",
            f"{medians[name] / medians[best_timm]:.2f}x",
            " / ".join(f"{run['seconds']:.1f}" for run in tool_runs),
            " / ".join(f"{run['top1']:.2f}" for run in tool_runs),
        ]
        for name, tool_runs in runs.items()
    ]
    ratio = medians["pretrain stage"] / medians[best_timm]
    met = ratio >= GOAL_VS_TIMM and accuracy["pretrain stage"] >= accuracy[best_timm]
    goals = [goal(
        f"pretrain stage >= {GOAL_VS_TIMM:g}x the faster timm train.py img/s at equal or better top-1", met,
        f"{ratio:.2f}x, top-1 {accuracy['pretrain stage']:.2f} vs {accuracy[best_timm]:.2f} %",
    )]
    cfg = PARAMS.pretrain
    text = "\n".join([
        header_line(),
        "",
        f"Tiny VOLO on digits ({train_images} train images, {cfg.img_size} px), {args.epochs} epochs, batch "
        f"{cfg.batch_size}, AdamW, 2 loader workers, CPU fp32; {args.repeats} runs per tool, alternating. img/s: "
        "median over all epochs of all runs (training with data loading, no validation).",
        "",
        markdown_table(["tool", "train img/s (median)", "x faster timm", "wall s per run", "val top-1 % per run"], rows),
        "",
        "Goals: " + "; ".join(goals) + ".",
    ])
    return text, {"runs": runs, "median_img_per_s": medians, "goals": goals}


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work:
        tree = work / "digits"
        if not tree.is_dir():
            write_digits(tree, PARAMS.data.digits, PARAMS.seed)
        shutil.rmtree(work / "project", ignore_errors=True)
        project = ProjectCopy(
            work / "project", {"data": {"source": "imagefolder", "root": str(tree)}, "pretrain": {"epochs": args.epochs}}
        )
        project.repro("convert")
        settings = {"num_classes": 10, "img_size": PARAMS.pretrain.img_size, "epochs": args.epochs}
        variants = {
            "pretrain stage": lambda: run_pretrain(project),
            "timm train.py": lambda: run_timm(args.timm_repo, tree, work, {}, **settings),
            "timm train.py, OMP_NUM_THREADS=1": lambda: run_timm(
                args.timm_repo, tree, work, {"OMP_NUM_THREADS": "1"}, **settings
            ),
        }
        runs: dict[str, list[dict]] = {name: [] for name in variants}
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
