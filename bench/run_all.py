"""Run every benchmark in sequence (never concurrently) and print their reports: loader (plain, then with the
recipe's RandAugment and random erasing: loader_recipe), loader_profile, rand_augment, convert, train_step, layout,
caching, startup, token_labels, memory, scale (ImageNet-shaped trees through the whole pipeline), model_export (the
MLflow model each profile's training stage logs), and peer (timm's train.py) when --timm-repo is given. `make bench` runs this.

Each benchmark's progress goes to stderr, its report (header line, markdown table, goals) to stdout and to its dated
result file; with --json-dir DIR each also writes DIR/<name>.json. At the end, every goal line of the run, read
from the result files' JSON, goes to one summary, bench/results/bench_goals_<machine>_<date>.md, linking each
report (docs/performance.md quotes it). A failing benchmark is reported and the others still run; the exit code is
1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from _common import GOAL_LINE, header_line, markdown_table, write_results

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "loader", "loader_recipe", "loader_profile", "rand_augment", "convert", "train_step", "layout", "caching",
    "startup", "token_labels", "memory", "scale", "model_export",
)
# The line a bench prints after writing its result file (_common.write_results), the path relative to bench/.
WRITTEN = re.compile(r"^written: (?P<path>\S+\.md)$")
# name -> (script, its options): the recipe's train augment (sail-sg/volo: --aa rand-m9-mstd0.5-inc1 --reprob 0.25).
SCRIPTS = {"loader_recipe": ("loader", ["--rand-augment", "rand-m9-mstd0.5-inc1", "--reprob", "0.25"])}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-repo", type=Path, metavar="PATH",
                        help="a timm source checkout (train.py + timm/): also run peer.py against timm's train.py")
    parser.add_argument("--json-dir", type=Path, metavar="DIR", help="write each benchmark's raw numbers to DIR/<name>.json")
    parser.add_argument("--only", nargs="+", choices=(*BENCHMARKS, "peer"), metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)}, peer)")
    parser.add_argument("--tiny", action="store_true",
                        help="each bench's --tiny (tests/test_benches.py): its code path at the smallest sizes")
    parser.add_argument("--results", type=Path, default=None, metavar="DIR",
                        help="the result files and the summary go here (default: bench/results; none with --tiny)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    runs = {name: SCRIPTS.get(name, (name, [])) for name in BENCHMARKS}
    if args.timm_repo is not None:
        runs["peer"] = ("peer", ["--timm-repo", str(args.timm_repo)])
    if args.only:
        runs = {name: options for name, options in runs.items() if name in args.only}
    if args.json_dir is not None:
        args.json_dir.mkdir(parents=True, exist_ok=True)
    failed, written = [], {}
    for name, (script, options) in runs.items():
        if args.json_dir is not None:
            options = [*options, "--json", str(args.json_dir / f"{name}.json")]
        options += ["--tiny"] * args.tiny + ["--results", str(args.results)] * (args.results is not None)
        print(f"## {name}\n", flush=True)
        returncode, written[name] = run(HERE / f"{script}.py", options)
        if returncode:
            failed.append(name)
            print(f"{name}: FAILED (see its stderr above)")
        print(flush=True)
    write_results(args, "bench_goals", summary(written, failed),
                  {"reports": {name: path and path.name for name, path in written.items()}, "failed": failed})
    if failed:
        sys.exit(1)


def run(script: Path, options: list[str]) -> tuple[int, Path | None]:
    """Run one bench, its report passed through as it comes; its exit code and the result file it wrote."""
    written = None
    command = [sys.executable, str(script), *options]
    with subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, text=True) as bench:
        for line in bench.stdout:
            print(line, end="", flush=True)
            if match := WRITTEN.match(line.strip()):
                written = HERE / match["path"]
    return bench.returncode, written


def summary(written: dict[str, Path | None], failed: list[str]) -> str:
    """Every goal line of the run, from each result file's JSON (`goals`), with a link to its report."""
    rows = []
    for name, path in written.items():
        if path is None:
            rows.append([name, "-", "FAILED" if name in failed else "no result file", "-", "-"])
            continue
        for line in json.loads(path.with_suffix(".json").read_text())["goals"]:
            match = GOAL_LINE.match(line)
            rows.append([name, match["text"], match["verdict"], match["measured"], f"[{path.name}]({path.name})"])
    return "\n".join([header_line(), "", "Every goal line of one `make bench` run, from each bench's result file:", "",
                      markdown_table(["bench", "goal", "verdict", "measured", "report"], rows)])


if __name__ == "__main__":
    main()
