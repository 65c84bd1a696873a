"""Memory and growth: peak RSS of every stage of the default pipeline, of pretrain with token labels at 1x and 10x
the records, and the `source` listing's time as the image tree grows.

- stages: `dvc repro --force` in a project copy of the shipped params (bench/_common.ProjectCopy), every stage run as
  users run it. Every 50 ms a thread reads the RSS (psutil) of each process DVC's stage commands run as: every
  descendant of the dvc process, not dvc itself (the stage's shell, the launcher, which runs a world of one in its
  own process, loader worker processes, an agent and its workers with more ranks; DALI's are threads). A sample
  belongs to the stage of the last "Running stage" line. Per stage: the peak of the processes' summed RSS (the goal's
  measure, an upper bound of what the stage holds: a page shared by several, a forked worker's copy-on-write pages
  or a library's, counts once in each; the JSON lists each process at that peak) and the peak of the largest
  process alone. Sampled, so a spike shorter than 50 ms can be missed: the report also gives the largest process of
  the whole repro, exact (getrusage RUSAGE_CHILDREN, dvc included).
- growth: the pretrain stage with token labels (the default), sampled the same way, in a second copy whose photo
  records are those of data.photos (1x) and then ten times as many, train and val (data.photos' train_per_class and
  val_per_class x 10): each `dvc repro pretrain` converts them, trains the teacher (1 epoch: memory, not accuracy)
  and generates their token labels first. The store is memory-mapped: the peak RSS should stay flat while the store
  grows tenfold (RSS counts a mapped file's pages once touched, so the store's size is beside it).
- listing: the `source` stage's script (plain python, as dvc.yaml runs it: interpreter start-up included) on
  generated ImageFolder trees of --files empty files (it stats every file, never reads one) laid out like ImageNet:
  about 1,331 files per class folder (1,281 train + 50 val), so a bigger tree has more folders, not bigger ones.
  Median of --repeats runs after an untimed one (a warm inode cache, as every repro after the first finds it); a
  line fitted through (files, seconds) is extrapolated to ImageNet's 1,331,167 files.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import psutil
import yaml

from coarse2fine import stage_server

from _common import (
    IMAGENET_CLASSES, IMAGENET_TRAIN, IMAGENET_VAL, NEAR_EMPTY_TINY, PROJECT_ROOT, TINY_NEAR_EMPTY, TINY_TRACKING,
    ProjectCopy, Repro, add_tiny_argument, goal, header_line, markdown_table, merge_params, project_copy, read_metric,
    tiny_sizes, tree_stats, workspace, write_json,
)

SAMPLE_SECONDS = 0.05
GOAL_STAGE_GB = 4.0  # GB = 10^9 bytes
GROWTH = 10  # the records of the larger pretrain run, x data.photos'
GOAL_GROWTH_RATIO = 1.2
# --tiny's growth copy: 18 train + 18 val patches at 1x, batches of 16 (a training epoch takes full batches only)
TINY_GROWTH = {
    "data": {"photos": {"train_per_class": 1, "val_per_class": 1}}, **TINY_TRACKING,
    **{stage: {"batch_size": 16} for stage in ("teacher", "token_labels", "pretrain")},
}
IMAGENET_FILES = IMAGENET_TRAIN + IMAGENET_VAL
PARTS = ("stages", "growth", "listing")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="default: all three")
    parser.add_argument("--epochs", type=int, default=2, metavar="N",
                        help="pretrain.epochs of the 1x and 10x runs (default: 2; their teacher trains 1)")
    parser.add_argument("--files", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], metavar="N",
                        help="file counts of the listing's trees, two or more (default: 10000 100000 1000000; the "
                             "largest takes about a million inodes)")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="timed listings per tree (default: 3)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="make the project copies and trees here; a finished tree there is reused, as is the "
                             "project copy if made with the same params (default: a temp dir)")
    add_tiny_argument(parser, f"{NEAR_EMPTY_TINY}, 1 pretrain epoch on 1 + 1 photo patches per class (batches of "
                              "16) and on 10x as many, trees of 100 and 1000 files, 1 timed listing; the stages in "
                              "a stage server of the bench's own")
    args = parser.parse_args()
    tiny_sizes(parser, args, epochs=1, files=[100, 1000], repeats=1)
    if len(set(args.files)) < 2:
        parser.error("--files: two sizes at least (a line is fitted through them)")
    return args


# ------------------------------------------------------------------------------------ peak RSS of the stages


@dataclass
class Peak:
    tree_bytes: int = 0  # the most the stage's processes held together, in one sample
    process_bytes: int = 0  # the most one of them held
    processes: int = 0  # the most processes at once
    samples: int = 0  # that found the stage's processes
    at_tree_peak: list[dict] = field(default_factory=list)  # each process at the summed peak: its RSS, command line


def stage_processes() -> dict[psutil.Process, int]:
    """Every process under this bench's children (dvc; with --tiny, also its stage server), the children themselves
    left out, and the server's supervisors too (each only waits for the copy it forked, which runs the stage), with
    its RSS."""
    sizes = {}
    for tool in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # a process may end between the listing and the read
            processes = tool.children(recursive=True)
            if "coarse2fine.stage_server" in tool.cmdline():
                processes = [process for process in processes if process.ppid() != tool.pid]
            for process in processes:
                with contextlib.suppress(psutil.Error):
                    sizes[process] = process.memory_info().rss
    return sizes


def command_line(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline())[:200]
    return "(ended)"


class StageSampler:
    """While in its `with`, samples `stage_processes` every SAMPLE_SECONDS into `peaks`, under the stage last
    given to `start_stage`."""

    def __init__(self) -> None:
        self.peaks: dict[str, Peak] = {}
        self._stage: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_done, daemon=True)

    def start_stage(self, stage: str) -> None:
        self.peaks[stage] = Peak()
        self._stage = stage

    def __enter__(self) -> StageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample_until_done(self) -> None:
        while not self._done.wait(SAMPLE_SECONDS):
            if self._stage is None:
                continue
            peak, sizes = self.peaks[self._stage], stage_processes()
            if not sizes:  # the stage's command not started yet, or ended
                continue
            if sum(sizes.values()) > peak.tree_bytes:
                peak.tree_bytes = sum(sizes.values())
                peak.at_tree_peak = [{"rss": size, "command": command_line(process)} for process, size in sizes.items()]
            peak.process_bytes = max(peak.process_bytes, max(sizes.values()))
            peak.processes = max(peak.processes, len(sizes))
            peak.samples += 1


def sampled_repro(project: ProjectCopy, *args: str) -> tuple[Repro, dict[str, Peak]]:
    """`dvc repro ARGS` in `project`, with the peaks of each stage that ran."""
    with StageSampler() as sampler:
        run = project.repro(*args, on_stage=sampler.start_stage)
    return run, sampler.peaks


def measure_stages(project: ProjectCopy) -> dict:
    run, peaks = sampled_repro(project, "--force")
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return {"stage_seconds": run.stage_seconds, "peaks": {stage: asdict(peak) for stage, peak in peaks.items()},
            "largest_process_exact_bytes": largest}


# ---------------------------------------------------------------------------- pretrain at 1x and 10x the records


def measure_growth(work: Path, base: dict, epochs: int) -> dict[str, dict]:
    """The pretrain stage's peaks in a fresh copy (`base` params; the teacher 1 epoch, pretrain `epochs`) on the
    photos' records, then on GROWTH times as many."""
    shutil.rmtree(work / "growth", ignore_errors=True)
    project = ProjectCopy(work / "growth", merge_params(
        copy.deepcopy(base), {"teacher": {"epochs": 1}, "pretrain": {"epochs": epochs}}))
    params = yaml.safe_load((project.path / "params.yaml").read_text())
    if params["data"]["source"] != "photos":
        raise SystemExit(f"growth: the shipped data.source is {params['data']['source']!r}; the bench scales photos'")
    photos = params["data"]["photos"]
    results = {}
    for factor in (1, GROWTH):
        counts = {key: photos[key] * factor for key in ("train_per_class", "val_per_class")}
        project.edit_params({"data": {"photos": counts}})
        run, peaks = sampled_repro(project, "pretrain")
        if "pretrain" not in peaks:
            raise SystemExit(f"`dvc repro pretrain` ran no stage named pretrain (ran: {', '.join(run.stage_seconds)})")
        results[f"{factor}x"] = {
            "train_images": int(read_metric(project.path / "metrics" / "convert" / "metrics.json", "images_train")),
            "store_bytes": tree_stats(project.path / "data" / "token_labels")[1],
            "stage_seconds": run.stage_seconds,
            "peaks": {stage: asdict(peak) for stage, peak in peaks.items()},
        }
    return results


