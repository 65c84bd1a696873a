"""DVC caching: what `dvc repro` costs when nothing changed, and when only the last stage's params changed.

In a fresh copy of the project (a temporary git repository with dvc.yaml, params.yaml, stages/, src/, .dvc/, as
tests/test_pipeline.py makes it) with fast params, a full `dvc repro` runs once (reported, not a row); then, in
--repeats interleaved rounds:
- no-op: `dvc repro` with nothing changed (must run only the two stages DVC runs at every repro: `source`, which
  lists the source images and writes the same digest, so nothing after it runs, and `lineage`, which finds nothing
  new to record in MLflow and, by its mark beside the store, does not import MLflow to find that out);
- last stage only: `evaluate.finetune.crop_pct` set to a value not used before (DVC's run cache would restore a
  previous value's outputs without running anything), then `dvc repro` (must run evaluate@finetune, the
  two-line compare and the two stages of every repro only; the time in the stages between, convert to finetune,
  from `Running stage` lines, must be 0).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from _common import (
    NEAR_EMPTY_TINY, TINY_NEAR_EMPTY, TINY_TRACKING, Repro, add_tiny_argument, goal, header_line, markdown_table,
    project_copy, tiny_sizes, workspace, write_json,
)

GOAL_NOOP_SECONDS = 3.0
LAST_STAGE = "evaluate@finetune"
REPORT_STAGE = "compare"  # reads the evaluations: reruns with the last one
LISTING_STAGE = "source"  # always runs: its unchanged output is what keeps the rest cached
LINEAGE_STAGE = "lineage"  # always runs, last: MLflow's links for the stages DVC skipped
EVERY_REPRO = f"{LINEAGE_STAGE}, {LISTING_STAGE}"  # `ran`'s sorted listing of the two
FIRST_CROP_PCT, CROP_PCT_STEP = 0.875, -0.025  # a new value every round: a real run, never a run-cache restore


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subset", type=float, default=0.3, metavar="F", help="data.subset of the copy (default: 0.3)")
    parser.add_argument("--epochs", type=int, default=2, metavar="N",
                        help="teacher.epochs, pretrain.epochs and finetune.epochs of the copy (default: 2)")
    parser.add_argument("--repeats", type=int, default=5, metavar="N", help="rounds of both timings (default: 5)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the raw numbers (every repeat) as JSON")
    parser.add_argument("--workdir", type=Path, metavar="DIR",
                        help="make the project copy here, or reuse the one made there with the same params "
                             "(default: a temp dir)")
    add_tiny_argument(parser, f"{NEAR_EMPTY_TINY}, 1 round")
    args = parser.parse_args()
    tiny_sizes(parser, args, subset=TINY_NEAR_EMPTY["data"]["subset"], epochs=1, repeats=1)
    return args


def earlier_seconds(run: Repro) -> float:
    """Seconds in the stages between the listing and the last stage (convert to finetune)."""
    outside = (LISTING_STAGE, LAST_STAGE, REPORT_STAGE, LINEAGE_STAGE)
    return sum(seconds for stage, seconds in run.stage_seconds.items() if stage not in outside)


def stage_median(runs: list[Repro], stage: str) -> float:
    return statistics.median(run.stage_seconds.get(stage, 0.0) for run in runs)


def ran(runs: list[Repro]) -> str:
    stages = sorted({stage for run in runs for stage in run.stage_seconds})
    return ", ".join(stages) or "none"


def report(full: Repro, noop: list[Repro], change: list[Repro], args: argparse.Namespace) -> tuple[str, dict]:
    def row(name: str, runs: list[Repro]) -> list[str]:
        seconds = [run.seconds for run in runs]
        earlier = max(earlier_seconds(run) for run in runs)
        return [
            name, f"{statistics.median(seconds):.2f}", f"{min(seconds):.2f}-{max(seconds):.2f}", ran(runs),
            f"{stage_median(runs, LISTING_STAGE):.2f}", f"{earlier:.2f}", f"{stage_median(runs, LAST_STAGE):.2f}",
            f"{stage_median(runs, LINEAGE_STAGE):.2f}",
        ]

    noop_median = statistics.median(run.seconds for run in noop)
    earlier = max(earlier_seconds(run) for run in change)
    goals = [
        goal(
            f"no-op dvc repro <= {GOAL_NOOP_SECONDS:g} s, running only {EVERY_REPRO}",
            noop_median <= GOAL_NOOP_SECONDS and ran(noop) == EVERY_REPRO,
            f"{noop_median:.2f} s, ran {ran(noop)}",
        ),
        goal(
            f"a change under evaluate.finetune: runs only {LAST_STAGE} (and {REPORT_STAGE}, {EVERY_REPRO}), 0 s in the "
            "stages between",
            all(ran([run]) == f"{REPORT_STAGE}, {LAST_STAGE}, {EVERY_REPRO}" for run in change) and earlier == 0,
            f"ran {ran(change)}, {earlier:.2f} s in the stages between",
        ),
    ]
    full_stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in full.stage_seconds.items())
    text = "\n".join(
        [
            header_line(),
            "",
            f"`dvc repro` in a fresh project copy (data.subset {args.subset}, teacher/pretrain/finetune epochs {args.epochs}); "
            f"first full run {full.seconds:.1f} s ({full_stages}); then median of {args.repeats} interleaved rounds.",
            "",
            markdown_table(
                ["dvc repro after", "wall s (median)", "wall s range", "stages run", f"s in {LISTING_STAGE} (median)",
                 "s in the stages between (max)", f"s in {LAST_STAGE} (median)", f"s in {LINEAGE_STAGE} (median)"],
                [row("no change", noop), row("evaluate.finetune.crop_pct changed", change)],
            ),
            "",
            "Goals: " + "; ".join(goals) + ".",
        ]
    )
    raw = {
        "full": {"seconds": full.seconds, "stage_seconds": full.stage_seconds},
        "noop": [{"seconds": run.seconds, "stage_seconds": run.stage_seconds} for run in noop],
        "last_stage_change": [{"seconds": run.seconds, "stage_seconds": run.stage_seconds} for run in change],
    }
    return text, raw


def main() -> None:
    args = parse_args()
    with workspace(args.workdir) as work:
        fast = {"data": {"subset": args.subset}, **{stage: {"epochs": args.epochs} for stage in ("teacher", "pretrain", "finetune")}}
        if args.tiny:  # with the tiny sizes: TINY_NEAR_EMPTY, so the copy bench/startup.py --tiny left is reused
            fast |= {"evaluate": TINY_NEAR_EMPTY["evaluate"], **TINY_TRACKING}
        project = project_copy(work, fast)
        full = project.repro()
        noop, change = [], []
        for repeat in range(args.repeats):
            noop.append(project.repro())
            project.edit_params({"evaluate": {"finetune": {"crop_pct": round(FIRST_CROP_PCT + CROP_PCT_STEP * repeat, 3)}}})
            change.append(project.repro())
    text, raw = report(full, noop, change, args)
    print(text)
    write_json(args, text, raw)


if __name__ == "__main__":
    main()
