"""Stage start-up: what each launched stage costs when it has next to no work, before and after a change.

In a fresh copy of the project (as tests/test_pipeline.py makes it) with the shipped params cut to almost no work
(`data.subset`, one epoch of each training stage), a full `dvc repro` runs once (not timed as a row); then
`dvc repro --force` reruns every stage in --repeats interleaved rounds, and each stage's wall time (from its
"Running stage" line to the next) is its start-up (the launcher, imports, process group, loader build, MLflow
run and model logging) plus its little work. With --before REF the same is done, interleaved, in a second copy
made from commit REF's files: before/after per stage, in one run on the same machine. Each round also reruns the
copy with its launched stages in a stage server (`python -m coarse2fine.stage_server`: the imports paid once, each
stage a fork of the warm server), the opt-in way to pay less start-up.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from coarse2fine.stage_server import SERVER_ENV
from coarse2fine.stage_server import running as running_stage_server

from _common import (
    COPY_DIR, NEAR_EMPTY, PROJECT_ROOT, TINY_NEAR_EMPTY, ProjectCopy, Repro, add_tiny_argument, goal, header_line,
    markdown_table, workspace, write_json,
)

GOAL_SECONDS = 5.0
# The launched stages (the listing, compare and lineage are plain python and cost well under a second).
LAUNCHED = ("convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="REF", help="also time the stages of commit REF, interleaved")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="forced reruns per copy (default: 3)")
    add_tiny_argument(parser, "one copy logging no MLflow models, the first run's times only; the copy stays in --workdir for the other "
                              "pipeline benches' --tiny (caching, ablation, memory; token_targets --project "
                              "DIR/project)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR", help="make the project copies here (default: a temp dir)")
    return parser.parse_args()


def checkout(ref: str, into: Path) -> Path:
    """The files of commit `ref` of this repository, unpacked at `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=PROJECT_ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def median_seconds(runs: list[Repro], stage: str) -> float:
    return statistics.median(run.stage_seconds[stage] for run in runs)


SERVED = "after, stage server"


def report(timed: dict[str, list[Repro]], args: argparse.Namespace) -> tuple[str, dict]:
    """One row per launched stage: its median seconds in each variant, and the ratios that compare them."""
    titles = {"after": "own process: s (median)", "before": f"before ({args.before}): s (median)",
              SERVED: "stage server: s (median)"}
    variants = [name for name in titles if name in timed]
    ratios = [(top, bottom, title) for top, bottom, title in (
        ("after", "before", "after / before"), (SERVED, "after", "stage server / own process"),
    ) if top in timed and bottom in timed]
    headers = ["stage", *(titles[name] for name in variants), *(title for _, _, title in ratios)]
    rows = []
    for stage in LAUNCHED:
        seconds = {name: median_seconds(timed[name], stage) for name in variants}
        rows.append([stage, *(f"{seconds[name]:.2f}" for name in variants),
                     *(f"{seconds[top] / seconds[bottom]:.2f}x" for top, bottom, _ in ratios)])
    goals = [
        _goal(timed[name], f"every launched stage with next to no work <= {GOAL_SECONDS:g} s{suffix}")
        for name, suffix in (("after", ""), (SERVED, " (in a stage server)")) if name in timed
    ]
    rounds = "the first full run" if args.tiny else f"median of {args.repeats} interleaved `dvc repro --force` rounds"
    text = "\n".join([
        header_line(),
        "",
        f"Each launched stage's wall time in a project copy with data.subset {NEAR_EMPTY['data']['subset']} and one "
        f"epoch per training stage, {rounds}" + (f"; before: commit {args.before}" if "before" in timed else "")
        + ("; stage server: the same copy's stages forked by `coarse2fine.stage_server`" if SERVED in timed else "")
        + (f" (in the stage server at ${SERVER_ENV})" if args.tiny and os.environ.get(SERVER_ENV) else "") + ".",
        "",
        markdown_table(headers, rows),
        "",
        "Goals: " + "; ".join(goals) + ".",
    ])
    raw = {name: [run.stage_seconds for run in runs] for name, runs in timed.items()}
    return text, raw


def _goal(runs: list[Repro], text: str) -> str:
    slowest = max(LAUNCHED, key=lambda stage: median_seconds(runs, stage))
    seconds = median_seconds(runs, slowest)
    return goal(text, seconds <= GOAL_SECONDS, f"slowest {slowest}, {seconds:.2f} s")


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work, tempfile.TemporaryDirectory(prefix="coarse2fine-before-") as old:
        # where the other benches' --tiny find it
        copies = {"after": ProjectCopy(work / COPY_DIR, TINY_NEAR_EMPTY if args.tiny else NEAR_EMPTY)}
        if args.tiny:  # the first run's times, in the environment's stage server if it has one (the test suite's)
            timed = {"after": [copies["after"].repro()]}
        else:
            if args.before:
                source = checkout(args.before, Path(old) / "tree")
                copies["before"] = ProjectCopy(work / "before", NEAR_EMPTY, source=source)
            for project in copies.values():  # each stage in a process of its own, as dvc runs it by default
                project.env.pop(SERVER_ENV, None)
                project.repro()
            timed = timed_rounds(copies, args.repeats)
    text, raw = report(timed, args)
    print(text)
    write_json(args, text, raw)


def timed_rounds(copies: dict[str, ProjectCopy], repeats: int) -> dict[str, list[Repro]]:
    """`dvc repro --force` in each copy, `repeats` interleaved rounds, and in the "after" copy once more per round
    with its stages in a stage server."""
    with running_stage_server() as address:
        served = copy.copy(copies["after"])
        served.env = {**served.env, SERVER_ENV: str(address)}
        variants = {**copies, SERVED: served}
        timed: dict[str, list[Repro]] = {name: [] for name in variants}
        for repeat in range(repeats):
            for name in variants if repeat % 2 == 0 else reversed(variants):
                timed[name].append(variants[name].repro("--force"))
    return timed


if __name__ == "__main__":
    main()
