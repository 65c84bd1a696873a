"""One command checks a GPU node: `python -m coarse2fine.gpu_check [--out DIR]` (`make gpu-check`; docs/gpu.md).

Run from the project's checkout (it runs the checkout's tests/, bench/ and pipeline). Each step runs in a process
of its own with its own timeout, so a hung DALI pipeline or compile stops only its step:
- pytest: the GPU smoke tests, `pytest -m "gpu and not slow" tests/test_gpu.py` (its slow test, every stage under
  DVC, is the dvc step here, on the photos);
- dali_train_graph: one epoch of the DALI loader's train graph on the device, the recipe's augment
  (profiles/volo_d1.yaml: RandAugment, random erasing, flip) at 224 px, each batch checked against the loaders'
  contract;
- loaders: both loaders' throughput at 224 px with that augment, bench/loader.py's rows on the device;
- dvc: one epoch of every stage through DVC on the photos with `launch.device: cuda`, in a project copy;
- timm_gpu_step, gpu_step: timm's bare training loop and the Trainer's step, eager and compiled.
It writes DIR/report.md and DIR/report.json (device, versions, every figure, each step's status and time; each
step's output in DIR/logs/) and exits 1 if a step failed, 2 without a usable CUDA GPU. A step whose modules or
programs are missing fails with that reason instead of running.

`--cpu-dry-run` runs the same steps on the CPU at tiny sizes, figures that measure nothing: how the suite tests
this command (tests/test_gpu_check.py) and how a wheelhouse install is checked (scripts/check_wheelhouse.sh).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable
from xml.etree import ElementTree

import torch

NO_GPU_EXIT = 2
RECIPE_PROFILE = Path("profiles/volo_d1.yaml")  # the recipe's augment: this profile's `augment` section
VAL_PHOTOS = 40
TRAINING_STAGES = ("teacher", "pretrain", "finetune")
ANNOUNCED = re.compile(r"^([\w@ ()-]+): device (\S+) x\d+", re.MULTILINE)  # each stage's start-up line
Figures = dict[str, float]


@dataclass(frozen=True)
class Check:
    project: Path  # the checkout whose tests, benches and pipeline run
    work: Path  # scratch the steps share (the synthetic photos and their records), removed at the end
    dry_run: bool

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.dry_run else torch.device("cuda", 0)

    def size(self, *, gpu: int, dry_run: int) -> int:
        return dry_run if self.dry_run else gpu

    @property
    def img_size(self) -> int:
        """The loaders' output side: the recipe's 224 px on a GPU."""
        return self.size(gpu=224, dry_run=64)


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    timeout_s: int  # about twice what the step is expected to take on one H100 (docs/gpu.md)
    command: Callable[[Check, Path], list[str]]  # (check, the JSON file the step writes) -> its command line
    modules: tuple[str, ...] = ()
    programs: tuple[str, ...] = ()
    # The step's figures from its JSON: a worker step's own, a bench's median img/s per row.
    figures: Callable[[dict], Figures] = lambda results: results["figures"]


# ----------------------------------------------------------------------------------------- the steps' workers
# Worker steps run this module again with --run-step NAME; each returns its figures and a Markdown report.


def smoke_tests(check: Check) -> tuple[Figures, str]:
    import pytest

    junit = check.work / "pytest.xml"
    code = pytest.main(["tests/test_gpu.py", "-m", "gpu and not slow", "-p", "no:cacheprovider", f"--junitxml={junit}"])
    suite = ElementTree.parse(junit).getroot().find("testsuite")
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    figures = {"tests": tests, "passed": tests - skipped - failed, "skipped": skipped, "failed": failed}
    require(code == 0, f"pytest exited {code}: {failed} of {tests} GPU smoke tests failed (see the log)")
    require(check.dry_run or figures["passed"] > 0, "no GPU smoke test ran: every one was skipped")
    return figures, f"{figures['passed']} passed, {skipped} skipped, {failed} failed of {tests} (`pytest -m gpu`)."


def dali_train_graph(check: Check) -> tuple[Figures, str]:
    from loader import BATCH_SIZE  # bench/loader.py: the batch both loader steps use

    from coarse2fine.config import parse_params
    from coarse2fine.data.loaders import build_loader

    # all_dali: the GPU's graph wherever it runs, so the dry run's CPU runs what a GPU runs (auto is that on a GPU).
    loader_cfg = {"backend": "dali", "workers": loader_workers(), "dali_graph": "all_dali"}
    params = parse_params({"loader": loader_cfg, "augment": recipe_augment()})
    runtime = world_of_one(check)
    loader = build_loader(
        "train", photo_records(check), img_size=check.img_size, batch_size=BATCH_SIZE, runtime=runtime,
        loader_cfg=params.loader, augment_cfg=params.augment, crop_pct=1.0, seed=0,
    )
    require(loader.backend == "dali", f"the loader is {loader.backend!r}, not DALI")
    images = moved = 0
    started = time.perf_counter()
    for batch in loader:
        image = batch["image"]
        require(image.device.type == check.device.type, f"images on {image.device}, not {check.device}")
        require(image.shape == (len(batch["label"]), 3, check.img_size, check.img_size),
                f"images of shape {tuple(image.shape)}")
        layout = runtime.image_memory_format  # channels-last on a GPU
        require(image.is_contiguous(memory_format=layout), f"images not {layout}")
        require(bool(image.isfinite().all()) and float(image.abs().max()) < 10, "images not finite and normalised")
        require(batch["affine"].shape == (len(image), 2, 3), "no per-image affine")
        images += len(image)
        moved += len(batch["moved"])  # images that RandAugment's geometric ops moved: their targets follow
    seconds = time.perf_counter() - started
    require(images == len(loader) * BATCH_SIZE, f"{images} images in {len(loader)} batches of {BATCH_SIZE}")
    require(moved > 0, "RandAugment moved no image: its geometric ops did not run")
    figures = {"batches": len(loader), "images": images, "moved images": moved, "img/s": images / seconds}
    text = (f"The all-DALI train graph on {check.device}, {params.augment.rand_augment} + random erasing "
            f"{params.augment.reprob} + flip {params.augment.hflip}, {check.img_size} px: {len(loader)} batches of "
            f"{BATCH_SIZE} met the loaders' contract; {moved} of {images} images moved by RandAugment's geometry; "
            f"{figures['img/s']:.0f} img/s over the epoch, the graph's build included.")
    return figures, text


def loader_throughput(check: Check) -> tuple[Figures, str]:
    import loader as loader_bench  # bench/loader.py
    from _common import interleaved, markdown_table

    augment = recipe_augment()
    args = argparse.Namespace(workers=loader_workers(), img_size=check.img_size, rand_augment=augment["rand_augment"],
                              reprob=augment["reprob"], interpolation=augment["interpolation"])
    records_dir = photo_records(check)
    runtime = world_of_one(check)  # DALI's GPU graph on the device
    rows = {backend: loader_bench.ProjectLoader(backend, records_dir, args, runtime) for backend in ("dali", "torch")}
    rates = interleaved(rows, repeats=check.size(gpu=3, dry_run=1))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    # A short epoch weighs its start (a fresh DALI pipeline, new DataLoader workers) far more than an ImageNet epoch
    # does: one more epoch each gives the time to the first batch and the rate over the second half apart.
    split = {name: row.first_batch_and_second_half() for name, row in rows.items()}
    figures = {**{f"{name} img/s": median for name, median in medians.items()},
               "dali / torch": medians["dali"] / medians["torch"],
               **{f"{name} first batch s": first for name, (first, _) in split.items()},
               **{f"{name} img/s, second half": rate for name, (_, rate) in split.items()},
               "dali / torch, second half": split["dali"][1] / split["torch"][1]}
    table = markdown_table(["loader", "img/s (median)", "img/s range", "first batch (s)", "img/s, second half"],
                           [[name, f"{medians[name]:.0f}", f"{min(values):.0f}-{max(values):.0f}",
                             f"{split[name][0]:.2f}", f"{split[name][1]:.0f}"] for name, values in rates.items()])
    text = (f"Train loaders on {check.device}, {check.img_size} px, batch {loader_bench.BATCH_SIZE}, {args.workers} "
            f"DALI threads / DataLoader workers, {args.rand_augment} + random erasing {args.reprob} + flip; "
            f"{rows['dali'].loader.num_samples} images an epoch, median of {len(rates['dali'])} interleaved epochs "
            f"after a warm-up epoch (bench/loader.py's rows); then one more epoch each, timed to its first batch and "
            f"over its second half.\n\n{table}")
    return figures, text


def dvc_pipeline(check: Check) -> tuple[Figures, str]:
    from _common import TINY_NEAR_EMPTY, ProjectCopy, merge_params, read_metric

    # The dry run: the near-empty copy of the benches' --tiny, without logging each model to MLflow (seconds a stage).
    one_epoch = copy.deepcopy(TINY_NEAR_EMPTY) if check.dry_run else {stage: {"epochs": 1} for stage in TRAINING_STAGES}
    params = merge_params(one_epoch, {"launch": {"device": check.device.type}})
    project = ProjectCopy(check.work / "project", params)
    repro = project.repro()
    devices = dict(ANNOUNCED.findall(repro.output))
    expected = str(check.device)
    require(set(TRAINING_STAGES) <= set(devices), f"not every training stage ran: {', '.join(devices)}")
    elsewhere = {stage: device for stage, device in devices.items() if device != expected}
    require(not elsewhere, f"stages not on {expected}: {elsewhere}")
    evaluations = {name: read_metric(project.path / f"metrics/evaluate/{name}/metrics.json", "top1")
                   for name in ("pretrain", "finetune")}
    figures = {"seconds": repro.seconds, **{f"{stage} s": seconds for stage, seconds in repro.stage_seconds.items()},
               **{f"{name} top1": top1 for name, top1 in evaluations.items()}}
    stage_times = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in repro.stage_seconds.items())
    text = (f"`dvc repro` of a project copy ({', '.join(dotted(params))}) on {expected}: "
            f"{len(repro.stage_seconds)} stages in {repro.seconds:.0f} s ({stage_times}); "
            f"val top-1 {evaluations['pretrain']:.1f} % pre-trained, {evaluations['finetune']:.1f} % fine-tuned.")
    return figures, text


def dotted(params: dict, prefix: str = "") -> list[str]:
    """{"data": {"subset": 0.1}} as ["data.subset 0.1"]."""
    return [item for key, value in params.items() for item in (
        dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key} {value}"])]


WORKERS: dict[str, Callable[[Check], tuple[Figures, str]]] = {
    "pytest": smoke_tests, "dali_train_graph": dali_train_graph, "loaders": loader_throughput, "dvc": dvc_pipeline,
}


def require(condition: bool, failure: str) -> None:
    """A check of the step's own: its failure ends the step with this line (not an assert: python -O drops those)."""
    if not condition:
        raise SystemExit(failure)


