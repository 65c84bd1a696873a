"""What the benchmarks share: a synthetic photo-like JPEG tree, interleaved timing, the report (header line,
markdown table, JSON).

The machine is often shared, so absolute numbers drift: every benchmark times all its variants in one run,
interleaved (repeat r runs every variant once, starting at a rotating variant), and reports medians and
ratios between variants of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import yaml
from PIL import Image, ImageDraw, ImageFilter

from coarse2fine.config import Params, parse_params
from coarse2fine.data import records
from coarse2fine.data.convert import convert
from coarse2fine.data.sources import write_digits
from coarse2fine.distributed import Runtime
from coarse2fine.labels.store import TokenLabelStore, write_store
from coarse2fine.training import losses
from coarse2fine.training.train import StagePaths, Trainer

# ImageNet-1k (ILSVRC 2012): images per split and classes, what the scale benches project to.
IMAGENET_TRAIN, IMAGENET_VAL, IMAGENET_CLASSES = 1_281_167, 50_000, 1000
PHOTO_SIZE = (500, 375)  # width, height: a typical ImageNet / Pascal VOC photo
JPEG_QUALITY = 90
CPU = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))  # one rank, no process group


def photo_like(seed: int, size: tuple[int, int] = PHOTO_SIZE) -> Image.Image:
    """A smooth colour field, blurred shapes, grain-sized texture and sensor-like noise: at quality 90 it is about
    90 KB at 500x375 and decodes in about 2 ms, like a typical ImageNet photo (flat colour would be far smaller and
    faster, white noise far larger and slower)."""
    rng = np.random.default_rng(seed)
    width, height = size
    field = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)).resize(size, Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(field)
    for _ in range(rng.integers(4, 10)):
        x0, y0 = rng.integers(-width // 4, width), rng.integers(-height // 4, height)
        x1, y1 = x0 + rng.integers(20, width // 2), y0 + rng.integers(20, height // 2)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    pixels = np.asarray(field.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.int16)
    grain = rng.integers(0, 256, (height // 2, width // 2), dtype=np.uint8)
    texture = np.asarray(Image.fromarray(grain).resize(size, Image.Resampling.BICUBIC), dtype=np.int16)
    pixels += ((texture - 128) * 60 // 128)[..., None]  # luminance texture, up to +-60
    pixels += rng.integers(-12, 13, pixels.shape, dtype=np.int16)  # per-channel sensor noise
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def _write_photo(job: tuple[Path, int]) -> None:
    path, seed = job
    photo_like(seed).save(path, "JPEG", quality=JPEG_QUALITY)


def photo_tree(work: Path, *, train_images: int, val_images: int, classes: int = 10) -> Path:
    """An ImageFolder tree work/photos-T+V/{train,val}/class_XX/NNNNN.jpg of `photo_like` JPEGs, spread evenly
    over the classes. Deterministic; a finished tree of the same spec (in a kept --workdir) is reused."""
    spec = {"train": train_images, "val": val_images, "classes": classes, "size": PHOTO_SIZE, "quality": JPEG_QUALITY}
    root = work / f"photos-{train_images}+{val_images}"
    marker = root.with_name(f"{root.name}.json")  # written last: marks the tree complete
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == json.loads(json.dumps(spec)):
        return root
    shutil.rmtree(root, ignore_errors=True)
    jobs = []
    for split in ("train", "val"):
        for label in range(classes):
            folder = root / split / f"class_{label:02d}"
            folder.mkdir(parents=True)
            count = spec[split] // classes + (label < spec[split] % classes)
            jobs += [(folder / f"{number:05d}.jpg", len(jobs)) for number in range(count)]
    with Pool(len(os.sched_getaffinity(0))) as pool:
        pool.map(_write_photo, jobs, chunksize=32)
    marker.write_text(json.dumps(spec), encoding="utf-8")
    return root


@contextlib.contextmanager
def workspace(workdir: Path | None) -> Iterator[Path]:
    """`workdir` (kept), or a temporary directory removed afterwards."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        yield workdir
        return
    with tempfile.TemporaryDirectory(prefix="coarse2fine-bench-") as temporary:
        yield Path(temporary)


