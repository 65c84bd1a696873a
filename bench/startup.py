"""Stage start-up: what each launched stage costs when it has next to no work, before and after a change.

In a fresh copy of the project (as tests/test_pipeline.py makes it) with the shipped params cut to almost no work
(`data.subset`, one epoch of each training stage), a full `dvc repro` runs once (not timed as a row); then
`dvc repro --force` reruns every stage in --repeats interleaved rounds, and each stage's wall time (from its
"Running stage" line to the next) is its start-up (the launcher, imports, process group, loader build, MLflow
run and model logging) plus its little work. With --before REF the same is done, interleaved, in a second copy
made from commit REF's files: before/after per stage, in one run on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from _common import (
    COPY_DIR, NEAR_EMPTY, PROJECT_ROOT, ProjectCopy, Repro, add_tiny_argument, goal, header_line, markdown_table,
    workspace, write_json,
)

GOAL_SECONDS = 5.0
# The launched stages (the listing, compare and lineage are plain python and cost well under a second).
LAUNCHED = ("convert", "teacher", "token_labels", "pretrain", "finetune", "evaluate@pretrain", "evaluate@finetune")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="REF", help="also time the stages of commit REF, interleaved")
    parser.add_argument("--repeats", type=int, default=3, metavar="N", help="forced reruns per copy (default: 3)")
    add_tiny_argument(parser, "one copy, the first run's times only; the copy stays in --workdir for the other "
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


def report(timed: dict[str, list[Repro]], args: argparse.Namespace) -> tuple[str, dict]:
    after = timed["after"]
    before = timed.get("before")
    headers = ["stage", "after: s (median)"] + (["before: s (median)", "after / before"] if before else [])
    rows = []
    for stage in LAUNCHED:
        now = median_seconds(after, stage)
        row = [stage, f"{now:.2f}"]
        if before:
            then = median_seconds(before, stage)
            row += [f"{then:.2f}", f"{now / then:.2f}x"]
        rows.append(row)
    slowest = max(LAUNCHED, key=lambda stage: median_seconds(after, stage))
    goals = [goal(f"every launched stage with next to no work <= {GOAL_SECONDS:g} s",
                  median_seconds(after, slowest) <= GOAL_SECONDS,
                  f"slowest {slowest}, {median_seconds(after, slowest):.2f} s")]
    rounds = "the first full run" if args.tiny else f"median of {args.repeats} interleaved `dvc repro --force` rounds"
    text = "\n".join([
        header_line(),
        "",
        f"Each launched stage's wall time in a project copy with data.subset {NEAR_EMPTY['data']['subset']} and one "
        f"epoch per training stage, {rounds}" + (f"; before: commit {args.before}." if before else "."),
        "",
        markdown_table(headers, rows),
        "",
        "Goals: " + "; ".join(goals) + ".",
    ])
    raw = {name: [run.stage_seconds for run in runs] for name, runs in timed.items()} | {"goals": goals}
    return text, raw


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work, tempfile.TemporaryDirectory(prefix="coarse2fine-before-") as old:
        copies = {"after": ProjectCopy(work / COPY_DIR, NEAR_EMPTY)}  # where the other benches' --tiny find it
        if args.before:
            copies["before"] = ProjectCopy(work / "before", NEAR_EMPTY, source=checkout(args.before, Path(old) / "tree"))
        timed = {name: [project.repro()] for name, project in copies.items()}
        if not args.tiny:
            timed = {name: [] for name in copies}
            for repeat in range(args.repeats):
                order = list(copies) if repeat % 2 == 0 else list(reversed(copies))
                for name in order:
                    timed[name].append(copies[name].repro("--force"))
    text, raw = report(timed, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