def world_of_one(check: Check):
    """The Runtime of one process on the check's device."""
    from coarse2fine.distributed import Runtime

    return Runtime(rank=0, world_size=1, local_rank=0, device=check.device)


def loader_workers() -> int:
    return min(8, len(os.sched_getaffinity(0)))


def recipe_augment() -> dict:
    import yaml

    return yaml.safe_load(RECIPE_PROFILE.read_text(encoding="utf-8"))["augment"]


def photo_records(check: Check) -> Path:
    """bench/_common's synthetic photos (500 x 375 JPEGs) converted into records: made by the first step that
    needs them, reused by the next."""
    from _common import convert_tree, photo_tree

    tree = photo_tree(check.work, train_images=check.size(gpu=4096, dry_run=192), val_images=VAL_PHOTOS)
    return convert_tree(tree, check.work / "records")


def run_worker(name: str, check: Check, results: Path) -> None:
    sys.path.insert(0, str(check.project / "bench"))  # the benches' helpers (_common, loader)
    if not check.dry_run:
        torch.cuda.set_device(check.device)
    figures, report = WORKERS[name](check)
    results.write_text(json.dumps({"figures": figures, "report": report}, indent=2), encoding="utf-8")


# ---------------------------------------------------------------------------------------------- the steps


def worker(name: str) -> Callable[[Check, Path], list[str]]:
    def command(check: Check, results: Path) -> list[str]:
        dry_run = ["--cpu-dry-run"] if check.dry_run else []
        return [sys.executable, "-m", "coarse2fine.gpu_check", "--run-step", name, "--results", str(results),
                "--work", str(check.work), *dry_run]
    return command