def digits_tree(work: Path, params: Params, keep_per_class: dict[str, int] | None = None) -> Path:
    """scikit-learn's digits as an ImageFolder under `work` (PNG, params.data.digits' size; reused if a kept
    --workdir has it); `keep_per_class` (split -> n) keeps each class folder's first n images."""
    tree = work / ("digits-subset" if keep_per_class else "digits")
    if tree.is_dir():
        return tree
    partial = tree.with_name(f"{tree.name}.partial")  # renamed when complete: an interrupted write is not reused
    shutil.rmtree(partial, ignore_errors=True)
    write_digits(partial, params.data.digits, params.seed)
    for split, keep in (keep_per_class or {}).items():
        for folder in (partial / split).iterdir():
            for image in sorted(folder.iterdir())[keep:]:
                image.unlink()
    return partial.rename(tree)


def imagefolder_params(root: Path, convert_workers: int = 2) -> Params:
    """The project's params (schema defaults) for converting the ImageFolder tree at `root`."""
    return parse_params({"data": {"source": "imagefolder", "root": str(root), "convert_workers": convert_workers}})


def run_convert(params: Params, out: Path) -> dict:
    """The library's convert stage on one rank; its progress and summary go to stderr, away from the report."""
    with contextlib.redirect_stdout(sys.stderr):
        return convert(params, CPU, out)


def convert_tree(root: Path, out: Path) -> Path:
    """`root` converted into records at `out` (reused if a finished conversion of `root` is already there)."""
    manifest = out / records.MANIFEST_FILE
    if not (manifest.is_file() and records.read_manifest(out)["source"].get("root") == str(root)):
        run_convert(imagefolder_params(root), out)
    return out


def tree_stats(root: Path) -> tuple[int, int]:
    """(files, bytes) under root."""
    sizes = [path.stat().st_size for path in root.rglob("*") if path.is_file()]
    return len(sizes), sum(sizes)


def interleaved(
    variants: dict[str, Callable[[], int]], repeats: int, before: Callable[[], None] = lambda: None
) -> dict[str, list[float]]:
    """Items per second of each variant, `repeats` times. A variant is a call that does one unit of work
    (an epoch, a conversion) and returns how many items it handled; `before` runs untimed ahead of every call
    (e.g. deleting the last run's output). Every variant runs once untimed first (warm-up: worker start, page
    cache, first-graph costs); then the repeats run interleaved, each repeat starting at the next variant so
    none always follows the same neighbour."""
    for run in variants.values():
        before()
        run()
    names = list(variants)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            before()
            started = time.perf_counter()
            items = variants[name]()
            rates[name].append(items / (time.perf_counter() - started))
        progress = ", ".join(f"{name} {values[-1]:.0f}/s" for name, values in rates.items())
        print(f"repeat {repeat + 1}/{repeats}: {progress}", file=sys.stderr)
    return rates


class CpuTimed:
    """A variant call that also records its items per CPU-second of this process (first call: the warm-up)."""

    def __init__(self, run: Callable[[], int]):
        self.run = run
        self.rates: list[float] = []

    def __call__(self) -> int:
        started = time.process_time()
        items = self.run()
        self.rates.append(items / (time.process_time() - started))
        return items

    def cpu_ms_per_item(self) -> float:
        """CPU milliseconds per item, median of the timed calls (the warm-up left out)."""
        return 1000 / statistics.median(self.rates[1:])


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def header_line() -> str:
    """Machine, date, load, the code's commit and the command line, for the top of a report."""
    cores = len(os.sched_getaffinity(0))
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    script = Path(sys.argv[0]).resolve()  # as run from the project root: no path of this machine in a result file
    script = script.relative_to(PROJECT_ROOT) if script.is_relative_to(PROJECT_ROOT) else script
    command = shlex.join(["python", str(script), *sys.argv[1:]])
    return f"{cores} cores ({cpu_model()}), {date}, load average {load}; commit {commit()}; command: `{command}`"


