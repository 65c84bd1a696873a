"""ImageNet-shaped scale: what each stage of `dvc repro` costs on a tree shaped like ImageNet-1k, split into a
fixed cost and a cost per file or sample, and what that projects to on ImageNet-1k (on local disk and on NFS) and
for VOLO-D1's 310 pre-training epochs on one 8-GPU node.

Why: the other benches run trees of a few thousand files in a few shards. ImageNet has 1.33 M files in 1,000 class
folders, which its profile converts into 1,024 + 64 shards; there, what a stage or DVC does per file, per shard
and per open file decides whether it takes seconds or hours, or fails at the open-file limit.

What runs: two ImageFolder trees of tiny JPEGs (pixels do not matter here; files, folders and shards do), 1,000
class folders named like WordNet ids, --train-images + --val-images and --small times as many. For each, a fresh
project copy (bench/_common.ProjectCopy) of bench/startup.py's near-empty params (one epoch per training stage,
no extra evaluation sizes) with every image size at 32 px, `data.subset` 1, and the VOLO-D1 profile's shard
counts, loader workers and convert workers (--train-shards, --val-shards, --loader-workers, --convert-workers
override them), runs `dvc repro -v` with the soft open-file limit (`ulimit -Sn`) at --nofile. If that fails, the
limit's goal is missed, the failing stage and its error are reported, and the repro is finished without the limit
so that the rest is still measured.

Per stage, from the run on the large tree:
- wall time: from its "Running stage" line to the next (bench/_common.Repro); fixed cost and cost per unit: the
  line through the two trees' wall times (unit: files for source and convert, train samples for the training
  stages and token_labels, val samples for the evaluations; compare and lineage: a fixed cost only).
- DVC's own time, from when `dvc repro -v`'s lines arrive: the stage's command ends at DVC's first log line after
  it; then hashing the outputs (to DVC's first "Preparing to transfer" line), committing them to the cache (to
  "was reproduced") and the checks before the next stage (the lock file, the next stage's dependencies, removing
  its old outputs). A repro checks nothing out; one dvc process never waits for its own repository lock. The
  trees DVC builds are counted with their files (each one a stat, or a hash when new).
- open files per process (peak), bytes read and written: every SAMPLE_SECONDS a thread reads, for each process of
  the stage (dvc's descendants; with --tiny, the copies its stage server forks), its open descriptors (all, and those
  of the records: data/records or DVC's cache), the records files it maps (DALI's readers map them and hold no
  descriptor) and /proc/<pid>/io (rchar and wchar: bytes through read and write
  calls, the page cache's included), keeping each process's last sample. A process's last SAMPLE_SECONDS and a
  process shorter than a sample are missed. dvc's own bytes are its counters' change over the stage.

Also: the bytes DVC's cache adds over the outputs (disk blocks of every file under the outputs and .dvc/cache,
each inode once, against the outputs' alone), and the no-op `dvc repro` on each tree (median of --repeats, after an
untimed one with -v whose built trees give its stats).

Projection to ImageNet-1k (the model, stated in the report): per stage, fixed + per unit x ImageNet's units, plus
ImageNet's image bytes moved at LOCAL_BYTES_PER_S (the trees' JPEGs are tiny) and DVC's own time fitted the same
way (convert's per byte of the records: DVC hashes and commits ImageNet's bytes); on NFS, plus NFS_OP_SECONDS per
metadata operation (a stat or open: per file listed or converted, per records file opened or mapped by each
process, per file of each tree DVC builds) and the bytes at NFS_BYTES_PER_S instead. VOLO-D1: the GPU's time from
the H200 step in bench/results/gpu_check_*.json, against the per-epoch costs (DALI's pipeline start, also quoted
from there; validation and checkpoints, modelled) and the one-off stages projected here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing import Pool
from pathlib import Path

import psutil
import yaml
from PIL import Image

from coarse2fine import stage_server

from _common import (
    IMAGENET_CLASSES, IMAGENET_TRAIN, IMAGENET_VAL, NEAR_EMPTY, PROJECT_ROOT, RESULTS_DIR, STAGE_LINE, TINY_TRACKING,
    ProjectCopy, add_tiny_argument, goal, header_line, markdown_table, merge_params, stage_output_error, tiny_sizes,
    workspace, write_json,
)

PROFILE = PROJECT_ROOT / "profiles" / "volo_d1.yaml"  # the ImageNet recipe whose shard counts and workers run here
IMAGE_SIZE = 32  # the trees' JPEGs and every stage's img_size: 2 x 2 tokens at model.patch_size 8 (as TINY_DIGITS)
SAMPLE_SECONDS = 0.1
GOAL_CACHE_OVERHEAD = 0.01
GOAL_NOOP_SECONDS, GOAL_NOOP_IMAGENET_SECONDS = 5.0, 30.0
IMAGENET_FILES = IMAGENET_TRAIN + IMAGENET_VAL
# ILSVRC2012_img_train.tar + ILSVRC2012_img_val.tar: about the bytes of their JPEGs.
IMAGENET_BYTES = 147_897_477_120 + 6_744_924_160
IMAGENET_MEAN_BYTES = IMAGENET_BYTES / IMAGENET_FILES
# The latency model of the projection (assumed, not measured): a local NVMe disk streams 2 GB/s and its metadata
# costs are in what ran here; an NFS mount streams 1 GB/s (10 GbE) and pays a round trip per metadata operation.
LOCAL_BYTES_PER_S, NFS_BYTES_PER_S, NFS_OP_SECONDS = 2e9, 1e9, 0.5e-3
VOLO_D1_PARAMETERS = 26.6e6  # timm's volo_d1_224; a checkpoint holds the weights and AdamW's two moments, fp32
FORWARD_SHARE = 1 / 3  # of a training step's time, a forward's (validation): an assumption, not measured
TRAINING = ("teacher", "pretrain", "finetune")
# Per stage: its unit, and the images a unit moves (read or written) at ImageNet's size.
UNITS = {
    "source": ("files", 0.0), "convert": ("files", 2.0),  # reads each image, writes it into a shard
    # one epoch: each train image, and ImageNet's val share of a val image (validation every epoch)
    **{stage: ("train samples", 1 + IMAGENET_VAL / IMAGENET_TRAIN) for stage in TRAINING},
    "token_labels": ("train samples", 1.0),
    "evaluate@pretrain": ("val samples", 1.0), "evaluate@finetune": ("val samples", 1.0),
    "compare": (None, 0.0), "lineage": (None, 0.0),
}
IMAGENET_UNITS = {"files": IMAGENET_FILES, "train samples": IMAGENET_TRAIN, "val samples": IMAGENET_VAL, None: 0}
DVC_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+: ")  # what `dvc -v` logs, not a stage's output
BUILT_TREE = re.compile(r"built tree 'object ([0-9a-f]{32})\.dir'")


def parse_args() -> argparse.Namespace:
    profile = yaml.safe_load(PROFILE.read_text())
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-images", type=int, default=100_000, metavar="N",
                        help="train images of the large tree (default: 100000)")
    parser.add_argument("--val-images", type=int, default=10_000, metavar="N",
                        help="val images of the large tree, at least 1 per class (default: 10000)")
    parser.add_argument("--small", type=float, default=0.1, metavar="F",
                        help="the small tree's images, as a fraction of the large one's (default: 0.1)")
    parser.add_argument("--classes", type=int, default=IMAGENET_CLASSES, metavar="N",
                        help=f"class folders (default: ImageNet's {IMAGENET_CLASSES})")
    for key, name in (("train_shards", "data.train_shards"), ("val_shards", "data.val_shards"),
                      ("convert_workers", "data.convert_workers")):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=profile["data"][key], metavar="N",
                            help=f"{name} (default: {PROFILE.name}'s, {profile['data'][key]})")
    parser.add_argument("--loader-workers", type=int, default=profile["loader"]["workers"], metavar="N",
                        help=f"loader.workers (default: {PROFILE.name}'s, {profile['loader']['workers']})")
    parser.add_argument("--nofile", type=int, default=1024, metavar="N",
                        help="the soft open-file limit of the measured repros (ulimit -Sn; default: 1024; 0: as "
                             "inherited)")
    parser.add_argument("--repeats", type=int, default=5, metavar="N", help="timed no-op repros per tree (default: 5)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="make the trees and project copies here; a finished tree there is reused (default: a "
                             "temp dir)")
    add_tiny_argument(parser, "a large tree of 2048 + 2000 images and a small one of half as many, 1 timed no-op "
                              "per tree, the stages in a stage server of the bench's own, no MLflow models")
    args = parser.parse_args()
    tiny_sizes(parser, args, train_images=2048, val_images=2000, small=0.5, repeats=1)
    if min(args.val_images * args.small, args.train_images * args.small) < args.classes:
        parser.error("--small: the small tree needs an image per class in train and in val")
    return args


# ------------------------------------------------------------------------------------------------ the trees


def wordnet_ids(classes: int) -> list[str]:
    """Deterministic folder names shaped like ImageNet's WordNet ids (n01440764 ...), in sorted order."""
    return [f"n{1_440_764 + 9_973 * label:08d}" for label in range(classes)]