def gpu_step_command(check: Check, results: Path) -> list[str]:
    sizes = (["--device", "cpu", "--precision", "fp32", "--model", "volo_custom", "--img-size", "32", "--batch", "2",
              "--steps", "1", "--repeats", "1"] if check.dry_run else ["--compile", "--steps", "20", "--repeats", "2"])
    # Its figures go into this report: its own dated report into the scratch folder, not the checkout's bench/results.
    return [sys.executable, "bench/gpu_step.py", *sizes, "--json", str(results), "--results", str(check.work)]


def timm_gpu_step_command(check: Check, results: Path) -> list[str]:
    sizes = (["--device", "cpu", "--eager-only", "--model", "resnet10t", "--batch-size", "2", "--steps", "1",
              "--repeats", "1"] if check.dry_run else ["--steps", "20", "--repeats", "2"])
    return [sys.executable, "bench/timm_gpu_step.py", *sizes, "--json", str(results)]


def bench_figures(results: dict) -> Figures:
    return {f"{row} img/s": value for row, value in results["median_img_per_s"].items()}


PROJECT_MODULES = ("pydantic", "yaml", "tfrecord", "timm")  # besides torch: what the project's code imports
STEPS = (
    Step("pytest", "GPU smoke tests (pytest -m gpu)", 240, worker("pytest"),
         modules=(*PROJECT_MODULES, "pytest", "nvidia.dali")),
    Step("dali_train_graph", "DALI's train graph on the device with the recipe's augment", 180,
         worker("dali_train_graph"),
         modules=(*PROJECT_MODULES, "nvidia.dali")),
    Step("loaders", "the loaders' throughput with the recipe's augment, DALI vs torch", 240, worker("loaders"),
         modules=(*PROJECT_MODULES, "nvidia.dali", "torchvision")),
    Step("dvc", "one epoch of every stage through DVC on the photos", 420, worker("dvc"),
         modules=(*PROJECT_MODULES, "dvc", "dvclive", "mlflow", "skimage"), programs=("dvc", "git")),
    Step("timm_gpu_step", "timm's bare training loop (bench/timm_gpu_step.py)", 300, timm_gpu_step_command,
         modules=("timm",), figures=bench_figures),
    Step("gpu_step", "the Trainer's step with a compiled ground truth (bench/gpu_step.py --compile)", 480,
         gpu_step_command, modules=PROJECT_MODULES, figures=bench_figures),
)