def commit() -> str:
    """The checkout's commit, `-dirty` when its tracked files were changed; `unknown` outside a git checkout."""
    described = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True)
    return described.stdout.strip() if described.returncode == 0 else "unknown"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    header, *body = [[str(cell).replace("|", "\\|") for cell in line] for line in [headers, *rows]]  # | ends a cell
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    lines = [header, ["-" * width for width in widths], *body]
    return "\n".join("| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths)) + " |" for line in lines)


# The goal lines this process's report states, in order: its result file's JSON lists them (`goals`), and
# run_all.py's summary of a `make bench` run is made from those lists.
GOALS: list[str] = []
GOAL_LINE = re.compile(r"(?P<text>.*): (?P<verdict>met|MISSED|not checked) \((?P<measured>.*)\)$")


def goal(text: str, met: bool | None, measured: str) -> str:
    """One goal line; `met` None: not checked (what it needs did not run), `measured` says why."""
    verdict = "not checked" if met is None else "met" if met else "MISSED"
    GOALS.append(f"{text}: {verdict} ({measured})")
    return GOALS[-1]


def add_common_arguments(parser: argparse.ArgumentParser, *, repeats: int) -> None:
    parser.add_argument(
        "--imagefolder", type=Path, metavar="PATH", help="a real tree PATH/{train,val}/<class>/*, not synthetic photos"
    )
    parser.add_argument(
        "--repeats", type=int, default=repeats, metavar="N", help=f"timed repeats per variant (default: {repeats})"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    parser.add_argument(
        "--workdir", type=Path, metavar="DIR", help="keep the generated tree and outputs here (default: a temp dir)"
    )


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """--threads: torch's intra-op threads for a bench that times training steps in its own process."""
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), metavar="N",
                        help=f"torch intra-op threads (default: {torch.get_num_threads()}, this machine's default)")


def add_workdir_arguments(parser: argparse.ArgumentParser, kept: str) -> None:
    """--workdir (where `kept` is kept) and --refresh-params (project_copy)."""
    parser.add_argument("--workdir", type=Path, default=None, help=f"keep {kept} here (default: a temp dir)")
    parser.add_argument("--refresh-params", action="store_true",
                        help="a kept --workdir's project copy made with other params (a default changed since): commit "
                             "today's there, so only the stages they reach rerun (its code must be this checkout's)")


def add_tiny_argument(parser: argparse.ArgumentParser, sizes: str) -> None:
    """--tiny, and --results (write_results: a tiny run writes no dated report unless given a folder)."""
    parser.add_argument(
        "--tiny", action="store_true",
        help="a smoke test of the bench itself (tests/test_benches.py): the same code path at the smallest sizes, "
        f"figures that measure nothing: {sizes} (options given on the command line win)",
    )
    add_results_argument(parser)


def add_results_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=None, metavar="DIR",
                        help="write the dated report here (default: bench/results; none with --tiny)")


def tiny_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace, **sizes: object) -> None:
    """With --tiny, `sizes` (option name -> value) replace the options left at their defaults."""
    if args.tiny:
        for name, value in sizes.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)


def plain_options(args: argparse.Namespace) -> dict:
    """The options as JSON takes them: paths (alone or in lists) as strings."""
    def plain(value: object) -> object:
        if isinstance(value, list):
            return [plain(item) for item in value]
        return str(value) if isinstance(value, Path) else value

    return {key: plain(value) for key, value in vars(args).items()}


def write_json(
    args: argparse.Namespace, text: str, raw: dict, topic: str | None = None, machine: str | None = None
) -> None:
    """The report, the options and the raw numbers: to --json PATH if given, and as the bench's dated result file
    (write_results; its topic the bench's name unless `topic` names a variant, its machine this one unless `machine`
    names the one that ran what the report shows)."""
    if args.json is not None:
        report = {"report": text, "args": plain_options(args), "goals": GOALS, **raw}
        args.json.parent.mkdir(parents=True, exist_ok=True)  # a missing folder would stop a bench after its first run
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    write_results(args, topic or Path(sys.argv[0]).stem, text, raw, machine)


def random_store(directory: Path, records: int, *, num_classes: int, top_k: int, grid: int, seed: int) -> TokenLabelStore:
    """A token-label store of random teacher maps for `records` records: each cell's top-k log-probabilities of
    random scores (distinct classes), as the token_labels stage writes them."""
    scores = torch.randn(records, num_classes, grid, grid, generator=torch.Generator().manual_seed(seed))
    log_probs, classes = scores.log_softmax(dim=1).topk(top_k, dim=1)
    write_store(directory, log_probs.half().numpy(), classes.numpy(), num_classes=num_classes)
    return TokenLabelStore(directory, records=records, num_classes=num_classes)