# ------------------------------------------------------------------------------------- the listing's time


def class_folders(files: int) -> int:
    """Class folders of a tree of `files` files, each holding about ImageNet's files per class."""
    return max(1, round(files * IMAGENET_CLASSES / IMAGENET_FILES))


def file_tree(work: Path, files: int) -> Path:
    """An ImageFolder tree work/files-N/{train,val}/class_XXXX/NNNNN.jpg of `files` empty files, ImageNet's share of
    them val, in `class_folders(files)` classes. A finished tree (in a kept --workdir) is reused."""
    classes = class_folders(files)
    train = round(files * IMAGENET_TRAIN / IMAGENET_FILES)
    spec = {"files": files, "classes": classes, "train": train}
    root = work / f"files-{files}"
    marker = root.with_name(f"{root.name}.json")  # written last: marks the tree complete
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == spec:
        return root
    shutil.rmtree(root, ignore_errors=True)
    for split, count in (("train", train), ("val", files - train)):
        for label in range(classes):
            folder = root / split / f"class_{label:04d}"
            folder.mkdir(parents=True)
            for number in range(count // classes + (label < count % classes)):
                (folder / f"{number:05d}.jpg").touch()
    marker.write_text(json.dumps(spec), encoding="utf-8")
    return root


def time_listing(root: Path, files: int, out: Path, repeats: int) -> list[float]:
    """Wall seconds of the `source` stage's script listing `root` (`files` files), `repeats` times after an untimed
    run."""
    out.mkdir(parents=True, exist_ok=True)
    params = merge_params(yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text()),
                          {"data": {"source": "imagefolder", "root": str(root)}})
    (out / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    command = [
        sys.executable, "stages/source.py", "--params", str(out / "params.yaml"), "--out", str(out / "source.json"),
        "--teacher-out", str(out / "teacher_source.json"), "--pretrain-out", str(out / "pretrain_source.json"),
        "--finetune-out", str(out / "finetune_source.json"), "--labels-out", str(out / "token_labels_source.json"),
    ]
    env = {**os.environ, "PYTHONPATH": "src"}  # dvc.yaml's
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        subprocess.run(command, cwd=PROJECT_ROOT, env=env, check=True)
        seconds.append(time.perf_counter() - started)
    listed = sum(json.loads((out / "source.json").read_text())["files"].values())
    if listed != files:
        raise SystemExit(f"{root}: the source stage listed {listed} files of {files}")
    return seconds[1:]


def measure_listing(work: Path, sizes: list[int], repeats: int) -> dict:
    runs = {}
    for files in sorted(sizes):
        root = file_tree(work, files)
        runs[files] = time_listing(root, files, work / "listing" / str(files), repeats)
        print(f"listing {files} files: {statistics.median(runs[files]):.2f} s", file=sys.stderr, flush=True)
    medians = [statistics.median(seconds) for seconds in runs.values()]
    per_file, start_up = np.polyfit(list(runs), medians, 1)
    return {"seconds": runs, "fit_start_up_seconds": float(start_up), "fit_seconds_per_file": float(per_file),
            "imagenet_seconds": float(start_up + per_file * IMAGENET_FILES)}


# ---------------------------------------------------------------------------------------------- the report


def megabytes(count: float) -> str:
    return f"{count / 1e6:.0f}"


def stages_section(stages: dict, tiny: bool) -> tuple[list[str], str]:
    peaks = stages["peaks"]
    rows = [
        [stage, f"{seconds:.1f}", megabytes(peaks[stage]["tree_bytes"]), megabytes(peaks[stage]["process_bytes"]),
         str(peaks[stage]["processes"]), str(peaks[stage]["samples"])]
        for stage, seconds in stages["stage_seconds"].items()
    ]
    project = ("bench/startup.py's near-empty copy (--tiny: in a stage server, whose imports every copy's RSS counts)"
               if tiny else "a project copy of the shipped params.yaml")
    exact = megabytes(stages["largest_process_exact_bytes"])
    sampled = megabytes(max(peak["process_bytes"] for peak in peaks.values()))
    lines = [
        f"Peak RSS of each stage of `dvc repro --force` in {project}, sampled every {SAMPLE_SECONDS * 1000:.0f} ms "
        "(MB = 10^6 bytes; the stage's processes: dvc itself left out):",
        "",
        markdown_table(["stage", "wall s", "processes' summed RSS, peak MB", "largest process, peak MB",
                        "processes (most)", "samples"], rows),
        "",
        f"Largest process of the whole repro, exact (getrusage, dvc included): {exact} MB; sampled: {sampled} MB.",
    ]
    largest = max(peaks, key=lambda stage: peaks[stage]["tree_bytes"])
    most = peaks[largest]["tree_bytes"] / 1e9
    return lines, goal(f"every stage's processes <= {GOAL_STAGE_GB:g} GB of summed RSS", most <= GOAL_STAGE_GB,
                       f"largest {largest}, {most:.2f} GB")


def growth_section(growth: dict, epochs: int) -> tuple[list[str], str]:
    baseline = growth["1x"]["peaks"]["pretrain"]["tree_bytes"]
    rows = []
    for name, run in growth.items():
        pretrain = run["peaks"]["pretrain"]
        rows.append([name, str(run["train_images"]), f"{run['store_bytes'] / 1e6:.2f}",
                     f"{run['stage_seconds']['pretrain']:.1f}", megabytes(pretrain["tree_bytes"]),
                     megabytes(pretrain["process_bytes"]), f"{pretrain['tree_bytes'] / baseline:.2f}x"])
    ratio = growth[f"{GROWTH}x"]["peaks"]["pretrain"]["tree_bytes"] / baseline
    lines = [
        f"The pretrain stage with token labels, {epochs} epoch(s), on data.photos' records and on {GROWTH}x as many "
        "(train and val), each after its own convert, 1-epoch teacher and token labels:",
        "",
        markdown_table(["records", "train images", "token-label store MB", "pretrain wall s",
                        "processes' summed RSS, peak MB", "largest process, peak MB", "x 1x (summed)"], rows),
    ]
    text = f"pretrain's RSS flat from 1x to {GROWTH}x the records ({GROWTH}x / 1x <= {GOAL_GROWTH_RATIO:g})"
    return lines, goal(text, ratio <= GOAL_GROWTH_RATIO, f"{ratio:.2f}x")


def listing_section(listing: dict, repeats: int) -> list[str]:
    rows = [[str(files), str(class_folders(files)), f"{statistics.median(seconds):.2f}"]
            for files, seconds in listing["seconds"].items()]
    return [
        f"The `source` stage's script listing generated ImageFolder trees of empty files (median of {repeats} timed "
        "run(s) after an untimed one, python start-up included):",
        "",
        markdown_table(["files", "class folders", "listing s (median)"], rows),
        "",
        f"Line fitted through them: {listing['fit_start_up_seconds']:.2f} s + "
        f"{listing['fit_seconds_per_file'] * 1e6:.2f} µs per file; ImageNet's {IMAGENET_FILES:,} files "
        f"({IMAGENET_TRAIN:,} train + {IMAGENET_VAL:,} val): {listing['imagenet_seconds']:.1f} s.",
    ]


def report(raw: dict, args: argparse.Namespace) -> str:
    """The report of the parts that ran."""
    text, goals = [header_line()], []
    if "stages" in raw:
        lines, line = stages_section(raw["stages"], args.tiny)
        text += ["", *lines]
        goals.append(line)
    if "growth" in raw:
        lines, line = growth_section(raw["growth"], args.epochs)
        text += ["", *lines]
        goals.append(line)
    if "listing" in raw:
        text += ["", *listing_section(raw["listing"], args.repeats)]
    if goals:  # the listing has none
        text += ["", "Goals: " + "; ".join(goals) + "."]
    return "\n".join(text)


def main() -> None:
    args = parse_args()
    # Every stage in a process of its own under dvc, as users run them: another stage server's (the test suite's, or
    # `python -m coarse2fine.stage_server`'s) would run them outside the trees sampled here. --tiny runs them in a
    # server of its own, whose copies it samples: the code path in seconds, not a minute of imports per stage (its
    # RSS then counts the server's imports, shared, in every copy).
    os.environ.pop(stage_server.SERVER_ENV, None)
    raw: dict = {}
    with workspace(args.workdir) as work, contextlib.ExitStack() as stack:
        if args.tiny:
            os.environ[stage_server.SERVER_ENV] = str(stack.enter_context(stage_server.running()))
        if "stages" in args.parts:  # first: getrusage's children are then only this repro (and the copy's git)
            # tiny: the copy bench/startup.py --tiny left in the same --workdir
            raw["stages"] = measure_stages(project_copy(work, TINY_NEAR_EMPTY if args.tiny else {}))
        if "growth" in args.parts:
            raw["growth"] = measure_growth(work, TINY_GROWTH if args.tiny else {}, args.epochs)
        if "listing" in args.parts:
            raw["listing"] = measure_listing(work, args.files, args.repeats)
    text = report(raw, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