def missing(step: Step) -> list[str]:
    """The step's modules that do not import here and programs not on PATH (the interpreter's folder first, as the
    steps run them)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    absent = [module for module in step.modules if not importable(module)]
    return absent + [program for program in step.programs if shutil.which(program, path=path) is None]


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing
        return False


def run_step(step: Step, check: Check, out: Path) -> dict:
    """The step in a process group of its own, its output in out/logs/NAME.log: status, seconds, reason, figures."""
    result = {"name": step.name, "title": step.title, "timeout_s": step.timeout_s, "seconds": 0.0, "figures": {}}
    absent = missing(step)
    if absent:
        reason = f"needs {', '.join(absent)}, not installed here: install the wheelhouse (docs/gpu.md)"
        return {**result, "status": "failed", "reason": reason}
    log, results = out / "logs" / f"{step.name}.log", out / "steps" / f"{step.name}.json"
    log.parent.mkdir(parents=True, exist_ok=True)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(check.project / "src"),
                                                                       os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as output:
        process = subprocess.Popen(step.command(check, results), cwd=check.project, env=env, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        with_children_ended(process)
    result.update(seconds=time.perf_counter() - started, log=str(log.relative_to(out)))
    if code is None:
        return {**result, "status": "failed", "reason": f"timed out after {step.timeout_s} s"}
    if code != 0:
        return {**result, "status": "failed", "reason": f"exit {code}: {last_line(log)}"}
    raw = json.loads(results.read_text(encoding="utf-8"))
    return {**result, "status": "passed", "figures": step.figures(raw), "report": raw["report"]}


def with_children_ended(process: subprocess.Popen) -> None:
    """Ends what the step left running (a timed-out step, DataLoader workers, a stage under DVC): its group."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


# ---------------------------------------------------------------------------------------------- the report


def device_name(check: Check) -> str:
    if check.dry_run:
        return f"CPU only, {len(os.sched_getaffinity(0))} cores (a dry run: figures that measure nothing)"
    properties = torch.cuda.get_device_properties(0)
    return f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB ({torch.cuda.device_count()} visible)"


def versions() -> dict[str, str]:
    installed: dict[str, str] = {}
    for dist in metadata.distributions():  # in sys.path's order: the first of a name is the one that imports
        installed.setdefault((dist.metadata["Name"] or "").lower(), dist.version)
    dali = [f"{version} ({name})" for name, version in installed.items() if name.startswith("nvidia-dali")]
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "CUDA (torch's build)": str(torch.version.cuda), "cuDNN": str(torch.backends.cudnn.version()),
        "DALI": ", ".join(dali) or "not installed",
        **{name: installed.get(name, "not installed") for name in ("timm", "dvc", "mlflow", "pydantic", "numpy")},
    }