def bench_trainer(
    params: Params, model: torch.nn.Module, runtime: Runtime, scratch: Path, *, num_classes: int,
    train_loader: Iterable, val_loader: Iterable, token_labels: bool,
) -> Trainer:
    """The stages' Trainer for params.pretrain (with the defaults' token-label objective when `token_labels`), its
    files under `scratch`."""
    objective = losses.TokenLabelObjective.from_params(num_classes, params.pretrain) if token_labels else None
    return Trainer(
        stage="bench", params=params, cfg=params.pretrain, model=model, classes=[str(i) for i in range(num_classes)],
        train_loader=train_loader, val_loader=val_loader, runtime=runtime, param_sections=("pretrain",),
        provenance={"data_digest": "random"}, paths=StagePaths.under(scratch), objective=objective,
    )


class TrainerSteps:
    """Real Trainer updates (backward, optimizer step) over the batches `batches()` gives per call; returns the
    images trained, with the device synchronised."""

    def __init__(self, trainer: Trainer, batches: Callable[[], Iterable[dict[str, torch.Tensor]]]):
        self.trainer, self.batches = trainer, batches

    def __call__(self) -> int:
        self.trainer.train_forward.train()
        images = 0
        for batch in self.batches():
            self.trainer.backward(batch, micro_steps=1, sync=True)
            self.trainer.optimizer_step()
            images += len(batch["label"])  # a shape: no wait for the device
        self.trainer.runtime.synchronize()
        return images


RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_slug() -> str:
    """A result file's machine: the cores and the accelerator or CPU model, e.g. `2cpu-amd-epyc`."""
    cores = len(os.sched_getaffinity(0))
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}gpu-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower())
    words = re.sub(r"[^a-z0-9]+", " ", re.sub(r"\((r|tm)\)", "", cpu_model().lower())).split()
    return f"{cores}cpu-" + "-".join(words[:2])