def _write_jpeg(job: tuple[str, int]) -> None:
    path, seed = job
    colour = (seed % 251, seed // 251 % 251, seed // 63_001 % 251)
    buffer = io.BytesIO()
    Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), colour).save(buffer, "JPEG", quality=90)
    Path(path).write_bytes(buffer.getvalue())


def scale_tree(work: Path, train: int, val: int, classes: int) -> Path:
    """work/imagenet-shaped-T+V/{train,val}/<wnid>/ of solid-colour JPEGs spread evenly over `classes` folders, named
    as ImageNet's (train: <wnid>_<k>.JPEG; val: ILSVRC2012_val_<n>.JPEG). A finished tree of the same spec is reused."""
    spec = {"train": train, "val": val, "classes": classes, "size": IMAGE_SIZE}
    root = work / f"imagenet-shaped-{train}+{val}"
    marker = root.with_name(f"{root.name}.json")  # written last: marks the tree complete
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == spec:
        return root
    shutil.rmtree(root, ignore_errors=True)
    jobs = []
    for split, count in (("train", train), ("val", val)):
        for label, wnid in enumerate(wordnet_ids(classes)):
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for k in range(count // classes + (label < count % classes)):
                name = f"{wnid}_{k}.JPEG" if split == "train" else f"ILSVRC2012_val_{len(jobs):08d}.JPEG"
                jobs.append((str(folder / name), len(jobs)))
    with Pool(len(os.sched_getaffinity(0))) as pool:
        pool.map(_write_jpeg, jobs, chunksize=256)
    marker.write_text(json.dumps(spec), encoding="utf-8")
    return root


# ------------------------------------------------------------------------- sampling the stages' processes


@dataclass
class ProcessPeak:
    command: str
    fds: int = 0  # open descriptors, peak
    files: int = 0  # of them regular files
    records: int = 0  # of them files of the records (data/records, or DVC's cache they link to)
    mapped: int = 0  # records files mapped into memory (DALI's readers map them: no descriptor, no rlimit)
    read: int = 0  # /proc/<pid>/io rchar and wchar at the last sample
    written: int = 0
    disk_read: int = 0  # read_bytes and write_bytes: what reached the storage layer
    disk_written: int = 0


@dataclass
class StageSample:
    processes: dict[str, ProcessPeak] = field(default_factory=dict)  # by "pid:create_time"
    dvc_first: list[int] = field(default_factory=list)  # dvc's rchar, wchar at the stage's start
    dvc_last: list[int] = field(default_factory=list)  # and at the stage's last sample
    dvc_fds: int = 0  # dvc's own open descriptors, peak
    samples: int = 0


def bench_processes() -> tuple[psutil.Process | None, list[psutil.Process]]:
    """This bench's dvc process, and the processes running stages: dvc's descendants, and the copies this bench's
    stage server forks (its supervisors, which only wait for them, left out)."""
    dvc, stages = None, []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # a process may end between the listing and the read
            descendants = child.children(recursive=True)
            if "coarse2fine.stage_server" in child.cmdline():
                stages += [process for process in descendants if process.ppid() != child.pid]
            else:
                dvc, stages = child, stages + descendants
    return dvc, stages


class Sampler:
    """While in its `with`, samples the stages' processes every SAMPLE_SECONDS under the stage last given to
    `start_stage` (a repro's `on_stage`)."""

    def __init__(self, records: tuple[Path, ...]):
        self.records = tuple(str(path) + os.sep for path in records)
        self.stages: dict[str, StageSample] = {}
        self._stage: str | None = None
        self._done = threading.Event()
        self._failure: Exception | None = None  # what stopped the sampling thread, raised at the `with`'s end
        self._thread = threading.Thread(target=self._sample_until_done, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self._done.set()
        self._thread.join()
        if self._failure is not None:  # else every later stage would read as if none of its processes ran
            raise RuntimeError(f"sampling stopped during stage {self._stage}") from self._failure

    def start_stage(self, stage: str) -> None:
        self.stages[stage] = StageSample()
        dvc, _ = bench_processes()
        with contextlib.suppress(psutil.Error, AttributeError):  # AttributeError: no dvc process (any more)
            counters = dvc.io_counters()
            self.stages[stage].dvc_first = self.stages[stage].dvc_last = [counters.read_chars, counters.write_chars]
        self._stage = stage

    def _sample_until_done(self) -> None:
        try:
            while not self._done.wait(SAMPLE_SECONDS):
                if self._stage is not None:
                    self._sample_stage(self.stages[self._stage])
        except Exception as failure:  # kept for __exit__ to raise in the bench's own thread
            self._failure = failure

    def _sample_stage(self, stage: StageSample) -> None:
        dvc, processes = bench_processes()
        with contextlib.suppress(psutil.Error, AttributeError):
            stage.dvc_fds = max(stage.dvc_fds, dvc.num_fds())
            counters = dvc.io_counters()
            stage.dvc_last = [counters.read_chars, counters.write_chars]
        for process in processes:
            with contextlib.suppress(psutil.Error):
                self._sample(stage, process)
        stage.samples += 1

    def _mapped_records(self, pid: int) -> int:
        """Records files in /proc/<pid>/maps (its path column)."""
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                paths = {line.split(maxsplit=5)[-1].rstrip("\n") for line in maps if line.count(" ") >= 5}
        except (FileNotFoundError, ProcessLookupError) as ended:  # it ended after psutil's reads: as psutil says so
            raise psutil.NoSuchProcess(pid) from ended
        return sum(path.startswith(self.records) for path in paths)

    def _sample(self, stage: StageSample, process: psutil.Process) -> None:
        key = f"{process.pid}:{process.create_time()}"
        peak = stage.processes.get(key) or ProcessPeak(" ".join(process.cmdline())[:200])
        files = [opened.path for opened in process.open_files()]
        counters = process.io_counters()
        peak.fds = max(peak.fds, process.num_fds())
        peak.files = max(peak.files, len(files))
        peak.records = max(peak.records, sum(path.startswith(self.records) for path in files))
        peak.mapped = max(peak.mapped, self._mapped_records(process.pid))
        peak.read, peak.written = counters.read_chars, counters.write_chars
        peak.disk_read, peak.disk_written = counters.read_bytes, counters.write_bytes
        stage.processes[key] = peak


# ---------------------------------------------------------------------- DVC's own steps, from its -v lines


@dataclass
class StageLog:
    wall: float  # from its "Running stage" line to the next (or the end)
    command: float  # to DVC's first line after it
    hashing: float
    committing: float
    checks: float  # the lock file, the next stage's checks
    trees: list[str]  # md5s of the trees DVC built meanwhile (with repeats)


class DvcLog:
    """When each line of `dvc repro -v` arrives (a repro's `on_line`), read into DVC's own steps per stage."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.events: list[tuple[float, str, str]] = []  # (when, kind, stage or tree)

    def line(self, text: str) -> None:
        now = time.perf_counter()
        if match := STAGE_LINE.search(text):
            self.events.append((now, "run", match.group(1)))
        elif DVC_LINE.match(text):
            tree = BUILT_TREE.search(text)
            kind = ("tree" if tree else "transfer" if "Preparing to transfer" in text
                    else "reproduced" if "was reproduced" in text else "dvc")
            self.events.append((now, kind, tree.group(1) if tree else ""))

    def before_first_stage(self) -> float:
        return next((at for at, kind, _ in self.events if kind == "run"), time.perf_counter()) - self.started

    def trees(self) -> list[str]:
        return [tree for _, kind, tree in self.events if kind == "tree"]

    def stages(self, ended: float) -> dict[str, StageLog]:
        """Each stage whose command ended (a failed stage's did not, for DVC)."""
        runs = [index for index, (_, kind, _) in enumerate(self.events) if kind == "run"]
        stages = {}
        for number, first in enumerate(runs):
            last = runs[number + 1] if number + 1 < len(runs) else len(self.events)
            started, end = self.events[first][0], self.events[last][0] if last < len(self.events) else ended
            own = self.events[first + 1:last]
            reproduced = next((at for at, kind, _ in own if kind == "reproduced"), None)
            if not own or reproduced is None:
                continue
            command_end = own[0][0]
            transfer = next((at for at, kind, _ in own if kind == "transfer"), reproduced)
            stages[self.events[first][2]] = StageLog(
                wall=end - started, command=command_end - started, hashing=transfer - command_end,
                committing=reproduced - transfer, checks=end - reproduced,
                trees=[tree for _, kind, tree in own if kind == "tree"])
        return stages


def tree_files(project: Path, md5: str) -> int:
    """Files of the tree DVC built as `md5`.dir (its listing in the cache; 0 if not there)."""
    listing = project / ".dvc" / "cache" / "files" / "md5" / md5[:2] / f"{md5[2:]}.dir"
    return len(json.loads(listing.read_text())) if listing.is_file() else 0


# --------------------------------------------------------------------------------------- one tree's runs


@contextlib.contextmanager
def soft_nofile(limit: int):
    """This process's soft open-file limit at `limit` (0: unchanged) while the block runs: what dvc, its stages and
    (forwarded to its copies) the stage server's inherit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit or soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def copy_params(tree: Path, args: argparse.Namespace) -> dict:
    near_empty = merge_params(copy.deepcopy(NEAR_EMPTY), TINY_TRACKING if args.tiny else {})
    return merge_params(near_empty, {
        "data": {"source": "imagefolder", "root": str(tree), "subset": 1.0, "train_shards": args.train_shards,
                 "val_shards": args.val_shards, "convert_workers": args.convert_workers},
        "loader": {"workers": args.loader_workers},
        "model": {"patch_size": 8},
        **{stage: {"img_size": IMAGE_SIZE} for stage in TRAINING},
    })


def failure_line(output: str) -> str:
    """What a failed repro's output says went wrong: the open-file limit's error, else the stage's one-line error,
    else DVC's."""
    lines = output.splitlines()
    for wanted in ("Too many open files", "error: ", " ERROR: "):
        if found := next((line.strip() for line in lines if wanted in line), None):
            return found[:300]
    return lines[-1]


def measured_repro(project: ProjectCopy, nofile: int) -> dict:
    """`dvc repro -v` under the open-file limit, sampled; if it fails, the failure, and the repro finished without
    the limit (what each stage cost comes from the attempt that ran it)."""
    records = (project.path / "data" / "records", project.path / ".dvc" / "cache")
    attempts = []
    for limit in (nofile, 0):
        log = DvcLog()
        with Sampler(records) as sampler, soft_nofile(limit):
            try:
                project.repro("-v", on_stage=sampler.start_stage, on_line=log.line)
                error = None
            except RuntimeError as failure:
                error = failure_line(str(failure)).replace(f"{project.path}{os.sep}", "")
            ended = time.perf_counter()
        attempts.append({"limit": limit, "log": log, "stages": log.stages(ended), "samples": sampler.stages,
                         "error": error})
        if error is None or limit == 0:
            break
        failed = list(sampler.stages)[-1]
        print(f"dvc repro under ulimit -Sn {limit} failed in {failed}: {error}; finishing it without the limit",
              file=sys.stderr, flush=True)
    if attempts[-1]["error"]:
        raise SystemExit(f"dvc repro failed without the open-file limit too: {attempts[-1]['error']}")
    first, last = attempts[0], attempts[-1]
    stages = {**last["stages"], **first["stages"]}  # a stage the first attempt finished: its figures
    order = list(dict.fromkeys([*first["samples"], *last["samples"]]))
    trees = [tree for attempt in attempts for tree in attempt["log"].trees()]
    return {
        "limit_failed": None if first is last else {"stage": list(first["samples"])[-1], "error": first["error"]},
        "stages": {stage: asdict(stages[stage]) for stage in order if stage in stages},
        "samples": {stage: asdict((first if stage in first["stages"] else last)["samples"][stage])
                    for stage in order if stage in stages},
        "before_first_stage": last["log"].before_first_stage(),
        "tree_files": {tree: tree_files(project.path, tree) for tree in set(trees)},
    }


def noop_repros(project: ProjectCopy, repeats: int, nofile: int) -> dict:
    """An untimed `dvc repro -v` (the trees it builds), then `repeats` timed `dvc repro`s."""
    log = DvcLog()
    with soft_nofile(nofile):
        project.repro("-v", on_line=log.line)
        runs = [project.repro() for _ in range(repeats)]
    trees = log.trees()
    return {"seconds": [run.seconds for run in runs], "stage_seconds": [run.stage_seconds for run in runs],
            "tree_stats": sum(tree_files(project.path, tree) for tree in trees)}


def dvc_lock_outputs(project: Path) -> list[Path]:
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return [project / out["path"] for stage in lock["stages"].values() for out in stage.get("outs", [])]


def disk_bytes(paths: list[Path]) -> int:
    """Disk blocks of every file under `paths` (links not followed), each inode once: a hard link costs nothing."""
    seen: dict[tuple[int, int], int] = {}
    for top in paths:
        for path in [top] if top.is_file() else top.rglob("*"):
            stat = path.lstat()
            seen[(stat.st_dev, stat.st_ino)] = stat.st_blocks * 512
    return sum(seen.values())


def cache_overhead(project: ProjectCopy) -> dict:
    outputs = dvc_lock_outputs(project.path)
    alone = disk_bytes(outputs)
    added = disk_bytes([*outputs, project.path / ".dvc" / "cache"]) - alone
    configured = subprocess.run(["dvc", "config", "cache.type"], cwd=project.path, env=project.env,
                                capture_output=True, text=True).stdout.strip()  # nothing (exit 251) when unset
    link_types = ", ".join(re.findall(r"\w+", configured))  # dvc prints a list as ['hardlink', 'symlink']
    return {"outputs_bytes": alone, "added_bytes": added, "cache_type": link_types or "DVC's default (reflink, copy)"}


def output_bytes(project: Path) -> dict[str, int]:
    """Apparent bytes of each stage's outputs (dvc.lock's sizes)."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return {stage: sum(out.get("size", 0) for out in entry.get("outs", [])) for stage, entry in lock["stages"].items()}


def measure_tree(work: Path, train: int, val: int, args: argparse.Namespace) -> dict:
    tree = scale_tree(work, train, val, args.classes)
    files = train + val
    print(f"{tree.name}: {files} files; dvc repro", file=sys.stderr, flush=True)
    path = work / f"project-{tree.name}"
    shutil.rmtree(path, ignore_errors=True)
    project = ProjectCopy(path, copy_params(tree, args))
    result = measured_repro(project, args.nofile)
    print(f"{tree.name}: no-op repros", file=sys.stderr, flush=True)
    result |= {
        "tree": tree.name, "units": {"files": files, "train samples": train, "val samples": val},
        "source_bytes": sum(path.stat().st_size for path in tree.rglob("*.JPEG")),
        "output_bytes": output_bytes(project.path), "cache": cache_overhead(project),
        "noop": noop_repros(project, args.repeats, args.nofile),
    }
    return result


# ------------------------------------------------------------------------------------------ fits, projections


def line_through(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
    """(fixed, per unit) of the line through two points; one x (no unit): the mean, fixed."""
    if x[0] == x[1]:
        return statistics.mean(y), 0.0
    slope = (y[1] - y[0]) / (x[1] - x[0])
    return y[0] - slope * x[0], slope


def dvc_own(stage: dict) -> float:
    return stage["hashing"] + stage["committing"] + stage["checks"]


def records_files(samples: dict) -> int:
    """Opens of records files in a stage: each process's peak of them open or mapped, summed."""
    return sum(max(process["records"], process["mapped"]) for process in samples["processes"].values())


def project_stage(stage: str, small: dict, large: dict) -> dict:
    """The stage's fits and ImageNet-1k's time on local disk and NFS (the model: the module's docstring, the
    report's text)."""
    unit, images_per_unit = UNITS.get(stage, (None, 0.0))
    units = (small["units"].get(unit, 0), large["units"].get(unit, 0))
    fixed, per_unit = line_through(units, (small["stages"][stage]["command"], large["stages"][stage]["command"]))
    wall_fixed, wall_per_unit = line_through(units, (small["stages"][stage]["wall"], large["stages"][stage]["wall"]))
    out = (small["output_bytes"].get(stage, 0), large["output_bytes"].get(stage, 0))
    imagenet_units = IMAGENET_UNITS[unit]
    own = (dvc_own(small["stages"][stage]), dvc_own(large["stages"][stage]))
    if stage == "convert":  # the records: ImageNet's JPEGs passed through, and the framing measured per record
        framing = (large["output_bytes"][stage] - large["source_bytes"]) / large["units"]["files"]
        imagenet_out = IMAGENET_BYTES + framing * IMAGENET_FILES
        dvc_fixed, dvc_per_unit = line_through(out, own)  # per byte: DVC hashes and commits the records
        dvc_units = imagenet_out
    else:
        out_fixed, out_per_unit = line_through(units, out)
        imagenet_out = max(out_fixed, 0) + max(out_per_unit, 0) * imagenet_units
        dvc_fixed, dvc_per_unit = line_through(units, own)
        dvc_units = imagenet_units
    moved = images_per_unit * imagenet_units * IMAGENET_MEAN_BYTES
    # A line through two noisy points can dip below 0: such a fixed cost or slope counts as 0.
    local_command = max(fixed, 0) + max(per_unit, 0) * imagenet_units + moved / LOCAL_BYTES_PER_S
    local_dvc = max(dvc_fixed, 0) + max(dvc_per_unit, 0) * dvc_units
    dvc_stats = sum(large["tree_files"][tree] for tree in large["stages"][stage]["trees"])
    opens = (imagenet_units if stage in ("source", "convert") else 0) + records_files(large["samples"][stage])
    ops = opens + dvc_stats
    nfs_bytes = (moved + imagenet_out) * (1 / NFS_BYTES_PER_S - 1 / LOCAL_BYTES_PER_S)  # DVC reads the outputs once
    return {
        "unit": unit, "fixed": wall_fixed, "per_unit": wall_per_unit, "command_fixed": fixed,
        "command_per_unit": per_unit, "dvc_fixed": dvc_fixed, "dvc_per_unit": dvc_per_unit,
        "imagenet_units": imagenet_units, "imagenet_bytes_moved": moved, "imagenet_output_bytes": imagenet_out,
        "metadata_ops": ops, "local": local_command + local_dvc,
        "nfs": local_command + local_dvc + ops * NFS_OP_SECONDS + nfs_bytes,
    }


def project_noop(small: dict, large: dict) -> dict:
    medians = (statistics.median(small["noop"]["seconds"]), statistics.median(large["noop"]["seconds"]))
    fixed, per_file = line_through((small["units"]["files"], large["units"]["files"]), medians)
    local = max(fixed, 0) + max(per_file, 0) * IMAGENET_FILES
    ops = IMAGENET_FILES + large["noop"]["tree_stats"]  # the listing's stats, and DVC's of the outputs
    return {"fixed": fixed, "per_file": per_file, "local": local, "nfs": local + ops * NFS_OP_SECONDS,
            "metadata_ops": ops}


def quoted_gpu_figures() -> dict:
    """The H200's figures the VOLO-D1 projection quotes: the Trainer's compiled token-label step and the DALI train
    graph's time to its first batch, from the newest bench/results/gpu_check_*.json."""
    files = sorted(RESULTS_DIR.glob("gpu_check_*.json"), key=lambda path: path.name.rsplit("_", 1)[-1])
    if not files:
        raise SystemExit(f"no gpu_check_*.json in {RESULTS_DIR}: the VOLO-D1 projection quotes its H200 figures")
    wanted = {"step": ("gpu_step", "token labels + MixToken, compiled img/s"),
              "first_batch": ("loaders", "dali first batch s"), "loader": ("loaders", "dali img/s, second half")}
    found = {}
    for run in json.loads(files[-1].read_text()):
        for step in run.get("steps", []):
            for name, (step_name, key) in wanted.items():
                if step["name"] == step_name and key in step["figures"]:
                    found[name] = step["figures"][key]
    for name, (step_name, key) in wanted.items():
        if name not in found:
            raise stage_output_error(files[-1], f"{step_name}: {key}", "no such figure")
    return found | {"file": files[-1].name, "device": json.loads(files[-1].read_text())[0]["device"]}


def project_volo(projections: dict[str, dict], profile: dict) -> dict:
    """VOLO-D1's pre-training epochs on one node of the profile's GPUs: the GPU's steps against the rest."""
    gpu = quoted_gpu_figures()
    gpus = profile["launch"]["nnodes"] * profile["launch"]["nproc_per_node"]
    epochs = profile["pretrain"]["epochs"] + profile["pretrain"]["schedule"]["cooldown_epochs"]
    checkpoint_bytes = VOLO_D1_PARAMETERS * 12  # fp32 weights + two moments
    rows = {
        "GPU steps": epochs * IMAGENET_TRAIN / (gpus * gpu["step"]),
        "DALI pipeline start, every epoch": epochs * gpu["first_batch"],
        "validation, every epoch": epochs * IMAGENET_VAL / (gpus * gpu["step"] / FORWARD_SHARE),
        "checkpoint, every epoch": epochs * checkpoint_bytes / LOCAL_BYTES_PER_S,
        "pretrain stage's fixed cost (start-up), once": max(projections["pretrain"]["command_fixed"], 0),
        "source + convert, once (local disk)": projections["source"]["local"] + projections["convert"]["local"],
    }
    return {"gpus": gpus, "epochs": epochs, "quoted": gpu, "rows": rows,
            "nfs_epoch_read": IMAGENET_BYTES / NFS_BYTES_PER_S, "gpu_epoch": IMAGENET_TRAIN / (gpus * gpu["step"])}


# ---------------------------------------------------------------------------------------------- the report


def megabytes(count: float) -> str:
    return f"{count / 1e6:.1f}"


def peak_process(samples: dict) -> dict:
    """The stage's process with the most open descriptors (none sampled: zeros)."""
    return max(samples["processes"].values(), key=lambda process: process["fds"],
               default={"fds": 0, "records": 0, "mapped": 0})


def report(raw: dict, args: argparse.Namespace) -> str:
    profile = raw["profile"]
    small, large, projections, volo = raw["small"], raw["large"], raw["projections"], raw["volo"]
    stage_rows, dvc_rows, projection_rows = [], [], []
    for stage, fit in projections.items():
        samples, log = large["samples"][stage], large["stages"][stage]
        peak = peak_process(samples)
        processes = samples["processes"].values()
        per_thousand = f"{fit['per_unit'] * 1000:.3f}" if fit["unit"] else "-"
        stage_rows.append([
            stage, fit["unit"] or "-", f"{small['stages'][stage]['wall']:.2f}", f"{log['wall']:.2f}",
            f"{fit['fixed']:.2f}", per_thousand, str(peak["fds"]),
            f"{max((process['records'] for process in processes), default=0)} / "
            f"{max((process['mapped'] for process in processes), default=0)}", str(len(processes)),
            megabytes(sum(process["read"] for process in processes)),
            megabytes(sum(process["written"] for process in processes)), f"{dvc_own(log):.2f}",
        ])
        first, last = samples["dvc_first"], samples["dvc_last"]
        dvc_bytes = [last[0] - first[0], last[1] - first[1]] if first else None
        dvc_rows.append([
            stage, f"{log['command']:.2f}", f"{log['hashing']:.2f}", f"{log['committing']:.2f}", f"{log['checks']:.2f}",
            str(len(log["trees"])), str(sum(large["tree_files"][tree] for tree in log["trees"])),
            *([megabytes(count) for count in dvc_bytes] if dvc_bytes else ["-", "-"]), str(samples["dvc_fds"]),
        ])
        projection_rows.append([stage, fit["unit"] or "-", f"{fit['imagenet_units']:,}",
                                f"{fit['imagenet_bytes_moved'] / 1e9:.1f}", f"{fit['imagenet_output_bytes'] / 1e9:.2f}",
                                f"{fit['metadata_ops']:,}", f"{fit['local']:.1f}", f"{fit['nfs']:.1f}"])
    noop = raw["noop_projection"]
    whole_local = sum(fit["local"] for fit in projections.values())
    whole_nfs = sum(fit["nfs"] for fit in projections.values())
    projection_rows += [
        ["whole repro", "-", "-", "-", "-", f"{sum(fit['metadata_ops'] for fit in projections.values()):,}",
         f"{whole_local:.1f}", f"{whole_nfs:.1f}"],
        ["no-op repro", "files", f"{IMAGENET_FILES:,}", "0.0", "-", f"{noop['metadata_ops']:,}", f"{noop['local']:.1f}",
         f"{noop['nfs']:.1f}"],
    ]

    def noop_row(name: str, result: dict) -> list[str]:
        seconds = result["noop"]["seconds"]
        stage = {key: statistics.median(run.get(key, 0.0) for run in result["noop"]["stage_seconds"])
                 for key in ("source", "lineage")}
        return [name, f"{statistics.median(seconds):.2f}", f"{min(seconds):.2f}-{max(seconds):.2f}",
                f"source {stage['source']:.2f} s, lineage {stage['lineage']:.2f} s, DVC's own "
                f"{statistics.median(seconds) - sum(stage.values()):.2f} s; {result['noop']['tree_stats']:,} files in "
                "the trees DVC built"]

    cache = large["cache"]
    overhead = cache["added_bytes"] / cache["outputs_bytes"]
    failed = large["limit_failed"] or small["limit_failed"]
    limit = f"ulimit -Sn {args.nofile}" if args.nofile else "the inherited open-file limit"
    summary_rows = [
        ["whole repro, small tree", f"{sum(s['wall'] for s in small['stages'].values()):.1f}", "-",
         f"{small['tree']}; DVC before the first stage {small['before_first_stage']:.2f} s"],
        ["whole repro, large tree", f"{sum(s['wall'] for s in large['stages'].values()):.1f}", "-",
         f"{large['tree']}; DVC before the first stage {large['before_first_stage']:.2f} s"],
        noop_row("no-op repro, small tree", small), noop_row("no-op repro, large tree", large),
        ["cache overhead", f"{overhead * 100:.1f} %", "-",
         f"{megabytes(cache['added_bytes'])} MB on disk added by .dvc/cache over the outputs' "
         f"{megabytes(cache['outputs_bytes'])} MB (cache.type: {cache['cache_type']})"],
        ["open-file limit", limit, "-", "passed" if not failed else f"FAILED in {failed['stage']}: {failed['error']}"],
    ]
    profile_line = (f"{PROFILE.name}: train_shards {profile['data']['train_shards']}, val_shards "
                    f"{profile['data']['val_shards']}, loader.workers {profile['loader']['workers']}, "
                    f"data.convert_workers {profile['data']['convert_workers']}")
    ran = (f"ran: {args.train_shards} + {args.val_shards} shards, {args.loader_workers} loader workers, "
           f"{args.convert_workers} convert workers")
    volo_rows = [[name, f"{seconds / 3600:.2f}", f"{seconds / sum(volo['rows'].values()) * 100:.1f} %"]
                 for name, seconds in volo["rows"].items()]
    total = sum(volo["rows"].values())
    volo_rows.append(["total", f"{total / 3600:.2f}", "100.0 %"])
    gpu_share = volo["rows"]["GPU steps"] / total
    goals = [
        goal(f"the cache adds <= {GOAL_CACHE_OVERHEAD:.0%} over the outputs", overhead <= GOAL_CACHE_OVERHEAD,
             f"{overhead * 100:.1f} %, cache.type {cache['cache_type']}"),
        goal(f"no-op dvc repro on the scale tree <= {GOAL_NOOP_SECONDS:g} s",
             statistics.median(large["noop"]["seconds"]) <= GOAL_NOOP_SECONDS,
             f"{statistics.median(large['noop']['seconds']):.2f} s"),
        goal(f"no-op dvc repro projected to ImageNet-1k <= {GOAL_NOOP_IMAGENET_SECONDS:g} s on local disk",
             noop["local"] <= GOAL_NOOP_IMAGENET_SECONDS, f"{noop['local']:.1f} s"),
        goal(f"a whole dvc repro of the scale tree passes under {limit}", not failed,
             "passed" if not failed else f"failed in {failed['stage']}"),
    ]
    text = [
        header_line(),
        "",
        f"Two ImageFolder trees of {IMAGE_SIZE} px solid-colour JPEGs in {args.classes} class folders named like "
        f"WordNet ids: {small['tree']} and {large['tree']}; in a fresh project copy each (bench/startup.py's "
        f"near-empty params: 1 epoch per training stage, every img_size {IMAGE_SIZE}, model.patch_size 8, "
        f"data.subset 1{', no MLflow models' if args.tiny else ''}), `dvc repro -v` under {limit}. "
        f"{profile_line}; {ran}. Open files and bytes sampled every {SAMPLE_SECONDS * 1000:.0f} ms per process "
        "(MB = 10^6 bytes); fixed and per-unit costs: the line through the two trees' wall times.",
        "",
        markdown_table(["stage", "unit", "wall s, small", "wall s, large", "fixed s", "s per 1,000 units",
                        "open fds per process, peak", "records files open / mapped per process, peak",
                        "processes", "read MB",
                        "written MB", "DVC's own s"], stage_rows),
        "",
        f"DVC's own time per stage on {large['tree']} (from the arrival of `dvc repro -v`'s lines; a repro checks "
        "nothing out and waits for no lock of its own), the trees it built (each file a stat, or a hash when new), "
        "its bytes read and written (rchar, wchar) and its open descriptors (peak):",
        "",
        markdown_table(["stage", "command s", "hashing outputs s", "committing to the cache s",
                        "checks before the next s", "trees built", "files in them", "dvc read MB", "dvc written MB",
                        "dvc fds, peak"], dvc_rows),
        "",
        markdown_table(["measure", "value", "range", "detail"], summary_rows),
        "",
        f"Projected to ImageNet-1k ({IMAGENET_TRAIN:,} train + {IMAGENET_VAL:,} val files, {IMAGENET_BYTES / 1e9:.0f} "
        f"GB, {args.classes} classes, the profile's shards). Model: a stage's fixed cost + its cost per unit x "
        "ImageNet's units (both measured here, on this CPU, tiny models and 32 px images: a training stage's "
        f"per-sample cost is this CPU's, not a GPU's) + the image bytes it moves at ImageNet's mean "
        f"{IMAGENET_MEAN_BYTES / 1e3:.0f} KB per file over the disk; + DVC's own time, fitted the same way (convert's "
        "per byte of the records, x ImageNet's bytes + the framing measured per record); a fit below 0 (noise) "
        f"counts as 0. Local disk: {LOCAL_BYTES_PER_S / 1e9:g} GB/s, its metadata costs as measured here. NFS: "
        f"{NFS_BYTES_PER_S / 1e9:g} GB/s for the bytes moved and for DVC reading the outputs once, plus "
        f"{NFS_OP_SECONDS * 1e3:g} ms per metadata operation (a stat or open): per file listed or converted, per "
        "records file each process opened or mapped, per file of every tree DVC built. Decoding and the models' "
        "compute at ImageNet's size are not in it (the GPU's, below).",
        "",
        markdown_table(["stage", "unit", "ImageNet units", "image GB moved", "output GB", "metadata ops",
                        "local disk s", "NFS s"], projection_rows),
        "",
        f"VOLO-D1's {volo['epochs']} pre-training epochs on one node of {volo['gpus']} GPUs ({PROFILE.name}). "
        f"Quoted from {volo['quoted']['file']} ({volo['quoted']['device']}): the Trainer's compiled token-label + "
        f"MixToken step at {volo['quoted']['step']:.0f} img/s per GPU and the DALI train graph's "
        f"{volo['quoted']['first_batch']:.2f} s to an epoch's first batch (its rate over an epoch's second half, "
        f"{volo['quoted']['loader']:.0f} img/s with 8 threads, is near the step's: the loader needs its CPU cores). "
        f"Modelled: validation at the step's rate / {FORWARD_SHARE:.2f} (a forward), a checkpoint of "
        f"{VOLO_D1_PARAMETERS / 1e6:.1f} M parameters x 12 bytes per epoch at {LOCAL_BYTES_PER_S / 1e9:g} GB/s. "
        "Measured here: the pretrain stage's fixed cost and the one-off stages' projection. Not in it: token_labels "
        "(the profile's NFNet-F6 teacher at 576 px, no GPU figure) and fine-tuning.",
        "",
        markdown_table(["part", "hours", "share"], volo_rows),
        "",
        f"The GPU's share: {gpu_share * 100:.1f} %. On NFS, reading the records once per epoch "
        f"({IMAGENET_BYTES / 1e9:.0f} GB at {NFS_BYTES_PER_S / 1e9:g} GB/s) takes {volo['nfs_epoch_read']:.0f} s "
        f"against the GPUs' {volo['gpu_epoch']:.0f} s per epoch, unless the page cache holds them.",
        "",
        "Goals: " + "; ".join(goals) + ".",
    ]
    return "\n".join(text)


def main() -> None:
    args = parse_args()
    # Every stage in a process of its own under dvc, as users run them (another stage server's stages would run
    # outside the sampled trees); --tiny runs them in a server of its own, whose copies it samples.
    os.environ.pop(stage_server.SERVER_ENV, None)
    profile = yaml.safe_load(PROFILE.read_text())
    raw: dict = {"profile": {"data": profile["data"], "loader": profile["loader"]}}
    with workspace(args.workdir) as work, contextlib.ExitStack() as stack:
        if args.tiny:
            os.environ[stage_server.SERVER_ENV] = str(stack.enter_context(stage_server.running()))
        sizes = {"small": (round(args.train_images * args.small), round(args.val_images * args.small)),
                 "large": (args.train_images, args.val_images)}
        for name, (train, val) in sizes.items():
            raw[name] = measure_tree(work, train, val, args)
    raw["projections"] = {stage: project_stage(stage, raw["small"], raw["large"]) for stage in raw["large"]["stages"]}
    raw["noop_projection"] = project_noop(raw["small"], raw["large"])
    raw["volo"] = project_volo(raw["projections"], profile)
    text = report(raw, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