def project_commit(project: Path) -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=project, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else "unknown (not a git checkout)"


def comparisons(steps: list[dict]) -> Figures:
    """The Trainer's step against timm's bare loop, eager and compiled (bench/gpu_step.py and timm_gpu_step.py)."""
    figures = {step["name"]: step["figures"] for step in steps}
    trainer, timm = figures.get("gpu_step", {}), figures.get("timm_gpu_step", {})
    pairs = {"Trainer ground truth / timm, eager": ("ground truth img/s", "eager img/s"),
             "Trainer ground truth / timm, compiled": ("ground truth, compiled img/s", "torch.compile img/s")}
    return {name: trainer[ours] / timm[theirs] for name, (ours, theirs) in pairs.items()
            if ours in trainer and theirs in timm}


def figures_line(figures: Figures) -> str:
    return ", ".join(f"{name} {number(value)}" for name, value in figures.items())


def number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def markdown(report: dict) -> str:
    failed = [step for step in report["steps"] if step["status"] != "passed"]
    verdict = f"FAILED ({len(failed)} of {len(report['steps'])} steps)" if failed else "passed"
    lines = [
        f"# GPU check: {verdict}", "",
        f"{report['device']}; {report['date']}, {report['seconds']:.0f} s; project commit {report['commit']}; "
        f"command `{report['command']}`.", "",
        "| package | version |", "| --- | --- |", *(f"| {name} | {v} |" for name, v in report["versions"].items()), "",
        "| step | status | seconds (timeout) | figures |", "| --- | --- | --- | --- |",
        *(f"| {step['name']} | {step['status']} | {step['seconds']:.0f} ({step['timeout_s']}) | "
          f"{figures_line(step['figures']) or step.get('reason', '')} |" for step in report["steps"]),
    ]
    if report["comparisons"]:
        lines += ["", "The Trainer against timm: " + figures_line(report["comparisons"]) + "."]
    for step in report["steps"]:
        body = step.get("report") or f"**{step['status']}**: {step.get('reason', '')}"
        log = f"\n\nOutput: `{step['log']}`." if "log" in step else ""
        lines += ["", f"## {step['name']}: {step['title']}", "", body + log]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m coarse2fine.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), metavar="DIR",
                        help="where report.md, report.json and the steps' logs go (default: gpu-check)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="the same steps on the CPU at tiny sizes (no GPU needed; figures that measure nothing)")
    parser.add_argument("--only", nargs="+", choices=[step.name for step in STEPS], metavar="STEP",
                        help=f"run only these steps ({', '.join(step.name for step in STEPS)})")
    # One worker step in this process (what the check itself runs, each in a child process).
    parser.add_argument("--run-step", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    project = Path.cwd()
    if args.run_step:
        run_worker(args.run_step, Check(project, args.work, args.cpu_dry_run), args.results)
        return 0
    if not (project / "dvc.yaml").is_file() or not (project / "tests" / "test_gpu.py").is_file():
        print(f"gpu_check: run it from the project's checkout (no dvc.yaml and tests/ in {project})", file=sys.stderr)
        return NO_GPU_EXIT
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(f"gpu_check: no usable CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda}): run it "
              "on a GPU node, or with --cpu-dry-run", file=sys.stderr)
        return NO_GPU_EXIT
    steps = [step for step in STEPS if not args.only or step.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="coarse2fine-gpu-check-") as work:
        check = Check(project, Path(work), args.cpu_dry_run)
        results = []
        for number, step in enumerate(steps, 1):
            print(f"gpu_check: [{number}/{len(steps)}] {step.name}: {step.title} ...", flush=True)
            results.append(run_step(step, check, args.out))
            print(f"gpu_check: {step.name} {results[-1]['status']} in {results[-1]['seconds']:.0f} s"
                  + (f": {results[-1]['reason']}" if "reason" in results[-1] else ""), flush=True)
    report = {
        "mode": "cpu dry run" if args.cpu_dry_run else "gpu", "device": device_name(check),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "coarse2fine.gpu_check", *(argv or sys.argv[1:])]),
        "commit": project_commit(project), "versions": versions(), "seconds": time.perf_counter() - started,
        "passed": all(result["status"] == "passed" for result in results), "steps": results,
        "comparisons": comparisons(results),
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.out / "report.md").write_text(markdown(report), encoding="utf-8")
    print(f"gpu_check: {'passed' if report['passed'] else 'FAILED'}; report in {args.out / 'report.md'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