def write_results(
    args: argparse.Namespace, topic: str, text: str, raw: dict, machine: str | None = None
) -> Path | None:
    """The report as `<results>/<topic>_<machine>_<date>.md` and the raw numbers beside it as .json (`args.results`,
    default bench/results; nothing with --tiny unless --results is given): the docs quote these files. A second
    run on the same day and machine replaces the first's. `machine`: machine_slug() unless given."""
    folder = args.results if args.results is not None else None if args.tiny else RESULTS_DIR
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{topic}_{machine or machine_slug()}_{datetime.date.today().isoformat()}.md"
    path.write_text(text + "\n", encoding="utf-8")
    numbers = {"args": plain_options(args), "goals": GOALS, **raw}
    path.with_suffix(".json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    print(f"written: {path.relative_to(folder.parent) if folder == RESULTS_DIR else path}", flush=True)
    return path


# ----------------------------------------------------------------------------------- a DVC project copy

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STAGE_LINE = re.compile(r"Running stage '([\w@-]+)'")
# The shipped params cut to almost no work: bench/startup.py's copy, and the one copy the pipeline benches' --tiny
# runs share in the test suite (startup makes it, the others reuse it from the same --workdir: see project_copy).
NEAR_EMPTY = {
    "data": {"subset": 0.1},
    **{stage: {"epochs": 1} for stage in ("teacher", "pretrain", "finetune")},
    "evaluate": {"pretrain": {"extra_sizes": []}, "finetune": {"extra_sizes": []}},
}
# What every --tiny copy adds to its params: no MLflow model per training stage. Its torch.export took 3.6 s of a
# near-empty pretrain stage's 5.9 (2 Intel Xeon cores, 2026-11-28), which the test suite's tiny runs paid about fifty
# times; a bench's own runs keep the shipped tracking, as a user's stage has it (tests/test_pipeline.py checks the
# logged and registered model).
TINY_TRACKING = {"tracking": {"log_models": False}}
# --tiny's near-empty copy: startup.py --tiny makes it, the other pipeline benches' --tiny reuse it.
TINY_NEAR_EMPTY = {**NEAR_EMPTY, **TINY_TRACKING}
NEAR_EMPTY_TINY = ("bench/startup.py's near-empty copy (data.subset 0.1, 1 epoch per training stage, no extra "
                   "evaluation sizes, no MLflow models; reused from a --workdir where startup.py --tiny ran)")  # help
# The digits copy of bench/optimizers.py --tiny and bench/scaling.py --tiny (a tenth of the digits at 32 px, the
# schema's stem stride: 2 x 2 tokens), which runs only convert: one for both in a shared --workdir (project_copy).
TINY_DIGITS = {"data": {"source": "digits", "subset": 0.1}, "model": {"patch_size": 8}, "pretrain": {"img_size": 32},
               **TINY_TRACKING}
COPY_DIR = "project"  # a bench's project copy in its --workdir


def merge_params(base: dict, change: dict) -> dict:
    """`change` merged into `base` (nested dicts merged key by key), in place; returns base."""
    for key, value in change.items():
        if isinstance(value, dict):
            merge_params(base.setdefault(key, {}), value)
        else:
            base[key] = value
    return base


def stage_output_error(path: Path, key: str, found: object) -> SystemExit:
    """The one-line failure of a bench whose stage (or peer tool) no longer writes what the bench reads."""
    return SystemExit(f"{path}: no {key!r} (found: {found}): what the bench reads changed shape; update the bench")


def read_metric(path: Path, key: str) -> float:
    """`key` of the JSON metrics file at `path`, or a one-line exit naming both."""
    if not path.is_file():
        raise stage_output_error(path, key, "no such file")
    metrics = json.loads(path.read_text(encoding="utf-8"))
    if key not in metrics:
        raise stage_output_error(path, key, ", ".join(metrics) or "no keys")
    return float(metrics[key])


def read_column(path: Path, key: str, delimiter: str) -> list[float]:
    """Column `key` of the CSV/TSV table at `path` (a DVC plots file, timm's summary.csv), or a one-line exit."""
    if not path.is_file():
        raise stage_output_error(path, key, "no such file")
    with open(path, newline="", encoding="utf-8") as table:
        reader = csv.DictReader(table, delimiter=delimiter)
        if key not in (reader.fieldnames or []):
            raise stage_output_error(path, key, ", ".join(reader.fieldnames or []) or "an empty file")
        return [float(row[key]) for row in reader]


@dataclass
class Repro:
    seconds: float  # wall time of the whole `dvc repro`
    stage_seconds: dict[str, float]  # per stage that ran: from its "Running stage" line to the next one / the end
    output: str


class ProjectCopy:
    """The project's pipeline (dvc.yaml, params.yaml, stages/, src/, .dvc/) in a fresh git repository at `path`,
    as a user's clone would be (like tests/test_pipeline.py's fixture), with `params` changes applied and committed.
    Tools run from the interpreter's environment; MLflow logs into the copy. `source`: the tree it is copied from
    (default: this checkout; another commit's, for a before/after comparison)."""

    def __init__(self, path: Path, params: dict, source: Path = PROJECT_ROOT):
        self.path = path
        path.mkdir(parents=True)
        for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
            shutil.copy(source / name, path / name)
        for name in ("stages", "src"):
            shutil.copytree(source / name, path / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copytree(source / ".dvc", path / ".dvc", ignore=shutil.ignore_patterns("tmp", "cache"))
        self.env = self._tool_env(path)
        self.edit_params(params)
        self.run("git", "init", "-q")
        self.run("git", "add", "-A")
        self.run("git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "bench")

    @classmethod
    def reopen(cls, path: Path) -> ProjectCopy:
        """A copy made earlier (in a kept --workdir), with its params.yaml back at the committed one: what its stages
        wrote stays in DVC's cache, so a later run reuses every stage its changes do not reach."""
        project = cls.__new__(cls)
        project.path, project.env = path, cls._tool_env(path)
        project.run("git", "checkout", "-q", "HEAD", "--", "params.yaml")
        return project

    @staticmethod
    def _tool_env(path: Path) -> dict[str, str]:
        return {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "DVC_NO_ANALYTICS": "1",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_TRACKING_URI": f"sqlite:///{path / 'mlflow.db'}",
        }

    def run(self, *command: str) -> str:
        """Run a command in the copy; its output, or an error with the output if it fails."""
        result = subprocess.run(command, cwd=self.path, env=self.env, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{shlex.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def edit_params(self, change: dict) -> None:
        path = self.path / "params.yaml"
        path.write_text(yaml.safe_dump(merge_params(yaml.safe_load(path.read_text()), change), sort_keys=False))

    def repro(self, *args: str, on_stage: Callable[[str], None] = lambda stage: None,
              on_line: Callable[[str], None] = lambda line: None) -> Repro:
        """`dvc repro ARGS`, timed; stage times come from when each "Running stage" line arrives, and `on_stage`
        gets the stage's name then (bench/memory.py attributes its memory samples by it); `on_line` gets every line
        of the output as it arrives (bench/scale.py times DVC's own steps by them)."""
        return self.timed_dvc("repro", *args, on_stage=on_stage, on_line=on_line)

    def timed_dvc(self, *args: str, on_stage: Callable[[str], None] = lambda stage: None,
                  on_line: Callable[[str], None] = lambda line: None) -> Repro:
        """`dvc ARGS` (repro, or exp run), timed as `repro` says."""
        started = time.perf_counter()
        marks: list[tuple[str, float]] = []
        lines = []
        with subprocess.Popen(
            ["dvc", *args], cwd=self.path, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process:
            for line in process.stdout:
                lines.append(line)
                on_line(line)
                if match := STAGE_LINE.search(line):
                    marks.append((match.group(1), time.perf_counter()))
                    on_stage(match.group(1))
        ended = time.perf_counter()
        output = "".join(lines)
        if process.returncode:
            raise RuntimeError(f"dvc {' '.join(args)} failed ({process.returncode}):\n{output}")
        ends = [at for _, at in marks[1:]] + [ended]
        return Repro(ended - started, {stage: end - at for (stage, at), end in zip(marks, ends)}, output)


def project_copy(work: Path, params: dict, refresh_params: bool = False) -> ProjectCopy:
    """The project copy at work/COPY_DIR: the one a kept --workdir holds if it was made from this checkout's code and
    with the same `params` (what its stages wrote is reused: DVC runs only what a bench changes), else a new one.
    `refresh_params`: a kept copy whose params alone differ gets these committed, so only the stages they reach rerun
    (a default changed since the copy was made; DVC's run cache still holds the old params' outputs)."""
    path = work / COPY_DIR
    if not (path / "params.yaml").is_file():
        return ProjectCopy(path, params)
    if changed := code_difference(path):
        raise SystemExit(f"{path} holds a project copy made from other code ({changed} differs): use another --workdir")
    project = ProjectCopy.reopen(path)
    wanted = merge_params(yaml.safe_load((PROJECT_ROOT / "params.yaml").read_text()), params)
    if yaml.safe_load((path / "params.yaml").read_text()) != wanted:
        if not refresh_params:
            raise SystemExit(f"{path} holds a project copy made with other params: use another --workdir, or "
                             "--refresh-params to commit today's there")
        (path / "params.yaml").write_text(yaml.safe_dump(wanted, sort_keys=False))
        project.run("git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm",
                    "bench: params refreshed", "--", "params.yaml")
    return project


def code_difference(copy: Path) -> str | None:
    """The first of the pipeline's files (dvc.yaml, stages/, src/) in which a project copy differs from this
    checkout, or None: a kept copy must run today's code, or its figures are not today's."""
    def built(file: Path) -> bool:  # what Python and pip write beside the code
        return "__pycache__" in file.parts or any(part.endswith(".egg-info") for part in file.parts)

    def files(root: Path) -> set[str]:
        found = {"dvc.yaml"}
        for folder in ("stages", "src"):
            found |= {str(file.relative_to(root)) for file in (root / folder).rglob("*")
                      if file.is_file() and not built(file)}
        return found
    ours, theirs = files(PROJECT_ROOT), files(copy)
    for name in sorted(ours | theirs):
        if name not in ours or name not in theirs or (PROJECT_ROOT / name).read_bytes() != (copy / name).read_bytes():
            return name
    return None
